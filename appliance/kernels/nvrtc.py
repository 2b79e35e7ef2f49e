"""NVRTC, CUDA's runtime compiler, through ctypes: a CUDA C++ source in, a cubin out.

The native kernels are compiled here rather than by `mx.fast.cuda_kernel`, because MLX
compiles a custom kernel in every process (it never keeps one on disk) while holding the
lock that every kernel lookup of every thread takes: on an H100 the self-test's NVRTC
compiles stalled the warm-up and the model's load by seconds at each start (py-spy:
`get_jit_module` waiting on `pthread_rwlock_rdlock`). Compiled here, beside MLX, a cubin is
kept on disk (kernels/cubins.py) and handed to `mx.fast.precompiled_cuda_kernel`, which
only loads it.

libnvrtc comes with MLX CUDA (its `nvidia-cuda-nvrtc` dependency; libmlx links it), and
with the test extra on Linux x86-64, so the sources are compiled on machines without a GPU.
"""

from __future__ import annotations

import ctypes
import sys
from functools import cache
from pathlib import Path

SONAME = "libnvrtc.so.13"
# where the nvidia-cuda-nvrtc wheel puts it, under a site-packages directory
WHEEL_DIRS = ("nvidia/cu13/lib", "nvidia/cuda_nvrtc/lib")


class CompileError(RuntimeError):
    """NVRTC is missing, or refused the source (the message holds its log)."""


@cache
def library() -> ctypes.CDLL:
    """Returns libnvrtc: the one the nvidia-cuda-nvrtc wheel installed (where MLX CUDA's
    libmlx looks first, its rpath), else the system's. Raises CompileError where there is
    none. A process that compiles MLX's own kernels (kernels/ahead.py) and has not loaded
    MLX must find the NVRTC that MLX would use."""
    for site in sys.path:
        for sub in WHEEL_DIRS:
            lib_dir = Path(site) / sub
            if (lib_dir / SONAME).is_file():
                # NVRTC opens its builtins by name when it compiles: load them first from beside it
                for builtins in sorted(lib_dir.glob("libnvrtc-builtins.so.*")):
                    ctypes.CDLL(str(builtins))
                return _typed(ctypes.CDLL(str(lib_dir / SONAME)))
    try:
        return _typed(ctypes.CDLL(SONAME))
    except OSError:
        raise CompileError(f"no {SONAME} (install nvidia-cuda-nvrtc, which MLX CUDA depends on)") from None


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def _check(code: int, what: str) -> None:
    if code != 0:
        raise CompileError(f"{what}: {library().nvrtcGetErrorString(code).decode()}")


@cache
def version() -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return major.value, minor.value


def _strings(items: list[str]):
    return (ctypes.c_char_p * len(items))(*(item.encode() for item in items))


def compile_cubin(source: str, *, name: str, arch: str, options: tuple[str, ...] = ()) -> bytes:
    """Returns the cubin of `source` for `arch` (e.g. "sm_90"). `name` names the program in
    NVRTC's messages. Raises CompileError with NVRTC's log."""
    cubin, _ = compile_program(source, name=name, flags=(f"--gpu-architecture={arch}", *options))
    return cubin


def compile_program(source: str, *, name: str, flags: tuple[str, ...], headers: dict[str, str] | None = None,
                    expressions: tuple[str, ...] = ()) -> tuple[bytes, list[tuple[str, str]]]:
    """Returns the cubin of `source` compiled with `flags` (which name the architecture),
    and each of `expressions` (kernel templates' instances, e.g. "ns::k<float, 2>") with
    its lowered (mangled) name. `headers` maps include names to in-memory sources. Raises
    CompileError with NVRTC's log."""
    lib = library()
    headers = headers or {}
    program = ctypes.c_void_p()
    _check(lib.nvrtcCreateProgram(ctypes.byref(program), source.encode(), name.encode(), len(headers),
                                  _strings(list(headers.values())), _strings(list(headers))),
           "nvrtcCreateProgram")
    try:
        for expression in expressions:
            _check(lib.nvrtcAddNameExpression(program, expression.encode()), "nvrtcAddNameExpression")
        code = lib.nvrtcCompileProgram(program, len(flags), _strings(list(flags)))
        if code != 0:
            arch = next((f.split("=", 1)[1] for f in flags if f.startswith("--gpu-architecture=")), "?")
            raise CompileError(f"{name} did not compile for {arch} "
                               f"({lib.nvrtcGetErrorString(code).decode()}):\n{_log(lib, program)}")
        lowered = []
        for expression in expressions:
            mangled = ctypes.c_char_p()
            _check(lib.nvrtcGetLoweredName(program, expression.encode(), ctypes.byref(mangled)),
                   "nvrtcGetLoweredName")
            lowered.append((expression, mangled.value.decode()))
        size = ctypes.c_size_t()
        _check(lib.nvrtcGetCUBINSize(program, ctypes.byref(size)), "nvrtcGetCUBINSize")
        cubin = ctypes.create_string_buffer(size.value)
        _check(lib.nvrtcGetCUBIN(program, cubin), "nvrtcGetCUBIN")
        return cubin.raw, lowered
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(program))


def _log(lib: ctypes.CDLL, program: ctypes.c_void_p) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(program, ctypes.byref(size)) != 0 or size.value <= 1:
        return "(no log)"
    text = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(program, text)
    return text.value.decode(errors="replace").strip()
