"""First-touch cost: faulting in fresh memory against copying into memory already mapped.

A restore writes every byte of a prefix into buffers; in a freshly started server those
are pages the process never touched, and on a VM each first touch can cost more than the
copy itself. This prints both for `--mib` MiB (default 11, one KV block of the test model),
as milliseconds, median of `--repeats`.

With `--settle S` it first frees memory (drops the page cache, which needs root) and waits
S seconds, then times one first touch before the repeats. On this project's VM, memory
that has sat free for seconds costs ~50x more to touch than memory freed a moment ago
(which is what the repeats get), as with virtio-balloon's free page reporting: the host
takes reported pages back and must fault them in again.

    .venv/bin/python bench/first_touch.py [--mib 11] [--repeats 7] [--settle 10]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import drop_page_cache  # noqa: E402


def fresh_touch_ms(nbytes: int) -> float:
    """Allocates fresh private memory as MLX and numpy do (malloc: a new private mapping at
    this size, without our malloc tunables) and writes one byte per page."""
    a = np.empty(nbytes, dtype=np.uint8)
    started = time.perf_counter()
    a[::mmap.PAGESIZE] = 1
    elapsed = time.perf_counter() - started
    del a  # unmapped again: the next call gets fresh pages too
    return elapsed * 1000


def warm_copy_ms(src: np.ndarray, dst: np.ndarray) -> float:
    started = time.perf_counter()
    np.copyto(dst, src)
    return (time.perf_counter() - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--settle", type=float, default=None,
                        help="free memory (drop the page cache) and wait this many seconds first")
    args = parser.parse_args()
    n = args.mib << 20
    per_page = n // mmap.PAGESIZE
    if args.settle is not None:
        method = drop_page_cache([])
        time.sleep(args.settle)
        settled = fresh_touch_ms(n)
        print(f"{args.mib} MiB after freeing memory ({method}) and {args.settle:g} s: first touch "
              f"{settled:.1f} ms ({settled * 1000 / per_page:.1f} µs a page)")
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    touch = statistics.median(fresh_touch_ms(n) for _ in range(args.repeats))
    copy = statistics.median(warm_copy_ms(src, dst) for _ in range(args.repeats))
    print(f"{args.mib} MiB: first touch {touch:.1f} ms ({touch * 1000 / per_page:.1f} µs a page), "
          f"copy into mapped memory {copy:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
