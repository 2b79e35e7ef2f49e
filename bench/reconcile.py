"""Save-to-applied time of live config changes, beside the model's bare load time.

Two changes are timed from the moment `omlx.toml` is replaced (as an editor saves it) to
the moment /admin/api/status shows them applied:
  - a cache-budget change (target: < 1 s; the model is not reloaded),
  - a model swap (a changed model section, so the model reloads beside the old one;
    target: <= 1.2x the model's bare load time, measured in a fresh process each time).

    .venv/bin/python bench/reconcile.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import OUT_DIR, converted_model_dir, fmt, get_json, omlx_server, run_header, write_json  # noqa: E402

from appliance.platform import openblas_env  # noqa: E402

POLL_S = 0.005

BARE_LOAD = """
import time, sys
from pathlib import Path
from appliance.models.loaded import load_model
from appliance.spec import ModelSpec
started = time.perf_counter()
load_model(ModelSpec(name="bench", source=sys.argv[1], dtype="float32"), base_dir=Path("."), cache_dir=Path(sys.argv[2]))
print(time.perf_counter() - started)
"""


def bare_load_s(model_dir: Path, cache_dir: Path) -> float:
    """Returns the time `load_model` takes in a fresh process (weights already on disk)."""
    env = openblas_env(os.environ)
    out = subprocess.run([sys.executable, "-c", BARE_LOAD, str(model_dir), str(cache_dir)],
                         capture_output=True, text=True, check=True, env=env, timeout=600)
    return float(out.stdout.strip().splitlines()[-1])


def save(path: Path, text: str) -> float:
    """Replaces the config like an editor does; returns the time of the rename."""
    tmp = path.with_name(path.name + ".swp")
    tmp.write_text(text)
    os.replace(tmp, path)
    return time.perf_counter()


def wait_applied(url: str, predicate, timeout_s: float = 300) -> float:
    deadline = time.perf_counter() + timeout_s
    while time.perf_counter() < deadline:
        status = get_json(url, "/admin/api/status")
        if predicate(status):
            return time.perf_counter()
        time.sleep(POLL_S)
    raise SystemExit("change not applied in time")


def main() -> None:
    args = _args()
    model_dir = converted_model_dir()
    repeats = 2 if args.quick else 5
    with tempfile.TemporaryDirectory(prefix="omlx-bench-reconcile-") as tmp:
        work = Path(tmp)
        server = omlx_server(model_dir, work_dir=work, max_running=8, max_queued=64, log_name="reconcile")
        config = work / "omlx.toml"
        base = config.read_text()
        budgets, swaps = [], []
        with server.start() as srv:
            for i in range(repeats):
                text = base.replace("[cache]", f"[cache]\nmemory_gb = {0.5 + 0.25 * (i + 1)}")
                before = get_json(srv.url, "/admin/api/status")["config"]["hash"]
                t0 = save(config, text)
                t1 = wait_applied(srv.url, lambda s: s["config"]["hash"] != before)
                budgets.append(t1 - t0)
            for i in range(repeats):
                loaded_at = get_json(srv.url, "/admin/api/status")["models"][0]["loaded_at"]
                text = base.replace('dtype = "float32"', f'dtype = "float32"\nmax_context_tokens = {4096 - 64 * i}')
                t0 = save(config, text)
                t1 = wait_applied(srv.url, lambda s: s["models"][0]["loaded_at"] != loaded_at
                                  and s["models"][0]["state"] == "ready")
                swaps.append(t1 - t0)
        bare = [bare_load_s(model_dir, work / "cache") for _ in range(repeats)]
    result = {
        **run_header(__file__, ["--quick"] if args.quick else []),
        "budget_change_s": budgets,
        "model_swap_s": swaps,
        "bare_load_s": bare,
        "budget_change_median_s": statistics.median(budgets),
        "model_swap_median_s": statistics.median(swaps),
        "bare_load_median_s": statistics.median(bare),
    }
    result["swap_over_bare"] = result["model_swap_median_s"] / result["bare_load_median_s"]
    write_json(OUT_DIR / "reconcile.json", result)
    print("| change | median save-to-applied | target | result |")
    print("|---|---|---|---|")
    print(f"| cache budget (memory_gb) | {fmt(result['budget_change_median_s'], '.3f')} s | < 1 s | "
          f"{'met' if result['budget_change_median_s'] < 1 else 'missed'} |")
    print(f"| model swap (max_context_tokens) | {fmt(result['model_swap_median_s'], '.2f')} s "
          f"(bare load {fmt(result['bare_load_median_s'], '.2f')} s, ratio {fmt(result['swap_over_bare'])}) | "
          f"<= 1.2x bare load | {'met' if result['swap_over_bare'] <= 1.2 else 'missed'} |")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="save-to-applied times of live config changes")
    p.add_argument("--quick", action="store_true", help="two repeats instead of five")
    return p.parse_args()


if __name__ == "__main__":
    main()
