"""The web dashboard: its page and assets (shipped in the package, no CDN) at `/`, and
`GET /admin/api/overview`, the one call its Overview tab polls.

The page reads and changes everything through `/admin/api/`; it holds no state of its own.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

from starlette.requests import Request
from starlette.responses import FileResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles

from appliance.server.json import JSONResponse

STATIC = Path(__file__).parent / "static"
_weights_bytes: dict[tuple[int, float], int] = {}  # (id of a LoadedModel, its loaded_at) -> bytes


async def page(request: Request) -> Response:
    return FileResponse(STATIC / "index.html", headers={"Cache-Control": "no-cache"})


async def overview(request: Request) -> Response:
    """Uptime, backend, the applied config, models with their weights' memory, totals the
    page turns into rates (output tokens, finished requests), prompt tokens restored per
    tier, TTFT percentiles over recent requests, and requests running and queued."""
    app = request.app.state.appliance
    metrics = request.app.state.metrics
    models, ttfts, running, queued = [], [], 0, 0
    for name, entry in list(app.models.items()):
        engine = entry.engine
        row = {"name": name, "state": entry.state, "default": name == app.spec.default_model.name,
               "weights_bytes": None, "running": 0, "queued": 0, "requests": metrics.finished_by_model[name]}
        if engine is not None and entry.state not in ("stopped", "failed"):
            row["weights_bytes"] = weights_bytes(engine.loaded)
            live = engine.num_live
            row["running"] = min(live, engine.limits.max_running)
            row["queued"] = live - row["running"]
            running, queued = running + row["running"], queued + row["queued"]
            ttfts += [s.ttft_s for s in list(engine.recent) if s.ttft_s is not None]
        models.append(row)
    return JSONResponse({
        "time": time.time(),
        "started_at": app.started_at,
        "uptime_s": round(time.time() - app.started_at, 3),
        "backend": backend(),
        "config": {"path": str(app.config.path), "hash": app.spec.hash, "last_error": app.last_error},
        "models": models,
        "output_tokens": metrics.totals["output_tokens"],
        "prompt_tokens": metrics.totals["prompt_tokens"],
        "finished_requests": metrics.totals["finished_requests"],
        "cached_tokens_by_tier": dict(metrics.cached_by_tier),
        "ttft_p50_s": percentile(ttfts, 50),
        "ttft_p95_s": percentile(ttfts, 95),
        "running": running,
        "queued": queued,
    })


def weights_bytes(loaded) -> int:
    """Returns the bytes of a loaded model's parameters (counted once per load)."""
    key = (id(loaded), loaded.loaded_at)
    if key not in _weights_bytes:
        from mlx.utils import tree_flatten

        _weights_bytes[key] = sum(v.nbytes for _, v in tree_flatten(loaded.model.parameters()))
    return _weights_bytes[key]


def percentile(values: list[float], p: int) -> float | None:
    if not values:
        return None
    if len(values) == 1:
        return round(values[0], 4)
    return round(statistics.quantiles(values, n=100, method="inclusive")[p - 1], 4)


def backend() -> str:
    import mlx.core as mx

    from appliance.platform import device_kind

    return f"MLX {mx.__version__}, {device_kind()} ({sys.platform})"


ROUTES = [
    Route("/", page, methods=["GET"]),
    Route("/admin/api/overview", overview, methods=["GET"]),
    Mount("/dashboard", StaticFiles(directory=STATIC), name="dashboard"),
]
