"""A long prompt's encoding: one call of the tokenizer against pieces on all cores.

Renders a chat of `--tokens` random tokens (decoded, as bench/start_to_ready.py sends
them) with the model's chat template, then times, in turn, `tokenizer.encode` (one call:
what omlx did before appliance/models/pieces.py) and `PieceEncoder.encode` (what
`LoadedModel.encode` does now), checks that both give the same ids, and prints the
medians and their ratio.

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

    from mlx_lm.tokenizer_utils import load

    from appliance.models.pieces import PieceEncoder

    tokenizer = load(args.model_dir)
    rng = random.Random(1)
    content = tokenizer.decode([rng.randrange(100, 40000) for _ in range(args.tokens)])
    text = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)
    pieces = PieceEncoder.of(tokenizer)  # as LoadedModel.encode builds it
    whole = pieces.whole
    times: dict[str, list[float]] = {"whole": [], "pieces": []}
    for _ in range(args.repeats):  # in turn, so that a slow stretch meets both
        for name, encode in (("whole", whole), ("pieces", pieces.encode)):
            started = time.perf_counter()
            ids = encode(text)
            times[name].append(time.perf_counter() - started)
            if name == "whole":
                expected = ids
            elif ids != expected:
                print("pieces gave other ids than one call", file=sys.stderr)
                return 1
    medians = {name: statistics.median(t) * 1000 for name, t in times.items()}
    results = {"machine": machine(), "prompt_tokens": len(expected),
               "in_pieces": pieces.in_pieces, "median_ms": medians,
               "whole_over_pieces": medians["whole"] / medians["pieces"], "times_s": times}
    print(json.dumps({k: v for k, v in results.items() if k != "times_s"}))
    if args.out:
        write_json(args.out, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
