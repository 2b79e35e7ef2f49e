"""The prefill speed a restore-or-recompute decision prices a recompute at, under load.

omlx decides per request whether restoring a cached prefix beats recomputing it, from the
tiers' measured read rates and the engine's measured prefill speed (tokens/s). This
benchmark reads that speed from the server's own decision (GET /admin/api/cache,
`last_decision.prefill_tok_s`) twice: after one lone prompt of ~1,000 tokens, and again
after a burst of N short prompts sent at once (they share prefill calls). Each reading is
taken by a one-line probe request, whose lookup records the decision.

Run it against two checkouts to compare how they measure (`--code`, repeatable: a
checkout's `appliance` package serves, as in bench/restore.py):

    .venv/bin/python bench/prefill_speed.py [--code /path/to/checkout ...] [--burst 8]
    # NVIDIA GPU, a bf16 model from bench/gpu_model.py, under a profile from profiles/:
    python3 bench/prefill_speed.py --model /tmp/llama-8b --profile nvidia-h200 --burst 32

Writes bench/out/prefill_speed.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    REPO,
    client,
    converted_model_dir,
    fmt,
    get_json,
    log,
    omlx_server,
    run_header,
    stream_chat,
    write_json,
)
from throughput import prompt_set  # noqa: E402


def lone_prompt() -> list[dict]:
    """Returns a chat of ~1,000 tokens of numbered notes."""
    notes = " ".join(f"Note {i}: the harbour office records {i * 7} ships in year {1200 + i}." for i in range(60))
    return [{"role": "user", "content": f"[lone] {notes}"}]


def decision(url: str) -> dict:
    """Returns the server's last restore-or-recompute decision (its one model's)."""
    models = get_json(url, "/admin/api/cache")["models"]
    return next(iter(models.values()))["last_decision"] or {}


def commit(code: Path) -> str:
    """Returns the checkout's commit, marked + when its tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(code), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "-C", str(code), "diff", "--quiet", "HEAD"]).returncode != 0
    return head + ("+" if dirty else "") if head else str(code)


async def measure(code: Path, burst: int, *, model_dir: Path | None, profile: str | None) -> dict:
    """Returns the prefill speed `code`'s server reads after a lone prompt and after a burst."""
    with tempfile.TemporaryDirectory(prefix="omlx-prefill-speed-") as work, \
            omlx_server(model_dir or converted_model_dir(), work_dir=Path(work), max_running=max(16, burst),
                        max_queued=4 * burst, code=code, log_name="prefill_speed", profile=profile,
                        dtype="auto" if model_dir else "float32") as server:
        server.start()
        async with client() as http:
            async def probe(label: str) -> dict:
                await stream_chat(http, server.url, [{"role": "user", "content": f"[{label}] hi"}], max_tokens=1)
                return decision(server.url)

            lone = await stream_chat(http, server.url, lone_prompt(), max_tokens=1)
            after_lone = await probe("probe 1")
            shorts = await asyncio.gather(*(stream_chat(http, server.url, chat, max_tokens=4)
                                            for chat in prompt_set("burst", burst, max_notes=6)))
            after_burst = await probe("probe 2")
    errors = [t.error for t in [lone, *shorts] if t.error]
    return {"code": commit(code), "lone_prompt_tokens": lone.prompt_tokens, "lone_ttft_s": lone.ttft_s,
            "burst": burst, "burst_prompt_tokens": [t.prompt_tokens for t in shorts],
            "after_lone": after_lone, "after_burst": after_burst, "errors": errors}


def table(rows: list[dict]) -> str:
    lines = ["| code | lone prompt (tokens) | its TTFT (s) | prefill tok/s after it | burst | prefill tok/s "
             "after the burst | after ÷ before |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        before, after = r["after_lone"].get("prefill_tok_s"), r["after_burst"].get("prefill_tok_s")
        change = after / before if before and after else None
        lines.append(f"| {r['code']} | {r['lone_prompt_tokens']} | {fmt(r['lone_ttft_s'])} | {before} | "
                     f"{r['burst']} | {after} | {fmt(change)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--code", type=Path, action="append", default=None,
                        help="a checkout whose server to measure (repeatable; default: this one)")
    parser.add_argument("--burst", type=int, default=8, help="short prompts sent at once")
    parser.add_argument("--model", type=Path, metavar="DIR",
                        help="a model directory (bench/gpu_model.py) in its own dtype, instead of the test model")
    parser.add_argument("--profile", metavar="NAME", help="an omlx profile from profiles/ (e.g. nvidia-h200)")
    parser.add_argument("--out", type=Path, default=OUT_DIR / "prefill_speed.json")
    args = parser.parse_args()
    model_dir = args.model.resolve() if args.model else None
    result = {**run_header(__file__), "rows": []}
    for code in args.code or [REPO]:
        log(f"measuring {code}")
        result["rows"].append(asyncio.run(measure(code.resolve(), args.burst, model_dir=model_dir,
                                                  profile=args.profile)))
        write_json(args.out, result)
    print(table(result["rows"]))
    print(f"\nResults: {args.out}")


if __name__ == "__main__":
    main()
