"""`omlx serve`: logging, the appliance, uvicorn, and a graceful, bounded shutdown.

On SIGTERM or SIGINT uvicorn stops accepting connections and drains the open ones for
`server.drain_timeout_s`; then `lifespan.shutdown` stops the rest, in its labelled order.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from types import FrameType

import uvicorn

from appliance import platform
from appliance.config import LoadedConfig
from appliance.runtime import Appliance
from appliance.server.app import build_app
from appliance.spec import ServerSpec

log = logging.getLogger("omlx")

EXIT_DEVICE_LOST = 75  # EX_TEMPFAIL: the GPU's context was lost; a restart serves again


class Server(uvicorn.Server):
    """uvicorn, plus rebinding to a new address without dropping the old one first, and a
    clean exit (status 0) after a graceful stop on SIGTERM or SIGINT."""

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once it has shut down, so the process would die by
        # it (status -15) after a drain that went well; service managers and scripts read
        # that as a crash. (uvicorn 0.55's own list of signals to re-raise.)
        self._captured_signals.clear()

    async def rebind(self, host: str, port: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """Listens on host:port beside the current sockets; returns (close new, close old)."""
        loop = asyncio.get_running_loop()
        config = self.config

        def protocol(_loop: asyncio.AbstractEventLoop | None = None) -> asyncio.Protocol:
            return config.http_protocol_class(config=config, server_state=self.server_state,
                                              app_state=self.lifespan.state, _loop=_loop)

        new = await loop.create_server(protocol, host=host, port=port, backlog=config.backlog)
        old = list(self.servers)
        self.servers.append(new)
        log.info("listening on http://%s:%d", host, port)

        def close(servers: list) -> None:
            for s in servers:
                s.close()
                self.servers.remove(s)

        return (lambda: close([new])), (lambda: close(old))


def warn_if_open(server: ServerSpec) -> None:
    if server.open_to_the_network:
        log.warning("serving %s without keys (allow_unauthenticated = true): anyone who can reach port %d "
                    "can use the API, the admin API and the KV cache of every prompt", server.host, server.port)


def serve(config: LoadedConfig) -> int:
    """Serves `config` until SIGINT/SIGTERM (or a lost GPU); returns the exit status."""
    platform.configure_logging()
    platform.log_blas_status()
    # The cache holds other people's prompts: everything omlx creates is this user's alone.
    os.umask(0o077)
    warn_if_open(config.spec.server)
    spec = config.spec
    kernels = platform.keep_compiled_kernels(spec.cache.path(config.base_dir))
    if kernels is not None and platform.device_kind() == "gpu":
        log.info("compiled kernels are kept in %s", kernels)
    platform.limit_device_memory(spec.server.mlx_memory_limit_gb)
    appliance = Appliance(config)
    server = Server(uvicorn.Config(
        build_app(appliance, rebind=lambda host, port: server.rebind(host, port)),
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
    if appliance.device_lost is not None:
        return EXIT_DEVICE_LOST
    return 0 if server.started else 1
