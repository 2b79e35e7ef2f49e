"""MLX CUDA's own kernels, compiled ahead and in parallel on a machine's first start.

MLX CUDA compiles some of its kernels with NVRTC the first time a process meets them
(gathers and scatters per dtype, `mx.compile`d fusions, quantized matmuls) and keeps them
on disk (MLX_PTX_CACHE_DIR: a module's cubin as NAME.ptx, its kernels' names as NAME.txt,
its source as NAME.cu). It compiles them one at a time, holding a lock that every kernel
launch of every thread waits on: a machine's first start spent 14-23 s of its warm-up so,
on H100s and an H200, where a later start needs none (BENCHMARKS.md, "start to ready").

A manifest (kernels/ahead/mlx-VERSION.json) lists the modules a first start compiles, as
recorded from MLX's own cache: each module's name, source and kernels. `start` compiles the
ones missing from the cache, each in a process of its own, as many at once as there are
cores, while the server imports and loads its model, and writes them as MLX does; the
model's first forward pass `wait`s for it, and MLX then reads them instead of compiling.
Same source, same headers (MLX's own, read from libmlx: kernels/libmlx.py), same flags
(and NVRTC's optimizations split over the cores): MLX's own cubin, but for the note that
records the flags and the names NVRTC gives internal symbols, which differ between any two
compiles (bench/kernels_ahead.py compares them).

A manifest applies only to the build of libmlx it was recorded with (the SHA-256 its
wheel's RECORD gives it): another build compiles nothing ahead and MLX compiles as before.
A module that fails to compile is left to MLX. Files are written to temporary names and
renamed, the cubin last, so that MLX never reads a half-written module.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import orjson

from appliance.kernels import libmlx
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


@dataclass(frozen=True)
class Manifest:
    mlx: str  # MLX's version
    build: str  # libmlx's SHA-256, as its wheel's RECORD gives it
    modules: tuple[Module, ...]
    marks: tuple[str, ...] = ()  # omlx's marks that were kept beside the modules when they were recorded


@dataclass
class Report:
    """What `compile_ahead` did."""

    present: int = 0  # modules found compiled already
    compiled: dict[str, float] = field(default_factory=dict)  # module -> seconds
    failed: dict[str, str] = field(default_factory=dict)  # module -> why
    seconds: float = 0.0
    workers: int = 0


def module_path(directory: Path, name: str) -> Path:
    """Returns where MLX keeps module `name`'s cubin (get_ptx_path in MLX's jit_module.cpp)."""
    parts = [name[i:i + MAX_NAME] for i in range(0, len(name), MAX_NAME)] or [""]
    return directory.joinpath(*parts[:-1], parts[-1] + ".ptx")


def record(directory: Path, *, mlx: str, build: str) -> Manifest:
    """Returns the manifest of the modules MLX has compiled into `directory` (those whose
    source it kept) and of omlx's marks there."""
    modules = []
    for ptx in sorted(directory.rglob("*.ptx")):
        source, names = ptx.with_suffix(".cu"), ptx.with_suffix(".txt")
        if not (source.is_file() and names.is_file()):
            continue
        name = "".join(ptx.relative_to(directory).with_suffix("").parts)
        kernels = tuple(line.split("\t", 1)[0] for line in names.read_text().splitlines() if "\t" in line)
        modules.append(Module(name, source.read_text(), kernels))
    marks = tuple(sorted(p.name for p in directory.glob(f"{MARK_PREFIX}*") if p.is_file()))
    return Manifest(mlx=mlx, build=build, modules=tuple(modules), marks=marks)


def dump(manifest: Manifest) -> bytes:
    return orjson.dumps({"mlx": manifest.mlx, "build": manifest.build, "marks": list(manifest.marks),
                         "modules": [{"name": m.name, "source": m.source, "kernels": list(m.kernels)}
                                     for m in manifest.modules]}, option=orjson.OPT_INDENT_2)


def load(path: Path) -> Manifest:
    raw = orjson.loads(path.read_bytes())
    return Manifest(mlx=raw["mlx"], build=raw["build"], marks=tuple(raw.get("marks", ())),
                    modules=tuple(Module(m["name"], m["source"], tuple(m["kernels"])) for m in raw["modules"]))


def merged(first: Manifest, second: Manifest) -> Manifest:
    """Returns the modules and marks of both (of one build): two recordings, e.g. of models
    of other dtypes."""
    if (first.mlx, first.build) != (second.mlx, second.build):
        raise ValueError(f"manifests of two MLX builds: {first.mlx} {first.build}, {second.mlx} {second.build}")
    modules = {m.name: m for m in (*first.modules, *second.modules)}
    return Manifest(first.mlx, first.build, tuple(modules[n] for n in sorted(modules)),
                    tuple(sorted({*first.marks, *second.marks})))


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


