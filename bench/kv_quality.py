"""What a quantized KV tier costs in quality, with the real model: the prefix's KV is
restored from a tier at 8 or 4 bits (quantized, then dequantized) instead of computed, and
the model goes on from there.

Per precision, over `--prompts` prompts (chunks of Python standard-library sources, the
kind of text coding agents send): the max and mean absolute error of the logits over the
suffix's positions against the computed KV, the share of prompts whose next greedy token
is the same, and the share whose whole `--decode`-token greedy continuation is the same.
Then the perplexity of a fixed text's second half given its first half's KV.

    .venv/bin/python bench/kv_quality.py            # ~2 min on a 2-core CPU
"""

from __future__ import annotations

import argparse
import math
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import mlx.core as mx  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from appliance.kernels.kv_quant import round_trip  # noqa: E402
from bench.common import OUT_DIR, REPO, fmt, run_header, write_json  # noqa: E402

MODEL = REPO / ".models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT = "argparse.py"  # the fixed text for perplexity (Python 3.11's standard library)


@dataclass
class Quality:
    bits: int
    max_logit_error: float = 0.0
    mean_logit_error: float = 0.0
    next_token_same: float = 0.0  # share of prompts
    continuation_same: float = 0.0  # share of prompts
    perplexity: float = 0.0


def stdlib_texts(n: int) -> list[str]:
    """Returns `n` standard-library sources, in a fixed order, each at least ~8 KB."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.stat().st_size > 8192)
    if len(files) < n:
        raise SystemExit(f"only {len(files)} standard-library files are large enough for {n} prompts")
    step = len(files) / n
    return [files[int(i * step)].read_text(errors="replace") for i in range(n)]


def prefill(model, tokens: list[int]) -> list:
    """Returns a fresh prompt cache holding the KV of `tokens`."""
    cache = make_prompt_cache(model)
    model(mx.array(tokens)[None], cache=cache)
    mx.eval([c.state for c in cache])
    return cache


def restored(model, cache: list, bits: int) -> list:
    """Returns a new prompt cache with `cache`'s KV as a tier at `bits` bits gives it back."""
    out = make_prompt_cache(model)
    for src, dst in zip(cache, out):
        keys, values = (a[..., : src.offset, :] for a in src.state[:2])
        dst.state = (round_trip(keys, bits), round_trip(values, bits), src.offset)
    mx.eval([c.state for c in out])
    return out


def logits_after(model, cache: list, tokens: list[int]) -> mx.array:
    return model(mx.array(tokens)[None], cache=cache)[0].astype(mx.float32)


def greedy(model, cache: list, first: int, n: int) -> list[int]:
    out, token = [first], first
    for _ in range(n - 1):
        token = int(mx.argmax(model(mx.array([[token]]), cache=cache)[0, -1]).item())
        out.append(token)
    return out


def nll(model, cache: list, tokens: list[int]) -> float:
    """Returns the mean negative log-likelihood of tokens[1:] given the cache and tokens[0]."""
    logits = logits_after(model, cache, tokens[:-1])
    logp = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    picked = mx.take_along_axis(logp, mx.array(tokens[1:])[:, None], axis=-1)
    return -picked.mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--prefix", type=int, default=512, help="tokens restored from the tier")
    parser.add_argument("--suffix", type=int, default=32, help="tokens prefilled after it")
    parser.add_argument("--decode", type=int, default=16, help="greedy tokens compared")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    started = time.time()

    from appliance.models.loaded import load_model
    from appliance.spec import ModelSpec

    loaded = load_model(ModelSpec(name="bench", source=str(MODEL), dtype=args.dtype),
                        base_dir=REPO, cache_dir=REPO / ".cache" / "bench")
    model = loaded.model
    results = {bits: Quality(bits) for bits in (8, 4)}
    mean_error = {bits: 0.0 for bits in results}
    for i, text in enumerate(stdlib_texts(args.prompts)):
        tokens = loaded.encode(text)[: args.prefix + args.suffix]
        prefix, suffix = tokens[: args.prefix], tokens[args.prefix:]
        computed = prefill(model, prefix)
        caches = {bits: restored(model, computed, bits) for bits in results}  # before computed grows
        reference = logits_after(model, computed, suffix)
        ref_next = int(mx.argmax(reference[-1]).item())
        ref_run = greedy(model, computed, ref_next, args.decode)
        for bits, q in results.items():
            cache = caches[bits]
            logits = logits_after(model, cache, suffix)
            error = mx.abs(logits - reference)
            q.max_logit_error = max(q.max_logit_error, error.max().item())
            mean_error[bits] += error.mean().item()
            nxt = int(mx.argmax(logits[-1]).item())
            q.next_token_same += nxt == ref_next
            q.continuation_same += nxt == ref_next and greedy(model, cache, nxt, args.decode) == ref_run
        print(f"\r{i + 1}/{args.prompts} prompts", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    n = args.prompts
    for bits, q in results.items():
        q.mean_logit_error = mean_error[bits] / n
        q.next_token_same /= n
        q.continuation_same /= n

    text = (Path(sysconfig.get_paths()["stdlib"]) / TEXT).read_text()
    tokens = loaded.encode(text)[:2048]
    half = len(tokens) // 2
    computed = prefill(model, tokens[:half])
    caches = {bits: restored(model, computed, bits) for bits in results}
    reference_ppl = math.exp(nll(model, computed, tokens[half:]))
    for bits, q in results.items():
        q.perplexity = math.exp(nll(model, caches[bits], tokens[half:]))

    print(f"model {MODEL.name} ({loaded.dtype}); {n} prompts, {args.prefix}-token prefix restored, "
          f"{args.suffix}-token suffix, {args.decode}-token greedy continuation")
    print("| KV bits | max logit error | mean logit error | next token same | continuation same | perplexity |")
    print("|---:|---:|---:|---:|---:|---:|")
    print(f"| 16 | 0 | 0 | 100% | 100% | {reference_ppl:.3f} |")
    for bits, q in results.items():
        print(f"| {bits} | {fmt(q.max_logit_error, '.3f')} | {fmt(q.mean_logit_error, '.4f')} "
              f"| {q.next_token_same:.0%} | {q.continuation_same:.0%} | {q.perplexity:.3f} "
              f"({(q.perplexity / reference_ppl - 1):+.2%}) |")
    path = write_json(OUT_DIR / "kv_quality.json", {
        **run_header(__file__, started=started), "model": MODEL.name, "dtype": loaded.dtype,
        "args": vars(args), "reference_perplexity": reference_ppl, "text": TEXT,
        "results": list(results.values())})
    print(f"written: {path.relative_to(REPO)}")


if __name__ == "__main__":
    main()
