"""Optional bearer-token check in front of the API routes."""

from __future__ import annotations

import hmac

from gateway.errors import APIError

PUBLIC_PATHS = frozenset({"/health", "/version", "/metrics", "/metrics/bus", "/ping"})


class APIKeyMiddleware:
    """Owns one rule: with an API key configured, every non-public path needs ``Authorization: Bearer KEY``.

    /health, /version and /metrics stay open (probes and scrapers carry no key), as in vLLM.
    The comparison is constant-time.
    """

    def __init__(self, app, api_key: str | None):
        self.app = app
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send) -> None:
        if self.expected is None or scope["type"] != "http" or scope["path"] in PUBLIC_PATHS \
                or scope.get("method") == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or ()).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        await APIError(401, "invalid or missing API key").response()(scope, receive, send)
