"""Sums a py-spy profile per process and thread: where each thread's samples went.

`bench/gpu_run.sh profile` records one (`py-spy record --subprocesses --threads -f raw`,
with `--gil` only the samples of the thread holding the GIL, with `--idle` every thread's,
with `--native` the C and CUDA frames below Python's). This prints, per thread with the
most samples, its leaf stacks (the last DEPTH frames) and the frames most of its samples
pass through; `--match` keeps only the stacks through a frame containing that text (e.g.
`Engine._loop`: the engine thread while serving, not loading). At `-r 200`, a sample is 5 ms.

    python3 bench/spy_threads.py profile.txt [--depth 3] [--top 12] [--match Engine._loop] [--native]

With `--native`, the leaf is the deepest named frames (the libraries' own symbols; hex
addresses are skipped) and each thread's samples are split by the library they ended in.
"""

from __future__ import annotations

import argparse
import collections
from pathlib import Path


def frame_name(frame: str) -> str:
    """`func (file.py:12)` -> `func:12`; a native frame keeps its symbol."""
    if " (" not in frame:
        return frame
    name, where = frame.split(" (", 1)
    return f"{name}:{where.rstrip(')').rsplit(':', 1)[-1]}"


def library(frame: str) -> str:
    """The shared library a native frame is in (`0x.. (libnvrtc.so.13;...)` -> libnvrtc)."""
    return frame.split("(")[-1].split(".so")[0] if "(" in frame else "?"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("profile", type=Path, help="py-spy raw output (collapsed stacks)")
    parser.add_argument("--depth", type=int, default=3, help="frames in a leaf stack")
    parser.add_argument("--top", type=int, default=12, help="stacks and frames per thread")
    parser.add_argument("--threads", type=int, default=8, help="threads shown")
    parser.add_argument("--match", default="", help="only stacks through a frame containing this")
    parser.add_argument("--native", action="store_true", help="leaves by named native frames; libraries")
    args = parser.parse_args()

    totals: collections.Counter = collections.Counter()
    leaves: dict = collections.defaultdict(collections.Counter)
    through: dict = collections.defaultdict(collections.Counter)
    libraries: dict = collections.defaultdict(collections.Counter)
    for line in args.profile.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        parts = stack.split(";")
        at = next((i for i, p in enumerate(parts) if p.startswith("thread (")), None)
        if at is None or (args.match and args.match not in stack):
            continue
        process = parts[at - 1][:70] if at else "?"
        thread = (process, parts[at])
        frames = parts[at + 1:]
        n = int(count)
        totals[thread] += n
        if args.native:
            named = [frame_name(f) for f in frames if not f.startswith("0x")]
            leaves[thread][";".join(named[-args.depth:])] += n
            libraries[thread][library(frames[-1]) if frames else "?"] += n
        else:
            leaves[thread][";".join(frame_name(f) for f in frames[-args.depth:])] += n
        for name in {frame_name(f) for f in frames if not f.startswith("0x")}:
            through[thread][name] += n

    for thread, n in totals.most_common(args.threads):
        print(f"{n} samples  {thread[0]}  {thread[1]}")
        if args.native:
            print("  by library: " + ", ".join(f"{lib} {k}" for lib, k in libraries[thread].most_common(6)))
        for stack, k in leaves[thread].most_common(args.top):
            print(f"  leaf    {k:6d}  {stack[:240]}")
        for name, k in through[thread].most_common(args.top):
            print(f"  through {k:6d}  {name[:120]}")


if __name__ == "__main__":
    main()
