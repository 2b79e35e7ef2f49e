"""MLX CUDA's own kernels, compiled ahead and in parallel on a machine's first start.

MLX CUDA compiles some of its kernels with NVRTC the first time a process meets them
(gathers and scatters per dtype, `mx.compile`d fusions, quantized matmuls) and keeps them
on disk (MLX_PTX_CACHE_DIR: a module's cubin as NAME.ptx, its kernels' names as NAME.txt,
its source as NAME.cu). It compiles them one at a time, holding a lock that every kernel
launch of every thread waits on: a machine's first start spent 14-23 s of its warm-up so,
on H100s and an H200, where a later start needs none (BENCHMARKS.md, "start to ready").

A manifest (kernels/ahead/mlx-VERSION.json) lists the modules a first start compiles, as
recorded from MLX's own cache: each module's name, source and kernels, and the kinds of
weights (models/kinds.py) of the models that need it: a bfloat16 model's gathers, a 4-bit
model's quantized matmuls (~45 s each to compile on an H100's host, one kernel each).
`start` compiles those the default model needs and the cache lacks, each in a process of
its own, as many at once as there are cores, while the server imports and loads its model,
and writes them as MLX does; a model's first forward pass `wait`s for those of its own kinds
(asking for them where the default model's were others), and MLX then reads them instead
of compiling: a bfloat16 model never waits for a quantized model's matmuls.
Same source, same headers (MLX's own, read from libmlx: kernels/libmlx.py), same flags
(and NVRTC's optimizations split over the cores): MLX's own cubin, but for the note that
records the flags and the names NVRTC gives internal symbols, which differ between any two
compiles (bench/kernels_ahead.py compares them).

A manifest applies only to the build of libmlx it was recorded with (the SHA-256 its
wheel's RECORD gives it): another build compiles nothing ahead and MLX compiles as before.
A module that fails to compile is left to MLX. Files are written to temporary names and
renamed, the cubin last, so that MLX never reads a half-written module.

Where omlx ships a pack of the manifest compiled for this GPU's architecture
(kernels/packs.py: NVRTC needs no GPU, so packs are built on any machine), a module is
written from it instead of compiled: a first start then compiles nothing.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field, replace
from pathlib import Path

import orjson

from appliance.kernels import libmlx, packs
from appliance.kernels.cuda_driver import CudaError
from appliance.kernels.nvrtc import CompileError, compile_program, version

log = logging.getLogger("omlx.kernels")

MANIFESTS = Path(__file__).resolve().parent / "ahead"
MAX_NAME = 245  # MLX splits a longer module name into directories of this many characters
MODULE_TIMEOUT_S = 300.0  # one module's compile: MLX's largest took ~4 s on an H100's host
WAIT_S = 120.0  # the first forward pass waits this long at most for the compiles
MARK_PREFIX = "omlx-"  # marks omlx keeps among MLX's kernels (engine/warm_up.batch_changes_mark)


@dataclass(frozen=True)
class Module:
    """One NVRTC program of MLX's, as MLX names and compiles it."""

    name: str
    source: str
    kernels: tuple[str, ...]  # the name expressions MLX asks NVRTC to lower (kernel templates' instances)
    kinds: tuple[str, ...] = ()  # the kinds of weights (models/kinds.py) of the models that need it; (): all


@dataclass(frozen=True)
class Mark:
    """One of omlx's marks kept among MLX's kernels, and the kinds of weights it is for."""

    name: str
    kinds: tuple[str, ...] = ()


@dataclass(frozen=True)
class Manifest:
    mlx: str  # MLX's version
    build: str  # libmlx's SHA-256, as its wheel's RECORD gives it
    modules: tuple[Module, ...]
    marks: tuple[Mark, ...] = ()  # omlx's marks that were kept beside the modules when they were recorded


def applies(item: Module | Mark, kinds: tuple[str, ...] | None) -> bool:
    """Returns whether a model of weights of `kinds` needs `item` (None: any model does)."""
    return kinds is None or set(item.kinds) <= set(kinds)


@dataclass
class Report:
    """What `compile_ahead` did."""

    present: int = 0  # modules found compiled already
    shipped: int = 0  # modules written from the pack shipped for this GPU (kernels/packs.py)
    compiled: dict[str, float] = field(default_factory=dict)  # module -> seconds
    failed: dict[str, str] = field(default_factory=dict)  # module -> why
    seconds: float = 0.0
    workers: int = 0


def module_path(directory: Path, name: str) -> Path:
    """Returns where MLX keeps module `name`'s cubin (get_ptx_path in MLX's jit_module.cpp)."""
    parts = [name[i:i + MAX_NAME] for i in range(0, len(name), MAX_NAME)] or [""]
    return directory.joinpath(*parts[:-1], parts[-1] + ".ptx")


