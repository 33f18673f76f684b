"""`python -m gateway --redis-url URL --prefix ps --host H --port P --model PATH ...`: one gateway.

Its flags, and what they build (``GatewayConfig`` with its ``GatewayLimits``), are those of
``shared.flags``: the same table `pagedserve gateway` and `pagedserve serve` use.
"""

from __future__ import annotations

import socket
import sys

from shared.flags import parse_gateway
from shared.logs import configure_logging


def shared_port_socket(host: str, port: int) -> socket.socket:
    """A listening socket other processes may bind too (SO_REUSEPORT)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from gateway.app import build_app
    from gateway.direct_write import capture_raw_send
    from gateway.server import QuietServer

    config = parse_gateway(argv)
    configure_logging("gateway", config.telemetry, config.log_level)
    app = capture_raw_send(build_app(config))  # for the per-token fast path (direct_write.py)
    # log_config None: uvicorn's loggers propagate to the root handler above, so --log-format json
    # covers them too
    server = QuietServer(uvicorn.Config(app, host=config.host, port=config.port, log_config=None,
                                        log_level=config.log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[shared_port_socket(config.host, config.port)] if config.reuse_port else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
