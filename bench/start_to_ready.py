"""Start to ready, then one long chat cold, again (a memory-tier hit), and another of a
new length cold, over HTTP.

Starts `omlx serve` on a model directory with a profile, times `GET /health` = 200 from
the process start, splits that time by the server log's timestamps (process start to its
first line: imports and device set-up; the model load; the warm-up of the model's
stand-in beside the load; load to warm-up: the weights' fingerprint and the cache
set-up; the warm-up), then streams the chats and prints TTFT and decode ms/token of
each. Then what a memory hit adds to a request at the client: one-token chats (not
streamed: the reply comes after the first token, whatever text it decodes to) of the long
prompt again and of a short one, in turn, `--hit-repeats` times each; their medians'
difference is the hit's cost (encoding the prompt, looking up and restoring its prefix,
the tail's prefill). `--import-profile` runs the server with `-X importtime` and adds its
slowest imports.

    python bench/start_to_ready.py MODEL_DIR --profile nvidia-h200 --tokens 25000
    python bench/start_to_ready.py MODEL_DIR --code /path/to/other/checkout  # another commit's server

Kernel caches: by default the server shares MLX's (/tmp/mlx) with the machine's other
MLX processes (bench/common.server_env); `--fresh-kernel-caches` gives it empty ones (a
machine's first start); `--kernels-in-cache-dir` leaves them where `omlx serve` keeps
them itself, in its cache dir (the CUDA driver's beside them), so that two starts on one
`--work` dir are a first start and a later one, whatever /tmp holds (the later one finds
the first one's chats in its SSD tier too: its "cold" requests are not).

MODEL_DIR holds config.json, safetensors and tokenizer.json (bench/gpu_model.py writes one).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import HOST, REPO, client, free_port, get_json, omlx_process, stream_chat, with_profiles  # noqa: E402


def long_text(model_dir: Path, num_tokens: int, seed: int) -> str:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    rng = random.Random(seed)
    return tok.decode([rng.randrange(100, 40000) for _ in range(num_tokens)])


STAMP = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) ")


def phases(log: str, *, spawned_at: float, ready_at: float) -> dict:
    """Returns start to ready split into phases (seconds) by the log's timestamps (local
    time, milliseconds); a phase whose line is missing is left out."""
    def at(pattern: str) -> tuple[float, float | None] | None:
        for line in log.splitlines():
            if re.search(pattern, line) and (m := STAMP.match(line)):
                took = re.search(r" in ([0-9.]+) s", line)
                return (datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp(),
                        float(took.group(1)) if took else None)
        return None

    first, loaded, warm = at(r"."), at(r"loaded from .* in [0-9.]+ s"), at(r"warmed up in [0-9.]+ s")
    stand_in = at(r"warmed up beside its load, on a .* in [0-9.]+ s")
    preloaded = at(r"preloaded by .* in [0-9.]+ s")
    out = {}
    if preloaded:  # the default model's weights, read while the server's imports ran (models/preload.py)
        out["weights_preload_s"] = preloaded[1]
        out["weights_preloaded_after_start_s"] = preloaded[0] - spawned_at
    if stand_in:  # on the engine's thread, during the load: it ends before the model's own warm-up
        out["stand_in_warm_up_s"] = stand_in[1]
        if loaded:
            out["stand_in_end_after_load_s"] = stand_in[0] - loaded[0]
    if first:
        out["process_to_first_log_line_s"] = first[0] - spawned_at
    if loaded:
        out["model_load_s"] = loaded[1]
        if first:
            out["first_line_to_load_start_s"] = loaded[0] - loaded[1] - first[0]
    if warm:
        out["warm_up_s"] = warm[1]
        if loaded:
            out["load_to_warm_up_start_s"] = warm[0] - warm[1] - loaded[0]  # fingerprint, probe, cache
        out["warm_up_end_to_ready_s"] = ready_at - warm[0]
    return {k: round(v, 2) for k, v in out.items()}


def warm_up_parts(log: str) -> dict[str, dict[str, float]]:
    """Returns the seconds of each part of the stand-in's and the model's warm-ups, as
    their log lines list them ("... in 9.52 s (chat 0.40 s, batch changes 2.10 s)")."""
    out = {}
    for which, pattern in (("stand_in", r"warmed up beside its load, .*\((.*)\)$"), ("model", r"warmed up in .*\((.*)\)$")):
        if m := next((m for line in log.splitlines() if (m := re.search(pattern, line))), None):
            out[which] = {name: float(seconds) for name, seconds in re.findall(r"([^,]+?) ([0-9.]+) s(?:, |$)", m.group(1))}
    return out


IMPORT = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")


def import_profile(log: str, *, top: int = 15) -> dict:
    """Returns the server's imports (`-X importtime` lines in its log, both processes of
    its re-exec) that took longest, cumulative seconds by module with its depth (0: a
    top-level import), and the total of the top-level ones."""
    rows = [(int(m.group(2)) / 1e6, (len(m.group(3)) - 1) // 2, m.group(4)) for line in log.splitlines()
            if (m := IMPORT.match(line))]
    total = sum(s for s, depth, _ in rows if depth == 0)
    longest = sorted(rows, reverse=True)[:top]
    return {"top_level_total_s": round(total, 2),
            "longest": [{"module": name, "cumulative_s": round(s, 3), "depth": depth} for s, depth, name in longest]}


async def one_token(http, url: str, messages: list[dict]) -> dict:
    """One chat of one token, not streamed: its time at the client and the cached tokens,
    or its error (a benchmark records failures, it does not stop on them)."""
    started = time.perf_counter()
    reply = await http.post(f"{url}/v1/chat/completions",
                            json={"messages": messages, "max_tokens": 1, "temperature": 0.0})
    elapsed = time.perf_counter() - started
    if reply.status_code != 200:
        return {"s": round(elapsed, 4), "error": f"HTTP {reply.status_code}: {reply.text[:200]}"}
    usage = reply.json()["usage"]
    return {"s": round(elapsed, 4), "prompt_tokens": usage["prompt_tokens"],
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model_dir", type=Path)
    parser.add_argument("--profile", default=None)
    parser.add_argument("--tokens", type=int, default=25000)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--hit-repeats", type=int, default=5,
                        help="one-token chats of the long prompt (memory hits) and of a short one, each")
    parser.add_argument("--import-profile", action="store_true",
                        help="run the server with -X importtime and report its slowest imports")
    parser.add_argument("--stand-in", choices=("auto", "on", "off"), default=None,
                        help="[batching] warm_up_beside_load for this start (default: the config's)")
    parser.add_argument("--fresh-kernel-caches", action="store_true",
                        help="empty JIT caches (MLX's PTX, the CUDA driver's): a machine's first start")
    parser.add_argument("--kernels-in-cache-dir", action="store_true",
                        help="JIT caches where omlx serve keeps them: in its cache dir (under --work)")
    parser.add_argument("--kernels", default="", metavar="LINE",
                        help='a line of the config\'s [kernels] table, e.g. small_matmul = "generic"')
    parser.add_argument("--code", type=Path, default=None,
                        help="another checkout whose server to start (default: this one), for A/Bs")
    parser.add_argument("--work", type=Path, default=None,
                        help="the dir for the config and the cache (default: a fresh one); reused, a later start")
    args = parser.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="omlx-ready-"))
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    profile = f'profile = "{args.profile}"\n' if args.profile else ""
    config = work / "omlx.toml"
    code = (args.code or REPO).resolve()
    with_profiles(work, code)
    config.write_text(f"""{profile}
