"""Shared benchmark helpers: servers as subprocesses, streamed requests timed, percentiles.

Everything talks to 127.0.0.1 only. A `ServerProcess` runs in its own process group so
stopping it also stops whatever it spawned; use it as a context manager. It is the one
server harness: the tests' `start_server` (tests/conftest.py) starts theirs with it too.
"""

from __future__ import annotations

import asyncio
import math
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import httpx
import orjson

from appliance.engine.step_trace import ENV as STEP_TRACE_ENV
from appliance.platform import KERNEL_CACHE_ENV, default_kernel_dir, openblas_env, openblas_path

REPO = Path(__file__).resolve().parents[1]
OUT_DIR = REPO / "bench" / "out"
HOST = "127.0.0.1"


# --- servers --------------------------------------------------------------------------------


def free_port() -> int:
    """Returns a TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def server_env() -> dict[str, str]:
    """Returns a clean environment for a server: OpenBLAS preloaded, no stray OMLX_ overrides
    (the step trace's path passes: appliance/engine/step_trace.py), and MLX's compiled
    kernels where this machine's other MLX processes keep them: MLX's own default
    (`default_kernel_dir`). A server keeps them in its cache dir otherwise
    (appliance.platform.keep_compiled_kernels), a fresh one for each benchmark: each would
    compile them again, where a user's later start finds them; the benchmarks' servers and
    in-process paths share one cache as before."""
    env = openblas_env({k: v for k, v in os.environ.items() if not k.startswith("OMLX_") or k == STEP_TRACE_ENV})
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault(KERNEL_CACHE_ENV, str(default_kernel_dir()))
    return env


@dataclass
class ServerProcess:
    """A server subprocess in its own process group, logging to `log_path`."""

    name: str
    argv: list[str]
    port: int
    log_path: Path
    env: dict[str, str] = field(default_factory=server_env)
    cwd: Path = REPO  # `python -m appliance` imports the package from here
    config: Path | None = None  # the omlx.toml it serves, when it is omlx
    stop_grace_s: float = 15.0  # from SIGTERM (or another signal) to SIGKILL
    process: subprocess.Popen | None = None
    ready_s: float | None = None  # from the process's start to GET /health answering 200

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    @property
    def group(self) -> int | None:
        """Returns the server's process group id (its pid: it leads a new session)."""
        return self.process.pid if self.process is not None else None

    def start(self, *, ready_timeout_s: float = 300.0, wait_ready: bool = True) -> ServerProcess:
        """Starts the server and returns once GET /health answers 200 (at once when not
        `wait_ready`); raises RuntimeError when it exits or is not healthy in time."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        started = time.perf_counter()
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.argv, stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                            cwd=self.cwd, start_new_session=True)
        if wait_ready:
            self.wait_healthy(ready_timeout_s)
            self.ready_s = time.perf_counter() - started
        return self

    def wait_healthy(self, timeout_s: float) -> None:
        """Returns once GET /health answers 200; stops the server and raises RuntimeError
        when it exits first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.05)  # the first request goes out this soon after readiness
        self.stop()
        raise RuntimeError(f"{self.name} not healthy after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self, sig: int = signal.SIGTERM, *, grace_s: float | None = None) -> int | None:
        """Stops the whole process group (`sig`, then SIGKILL after `grace_s`, default
        `stop_grace_s`); returns the exit status."""
        if self.process is None:
            return None
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        if self.process.poll() is None:
            self._signal_group(sig)
            try:
                self.process.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait(timeout=grace_s)
        self._signal_group(signal.SIGKILL)  # stragglers the server itself spawned
        return self.process.returncode

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.process.pid, sig)  # start_new_session: the group id is the pid
        except (ProcessLookupError, PermissionError):
            pass

    def output(self) -> str:
        """Returns everything the server has logged so far."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, num_lines: int = 40) -> str:
        return "\n".join(self.output().splitlines()[-num_lines:])

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def omlx_server(model_dir: Path, *, work_dir: Path, max_running: int, max_queued: int,
                prefill_chunk_tokens: int | None = None, log_name: str = "omlx",
                code: Path = REPO, profile: str | None = None, dtype: str = "float32",
                memory_gb: float | None = None, ssd_kv_bits: int = 16, host_kv_bits: int = 16,
                batching: tuple[str, ...] = (), cache: tuple[str, ...] = (),
                model: tuple[str, ...] = (), server: tuple[str, ...] = (),
                kernels: tuple[str, ...] = ()) -> ServerProcess:
    """Returns (not started) an `omlx serve` on a free port with a temp config serving `model_dir`,
    running the `appliance` package of the checkout at `code`, under one of its `profile`s;
    `batching`, `cache`, `model`, `server`, `kernels`: more `[batching]`, `[cache]`,
    `[[models]]`, `[server]` or `[kernels]` lines (`key = value`, the value in TOML)."""
    port = free_port()
    batching_lines = f"prefill_chunk_tokens = {prefill_chunk_tokens}\n" if prefill_chunk_tokens else ""
    batching_lines += "".join(f"{line}\n" for line in batching)
    cache_lines = f"memory_gb = {memory_gb}\n" if memory_gb is not None else ""
    cache_lines += f"ssd_kv_bits = {ssd_kv_bits}\n" if ssd_kv_bits != 16 else ""
    cache_lines += f"host_kv_bits = {host_kv_bits}\n" if host_kv_bits != 16 else ""
    cache_lines += "".join(f"{line}\n" for line in cache)
    model_lines = "".join(f"{line}\n" for line in model)
    server_lines = "".join(f"{line}\n" for line in server)
    kernels_lines = "".join(f"{line}\n" for line in kernels)
    config = work_dir / "omlx.toml"
    with_profiles(work_dir, code)
    head = f'profile = "{profile}"\n' if profile else ""
    config.write_text(f"""{head}\
