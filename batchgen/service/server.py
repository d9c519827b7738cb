"""Run the service app on uvicorn (what ``batchgen serve`` calls)."""

from __future__ import annotations

import ipaddress
import logging
from typing import Any

from batchgen.service.app import ServiceConfig, create_app

logger = logging.getLogger(__name__)

# Seconds uvicorn waits for open connections (e.g. long polls) on shutdown.
_GRACEFUL_SHUTDOWN_S = 5


def is_loopback(host: str) -> bool:
    """Whether ``host`` only accepts connections from this machine."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_server(engine: Any, config: ServiceConfig, *, host: str, port: int) -> None:
    """Serve until SIGINT/SIGTERM; the engine thread stops after its current step and
    requests in flight stay pending in the store (they run again on the next start).

    Raises:
        OSError: the state directory cannot be used or the port cannot be bound.
    """
    import uvicorn

    if not is_loopback(host) and config.api_key is None:
        logger.warning(
            "listening on %s without --api-key: anyone who can reach this port can use the "
            "server and read its files",
            host,
        )
    app = create_app(engine, config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="info",
            access_log=False,
            timeout_graceful_shutdown=_GRACEFUL_SHUTDOWN_S,
        )
    )
    server.run()