def record(directory: Path, *, mlx: str, build: str, kinds: tuple[str, ...] = ()) -> Manifest:
    """Returns the manifest of the modules MLX has compiled into `directory` (those whose
    source it kept) and of omlx's marks there, each for models of weights of `kinds`."""
    modules = []
    for ptx in sorted(directory.rglob("*.ptx")):
        source, names = ptx.with_suffix(".cu"), ptx.with_suffix(".txt")
        if not (source.is_file() and names.is_file()):
            continue
        name = "".join(ptx.relative_to(directory).with_suffix("").parts)
        kernels = tuple(line.split("\t", 1)[0] for line in names.read_text().splitlines() if "\t" in line)
        modules.append(Module(name, source.read_text(), kernels, kinds))
    marks = tuple(Mark(p.name, kinds) for p in sorted(directory.glob(f"{MARK_PREFIX}*")) if p.is_file())
    return Manifest(mlx=mlx, build=build, modules=tuple(modules), marks=marks)


def dump(manifest: Manifest) -> bytes:
    return orjson.dumps({"mlx": manifest.mlx, "build": manifest.build,
                         "marks": [{"name": m.name, "kinds": list(m.kinds)} for m in manifest.marks],
                         "modules": [{"name": m.name, "kinds": list(m.kinds), "source": m.source,
                                      "kernels": list(m.kernels)} for m in manifest.modules]},
                        option=orjson.OPT_INDENT_2)


def load(path: Path) -> Manifest:
    raw = orjson.loads(path.read_bytes())
    return Manifest(mlx=raw["mlx"], build=raw["build"],
                    marks=tuple(Mark(m["name"], tuple(m["kinds"])) for m in raw.get("marks", ())),
                    modules=tuple(Module(m["name"], m["source"], tuple(m["kernels"]), tuple(m["kinds"]))
                                  for m in raw["modules"]))


def merged(first: Manifest, second: Manifest) -> Manifest:
    """Returns the modules and marks of both (of one build): two recordings, e.g. of models
    of other kinds of weights. What both hold is for the kinds both recordings had: a module
    of a bfloat16 model's and of a quantized bfloat16 model's is for every bfloat16 model."""
    if (first.mlx, first.build) != (second.mlx, second.build):
        raise ValueError(f"manifests of two MLX builds: {first.mlx} {first.build}, {second.mlx} {second.build}")

    def union(*items):
        kept = {}
        for item in items:
            before = kept.get(item.name)
            kept[item.name] = item if before is None else replace(
                item, kinds=tuple(sorted(set(before.kinds) & set(item.kinds))))
        return tuple(kept[n] for n in sorted(kept))

    return Manifest(first.mlx, first.build, union(*first.modules, *second.modules), union(*first.marks, *second.marks))


def manifest_for(mlx: str, build: str | None) -> Manifest | None:
    """Returns the manifest of MLX `mlx` when it was recorded with the libmlx `build`."""
    path = MANIFESTS / f"mlx-{mlx}.json"
    if build is None or not path.is_file():
        return None
    manifest = load(path)
    return manifest if manifest.build == build else None


def architecture(major: int, minor: int) -> str:
    """Returns the architecture MLX compiles its kernels for on a GPU of compute capability
    major.minor: SASS, with the architecture-specific features from 9.0 on (sm_90a)."""
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def compile_flags(arch: str, library: Path, *, split: bool = True) -> tuple[str, ...]:
    """Returns the flags MLX hands NVRTC (jit_module.cpp `compile`), and `--split-compile=0`:
    NVRTC's optimizations on every core, which changes nothing in the cubin but the note
    that records the flags (MLX's largest module, 88 instances, took 7.2 s on an H100's
    host with six compiling at once). `split=False`: MLX's flags alone."""
    mlx = ("--device-as-default-execution-space", f"--gpu-architecture={arch}", *libmlx.include_paths(library))
    return (*mlx, "--split-compile=0") if split and version() >= (12, 1) else mlx


