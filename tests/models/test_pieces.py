"""Long texts encoded in pieces, reusing a recent text's: the same ids as one call, on the real
model's tokenizer."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from mlx_lm.tokenizer_utils import load as load_tokenizer
from tokenizers import Tokenizer

from appliance.models.pieces import PieceEncoder, can_cut, cut


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path):
    return load_tokenizer(model_dir)


def texts(tokenizer) -> list[str]:
    """Prompts as agents send them: random tokens decoded, code, chat turns, odd spacing."""
    rng = random.Random(0)
    decoded = [tokenizer.decode([rng.randrange(100, 40000) for _ in range(3000)]) for _ in range(3)]
    module = Path(__file__).parents[2] / "appliance/models/pieces.py"
    code = Path(__file__).read_text() + module.read_text()
    chat = tokenizer.apply_chat_template(
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": decoded[0]},
         {"role": "assistant", "content": code}, {"role": "user", "content": "naïve  café 東京 🙂 x\u00a0y 12 345"}],
        tokenize=False, add_generation_prompt=True)
    alphabet = "ab 1.\n\t'\u00a0é東🙂<|>"
    noise = ["".join(rng.choice(alphabet) for _ in range(4000)) for _ in range(3)]
    return [*decoded, code, chat, *noise]


def test_pieces_give_the_ids_of_one_call(tokenizer):
    pieces = PieceEncoder.of(tokenizer)
    pieces.piece_chars = 64  # many cuts in every text
    assert pieces.in_pieces
    for text in texts(tokenizer):
        assert len(cut(text, 64)) > 10
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)


class Counting:
    """A tokenizers.Tokenizer that counts the characters it is asked to encode."""

    def __init__(self, backend):
        self.backend, self.chars = backend, 0

    def encode(self, text, **kwargs):
        self.chars += len(text)
        return self.backend.encode(text, **kwargs)

    def __getattr__(self, name):
        return getattr(self.backend, name)


def counted(tokenizer, **options) -> tuple[PieceEncoder, Counting]:
    backend = Counting(tokenizer.backend_tokenizer)
    pieces = PieceEncoder(lambda text: tokenizer.encode(text, add_special_tokens=False), backend, **options)
    assert pieces.in_pieces
    backend.chars = 0
    return pieces, backend


def test_a_resent_text_encodes_only_what_follows_a_kept_texts_pieces(tokenizer):
    pieces, backend = counted(tokenizer, piece_chars=256)
    chat = texts(tokenizer)[4]
    assert pieces.encode(chat) == tokenizer.encode(chat, add_special_tokens=False)
    assert backend.chars == len(chat)
    for turn in (chat, chat + "Thanks. And now?<|im_end|>\n<|im_start|>assistant\n"):
        backend.chars = 0
        assert pieces.encode(turn) == tokenizer.encode(turn, add_special_tokens=False)
        assert backend.chars <= 3 * 256 + len(turn) - len(chat)  # the last kept piece at most, and the new part
        assert len(pieces.memo) == 1  # the text it extends is dropped: its pieces are the new one's


def test_a_text_reuses_only_the_pieces_kept_for_its_owner(tokenizer):
    # owners are KV tenants: how fast a prompt encodes must not tell one what another sent
    pieces, backend = counted(tokenizer, piece_chars=256)
    chat = texts(tokenizer)[4]
    pieces.encode(chat, "tenant-a")
    backend.chars = 0
    assert pieces.encode(chat, "tenant-b") == tokenizer.encode(chat, add_special_tokens=False)
    assert backend.chars == len(chat)  # nothing of tenant-a's reused
    backend.chars = 0
    assert pieces.encode(chat, "tenant-a") == tokenizer.encode(chat, add_special_tokens=False)
    assert backend.chars <= 3 * 256
    assert [owner for owner, _ in pieces.memo] == ["tenant-a", "tenant-b"]


def test_an_edited_or_unsafely_continued_text_reuses_only_what_still_cuts_the_same(tokenizer):
    pieces, backend = counted(tokenizer, piece_chars=256)
    chat = texts(tokenizer)[4]
    pieces.encode(chat)
    middle = len(chat) // 2
    for edited in (chat[:middle] + "X" + chat[middle + 1:],  # one character changed
                   chat.rstrip() + "tail glued to the last word",  # the old end is no safe cut
                   "A" + chat[1:]):  # nothing in common
        backend.chars = 0
        assert pieces.encode(edited) == tokenizer.encode(edited, add_special_tokens=False)
        assert backend.chars <= len(edited)


def test_random_prefixes_and_tails_in_any_order_give_the_ids_of_one_call(tokenizer):
    rng = random.Random(3)
    pieces, _ = counted(tokenizer, piece_chars=64, memo_texts=4)
    alphabet = "ab 1.\n\t'\u00a0é東🙂<|>"
    sources = texts(tokenizer)
    for _ in range(40):
        source = rng.choice(sources)
        text = source[:rng.randrange(len(source))] + "".join(rng.choice(alphabet) for _ in range(rng.randrange(50)))
        assert pieces.encode(text) == tokenizer.encode(text, add_special_tokens=False)
        assert len(pieces.memo) <= 4


def test_cuts_fall_before_a_space_between_two_other_characters():
    text = "one two  three\tfour five\nsix seven"
    parts = cut(text, 8)
    assert "".join(parts) == text
    for part in parts[1:]:
        assert part[0] == " " and not part[1].isspace()
    assert parts[1:] and all(not p[-1].isspace() for p in parts[:-1])
    assert cut("no-safe-space-here  \t ", 4) == ["no-safe-space-here  \t "]


def test_a_short_text_is_encoded_whole(tokenizer):
    calls = []
    pieces = PieceEncoder(lambda text: calls.append(text) or [7], tokenizer.backend_tokenizer)
    calls.clear()  # the sample checked at construction
    assert pieces.encode("a short prompt") == [7] and calls == ["a short prompt"]


def with_config(tokenizer, change) -> Tokenizer:
    config = json.loads(tokenizer.backend_tokenizer.to_str())
    change(config)
    return Tokenizer.from_str(json.dumps(config))


def test_a_prefix_space_or_a_stripping_added_token_keeps_the_text_whole(tokenizer):
    def prefix_space(config):
        config["pre_tokenizer"]["pretokenizers"][-1]["add_prefix_space"] = True

    def stripping(config):
        config["added_tokens"][0]["rstrip"] = True

    def metaspace(config):
        config["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}

    assert can_cut(tokenizer.backend_tokenizer)
    for change in (prefix_space, stripping, metaspace):
        backend = with_config(tokenizer, change)
        assert not can_cut(backend)
        assert not PieceEncoder(lambda t, b=backend: b.encode(t, add_special_tokens=False).ids, backend).in_pieces


def test_a_split_pattern_across_spaces_fails_the_sample_and_keeps_the_text_whole(tokenizer):
    def across(config):  # a piece that runs from a word into the space and the word after it
        config["pre_tokenizer"]["pretokenizers"].insert(
            0, {"type": "Split", "pattern": {"Regex": r"\S+ \S+"}, "behavior": "Isolated", "invert": False})

    backend = with_config(tokenizer, across)
    whole = lambda text: backend.encode(text, add_special_tokens=False).ids  # noqa: E731
    assert can_cut(backend)
    pieces = PieceEncoder(whole, backend, piece_chars=64)
    assert not pieces.in_pieces
    text = texts(tokenizer)[0]
    assert pieces.encode(text) == whole(text)


def test_a_loaded_model_encodes_a_long_prompt_in_pieces(tokenizer, model_dir):
    from appliance.models.loaded import LoadedModel
    from appliance.spec import ModelSpec

    loaded = LoadedModel(spec=ModelSpec(name="tiny", source=str(model_dir)), path=model_dir, model=None,
                         tokenizer=tokenizer, context_tokens=8192, dtype="float32", load_s=0.0)
    prompt = texts(tokenizer)[4]  # the chat: special tokens, code, unicode
    assert len(prompt) > 2 * loaded._pieces.piece_chars and loaded._pieces.in_pieces
    assert loaded.encode(prompt) == tokenizer.encode(prompt, add_special_tokens=False)
    assert loaded.encode("hi there") == tokenizer.encode("hi there", add_special_tokens=False)
