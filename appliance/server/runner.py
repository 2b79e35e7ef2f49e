"""`omlx serve`: logging, the appliance, uvicorn, and a graceful, bounded shutdown."""

from __future__ import annotations

import logging

import uvicorn

from appliance import platform
from appliance.config import LoadedConfig
from appliance.runtime import Appliance
from appliance.server.app import build_app

log = logging.getLogger("omlx")


def serve(config: LoadedConfig) -> int:
    """Serves `config` until SIGINT/SIGTERM; returns the exit status."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    platform.log_blas_status()
    spec = config.spec
    appliance = Appliance(config)
    server = uvicorn.Server(uvicorn.Config(
        build_app(appliance),
        host=spec.server.host,
        port=spec.server.port,
        log_level="info",
        # Open streams get this long to finish; what is still running then is cancelled.
        timeout_graceful_shutdown=max(spec.server.drain_timeout_s, 0.1),
        lifespan="on",
    ))
    log.info("omlx serving %s on http://%s:%d (config %s, hash %s)",
             ", ".join(m.name for m in spec.models), spec.server.host, spec.server.port,
             config.path, spec.hash)
    server.run()
    return 0 if server.started else 1
