"""Long texts encoded in pieces on all cores, to the same token ids as one call.

HF tokenizers encodes one text on one core: a coding agent's 31K-token prompt took 80 ms
(SmolLM2's tokenizer), most of what a 32K memory hit adds to a request at the client
(BENCHMARKS.md). `encode_batch` spreads its texts over all cores, so a long text is cut
where the tokenizer would split it anyway, and the pieces' ids, joined, are the text's.

Where a cut is safe: at a space between two characters that are not whitespace, for a
tokenizer with no normalizer (or NFC, which composes within a character's marks), a
byte-level pre-tokenizer that adds no prefix space (alone, or after Digits and Split
patterns), and added tokens that hold no whitespace and neither strip nor check their
neighbours. The byte-level split patterns in use (GPT-2's, Llama 3's, Qwen 2's) never run
a piece from a non-space into the space after it and look at most one character ahead,
so the pieces after such a space are those of the text after it alone. Any other
tokenizer is encoded whole, and so is one whose pieces differ from the whole on a sample
checked when it is first used.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from typing import Any

PIECE_CHARS = 8192  # the shortest piece worth a core (~2K tokens, a few ms)
SAFE_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split"}
SAFE_SPACE = re.compile(r"(?<=\S) (?=\S)")  # a space with a non-whitespace character on each side
SAMPLE = ("def f(x):\n    return x  + 1  # a comment\n\n\tclass A: pass\n"
          "Hello, world!  It's 2026-12-07; 3.14159 <|im_start|> don't   stop\r\n"
          "naïve café 東京 🙂 a.b ,c ;d 'll 're x  y   z\n") * 4


class PieceEncoder:
    """Encodes text as `whole` does (one call of the tokenizer), long texts in pieces."""

    def __init__(self, whole: Callable[[str], list[int]], backend: Any, *, piece_chars: int = PIECE_CHARS,
                 cores: int | None = None):
        self.whole = whole
        self.backend = backend  # the tokenizers.Tokenizer behind `whole`
        self.piece_chars = piece_chars
        self.cores = cores or os.cpu_count() or 1
        self.in_pieces = can_cut(backend) and self._encode_pieces(cut(SAMPLE, len(SAMPLE) // 40)) == whole(SAMPLE)

    @classmethod
    def of(cls, tokenizer: Any) -> PieceEncoder:
        """Returns the encoder of an mlx-lm or HF tokenizer: one call is its `encode`
        without special tokens; a slow tokenizer (no `backend_tokenizer`) is always whole."""
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False),
                   getattr(tokenizer, "backend_tokenizer", None))

    def encode(self, text: str) -> list[int]:
        """Returns the token ids of `text` (no special tokens added)."""
        num_pieces = min(self.cores, len(text) // self.piece_chars) if self.in_pieces else 1
        return self._encode_pieces(cut(text, num_pieces)) if num_pieces > 1 else self.whole(text)

    def _encode_pieces(self, pieces: list[str]) -> list[int]:
        return [i for e in self.backend.encode_batch(pieces, add_special_tokens=False) for i in e.ids]


def can_cut(backend: Any) -> bool:
    """Returns whether a cut at a lone space keeps `backend`'s tokens (module docstring)."""
    if backend is None:
        return False
    try:
        config = json.loads(backend.to_str())
        added = backend.get_added_tokens_decoder().values()
    except (AttributeError, TypeError, ValueError):
        return False
    normalizer = config.get("normalizer")
    if normalizer is not None and normalizer.get("type") != "NFC":
        return False
    pre = config.get("pre_tokenizer") or {}
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    if not steps or steps[-1].get("type") != "ByteLevel" or steps[-1].get("add_prefix_space"):
        return False
    if any(s.get("type") not in SAFE_PRE_TOKENIZERS for s in steps):
        return False
    return not any(t.lstrip or t.rstrip or t.single_word or re.search(r"\s", t.content) for t in added)


def cut(text: str, num_pieces: int) -> list[str]:
    """Returns `text` in up to `num_pieces` pieces, each cut before a space that has a
    non-whitespace character on both sides."""
    starts, step = [0], len(text) // max(num_pieces, 1)
    for target in range(step, len(text), step or 1):
        at = safe_space(text, max(target, starts[-1] + 1))
        if at is None:
            break
        if at > starts[-1]:
            starts.append(at)
    return [text[a:b] for a, b in zip(starts, starts[1:] + [len(text)])]


def safe_space(text: str, start: int) -> int | None:
    """Returns the index of the first space at or after `start` between two characters
    that are not whitespace; None if there is none."""
    found = SAFE_SPACE.search(text, max(start, 1))
    return found.start() if found else None

