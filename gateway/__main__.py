"""`python -m gateway --redis-url URL --prefix ps --host H --port P --model PATH ...`: one gateway.

The shared flags come from ``shared.config.gateway_parser()`` (the ones `pagedserve gateway` and
`pagedserve serve` pass); the gateway adds its own limits.
"""

from __future__ import annotations

import argparse
import logging
import socket
import sys

from gateway.config import GatewayLimits
from shared.config import GatewayConfig, bus_from_args, gateway_parser


def parser() -> argparse.ArgumentParser:
    defaults = GatewayLimits()
    p = gateway_parser()
    p.prog = "python -m gateway"
    limits = p.add_argument_group("gateway limits")
    limits.add_argument("--request-timeout", type=float, default=defaults.idle_timeout_s,
                        help="seconds without any reply after which a request fails (503) and is aborted")
    limits.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes)
    limits.add_argument("--max-pending-requests", type=int, default=defaults.max_pending_requests)
    p.add_argument("--log-level", default="info")
    p.add_argument("--reuse-port", action="store_true",
                   help="bind with SO_REUSEPORT, so that several gateways share the port (the kernel spreads "
                        "connections over them)")
    return p


def parse_args(argv: list[str] | None = None) -> tuple[GatewayConfig, GatewayLimits, str, bool]:
    a = parser().parse_args(argv)
    config = GatewayConfig(bus=bus_from_args(a), host=a.host, port=a.port, model=a.model,
                           served_model_name=a.served_model_name, api_key=a.api_key or None,
                           num_detok_shards=a.num_detok_shards, max_model_len=a.max_model_len,
                           gateway_id=a.gateway_id)
    limits = GatewayLimits(idle_timeout_s=a.request_timeout, max_body_bytes=a.max_body_bytes,
                           max_pending_requests=a.max_pending_requests)
    return config, limits, a.log_level, a.reuse_port


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

    config, limits, log_level, reuse_port = parse_args(argv)
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s gateway %(levelname)s %(name)s: %(message)s")
    app = capture_raw_send(build_app(config, limits))  # for the per-token fast path (direct_write.py)
    server = uvicorn.Server(uvicorn.Config(app, host=config.host, port=config.port,
                                           log_level=log_level, timeout_graceful_shutdown=5))
    server.run(sockets=[shared_port_socket(config.host, config.port)] if reuse_port else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