[server]
host = "{HOST}"
port = {port}
drain_timeout_s = 2
{server_lines}
[[models]]
name = "bench"
source = "{model_dir}"
default = true
dtype = "{dtype}"
{model_lines}
[cache]
dir = "{work_dir / 'cache'}"
{cache_lines}
[batching]
max_running = {max_running}
max_queued = {max_queued}
{batching_lines}
[kernels]
{kernels_lines}""")
    return omlx_process(config, port, OUT_DIR / "logs" / f"{log_name}.log", cwd=code)


def with_profiles(work_dir: Path, code: Path = REPO) -> None:
    """Links the checkout's profiles/ beside a temp config (omlx looks for profiles there)."""
    link = work_dir / "profiles"
    if not link.exists():
        link.symlink_to(code / "profiles", target_is_directory=True)


def omlx_process(config: Path, port: int, log_path: Path, *, cwd: Path = REPO, **options) -> ServerProcess:
    """Returns (not started) `omlx serve --config config`, listening on `port`."""
    argv = [sys.executable, "-m", "appliance", "serve", "--config", str(config)]
    return ServerProcess("omlx", argv, port, log_path, cwd=cwd, config=config, **options)


def mlx_lm_server(model_dir: Path, *, extra_args: list[str], log_name: str = "mlx_lm") -> ServerProcess:
    """Returns (not started) an `mlx_lm.server` on a free port serving `model_dir`."""
    port = free_port()
    argv = [sys.executable, "-m", "mlx_lm.server", "--model", str(model_dir),
            "--host", HOST, "--port", str(port), *extra_args]
    return ServerProcess("mlx_lm", argv, port, OUT_DIR / "logs" / f"{log_name}.log")


def converted_model_dir() -> Path:
    """Returns the already-converted float32 test model directory (config.json + safetensors)."""
    root = REPO / ".cache" / "test" / "models"
    found = sorted(p.parent for p in root.glob("*/config.json")
                   if (p.parent / "model.safetensors").is_file() and p.parent.name.endswith("float32"))
    if not found:
        raise SystemExit(f"no converted float32 model under {root}; run the tests once (make test)")
    return found[0]


# --- requests --------------------------------------------------------------------------------