[server]
host = "{HOST}"
port = {port}
drain_timeout_s = 2

[[models]]
name = "bench"
source = "{args.model_dir.resolve()}"
default = true

[cache]
dir = "{work / 'cache'}"

[kernels]
{args.kernels}
""")
    log_path = (args.out.parent if args.out else work) / "omlx_server.log"
    server = omlx_process(config, port, log_path, cwd=code)
    if args.import_profile:
        server.env = {**server.env, "PYTHONPROFILEIMPORTTIME": "1"}
    if args.stand_in:
        server.env = {**server.env, "OMLX_BATCHING__WARM_UP_BESIDE_LOAD": args.stand_in}
    if args.fresh_kernel_caches:
        server.env = {**server.env, "MLX_PTX_CACHE_DIR": str(work / "ptx"), "CUDA_CACHE_PATH": str(work / "nv")}
    elif args.kernels_in_cache_dir:
        server.env = {k: v for k, v in server.env.items() if k != "MLX_PTX_CACHE_DIR"}
        server.env["CUDA_CACHE_PATH"] = str(work / "cache" / "nv")
    started, spawned_at = time.perf_counter(), time.time()
    results: dict = {"tokens": args.tokens, "profile": args.profile, "stand_in": args.stand_in or "config",
                     "fresh_kernel_caches": args.fresh_kernel_caches,
                     "kernels_in_cache_dir": args.kernels_in_cache_dir, "kernels": args.kernels}
    with server.start(ready_timeout_s=600):
        results["start_to_ready_s"] = round(time.perf_counter() - started, 2)
        text = log_path.read_text(errors="replace")
        results["phases"] = phases(text, spawned_at=spawned_at, ready_at=time.time())
        results["warm_up_parts"] = warm_up_parts(text)
        if args.import_profile:
            results["imports"] = import_profile(text)
        load = re.search(r"loaded from .* in ([0-9.]+) s", text)
        results["model_load_s"] = float(load.group(1)) if load else None
        results["log_lines"] = [line for line in text.splitlines()
                                if re.search(r"loaded|warm|ready|limit|memory|ahead", line, re.I)][:24]
        print(json.dumps(results, indent=1), flush=True)
        first = [{"role": "user", "content": long_text(args.model_dir, args.tokens, seed=1)}]
        other = [{"role": "user", "content": long_text(args.model_dir, args.tokens * 4 // 5, seed=2)}]

        async def go():
            async with client() as http:
                runs = []
                for label, messages in (("cold", first), ("memory_hit", first), ("cold_other_length", other)):
                    t = await stream_chat(http, server.url, messages, max_tokens=args.max_tokens)
                    decode = ((t.total_s - t.ttft_s) / (t.completion_tokens - 1) * 1000
                              if t.ok and t.completion_tokens and t.completion_tokens > 1 else None)
                    runs.append({"label": label, "ttft_s": t.ttft_s, "decode_ms": decode,
                                 "prompt_tokens": t.prompt_tokens, "cached_tokens": t.cached_tokens,
                                 "completion_tokens": t.completion_tokens, "error": t.error})
                    print(json.dumps(runs[-1]), flush=True)
                hits, shorts = [], []
                short = [{"role": "user", "content": "Say hello."}]
                for _ in range(args.hit_repeats):
                    hits.append(await one_token(http, server.url, first))
                    shorts.append(await one_token(http, server.url, short))
                return runs, hits, shorts

        results["requests"], hits, shorts = asyncio.run(go())
        results["one_token"] = {"memory_hit": hits, "short": shorts}
        answered = [[r["s"] for r in rs if "error" not in r] for rs in (hits, shorts)]
        if all(answered):
            hit_s, short_s = (statistics.median(times) for times in answered)
            results["one_token"].update(memory_hit_median_s=hit_s, short_median_s=short_s,
                                        memory_hit_adds_s=round(hit_s - short_s, 4))
        print(json.dumps({k: v for k, v in results["one_token"].items() if k.endswith("_s")}), flush=True)
        # The server's own view of each request (queue, TTFT from submit, prefill rate).
        status = get_json(server.url, "/admin/api/status")
        results["server_side"] = [m.get("recent_requests") for m in status.get("models", [])]
        print(json.dumps(results["server_side"]), flush=True)
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