class Compiles:
    """The modules of `manifest` that `directory` lacks, compiled on request, by the kinds
    of weights of the models that need them, each once, `workers` at a time, each in a
    process of its own (NVRTC compiles one program at a time in a process: two threads took
    as long as one after the other), and written as MLX would; a module the shipped `pack`
    holds is written from it instead. A module that fails is left to MLX. A mark is written
    once every module for its kinds is there."""

    def __init__(self, manifest: Manifest, directory: Path, *, flags: tuple[str, ...], headers: dict[str, str],
                 workers: int, pack: packs.Pack | None = None):
        self.manifest, self.directory, self.pack = manifest, directory, pack
        self.report = Report(workers=max(1, workers))
        self._job = {"directory": str(directory), "flags": flags, "headers": headers}
        self._pool = ThreadPoolExecutor(self.report.workers, thread_name_prefix="kernels-ahead")
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()

    def request(self, kinds: tuple[str, ...] | None) -> list[Future]:
        """Starts compiling what a model of weights of `kinds` (None: any model) needs and
        no request asked for before; returns the futures of all it needs."""
        wanted = [m for m in self.manifest.modules if applies(m, kinds)]
        with self._lock:
            new = [m for m in wanted if m.name not in self._futures]
            for module in sorted(new, key=lambda m: -len(m.kernels)):  # the most instances take longest: first
                if module_path(self.directory, module.name).is_file():
                    self.report.present += 1
                    self._futures[module.name] = done = Future()
                    done.set_result(None)
                else:  # from the pack or compiled, on the pool: its check of a cubin waits for the gate
                    self._futures[module.name] = self._pool.submit(self._obtain, module)
            futures = [self._futures[m.name] for m in wanted]
        self._mark()
        return futures

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _obtain(self, module: Module) -> None:
        if self._unpack(module):
            with self._lock:
                self.report.shipped += 1
            self._mark()
        else:
            self._build(module)

    def _unpack(self, module: Module) -> bool:
        """Writes `module` from the shipped pack; False where the pack lacks it or fails."""
        if self.pack is None:
            return False
        try:
            found = self.pack.read(module.name, module.source)
            if found is not None:
                write(self.directory, module, *found)
        except (OSError, zipfile.BadZipFile, KeyError, CudaError) as e:
            log.warning("%s not taken from the shipped kernels (%s): compiled here", module.name[:40], e)
            return False
        return found is not None

    def _build(self, module: Module) -> None:
        began = time.perf_counter()
        job = orjson.dumps({**self._job, "module": {"name": module.name, "source": module.source,
                                                    "kernels": module.kernels}})
        try:
            done = subprocess.run([sys.executable, "-m", __name__], input=job, capture_output=True,
                                  timeout=MODULE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            self.report.failed[module.name] = str(e)
            return
        if done.returncode != 0:
            self.report.failed[module.name] = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
            return
        self.report.compiled[module.name] = round(time.perf_counter() - began, 3)
        self._mark()

    def _mark(self) -> None:
        there = {m.name for m in self.manifest.modules if module_path(self.directory, m.name).is_file()}
        for mark in self.manifest.marks:
            if all(m.name in there for m in self.manifest.modules if applies(m, mark.kinds)):
                try:
                    (self.directory / mark.name).touch()
                except OSError:
                    pass


def compile_ahead(manifest: Manifest, directory: Path, *, flags: tuple[str, ...], headers: dict[str, str],
                  workers: int, kinds: tuple[str, ...] | None = None, pack: packs.Pack | None = None) -> Report:
    """Compiles what a model of weights of `kinds` (None: any model) needs of `manifest`
    and `directory` lacks, as `Compiles` does; returns what it did."""
    started = time.perf_counter()
    compiles = Compiles(manifest, directory, flags=flags, headers=headers, workers=workers, pack=pack)
    futures = compiles.request(kinds)
    wait_all(futures)
    compiles.close()
    report = compiles.report
    report.workers = max(1, min(workers, len(futures) - report.present - report.shipped))
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def compile_module(module: Module, directory: Path, *, flags: tuple[str, ...], headers: dict[str, str]) -> None:
    """Compiles `module` in this process and writes it into `directory` as MLX would.
    Raises CompileError or OSError."""
    cubin, lowered = compile_program(module.source, name=f"{module.name}.cu", flags=flags, headers=headers,
                                     expressions=module.kernels)
    write(directory, module, cubin, "".join(f"{expression}\t{mangled}\n" for expression, mangled in lowered))


def write(directory: Path, module: Module, cubin: bytes, names: str) -> None:
    """Writes a compiled module where and as MLX writes it: the kernels' names (NAME.txt:
    each name expression, a tab, its lowered name) and source (NAME.cu) first, its cubin
    (NAME.ptx, which MLX looks for) last, each renamed into place whole."""
    ptx = module_path(directory, module.name)
    ptx.parent.mkdir(parents=True, exist_ok=True)
    for path, data in ((ptx.with_suffix(".txt"), names.encode()), (ptx.with_suffix(".cu"), module.source.encode()),
                       (ptx, cubin)):
        fd, tmp = tempfile.mkstemp(dir=ptx.parent, prefix=".ahead-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_prepared: threading.Event | None = None  # set once `start` knows what, if anything, compiles here
_compiles: Compiles | None = None


def start(cache_dir: Path, expect: Callable[[], tuple[str, ...] | None] = lambda: None) -> None:
    """Starts compiling ahead, on a thread, the MLX kernels this machine lacks (CUDA only)
    for a model of the kinds of weights `expect` returns (models/kinds.py; None, where they
    are not known: every module): `omlx serve` calls it once its config is parsed, with
    its default model's kinds. A model of other kinds asks for its own (`wait`)."""
    global _prepared, _compiles
    prepared = _prepared = threading.Event()
    _compiles = None

    def run() -> None:
        global _compiles
        try:
            compiles = _compiles = prepare(cache_dir)
            prepared.set()
            if compiles is not None:
                kinds = expect()
                wait_all(compiles.request(kinds))
                log_report(compiles, kinds, time.perf_counter() - began)
        except Exception:
            log.warning("MLX's kernels were not compiled ahead; MLX compiles them as it meets them", exc_info=True)
        finally:
            prepared.set()

    began = time.perf_counter()
    threading.Thread(target=run, name="kernels-ahead", daemon=True).start()


def log_report(compiles: Compiles, kinds: tuple[str, ...] | None, seconds: float) -> None:
    report = compiles.report
    slowest = max(report.compiled.items(), key=lambda item: item[1], default=("-", 0.0))
    log.info("MLX's kernels compiled ahead for %s weights: %d of %d in %.2f s in %d processes (%d there already, "
             "%d from the shipped kernels; slowest %s, %.2f s)%s", "+".join(kinds) if kinds else "any",
             len(report.compiled), len(compiles.manifest.modules), seconds,
             min(report.workers, len(report.compiled) + len(report.failed)), report.present, report.shipped,
             slowest[0][:40], slowest[1],
             f"; {len(report.failed)} left to MLX: {report.failed}" if report.failed else "")


def prepare(cache_dir: Path) -> Compiles | None:
    """Returns the compiles of what this machine's MLX kernel cache lacks, none started;
    None where nothing applies (no manifest for this MLX build, no GPU). MLX is not
    imported: its import (1.3 s on an H100 machine) would delay the compiles, which are a
    first start's longest part."""
    from appliance import platform
    from appliance.kernels.cuda_driver import check_module, compute_capability, driver_version
    from appliance.kernels.gate import GATE

    library = libmlx.path()
    manifest = manifest_for(platform.mlx_version(), libmlx.build_id(library)) if library else None
    if manifest is None:  # a CPU or Metal build, or an MLX no manifest was recorded for
        log.debug("no manifest of MLX's kernels for this build: MLX compiles them as it meets them")
        return None
    try:
        arch, driver = architecture(*compute_capability()), driver_version()
    except CudaError as e:
        log.debug("no GPU to compile MLX's kernels for: %s", e)
        return None
    platform.keep_compiled_kernels(cache_dir)  # unless the environment names a dir
    pack = packs.find(MANIFESTS, mlx=manifest.mlx, build=manifest.build, arch=arch, driver=driver)

    def loads(cubin: bytes) -> None:
        with GATE.alone():  # loading a module may synchronize the device (kernels/gate.py)
            check_module(cubin)

    pack = replace(pack, verify=loads) if pack is not None else None
    return Compiles(manifest, platform.mlx_kernel_dir(), flags=compile_flags(arch, library),
                    headers=libmlx.headers(library), workers=os.cpu_count() or 1, pack=pack)


def wait(kinds: tuple[str, ...], timeout: float = WAIT_S) -> None:
    """Waits, before a model's first forward pass, for what a model of weights of `kinds`
    needs of the compiles ahead, asking for it first where `start` did not: MLX would
    otherwise compile such a module again, on its own, or one after the other."""
    prepared = _prepared
    if prepared is None:
        return
    deadline = time.monotonic() + timeout
    prepared.wait(timeout)
    compiles = _compiles
    if compiles is None:
        return
    _, pending = wait_all(compiles.request(kinds), timeout=max(0.0, deadline - time.monotonic()))
    if pending:
        log.warning("MLX's kernels for %s weights still compiling ahead after %.0f s; going on without them",
                    "+".join(kinds), timeout)


def main() -> int:
    """`python -m appliance.kernels.ahead` compiles one module: a job (JSON: directory, flags,
    headers, module) on stdin. `compile_ahead` runs one such process per module."""
    job = orjson.loads(sys.stdin.buffer.read())
    raw = job["module"]
    try:
        compile_module(Module(raw["name"], raw["source"], tuple(raw["kernels"])), Path(job["directory"]),
                       flags=tuple(job["flags"]), headers=job["headers"])
    except (CompileError, OSError) as e:
        print(f"{raw['name']}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