@dataclass(frozen=True)
class Timing:
    """One streamed request as the client saw it (times in seconds from its send)."""

    started_s: float  # on the benchmark's perf_counter clock
    ttft_s: float | None  # first chunk with non-empty content
    total_s: float
    completion_tokens: int  # from usage when the server sent it, else content chunks counted
    prompt_tokens: int | None
    finish_reason: str | None
    error: str | None = None
    cached_tokens: int | None = None  # usage.prompt_tokens_details.cached_tokens, when sent
    num_retries: int = 0  # connections the server dropped unanswered, retried (see stream_chat)

    @property
    def ok(self) -> bool:
        return self.error is None and self.ttft_s is not None


def client(*, max_connections: int = 256, timeout_s: float = 600.0) -> httpx.AsyncClient:
    """Returns an async HTTP client with room for `max_connections` concurrent streams."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False)


async def stream_chat(http: httpx.AsyncClient, url: str, messages: list[dict], *, max_tokens: int,
                      timeout_s: float = 600.0, retries: int = 0) -> Timing:
    """Returns the timing of one streamed chat completion (temperature 0); never raises.

    `retries`: how many times a connection the server dropped before answering is tried
    again (http.server's 5-deep listen backlog overflows under a burst); TTFT still counts
    from the first attempt.
    """
    body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}
    started = time.perf_counter()
    deadline = started + timeout_s
    num_retries = 0
    while True:
        state = _StreamState()
        try:
            await asyncio.wait_for(_read_stream(http, f"{url}/v1/chat/completions", body, state, started),
                                   max(deadline - time.perf_counter(), 1e-3))
        except httpx.TransportError as e:
            if not state.answered and num_retries < retries:
                num_retries += 1
                await asyncio.sleep(RETRY_DELAY_S)
                continue
            state.error = _describe(e)
        except Exception as e:  # a benchmark records failures, it does not stop on them
            state.error = _describe(e)
        break
    return Timing(
        started_s=started,
        ttft_s=state.ttft_s,
        total_s=time.perf_counter() - started,
        completion_tokens=state.usage_tokens if state.usage_tokens is not None else state.num_chunks,
        prompt_tokens=state.prompt_tokens,
        finish_reason=state.finish_reason,
        error=state.error,
        cached_tokens=state.cached_tokens,
        num_retries=num_retries,
    )


RETRY_DELAY_S = 0.5


def _describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"[:300]


@dataclass
class _StreamState:
    answered: bool = False  # response headers arrived
    ttft_s: float | None = None
    num_chunks: int = 0
    usage_tokens: int | None = None
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    cached_tokens: int | None = None


async def _read_stream(http: httpx.AsyncClient, url: str, body: dict, state: _StreamState,
                       started: float) -> None:
    async with http.stream("POST", url, json=body) as response:
        state.answered = True
        if response.status_code != 200:
            text = (await response.aread()).decode(errors="replace")
            state.error = f"HTTP {response.status_code}: {text[:300]}"
            return
        async for line in response.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                return
            _on_chunk(orjson.loads(data), state, started)


def _on_chunk(chunk: dict, state: _StreamState, started: float) -> None:
    if "error" in chunk:
        state.error = str(chunk["error"])[:300]
    for choice in chunk.get("choices") or ():
        if (choice.get("delta") or {}).get("content"):
            state.num_chunks += 1
            if state.ttft_s is None:
                state.ttft_s = time.perf_counter() - started
        state.finish_reason = choice.get("finish_reason") or state.finish_reason
    usage = chunk.get("usage")
    if usage:
        state.usage_tokens = usage.get("completion_tokens")
        state.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            state.cached_tokens = details["cached_tokens"]


# --- other load on the machine -------------------------------------------------------------

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _busy_s() -> float:
    """Returns CPU seconds all cores have spent busy since boot (from /proc/stat)."""
    with open("/proc/stat") as f:
        user, nice, system, _idle, _iowait, irq, softirq, steal = map(int, f.readline().split()[1:9])
    return (user + nice + system + irq + softirq + steal) / CLOCK_TICKS


def _own_cpu_s(groups: set[int]) -> float:
    """Returns CPU seconds used by this process and every process in `groups` (process groups)."""
    total = 0
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # After the ")": state ppid pgrp ... utime (11) stime (12), counted from 0.
        if int(entry.name) == os.getpid() or int(fields[2]) in groups:
            total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


class ForeignLoad:
    """Measures the share of the machine's CPU used by processes that are not ours."""

    def __init__(self, groups: set[int]):
        self.groups = groups
        self._start: tuple[float, float, float] | None = None

    def start(self) -> ForeignLoad:
        self._start = (time.monotonic(), _busy_s(), _own_cpu_s(self.groups))
        return self

    def share(self) -> float:
        """Returns foreign CPU time since start() as a share of all cores' time (0..1)."""
        t0, busy0, own0 = self._start
        elapsed = max(time.monotonic() - t0, 1e-6)
        foreign = (_busy_s() - busy0) - (_own_cpu_s(self.groups) - own0)
        return max(foreign, 0.0) / (elapsed * (os.cpu_count() or 1))


async def wait_for_quiet(groups: set[int], *, max_share: float = 0.2, max_wait_s: float = 45.0,
                         sample_s: float = 2.0) -> float:
    """Waits until others use under `max_share` of the CPU (at most `max_wait_s`); returns the last share."""
    deadline = time.monotonic() + max_wait_s
    while True:
        meter = ForeignLoad(groups).start()
        await asyncio.sleep(sample_s)
        share = meter.share()
        if share < max_share or time.monotonic() >= deadline:
            return share


# --- statistics and records -----------------------------------------------------------------


def percentile(values: list[float], q: float) -> float | None:
    """Returns the q-th percentile (0-100) of `values` by linear interpolation; None if empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(a: float | None, b: float | None) -> float | None:
    """Returns a / b, or None when either is missing or b is zero."""
    if a is None or b is None or b == 0:
        return None
    return a / b


def machine() -> dict:
    """Returns what the numbers were measured on."""
    return {
        "cpu_count": os.cpu_count(),
        "machine": platform.machine(),
        "system": platform.system(),
        "python": platform.python_version(),
        "openblas_preloaded": openblas_path() is not None,
        "versions": _versions("mlx", "mlx-lm", "omlx"),
    }


def run_header(script: str, argv: list[str] | None = None, *, started: float | None = None) -> dict:
    """Returns the fields every benchmark record starts with: when it ran, the command that
    reruns it (`script` is the benchmark's `__file__`), how long it took (when `started`,
    a `time.time()`, is given) and the machine."""
    header = {"date": datetime.now(UTC).isoformat(timespec="seconds"),
              "command": " ".join([".venv/bin/python", f"bench/{Path(script).name}",
                                   *(sys.argv[1:] if argv is None else argv)])}
    if started is not None:
        header["duration_s"] = round(time.time() - started, 1)
    return {**header, "machine": machine()}


def _versions(*names: str) -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for name in names:
        try:
            found[name] = version(name)
        except PackageNotFoundError:
            found[name] = "unknown"
    return found


def write_json(path: Path, data: dict) -> Path:
    """Writes `data` as indented JSON (dataclasses converted); returns the path."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(orjson.dumps(data, option=orjson.OPT_INDENT_2, default=_plain))
    return path


def _plain(value: object) -> object:
    if hasattr(value, "__dataclass_fields__"):
        return asdict(value)
    if isinstance(value, Path):
        return str(value)
    raise TypeError(type(value).__name__)


def fmt(value: float | None, spec: str = ".2f", *, none: str = "–") -> str:
    """Returns `value` formatted, or a dash when it is missing."""
    return none if value is None else format(value, spec)


# --- cold reads: the page cache, and what of a file it holds ---------------------------------


def drop_page_cache(paths: list[Path]) -> str:
    """Evicts `paths` from the page cache; returns the method used.

    "drop_caches" (sync, then the whole page cache, needs root) or "posix_fadvise"
    (POSIX_FADV_DONTNEED on each file, which drops only clean pages, hence the fsync).
    """
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return "drop_caches"
    except OSError:
        pass
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return "posix_fadvise"


def resident_bytes(paths: list[Path]) -> int | None:
    """Returns how many bytes of `paths` are in the page cache (util-linux fincore); None if unknown."""
    total = 0
    for i in range(0, len(paths), 200):
        chunk = [str(p) for p in paths[i:i + 200]]
        if not chunk:
            continue
        try:
            done = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", *chunk],
                                  capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if done.returncode != 0:
            return None
        total += sum(int(line) for line in done.stdout.split() if line.strip().isdigit())
    return total


def kv_files(cache_dir: Path) -> list[Path]:
    """Returns the SSD tier's block files under an omlx cache dir (`<dir>/kv/**/*.kv`)."""
    return sorted((cache_dir / "kv").rglob("*.kv"))


# --- omlx admin API ---------------------------------------------------------------------------


def get_json(url: str, path: str, *, timeout_s: float = 30.0) -> dict:
    """Returns the JSON answer of GET `url` + `path`; raises httpx errors."""
    response = httpx.get(f"{url}{path}", timeout=timeout_s, trust_env=False)
    response.raise_for_status()
    return response.json()


def wait_ssd_written(url: str, *, timeout_s: float = 120.0) -> bool:
    """Waits until omlx's SSD writer has nothing pending; returns whether it got there in time."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        writer = get_json(url, "/admin/api/cache")["tiers"].get("ssd", {}).get("writer") or {}
        if writer.get("pending_blocks", 0) == 0:
            return True
        time.sleep(0.2)
    return False


def wait_idle_work(url: str, *, timeout_s: float = 60.0) -> float | None:
    """Waits until omlx's engines have run their idle work that holds the GPU (the call
    shapes, `shapes_to_warm`), so that it slows no baseline measured beside them;
    returns the seconds waited, None when not done in time."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if all(m.get("shapes_to_warm", 0) == 0 for m in get_json(url, "/admin/api/status")["models"]):
            return round(time.monotonic() - started, 2)
        time.sleep(0.2)
    return None


