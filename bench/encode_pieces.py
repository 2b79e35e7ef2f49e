"""A long prompt's encoding as the server does it: one call of the tokenizer, against
`PieceEncoder` (appliance/models/pieces.py) on a text it has not seen and on the same
text resent with a new turn at its end (a coding agent's next request).

Renders a chat of `--tokens` random tokens (decoded, as bench/start_to_ready.py sends
them) with the model's chat template and times, in turn, `tokenizer.encode` (one call:
what `LoadedModel.encode` does without pieces), a first sight (an empty memo) and a
resend (the memo holding the chat without its new turn); checks that all give the same
ids; prints the medians and the ratios. It runs under the server's process environment
(`platform.ensure_process_env`: OpenBLAS, glibc's malloc tunables, one arena).

    python bench/encode_pieces.py MODEL_DIR --tokens 30000   # a dir with tokenizer.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import machine, write_json  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--tokens", type=int, default=30000)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    from appliance.platform import ensure_process_env, malloc_tuned

    ensure_process_env()  # re-executes with the server's environment, once

    from mlx_lm.tokenizer_utils import load

    from appliance.models.pieces import PieceEncoder

    tokenizer = load(args.model_dir)
    rng = random.Random(1)
    content = tokenizer.decode([rng.randrange(100, 40000) for _ in range(args.tokens)])
    chat = [{"role": "user", "content": content}]
    text = tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    turn = tokenizer.apply_chat_template(
        [*chat, {"role": "assistant", "content": "It is noise."}, {"role": "user", "content": "Look again."}],
        tokenize=False, add_generation_prompt=True)
    pieces = PieceEncoder.of(tokenizer)  # as LoadedModel.encode builds it
    whole = pieces.whole

    def first_sight(text: str) -> list[int]:
        pieces.memo.clear()
        return pieces.encode(text)

    times: dict[str, list[float]] = {"whole": [], "first_sight": [], "resent": []}
    expected = {text: whole(text), turn: whole(turn)}
    for _ in range(args.repeats):  # in turn, so that a slow stretch meets all; the resend finds `text` kept
        for name, encode, what in (("whole", whole, text), ("first_sight", first_sight, text),
                                   ("resent", pieces.encode, turn)):
            started = time.perf_counter()
            ids = encode(what)
            times[name].append(time.perf_counter() - started)
            if ids != expected[what]:
                print(f"{name} gave other ids than one call", file=sys.stderr)
                return 1
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    results = {"machine": machine(), "prompt_tokens": len(expected[text]), "resent_tokens": len(expected[turn]),
               "in_pieces": pieces.in_pieces, "malloc_tuned": malloc_tuned(), "median_ms": medians,
               "whole_over_first_sight": medians["whole"] / medians["first_sight"],
               "whole_over_resent": medians["whole"] / medians["resent"], "times_s": times}
    print(json.dumps({k: v for k, v in results.items() if k not in ("times_s", "machine")}))
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
