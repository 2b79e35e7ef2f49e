"""Restore vs recompute: TTFT of a prefix computed cold, restored from memory, and from SSD after a restart.

For each prefix size a fresh omlx serves the converted float32 model from a cache dir of
its own. One chat prompt of that many tokens (a system message of real source code from
the venv, then a short question) is sent three ways, streaming with max_tokens 8, and timed
client-side to the first content chunk:

1. cold: the first visit, computed from scratch;
2. memory: the same prompt again (median of 3), restored from the memory tier;
3. SSD after restart: the server is stopped (its SSD writes flushed), the page cache is
   dropped (`/proc/sys/vm/drop_caches`, else POSIX_FADV_DONTNEED per block file; residency
   is checked with fincore), a new server opens the same cache dir and gets the prompt.
   Done SSD_REPEATS times (a new server and a dropped page cache each time); the median
   counts.

Nothing is warmed up by the benchmark: each measured request is the first one a server gets
after GET /health turned 200 (polled every 50 ms), as a user's script would send it, so the
server's own start-up work counts. Every start's time to ready (process start to /health
200) is recorded. Which tier served a request comes from the server: the change of per-tier
hit counters in GET /admin/api/cache and the request's `cached_by_tier` in
GET /admin/api/status.

    .venv/bin/python bench/restore.py [--quick]     # quick: 256 and 1K tokens; full: 512, 2K, 8K
    .venv/bin/python bench/restore.py --sizes 2K --code /path/to/other/checkout   # another commit's server
    python3 bench/restore.py --model /tmp/llama-8b --profile nvidia-h200 --sizes 8K,25K --host --ssd-repeats 1

With `--model` and `--profile` it runs on a GPU model (bench/gpu_model.py) under a profile;
`--host` adds a host-tier phase: a server whose memory tier holds one prompt's KV and not
two; prompt A, then prompt B (which pushes A's blocks down to host memory), then A again,
restored from there. `--tiers-only` (with `--host`) skips the cold-and-memory server: the SSD
phase restarts on the host phase's cache dir and restores its prompt A, one cold prefill
and one start fewer (the 70B runs). Every measured request records the server's restore-or-recompute decision (its
inputs: prefill speed, per-tier restore rates and estimates; its choice), from
GET /admin/api/cache.

Writes bench/out/restore.json (bench/out/restore-quick.json with --quick) and prints a markdown
table. Server logs: bench/out/logs/restore-<size>-<start>.log.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    OUT_DIR,
    REPO,
    ChatTokens,
    ForeignLoad,
    ServerProcess,
    Timing,
    client,
    converted_model_dir,
    drop_page_cache,
    fmt,
    get_json,
    kv_files,
    log,
    longest_fit,
    omlx_server,
    ratio,
    resident_bytes,
    run_header,
    site_packages,
    stream_chat,
    tier_deltas,
    wait_idle_work,
    wait_ssd_written,
    write_json,
)

FULL_SIZES = {"512": 512, "2K": 2048, "8K": 8000}  # the test model's context is 8192
GPU_SIZES = {"8K": 8000, "25K": 25000, "32K": 32000}  # --model: GPU models have 32K
QUICK_SIZES = {"256": 256, "1K": 1024}
MAX_TOKENS = 8
MEMORY_REPEATS = 3
SSD_REPEATS = 3
TARGET_SSD_SHARE = 0.02  # SSD hit after restart <= 2% of cold, from 2K tokens up
TARGET_FROM_TOKENS = 2048
REQUEST_TIMEOUT_S = 900.0  # an 8K cold prefill takes ~190 s on an idle 2-core CPU
SOURCES = ("mlx_lm/generate.py", "mlx_lm/models/cache.py", "httpx/_client.py", "starlette/routing.py")
QUESTION = "Summarize in one sentence what the code above does."


# --- prompts -----------------------------------------------------------------------------------


def source_text() -> str:
    """Returns real Python source of installed packages, each file under a header (about 60K tokens)."""
    import importlib.util

    def path(name: str) -> Path:  # wherever the package lies (a venv, or a --target dir)
        top = importlib.util.find_spec(name.split("/")[0])
        return Path(top.origin).parent.parent / name if top and top.origin else site_packages() / name

    return "\n\n".join(f"# File: {name}\n{path(name).read_text()}" for name in SOURCES)


def prompt_of(tokens: ChatTokens, num_tokens: int, *, label: str) -> list[dict]:
    """Returns a chat of code review whose prompt is as close to `num_tokens` tokens as lines allow."""
    lines = source_text().splitlines()

    def chat(n: int) -> list[dict]:
        system = f"[{label}] You are a senior engineer reviewing this code.\n\n" + "\n".join(lines[:n])
        return [{"role": "system", "content": system}, {"role": "user", "content": QUESTION}]

    n = longest_fit(len(lines), lambda n: len(tokens.prompt(chat(n))) <= num_tokens)
    return chat(n)


# --- one size ----------------------------------------------------------------------------------


@dataclass
class Shot:
    """One timed request, as the client and the server saw it."""

    name: str
    timing: Timing
    tier_deltas: dict  # per tier: change of hits (and SSD read bytes/seconds)
    served_by: dict  # the request's cached_by_tier (tokens per tier), from /admin/api/status
    server_ttft_s: float | None
    server_queue_s: float | None
    foreign_cpu_share: float
    decision: dict | None = None  # the server's restore-or-recompute inputs and choice

    @property
    def ttft_s(self) -> float | None:
        return self.timing.ttft_s


@dataclass
class SizeResult:
    label: str
    target_tokens: int
    prompt_tokens: int | None = None
    cold: Shot | None = None
    memory: list[Shot] = field(default_factory=list)
    host: list[Shot] = field(default_factory=list)  # --host: cold A, cold B (A goes to host), A again
    host_pinned_bytes: int | None = None  # pinned host memory when the host phase began (CUDA)
    ssd_runs: list[Shot] = field(default_factory=list)  # one per restart
    ssd_restore_s: list[float | None] = field(default_factory=list)  # per restart, the engine's restore (its log)
    ready_s: list[float] = field(default_factory=list)  # each start's time to /health 200
    drop_method: str | None = None
    block_files: int = 0
    block_bytes: int = 0
    resident_after_drop_bytes: int | None = None
    resident_before_ssd_request_bytes: int | None = None
    ssd_writes_flushed: bool | None = None
    server_exit_codes: list[int | None] = field(default_factory=list)
    cache_after_ssd: dict | None = None
    error: str | None = None

    @property
    def ssd(self) -> Shot | None:
        """The median SSD-after-restart run (a failed run counts as the slowest)."""
        runs = sorted(self.ssd_runs, key=lambda r: (r.ttft_s is None, r.ttft_s or 0.0))
        return runs[len(runs) // 2] if runs else None

    @property
    def ssd_read_gbps(self) -> float | None:
        """The SSD tier's file-read throughput during the SSD request (its read_bytes / read_s)."""
        d = (self.ssd.tier_deltas.get("ssd") or {}) if self.ssd else {}
        return d["read_bytes"] / d["read_s"] / 1e9 if d.get("read_s") else None

    @property
    def ssd_file_gbps(self) -> dict[str, float | None]:
        """The measured prompt's block files over the median SSD run's time: its restore in
        the engine (from the server's log) and its client TTFT (a bound on the restore)."""
        if not self.ssd_runs or not self.block_bytes:
            return {"engine": None, "client": None}
        restore_s = sorted(s for s in self.ssd_restore_s if s)
        engine_s = restore_s[len(restore_s) // 2] if restore_s else None
        return {"engine": self.block_bytes / engine_s / 1e9 if engine_s else None,
                "client": self.block_bytes / self.ssd.ttft_s / 1e9 if self.ssd.ttft_s else None}

    @property
    def ready_median_s(self) -> float | None:
        values = sorted(self.ready_s)
        return values[len(values) // 2] if values else None

    @property
    def memory_ttft_s(self) -> float | None:
        values = sorted(s.ttft_s for s in self.memory if s.ttft_s is not None)
        return values[len(values) // 2] if values else None

    def summary(self) -> dict:
        cold = self.cold.ttft_s if self.cold else None
        ssd = self.ssd.ttft_s if self.ssd else None
        host = self.host[-1].ttft_s if len(self.host) > 2 else None
        return {
            "label": self.label, "prompt_tokens": self.prompt_tokens,
            "cold_ttft_s": cold, "memory_ttft_s": self.memory_ttft_s, "ssd_ttft_s": ssd,
            "host_ttft_s": host, "host_over_cold": ratio(host, self.host[0].ttft_s if self.host else None), "host_pinned_bytes": self.host_pinned_bytes,
            "host_served_by": self.host[-1].served_by if len(self.host) > 2 else None,
            "host_decision": self.host[-1].decision if len(self.host) > 2 else None,
            "ssd_decision": self.ssd.decision if self.ssd else None,
            "host_restore_gbps": ((self.host[-1].tier_deltas.get("host") or {}).get("restore_gbps")
                                  if len(self.host) > 2 else None),
            "memory_over_cold": ratio(self.memory_ttft_s, cold), "ssd_over_cold": ratio(ssd, cold),
            "memory_cached_tokens": self.memory[0].timing.cached_tokens if self.memory else None,
            "ssd_cached_tokens": self.ssd.timing.cached_tokens if self.ssd else None,
            "ssd_ttft_runs_s": [r.ttft_s for r in self.ssd_runs],
            "ssd_served_by": self.ssd.served_by if self.ssd else None,
            "ssd_read_gbps": self.ssd_read_gbps,
            "ssd_restore_s": self.ssd_restore_s, "ssd_file_gbps": self.ssd_file_gbps,
            "ready_s": self.ready_s, "ready_median_s": self.ready_median_s,
            "meets_target": (None if self.target_tokens < TARGET_FROM_TOKENS or ratio(ssd, cold) is None
                             else ratio(ssd, cold) <= TARGET_SSD_SHARE),
        }


async def timed(server: ServerProcess, name: str, messages: list[dict]) -> Shot:
    """Returns one streamed request with the server's view of it."""
    before = get_json(server.url, "/admin/api/cache")
    meter = ForeignLoad({server.group}).start()
    async with client() as http:
        timing = await stream_chat(http, server.url, messages, max_tokens=MAX_TOKENS, timeout_s=REQUEST_TIMEOUT_S)
    share = meter.share()
    after = get_json(server.url, "/admin/api/cache")
    recent = get_json(server.url, "/admin/api/status")["models"][0]["recent_requests"]
    last = recent[-1] if recent else {}
    decisions = [m.get("last_decision") for m in (after.get("models") or {}).values()]
    shot = Shot(name=name, timing=timing, tier_deltas=tier_deltas(before, after),
                served_by=last.get("cached_by_tier") or {}, server_ttft_s=last.get("ttft_s"),
                server_queue_s=last.get("queue_s"), foreign_cpu_share=share,
                decision=decisions[0] if decisions else None)
    log(f"   {name}: TTFT {fmt(timing.ttft_s, '.3f')} s, prompt {timing.prompt_tokens}, cached "
        f"{timing.cached_tokens} {shot.served_by}, others' CPU {share:.0%} {timing.error or ''}")
    log(f"      decision: {shot.decision}")
    log(f"      tiers: {shot.tier_deltas}")
    return shot


@dataclass(frozen=True)
class Setup:
    """How each server of the run is configured."""

    model_dir: Path
    code: Path
    profile: str | None = None
    dtype: str = "float32"
    ssd_repeats: int = SSD_REPEATS
    host: bool = False
    ssd_kv_bits: int = 16
    host_kv_bits: int = 16
    tiers_only: bool = False  # the SSD phase reopens the host phase's cache dir (see --tiers-only)


def start(setup: Setup, work_dir: Path, log_name: str, result: SizeResult, *,
          memory_gb: float | None = None) -> ServerProcess:
    code = setup.code
    server = omlx_server(setup.model_dir, work_dir=work_dir, max_running=4, max_queued=8, log_name=log_name,
                         code=code, profile=setup.profile, dtype=setup.dtype, memory_gb=memory_gb,
                         ssd_kv_bits=setup.ssd_kv_bits, host_kv_bits=setup.host_kv_bits)
    log(f"starting omlx ({server.log_path.name}, code {code}), cache dir {work_dir / 'cache'}")
    server.start(ready_timeout_s=600)
    result.ready_s.append(server.ready_s)
    log(f"   ready in {server.ready_s:.2f} s; its idle work (call shapes) ended {wait_idle_work(server.url)} s "
        "later, before any measured request")
    return server


def kv_bytes_per_token(model_dir: Path, dtype: str) -> int:
    """Returns the KV bytes per token of a Llama-style model dir (keys and values, all
    layers), in `dtype` ("auto": the checkpoint's own, bf16 for GPU models)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    itemsize = 4 if dtype == "float32" else 2
    return 2 * cfg["num_hidden_layers"] * kv_heads * head_dim * itemsize


def wait_pinned(server: ServerProcess, *, settle_s: float = 2.0, limit_s: float = 60.0) -> int:
    """Waits until the server's pinned host memory (CUDA: made by idle engines, at ~1.4 GB/s)
    stops growing, and returns it; the host phase measures the native host path, not the
    pinning."""
    deadline, last, since = time.monotonic() + limit_s, -1, time.monotonic()
    while time.monotonic() < deadline:
        pinned = get_json(server.url, "/admin/api/cache")["tiers"]["host"].get("pinned_bytes", 0)
        if pinned != last:
            last, since = pinned, time.monotonic()
        elif time.monotonic() - since >= settle_s:
            break
        time.sleep(0.25)
    log(f"   {last / 2**30:.1f} GiB of host memory pinned")
    return last


def measure_size(setup: Setup, tokens: ChatTokens, label: str, num_tokens: int, root: Path) -> SizeResult:
    result = SizeResult(label=label, target_tokens=num_tokens)
    messages = prompt_of(tokens, num_tokens, label=f"restore-{label}")
    work_dir = root / label
    work_dir.mkdir()
    cache_dir = work_dir / "cache"

    if setup.host:  # its own cache dir: the measured prompt's blocks must not be on its SSD yet
        host_dir = root / f"{label}-host"
        host_dir.mkdir()
        # A memory tier that holds one prompt's KV and not two: prompt B's blocks push
        # prompt A's down to host memory, and A's repeat is served from there.
        memory_gb = round(1.5 * num_tokens * kv_bytes_per_token(setup.model_dir, setup.dtype) / 2**30, 3)
        server = start(setup, host_dir, f"restore-{label}-host", result, memory_gb=memory_gb)
        try:
            result.host_pinned_bytes = wait_pinned(server)
            a = prompt_of(tokens, num_tokens, label=f"restore-{label}-host-a")
            b = prompt_of(tokens, num_tokens, label=f"restore-{label}-host-b")
            result.host.append(asyncio.run(timed(server, "host: cold A", a)))
            result.ssd_writes_flushed = wait_ssd_written(server.url)
            a_files = kv_files(host_dir / "cache")  # prompt A's blocks (B's come next)
            for name, chat in (("host: cold B", b), ("host: repeat A", a)):
                result.host.append(asyncio.run(timed(server, name, chat)))
        finally:
            result.server_exit_codes.append(server.stop(grace_s=60))
        if setup.tiers_only:  # prompt A, as saved by the host phase, is the SSD phase's prompt
            messages, work_dir, cache_dir = a, host_dir, host_dir / "cache"
            result.cold = result.host[0]
            result.prompt_tokens = result.cold.timing.prompt_tokens
        else:
            # Its blocks are of no further use; a 70B model's two 32K prompts hold 21 GB of them,
            # and the GPU machine's disk holds 64 GiB with the model.
            shutil.rmtree(host_dir, ignore_errors=True)

    if not setup.tiers_only:
        server = start(setup, work_dir, f"restore-{label}-1", result)
        try:
            result.cold = asyncio.run(timed(server, "cold", messages))
            result.prompt_tokens = result.cold.timing.prompt_tokens
            for i in range(MEMORY_REPEATS):
                result.memory.append(asyncio.run(timed(server, f"memory {i + 1}", messages)))
            result.ssd_writes_flushed = wait_ssd_written(server.url)
        finally:
            result.server_exit_codes.append(server.stop(grace_s=60))

    target_files = a_files if setup.tiers_only else kv_files(cache_dir)  # the measured prompt's blocks
    files = kv_files(cache_dir)
    result.block_files = len(target_files)
    result.block_bytes = sum(f.stat().st_size for f in target_files)
    for run in range(1, setup.ssd_repeats + 1):
        result.drop_method = drop_page_cache(files)
        resident = resident_bytes(target_files)
        if resident is not None:
            result.resident_after_drop_bytes = max(resident, result.resident_after_drop_bytes or 0)
        log(f"   {len(target_files)} block files, {result.block_bytes / 2**20:.1f} MiB; page cache dropped "
            f"({result.drop_method}), {resident} bytes of them still resident")
        server = start(setup, work_dir, f"restore-{label}-ssd{run}", result)
        try:
            resident = resident_bytes(target_files)
            if resident is not None:
                result.resident_before_ssd_request_bytes = max(resident, result.resident_before_ssd_request_bytes or 0)
            result.ssd_runs.append(asyncio.run(timed(server, f"ssd after restart {run}", messages)))
            result.ssd_restore_s.append(logged_restore_s(server.log_path))
            result.cache_after_ssd = get_json(server.url, "/admin/api/cache")
        finally:
            result.server_exit_codes.append(server.stop(grace_s=60))
    return result


RESTORED = re.compile(r"restored \d+ of \d+ prompt tokens \(.*?\) in ([\d.]+) s")


def logged_restore_s(log_path: Path) -> float | None:
    """Returns the seconds of the last restore a server logged (engine.py logs long ones)."""
    found = RESTORED.findall(log_path.read_text(errors="replace"))
    return float(found[-1]) if found else None


# --- report ------------------------------------------------------------------------------------


def table(results: list[SizeResult]) -> str:
    rows = ["| prefix | prompt tokens | cold TTFT (s) | memory TTFT (s) | SSD-after-restart TTFT (s) "
            "| memory/cold | SSD/cold | target SSD/cold ≤ 2% | cached tokens (memory / SSD) "
            "| SSD request served by (tokens per tier) | SSD tier read GB/s | block files (MiB) | resident before SSD request "
            "| SSD runs (s) | start to ready (s) |",
            "|---|---:|---:|---:|---:|---:|---:|---|---:|---|---:|---:|---:|---|---|"]
    for r in results:
        s = r.summary()
        target = "–" if s["meets_target"] is None else ("met" if s["meets_target"] else "missed")
        served = ", ".join(f"{k} {v}" for k, v in (s["ssd_served_by"] or {}).items()) or "nothing"
        resident = "–" if r.resident_before_ssd_request_bytes is None else f"{r.resident_before_ssd_request_bytes / 2**20:.1f} MiB"
        rows.append(
            f"| {r.label} | {r.prompt_tokens or '–'} | {fmt(s['cold_ttft_s'], '.3f')} | {fmt(s['memory_ttft_s'], '.3f')} "
            f"| {fmt(s['ssd_ttft_s'], '.3f')} | {fmt(_pct(s['memory_over_cold']))}% | {fmt(_pct(s['ssd_over_cold']))}% "
            f"| {target} | {s['memory_cached_tokens']} / {s['ssd_cached_tokens']} of {r.prompt_tokens} "
            f"| {served} | {fmt(s['ssd_read_gbps'])} | {r.block_files} ({r.block_bytes / 2**20:.1f}) | {resident} "
            f"| {' / '.join(fmt(t, '.3f') for t in s['ssd_ttft_runs_s'])} "
            f"| {' / '.join(fmt(t, '.2f') for t in r.ready_s)} |")
    return "\n".join(rows)


def _pct(value: float | None) -> float | None:
    return None if value is None else 100 * value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="256 and 1K tokens instead of 512, 2K and 8K")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--dir", type=Path, default=None, help="where the cache dirs go (default: the temp dir)")
    parser.add_argument("--sizes", default=None, help="comma-separated prefix labels to run (e.g. 2K)")
    parser.add_argument("--code", type=Path, default=REPO,
                        help="the checkout whose omlx the servers run (default: this one)")
    parser.add_argument("--model", type=Path, default=None,
                        help="a model directory (default: the converted test model, in float32)")
    parser.add_argument("--profile", default=None, help="a profile of profiles/ for every server")
    parser.add_argument("--ssd-repeats", type=int, default=SSD_REPEATS)
    parser.add_argument("--host", action="store_true", help="add the host-tier phase")
    parser.add_argument("--ssd-kv-bits", type=int, choices=(16, 8, 4), default=16)
    parser.add_argument("--host-kv-bits", type=int, choices=(16, 8, 4), default=16)
    parser.add_argument("--tiers-only", action="store_true",
                        help="with --host: no cold-and-memory server; the SSD phase restarts on the host phase's "
                             "cache dir and restores its prompt A (one cold prefill and one start fewer)")
    args = parser.parse_args(argv)
    sizes = QUICK_SIZES if args.quick else GPU_SIZES if args.model else FULL_SIZES
    if args.sizes:
        wanted = args.sizes.split(",")
        unknown = [w for w in wanted if w not in sizes]
        if unknown:
            parser.error(f"unknown sizes {unknown}: choose from {list(sizes)}")
        sizes = {label: n for label, n in sizes.items() if label in wanted}
    name = "restore-quick" if args.quick else "restore"
    out = args.out or OUT_DIR / (f"{name}-{'-'.join(sizes)}.json" if args.sizes else f"{name}.json")
    model_dir = args.model.resolve() if args.model else converted_model_dir()
    setup = Setup(model_dir, args.code.resolve(), profile=args.profile, dtype="auto" if args.model else "float32",
                  ssd_repeats=args.ssd_repeats, host=args.host, ssd_kv_bits=args.ssd_kv_bits,
                  host_kv_bits=args.host_kv_bits, tiers_only=args.tiers_only)
    if args.tiers_only and not args.host:
        parser.error("--tiers-only needs --host")
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # unwind: stop the servers
    started = time.time()
    tokens = ChatTokens(model_dir)
    results = []
    with tempfile.TemporaryDirectory(prefix="omlx-restore-", dir=args.dir) as tmp:
        for label, n in sizes.items():
            log(f"prefix {label} ({n} tokens)")
            try:
                results.append(measure_size(setup, tokens, label, n, Path(tmp)))
            except Exception as e:  # keep the other sizes
                log(f"   failed: {type(e).__name__}: {e}")
                results.append(SizeResult(label=label, target_tokens=n, error=f"{type(e).__name__}: {e}"[:2000]))
    record = {
        **run_header(__file__, argv, started=started),
        "model_dir": str(model_dir),
        "max_tokens": MAX_TOKENS,
        "code": str(args.code.resolve()),
        "warm_up": "none by the benchmark: each measured request is the first after /health turned 200",
        "summary": [r.summary() for r in results],
        "sizes": results,
    }
    path = write_json(out, record)
    print(f"## Restore vs recompute: client TTFT (streaming, max_tokens {MAX_TOKENS}), omlx, one server per prefix\n")
    print(table(results))
    methods = sorted({r.drop_method for r in results if r.drop_method})
    print(f"\nmemory: median of {MEMORY_REPEATS} repeats. SSD: median of {args.ssd_repeats} run(s), each a new server on the "
          f"same cache dir after the page cache was dropped ({', '.join(methods) or '–'}). No warm-up request: each "
          f"measured request is the first one its server got, sent once /health answered 200. Target: SSD-after-restart TTFT ≤ {TARGET_SSD_SHARE:.0%} of cold from "
          f"{TARGET_FROM_TOKENS} tokens up.\nResults: {path}")
    for r in results:
        s = r.summary()
        if s["host_ttft_s"] is not None:
            print(f"\nhost phase {r.label}: cold A {fmt(r.host[0].ttft_s, '.3f')} s, repeat A from host "
                  f"{fmt(s['host_ttft_s'], '.3f')} s ({fmt(_pct(s['host_over_cold']))}% of its cold), served by "
                  f"{s['host_served_by']}, {s['host_pinned_bytes'] / 2**30:.1f} GiB pinned; decision {s['host_decision']}")
        if r.ssd_runs:
            rates = s["ssd_file_gbps"]
            print(f"\nSSD phase {r.label}: {r.block_bytes / 2**20:.0f} MiB of block files; restores in the engine "
                  f"{r.ssd_restore_s} s ({fmt(rates['engine'])} GB/s of files), client TTFT "
                  f"{fmt(r.ssd.ttft_s, '.3f')} s ({fmt(rates['client'])} GB/s); decision {s['ssd_decision']}")
        if r.error:
            print(f"\n{r.label}: {r.error}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