def tier_deltas(before: dict, after: dict) -> dict[str, dict[str, float]]:
    """Returns per tier the change of hits (and SSD read bytes/seconds) between two /admin/api/cache answers."""
    deltas = {}
    for tier, now in after.get("tiers", {}).items():
        was = before.get("tiers", {}).get(tier, {})
        d = {k: now.get(k, 0) - was.get(k, 0) for k in ("hits", "read_bytes", "read_s")
             if isinstance(now.get(k), (int, float))}
        misses_now, misses_was = now.get("misses"), was.get("misses")
        if isinstance(misses_now, dict):
            d["misses"] = sum(misses_now.values()) - sum((misses_was or {}).values())
        deltas[tier] = d
    return deltas


# --- prompts -----------------------------------------------------------------------------------


class ChatTokens:
    """Counts a chat's prompt tokens the way omlx does: chat template as text, then encode."""

    def __init__(self, model_dir: Path):
        from transformers import AutoTokenizer  # slow import: only benchmarks that need it pay

        self.tokenizer = AutoTokenizer.from_pretrained(str(model_dir))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    def prompt(self, messages: list[dict], *, generation_prompt: bool = True) -> list[int]:
        """Returns the prompt token ids of `messages`."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt)
        return self.encode(text)


def log(message: str) -> None:
    """Prints a timestamped progress line to stderr."""
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def site_packages() -> Path:
    """Returns this interpreter's site-packages (the venv's), a stable source of real code."""
    import sysconfig

    return Path(sysconfig.get_paths()["purelib"])


def longest_fit(num_items: int, fits) -> int:
    """Returns the largest n in [0, num_items] with fits(n) true, for a monotone `fits` (binary search)."""
    low, high = 0, num_items
    while low < high:
        mid = (low + high + 1) // 2
        if fits(mid):
            low = mid
        else:
            high = mid - 1
    return low
