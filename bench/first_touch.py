"""First-touch cost: faulting in fresh memory against copying into memory already mapped.

A restore writes every byte of a prefix into buffers; in a freshly started server those
are pages the process never touched, and on a VM each first touch can cost more than the
copy itself. This prints both for `--mib` MiB (default 11, one KV block of the test model),
as milliseconds, median of `--repeats`.

    .venv/bin/python bench/first_touch.py [--mib 11] [--repeats 7]
"""

from __future__ import annotations

import argparse
import mmap
import statistics
import time

import numpy as np


def fresh_touch_ms(nbytes: int) -> float:
    """Maps fresh anonymous memory and writes one byte per page."""
    m = mmap.mmap(-1, nbytes)
    started = time.perf_counter()
    np.frombuffer(m, dtype=np.uint8)[::mmap.PAGESIZE] = 1
    elapsed = time.perf_counter() - started
    m.close()
    return elapsed * 1000


def warm_copy_ms(src: np.ndarray, dst: np.ndarray) -> float:
    started = time.perf_counter()
    np.copyto(dst, src)
    return (time.perf_counter() - started) * 1000


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=11)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    n = args.mib << 20
    src, dst = np.ones(n, dtype=np.uint8), np.zeros(n, dtype=np.uint8)
    touch = statistics.median(fresh_touch_ms(n) for _ in range(args.repeats))
    copy = statistics.median(warm_copy_ms(src, dst) for _ in range(args.repeats))
    print(f"{args.mib} MiB: first touch {touch:.1f} ms ({touch * 1000 / (n // mmap.PAGESIZE):.1f} µs a page), "
          f"copy into mapped memory {copy:.1f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
