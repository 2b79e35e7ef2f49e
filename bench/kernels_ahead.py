"""MLX's kernels compiled ahead (appliance/kernels/ahead.py): record a manifest from MLX's
own kernel cache, compile it into an empty one as many at once as asked, and compare
what was compiled with what MLX compiled.

    python bench/kernels_ahead.py record DIR --model MODEL_DIR --out appliance/kernels/ahead/mlx-VERSION.json
    python bench/kernels_ahead.py compile DIR [--model MODEL_DIR] [--workers N] [--manifest FILE] [--mlx-flags]
    python bench/kernels_ahead.py compare MLX_DIR OURS_DIR
    python bench/kernels_ahead.py pack --library DIR/mlx/lib/libmlx.so --arch sm_90a  # bench/kernels_pack.sh
    python bench/kernels_ahead.py unpack DIR

`record` marks what it records as needed by models of the kinds of weights of the model
that was served (appliance/models/kinds.py), and merges into --out when that holds a
manifest of the same build (what both hold is for the kinds both had). `compile` prints
each module's seconds and the whole. `compare` checks, per module both hold, the kernels'
lowered names and every section of the cubins but two: the string table, where NVRTC's
names of internal symbols carry a hash that differs between any two compiles (two
compiles of one source by NVRTC differ there and nowhere else), and the tool note, which
records the flags (omlx adds --split-compile=0). `pack` compiles every module of the
manifest recorded for a CUDA build of libmlx (an unpacked wheel's, no GPU needed) for one
architecture and writes the pack omlx ships (appliance/kernels/packs.py) beside the manifest
(rebuild it after every `record` into a shipped manifest: tests/kernels/test_packs.py checks
that the pack holds the manifest's modules);
`unpack` writes the shipped pack's modules for the installed build and this GPU into DIR as
a first start does (for `compare`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from appliance.kernels import ahead, libmlx  # noqa: E402
from appliance.models import kinds  # noqa: E402

LOOSE = (".strtab", ".note.nv.tkinfo")  # internal symbols' names (hashed per compile); the flags NVRTC got


def installed_build() -> tuple[str, str, Path]:
    import mlx.core as mx

    library = libmlx.path()
    build = libmlx.build_id(library) if library else None
    if library is None or build is None:
        raise SystemExit("no libmlx with a RECORD entry is installed")
    return mx.__version__, build, library


def sections(cubin: bytes) -> dict[str, bytes]:
    """Returns an ELF64 file's sections' bytes by name."""
    return {s.name: cubin[s.offset:s.offset + s.size] for s in libmlx.sections(cubin)}


def compare(theirs: Path, ours: Path) -> dict:
    mlx_modules = {m.name for m in ahead.record(theirs, mlx="", build="").modules}
    our_modules = {m.name for m in ahead.record(ours, mlx="", build="").modules}
    same, differ = [], {}
    for name in sorted(mlx_modules & our_modules):
        a, b = ahead.module_path(theirs, name), ahead.module_path(ours, name)
        if a.with_suffix(".txt").read_text() != b.with_suffix(".txt").read_text():
            differ[name] = "kernel names"
            continue
        sa, sb = sections(a.read_bytes()), sections(b.read_bytes())
        unlike = sorted(k for k in sa.keys() | sb.keys() if k not in LOOSE and sa.get(k) != sb.get(k))
        if unlike:
            differ[name] = f"sections {unlike[:4]}"
        else:
            same.append(name)
    return {"same": len(same), "differ": differ, "only_mlx": sorted(mlx_modules - our_modules),
            "only_ours": sorted(our_modules - mlx_modules)}


def build_pack(library: Path, arch: str, workers: int) -> dict:
    """Compiles the modules of the manifest recorded for `library`'s build for `arch` and
    writes their pack beside the manifest; returns what it did."""
    from appliance.kernels import nvrtc, packs

    build = libmlx.build_id(library)
    manifest = next((m for p in sorted(ahead.MANIFESTS.glob("mlx-*.json")) if (m := ahead.load(p)).build == build), None)
    if manifest is None:
        raise SystemExit(f"no manifest was recorded for the libmlx of build {build}")
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        report = ahead.compile_ahead(manifest, directory, flags=ahead.compile_flags(arch, library),
                                     headers=libmlx.headers(library), workers=workers)
        if report.failed:
            raise SystemExit(f"not every module compiled: {report.failed}")
        compiled = [packs.Compiled(m.name, m.source, (ptx := ahead.module_path(directory, m.name)).read_bytes(),
                                   ptx.with_suffix(".txt").read_text()) for m in manifest.modules]
    out = packs.pack_path(ahead.MANIFESTS, manifest.mlx, arch)
    packs.write(out, mlx=manifest.mlx, build=manifest.build, arch=arch, nvrtc=nvrtc.version(), modules=compiled)
    return {"pack": str(out), "bytes": out.stat().st_size, "cubin_bytes": sum(len(c.cubin) for c in compiled),
            "modules": len(compiled), "seconds": report.seconds, "slowest": max(report.compiled.items(),
                                                                               key=lambda item: item[1])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("dir", type=Path)
    rec.add_argument("--model", type=Path, required=True, help="the model whose start compiled them")
    rec.add_argument("--out", type=Path, required=True)
    com = sub.add_parser("compile")
    com.add_argument("dir", type=Path)
    com.add_argument("--model", type=Path, default=None, help="what its weights need (default: every module)")
    com.add_argument("--workers", type=int, default=16)
    com.add_argument("--manifest", type=Path, default=None, help="default: the one shipped for this MLX")
    com.add_argument("--mlx-flags", action="store_true", help="MLX's flags alone (no --split-compile)")
    cmp = sub.add_parser("compare")
    cmp.add_argument("mlx_dir", type=Path)
    cmp.add_argument("ours_dir", type=Path)
    pck = sub.add_parser("pack")
    pck.add_argument("--library", type=Path, required=True, help="a CUDA build's libmlx.so, its wheel unpacked")
    pck.add_argument("--arch", default="sm_90a", help="the GPU architecture, as ahead.architecture names it")
    pck.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    unp = sub.add_parser("unpack")
    unp.add_argument("dir", type=Path)
    args = parser.parse_args()

    if args.command == "compare":
        print(json.dumps(compare(args.mlx_dir, args.ours_dir), indent=1))
        return 0
    if args.command == "pack":
        print(json.dumps(build_pack(args.library.resolve(), args.arch, args.workers), indent=1))
        return 0
    version, build, library = installed_build()
    if args.command == "record":
        model_kinds = kinds.expected(str(args.model.resolve()), dtype="auto", base_dir=Path.cwd())
        if model_kinds is None:
            raise SystemExit(f"the kinds of weights of {args.model} cannot be read")
        manifest = ahead.record(args.dir, mlx=version, build=build, kinds=model_kinds)
        if args.out.is_file():
            kept = ahead.load(args.out)
            if (kept.mlx, kept.build) == (version, build):
                manifest = ahead.merged(kept, manifest)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_bytes(ahead.dump(manifest))
        print(json.dumps({"modules": {m.name: m.kinds for m in manifest.modules},
                          "marks": {m.name: m.kinds for m in manifest.marks},
                          "bytes": args.out.stat().st_size}, indent=1))
        return 0
    from appliance.kernels.cuda_driver import compute_capability, driver_version

    manifest = ahead.load(args.manifest) if args.command == "compile" and args.manifest \
        else ahead.manifest_for(version, build)
    if manifest is None:
        raise SystemExit(f"no manifest for MLX {version} build {build}")
    args.dir.mkdir(parents=True, exist_ok=True)
    if args.command == "unpack":
        from appliance.kernels import packs

        arch = ahead.architecture(*compute_capability())
        shipped = packs.find(ahead.MANIFESTS, mlx=version, build=build, arch=arch, driver=driver_version())
        if shipped is None:
            raise SystemExit(f"no pack for MLX {version} build {build} on {arch} with this driver")
        report = ahead.compile_ahead(manifest, args.dir, flags=(), headers={}, workers=1, pack=shipped)
        print(json.dumps({"arch": arch, "shipped": report.shipped, "present": report.present,
                          "failed": report.failed}, indent=1))
        return 0
    headers = libmlx.headers(library)
    flags = ahead.compile_flags(ahead.architecture(*compute_capability()), library, split=not args.mlx_flags)
    wanted = kinds.expected(str(args.model.resolve()), dtype="auto", base_dir=Path.cwd()) if args.model else None
    report = ahead.compile_ahead(manifest, args.dir, flags=flags, headers=headers, workers=args.workers,
                                 kinds=wanted)
    print(json.dumps({"workers": report.workers, "seconds": report.seconds, "present": report.present,
                      "compiled": report.compiled, "failed": report.failed, "headers": len(headers)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
