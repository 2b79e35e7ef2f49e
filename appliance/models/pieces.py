"""Long texts encoded in pieces, to the same token ids as one call, reusing the pieces of
a recent text that the new one starts with.

HF tokenizers encodes a 31K-token prompt in 80-110 ms (SmolLM2's tokenizer, one core),
most of what a 32K memory hit adds at the client (BENCHMARKS.md). A coding agent resends
the same context each turn with a little more at its end: so a long text is cut into
pieces where the tokenizer would split it anyway, each piece's ids are kept for the
MEMO_TEXTS most recent texts, and a text that starts with a kept text's pieces encodes
only what follows them. A text reuses only pieces kept for the same owner (the request's
KV tenant): how fast a prompt is encoded must not tell one tenant what another sent, as
the KV cache's tenants keep its hits apart. The pieces are encoded one after another, on
the calling thread: `encode_batch` on all cores made a hit slower in the server (0.36 s
against 0.18 s on an H100 host), whose one malloc arena (platform.MALLOC_TUNABLES) its
threads contend for.

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
import re
import threading
from collections.abc import Callable
from typing import Any

PIECE_CHARS = 4096  # ~1K tokens: the most of a resent text encoded again before its new part
MEMO_TEXTS = 16  # recent long texts whose pieces are kept (~1.5 MB each at 31K tokens)
SAFE_PRE_TOKENIZERS = {"ByteLevel", "Digits", "Split"}
SAFE_SPACE = re.compile(r"(?<=\S) (?=\S)")  # a space with a non-whitespace character on each side
SAMPLE = ("def f(x):\n    return x  + 1  # a comment\n\n\tclass A: pass\n"
          "Hello, world!  It's 2026-12-07; 3.14159 <|im_start|> don't   stop\r\n"
          "naïve café 東京 🙂 a.b ,c ;d 'll 're x  y   z\n") * 4

Piece = tuple[str, list[int]]  # a piece of text and its ids


class PieceEncoder:
    """Encodes text as `whole` does (one call of the tokenizer), long texts in pieces,
    reusing the pieces of a recent text it starts with."""

    def __init__(self, whole: Callable[[str], list[int]], backend: Any, *, piece_chars: int = PIECE_CHARS,
                 memo_texts: int = MEMO_TEXTS):
        self.whole = whole
        self.backend = backend  # the tokenizers.Tokenizer behind `whole`
        self.piece_chars = piece_chars
        self.memo_texts = memo_texts
        self.memo: list[tuple[str, list[Piece]]] = []  # (owner, pieces), the most recent text first
        self._lock = threading.Lock()
        self.in_pieces = can_cut(backend) and [i for p in cut(SAMPLE, len(SAMPLE) // 40)
                                               for i in self._ids(p)] == whole(SAMPLE)

    @classmethod
    def of(cls, tokenizer: Any) -> PieceEncoder:
        """Returns the encoder of an mlx-lm or HF tokenizer: one call is its `encode`
        without special tokens; a slow tokenizer (no `backend_tokenizer`) is always whole."""
        return cls(lambda text: tokenizer.encode(text, add_special_tokens=False),
                   getattr(tokenizer, "backend_tokenizer", None))

    def encode(self, text: str, owner: str = "") -> list[int]:
        """Returns the token ids of `text` (no special tokens added), reusing only pieces
        kept for `owner`."""
        if not self.in_pieces or len(text) < 2 * self.piece_chars:
            return self.whole(text)
        with self._lock:
            kept, older = self._kept(text, owner)
        done = sum(len(piece) for piece, _ in kept)
        rest = text[done:]
        pieces = kept + [(piece, self._ids(piece)) for piece in cut(rest, max(1, len(rest) // self.piece_chars))]
        with self._lock:  # the texts this one starts with are dropped: its pieces hold theirs
            self.memo = [(owner, pieces), *(m for m in self.memo if not any(m[1] is o for o in older))]
            del self.memo[self.memo_texts:]
        return [i for _, ids in pieces for i in ids]

    def _kept(self, text: str, owner: str) -> tuple[list[Piece], list[list[Piece]]]:
        """Returns the longest run of `owner`'s kept text's first pieces that `text` starts
        with, ending before a safe space of `text`; and `owner`'s kept texts `text` starts
        with."""
        best: list[Piece] = []
        best_chars, older = 0, []
        for pieces in (pieces for kept_for, pieces in self.memo if kept_for == owner):
            at, n = 0, 0
            while n < len(pieces) and text.startswith(pieces[n][0], at):
                at, n = at + len(pieces[n][0]), n + 1
            if n == len(pieces):
                older.append(pieces)
            if n and not SAFE_SPACE.match(text, at):  # a matched next piece would start with one
                at, n = at - len(pieces[n - 1][0]), n - 1
            if at > best_chars:
                best, best_chars = pieces[:n], at
        return best, older

    def _ids(self, piece: str) -> list[int]:
        return self.backend.encode(piece, add_special_tokens=False).ids


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

