"""Plots for BENCHMARKS.md from benchmark results (JSON), as PNG files.

    .venv/bin/pip install -e '.[bench]'   # once: matplotlib, which omlx itself does not need
    .venv/bin/python bench/plot.py [RESULTS_DIR] [--out DIR] [--use NAME=FILE ...]

RESULTS_DIR (default bench/results/h200) holds what the GPU runs wrote:
restore-8b.json and restore-70b-4bit.json (bench/restore.py --host), host_path.json
(bench/host_path.py), throughput.json (bench/throughput.py --mlx-lm-batch),
quant-8b-BITS.json and quant-70b-BITS.json (bench/restore.py --host --tiers-only). Each plot is
made from the files present; the PNGs go to docs/bench/ (--out). `--use NAME=FILE` reads
FILE (in RESULTS_DIR) where NAME is expected, e.g. a later run's
`--use throughput.json=throughput-0412.json`.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.is_file() else None


def tier_ttfts(result: dict) -> dict[str, float | None]:
    """Returns client TTFT per path of one size of a bench/restore.py --host result."""
    size = result["sizes"][0]
    host = [s["timing"]["ttft_s"] for s in size["host"] if s["name"] == "host: repeat A"]
    memory = [s["timing"]["ttft_s"] for s in size["memory"]]
    return {
        "cold": size["cold"]["timing"]["ttft_s"],
        "memory hit": statistics.median(memory) if memory else None,
        "host hit": host[0] if host else None,
        "SSD after restart": size["ssd_runs"][0]["timing"]["ttft_s"] if size["ssd_runs"] else None,
    }


def plot_tiers(results: dict[str, dict], out: Path, plt) -> Path:
    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4))
    axes = axes if len(results) > 1 else [axes]
    for ax, (title, result) in zip(axes, results.items()):
        ttfts = {k: v for k, v in tier_ttfts(result).items() if v is not None}
        bars = ax.bar(list(ttfts), list(ttfts.values()), color=["#999999", "#2a7", "#37c", "#c73"][:len(ttfts)])
        ax.bar_label(bars, fmt="%.2f s")
        ax.set_title(title)
        ax.set_ylabel("TTFT at the client (s)")
        ax.tick_params(axis="x", labelrotation=15)
    fig.suptitle("omlx on an H200: time to first token by where the prompt's KV comes from")
    fig.tight_layout()
    path = out / "h200-tiers.png"
    fig.savefig(path, dpi=110)
    return path


def plot_host_path(result: dict, out: Path, plt) -> Path:
    paths = {name: p["gbps"] for name, p in result["paths"].items()}
    fig, ax = plt.subplots(figsize=(9, 5))
    names = list(paths)[::-1]
    bars = ax.barh(names, [paths[n] for n in names], color="#37c")
    ax.bar_label(bars, fmt="%.1f")
    ax.set_xscale("log")
    ax.set_xlabel("GB/s of KV (log scale)")
    ax.set_title(f"Moving {result['kv_gb']} GB of KV ({result['tokens']} tokens, 8B shape) on an H200")
    fig.tight_layout()
    path = out / "h200-host-path.png"
    fig.savefig(path, dpi=110)
    return path


def plot_throughput(result: dict, out: Path, plt) -> Path:
    pooled: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0.0, 0.0]))
    for r in result["scenario_a"]:
        pooled[r["server"]][r["concurrency"]][0] += r["completion_tokens"]
        pooled[r["server"]][r["concurrency"]][1] += r["wall_s"]
    for r in result.get("scenario_a_mlx_lm_batch", []):
        pooled["mlx-lm batch_generate (in process)"][r["concurrency"]][0] += r["completion_tokens"]
        pooled["mlx-lm batch_generate (in process)"][r["concurrency"]][1] += r["wall_s"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for server, by_n in pooled.items():
        ns = sorted(by_n)
        ax.plot(ns, [by_n[n][0] / by_n[n][1] for n in ns], marker="o",
                label={"mlx_lm": "mlx_lm.server"}.get(server, server))
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent streams (N)")
    ax.set_ylabel("output tokens/s (all requests)")
    ax.set_title("Throughput on an H200, 8B shape, 64-token completions")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = out / "h200-throughput.png"
    fig.savefig(path, dpi=110)
    return path


def quant_ttfts(results: dict[tuple[str, int], dict]) -> dict[str, dict[str, float]]:
    """Returns client TTFT per group ("8B 8K") and bar ("cold", "host 8-bit", "SSD 8-bit")
    from bench/restore.py --host --tiers-only results keyed by (model, KV bits). An SSD
    request the server recomputed is left out: it measures no restore."""
    groups: dict[str, dict[str, float]] = defaultdict(dict)
    for (model, bits), result in sorted(results.items(), key=lambda kv: (int(kv[0][0].rstrip("B")), -kv[0][1])):
        for size in result["sizes"]:
            group = groups[f"{model} {size['label']}"]
            cold = size["host"][0]["timing"]["ttft_s"] if size["host"] else None
            if cold is not None:
                group["cold"] = min(group.get("cold", cold), cold)
            host = [s["timing"]["ttft_s"] for s in size["host"] if s["name"] == "host: repeat A"]
            if host and host[0] is not None:
                group[f"host {bits}-bit"] = host[0]
            ssd = size["ssd_runs"][0] if size["ssd_runs"] else None
            if ssd is not None and ssd["timing"]["ttft_s"] is not None and ssd["timing"]["cached_tokens"]:
                group[f"SSD {bits}-bit"] = ssd["timing"]["ttft_s"]
    return groups


def plot_quant(results: dict[tuple[str, int], dict], out: Path, plt) -> Path:
    groups = quant_ttfts(results)
    order = ["cold"] + [f"{tier} {bits}-bit" for tier in ("host", "SSD") for bits in (16, 8, 4)]
    bars = [bar for bar in order if any(bar in g for g in groups.values())]
    fig, ax = plt.subplots(figsize=(11, 5))
    width = 0.8 / len(bars)
    colors = {"cold": "#999999", "host": "#37c", "SSD": "#c73"}
    for i, bar in enumerate(bars):
        xs = [g + i * width for g, values in enumerate(groups.values()) if bar in values]
        ys = [values[bar] for values in groups.values() if bar in values]
        shade = {"16-bit": 1.0, "8-bit": 0.7, "4-bit": 0.45}.get(bar.split()[-1], 1.0)
        drawn = ax.bar(xs, ys, width, label=bar, color=colors[bar.split()[0]], alpha=shade)
        ax.bar_label(drawn, fmt="%.2f", fontsize=7, rotation=90, padding=2)
    ax.set_xticks([g + 0.4 - width / 2 for g in range(len(groups))], list(groups))
    ax.set_yscale("log")
    ax.set_ylim(top=max(v for g in groups.values() for v in g.values()) * 3)
    ax.set_ylabel("TTFT at the client (s, log scale)")
    ax.set_title("omlx on an H200: cold, host hit and SSD after a restart, by KV precision")
    ax.legend(fontsize=8, ncol=4, loc="upper left")
    fig.tight_layout()
    path = out / "h200-quant.png"
    fig.savefig(path, dpi=110)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="?", default=REPO / "bench" / "results" / "h200")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench")
    parser.add_argument("--use", action="append", default=[], metavar="NAME=FILE",
                        help="read FILE where the file NAME is expected")
    args = parser.parse_args(argv)
    used = dict(u.split("=", 1) for u in args.use)

    def result(name: str) -> dict | None:
        return load(args.results / used.get(name, name))

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    args.out.mkdir(parents=True, exist_ok=True)
    made = []
    tiers = {title: r for title, name in (("8B bf16, 25K-token prompt", "restore-8b.json"),
                                          ("70B 4-bit, 32K-token prompt", "restore-70b-4bit.json"))
             if (r := result(name)) is not None}
    if tiers:
        made.append(plot_tiers(tiers, args.out, plt))
    if (host := result("host_path.json")) is not None:
        made.append(plot_host_path(host, args.out, plt))
    if (throughput := result("throughput.json")) is not None:
        made.append(plot_throughput(throughput, args.out, plt))
    quant = {(model, bits): r for model, name in (("8B", "quant-8b"), ("70B", "quant-70b")) for bits in (16, 8, 4)
             if (r := result(f"{name}-{bits}.json")) is not None}
    if quant:
        made.append(plot_quant(quant, args.out, plt))
    for path in made:
        print(path.relative_to(REPO) if path.is_relative_to(REPO) else path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