def compile_ahead(manifest: Manifest, directory: Path, *, flags: tuple[str, ...], headers: dict[str, str],
                  workers: int) -> Report:
    """Compiles the modules of `manifest` that `directory` lacks, `workers` at a time, each
    in a process of its own, and writes each as MLX would; when every module is then
    there, writes the manifest's marks too. Returns what it did; a module that fails is
    left to MLX. (Processes, since NVRTC compiles one program at a time in a process: two
    threads took as long as one after the other.)"""
    started = time.perf_counter()
    report = Report()
    todo = [m for m in manifest.modules if not module_path(directory, m.name).is_file()]
    report.present = len(manifest.modules) - len(todo)
    todo.sort(key=lambda m: -len(m.kernels))  # the most instances take longest (gather_axis: 88, 5.9 s): first

    def build(module: Module) -> None:
        began = time.perf_counter()
        job = orjson.dumps({"directory": str(directory), "flags": flags, "headers": headers,
                            "module": {"name": module.name, "source": module.source, "kernels": module.kernels}})
        try:
            done = subprocess.run([sys.executable, "-m", __name__], input=job, capture_output=True,
                                  timeout=MODULE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as e:
            report.failed[module.name] = str(e)
            return
        if done.returncode != 0:
            report.failed[module.name] = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[0]
            return
        report.compiled[module.name] = round(time.perf_counter() - began, 3)

    report.workers = max(1, min(workers, len(todo)))
    if todo:
        with ThreadPoolExecutor(report.workers, thread_name_prefix="kernels-ahead") as pool:
            list(pool.map(build, todo))
    if not report.failed:
        for mark in manifest.marks:
            try:
                (directory / mark).touch()
            except OSError:
                pass
    report.seconds = round(time.perf_counter() - started, 3)
    return report


def compile_module(module: Module, directory: Path, *, flags: tuple[str, ...], headers: dict[str, str]) -> None:
    """Compiles `module` in this process and writes it into `directory` as MLX would.
    Raises CompileError or OSError."""
    cubin, lowered = compile_program(module.source, name=f"{module.name}.cu", flags=flags, headers=headers,
                                     expressions=module.kernels)
    write(directory, module, cubin, lowered)


def write(directory: Path, module: Module, cubin: bytes, lowered: list[tuple[str, str]]) -> None:
    """Writes a compiled module where and as MLX writes it: the kernels' names (NAME.txt) and
    source (NAME.cu) first, its cubin (NAME.ptx, which MLX looks for) last, each renamed
    into place whole."""
    ptx = module_path(directory, module.name)
    ptx.parent.mkdir(parents=True, exist_ok=True)
    names = "".join(f"{expression}\t{mangled}\n" for expression, mangled in lowered).encode()
    for path, data in ((ptx.with_suffix(".txt"), names), (ptx.with_suffix(".cu"), module.source.encode()),
                       (ptx, cubin)):
        fd, tmp = tempfile.mkstemp(dir=ptx.parent, prefix=".ahead-", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


_done: threading.Event | None = None


def start(cache_dir: Path) -> None:
    """Starts compiling ahead, on a thread, the MLX kernels this machine lacks (CUDA only):
    `omlx serve` calls it once its config is parsed."""
    global _done
    done = _done = threading.Event()

    def run() -> None:
        try:
            here(cache_dir)
        except Exception:
            log.warning("MLX's kernels were not compiled ahead; MLX compiles them as it meets them", exc_info=True)
        finally:
            done.set()

    threading.Thread(target=run, name="kernels-ahead", daemon=True).start()


def here(cache_dir: Path) -> Report | None:
    """Compiles ahead what this machine's MLX kernel cache lacks; None where nothing applies
    (no manifest for this MLX build, no GPU). MLX is not imported: its import (1.3 s on an
    H100 machine) would delay the compiles, which are a first start's longest part."""
    from appliance import platform
    from appliance.kernels.cuda_driver import CudaError, compute_capability

    library = libmlx.path()
    manifest = manifest_for(importlib.metadata.version("mlx"), libmlx.build_id(library)) if library else None
    if manifest is None:  # a CPU or Metal build, or an MLX no manifest was recorded for
        log.debug("no manifest of MLX's kernels for this build: MLX compiles them as it meets them")
        return None
    try:
        arch = architecture(*compute_capability())
    except CudaError as e:
        log.debug("no GPU to compile MLX's kernels for: %s", e)
        return None
    platform.keep_compiled_kernels(cache_dir)  # unless the environment names a dir
    directory = platform.mlx_kernel_dir()
    if all(module_path(directory, m.name).is_file() for m in manifest.modules):
        return Report(present=len(manifest.modules))
    report = compile_ahead(manifest, directory, flags=compile_flags(arch, library), headers=libmlx.headers(library),
                           workers=os.cpu_count() or 1)
    slowest = max(report.compiled.items(), key=lambda item: item[1], default=("-", 0.0))
    log.info("MLX's kernels compiled ahead: %d of %d in %.2f s in %d processes (%d there already; slowest %s, "
             "%.2f s)%s", len(report.compiled), len(manifest.modules), report.seconds, report.workers,
             report.present, slowest[0][:40], slowest[1],
             f"; {len(report.failed)} left to MLX: {report.failed}" if report.failed else "")
    return report


def wait(timeout: float = WAIT_S) -> None:
    """Waits for `start`'s compiles, if any, before a model's first forward pass: MLX would
    otherwise compile a module of them again, on its own."""
    done = _done
    if done is not None and not done.wait(timeout):
        log.warning("MLX's kernels still compiling ahead after %.0f s; going on without them", timeout)


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
