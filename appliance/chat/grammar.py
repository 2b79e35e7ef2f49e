"""Constrained decoding with llguidance: a grammar compiled for the model's tokenizer,
and the logits processor that masks every token the grammar does not allow.

llguidance (Rust, no torch) computes a token bitmask from the grammar's state in a few
tens of microseconds; MLX applies it with one `where` over the row's logits. The
engine calls the processor once a decode step for each constrained row only (see
`Constraint.processor`), so unconstrained rows in the same batch pay nothing.

Policy at the end of `max_tokens`: the grammar cannot finish early on its own, so an
answer cut by the budget ends with `finish_reason: "length"` and may be incomplete JSON,
as in OpenAI's API. An answer that ends with `stop` always matches the grammar.
"""

from __future__ import annotations

import copy
import json
import weakref
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import numpy as np
from llguidance import LLMatcher, LLTokenizer
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from appliance.chat.turn import OutputFormat
from appliance.models.loaded import LoadedModel

# JSON as json.dumps writes it (single spaces after , and :, no newlines): the layout
# models have seen most, and no room for a small model to ramble in whitespace. Unknown
# schema keywords are ignored rather than refused (`lenient`).
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ", "lenient": True}

_tokenizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def grammar_tokenizer(loaded: LoadedModel) -> LLTokenizer:
    """Returns llguidance's view of the model's tokenizer (built once a model: ~1 s)."""
    wrapper = loaded.tokenizer
    tok = _tokenizers.get(wrapper)
    if tok is None:
        backend = copy.copy(wrapper.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        tok = LLTokenizer(backend.to_str(), eos_token=sorted(loaded.eos_token_ids))
        _tokenizers[wrapper] = tok
    return tok


def special_token(loaded: LoadedModel, text: str) -> int | None:
    """Returns the id of the special token spelled `text`, or None."""
    token = loaded.tokenizer.backend_tokenizer.token_to_id(text)  # None when not one token
    if token is None or not grammar_tokenizer(loaded).is_special_token(token):
        return None
    return token


def json_rule(schema: dict[str, Any]) -> str:
    """Returns a lark `%json` item (llguidance's) for a JSON schema, in JSON_STYLE."""
    return "%json " + json.dumps({**schema, "x-guidance": JSON_STYLE})


def format_grammar(fmt: OutputFormat) -> str | None:
    """Returns the lark grammar an output format asks for; None for free text."""
    if fmt.kind == "text":
        return None
    if fmt.kind == "json_schema" and fmt.schema:
        return f"start: {json_rule(fmt.schema)}\n"
    return f'start: {json_rule({"type": "object"})}\n'



@dataclass(frozen=True)
class Constraint:
    """A grammar compiled for one model; each request gets its own matcher from it."""

    grammar: str
    tokenizer: LLTokenizer

    def processor(self) -> GrammarProcessor:
        """Returns a fresh logits processor (mlx-lm's `(tokens, logits) -> logits`)."""
        return GrammarProcessor(LLMatcher(self.tokenizer, self.grammar, log_level=0), self.tokenizer)


def compile_constraint(loaded: LoadedModel, grammar: str) -> Constraint:
    """Returns `grammar` checked against the model's tokenizer; raises ValueError."""
    tokenizer = grammar_tokenizer(loaded)
    error = LLMatcher.validate_grammar(grammar, tokenizer)
    if error:
        raise ValueError(error)
    return Constraint(grammar, tokenizer)


class GrammarProcessor:
    """Masks the logits of one row to the tokens the grammar allows next.

    The engine calls it once a decode step; from the second call on, the last token of
    `tokens` is the one sampled at the previous step, which the matcher consumes first.
    A matcher in an error state (it should never be) allows only end-of-sequence.
    """

    def __init__(self, matcher: LLMatcher, tokenizer: LLTokenizer):
        self.matcher = matcher
        self._mask = allocate_token_bitmask(1, tokenizer.vocab_size)
        self._calls = 0
        self._eos = sorted(set(tokenizer.eos_tokens))

    def __call__(self, tokens: mx.array, logits: mx.array) -> mx.array:
        if self._calls:
            self.matcher.consume_token(int(tokens[-1].item()))
        self._calls += 1
        vocab = logits.shape[-1]
        if self.matcher.is_error():
            allowed = np.zeros(vocab, dtype=bool)
            allowed[self._eos] = True
        else:
            fill_next_token_bitmask(self.matcher, self._mask)
            bits = np.unpackbits(self._mask.view(np.uint8), bitorder="little")
            allowed = np.zeros(vocab, dtype=bool)
            n = min(vocab, bits.size)
            allowed[:n] = bits[:n]
        return mx.where(mx.array(allowed), logits, mx.array(-np.inf, dtype=logits.dtype))
