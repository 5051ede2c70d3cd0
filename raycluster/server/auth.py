"""API keys for the HTTP API (vLLM's `--api-key` / `VLLM_API_KEY`).

`keys_from_env` reads the accepted keys from `RAYCLUSTER_API_KEY` (comma-separated, so a key can
be rotated by accepting the old and the new one for a while). The variable is read where the
app runs: the engine server's process, or each gateway replica, which inherits its Ray node's
environment (on KubeRay, a pod env var from a Secret), so the key never appears in a Serve config.

`ApiKeyMiddleware` (pure ASGI: nothing is wrapped around a streamed body) answers a request to a
protected path without `Authorization: Bearer <one of the keys>` with 401 in OpenAI's error
shape. Protected: every path but `/health`, `/metrics` and the OpenAPI docs, which probes and
scrapers reach without a key.
"""

from __future__ import annotations

import hmac
import json
import os
from typing import Iterable

API_KEY_ENV = "RAYCLUSTER_API_KEY"
OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


def keys_from_env(environ=os.environ) -> tuple[str, ...]:
    """The keys in `RAYCLUSTER_API_KEY` (empty: no key is required)."""
    return tuple(k.strip() for k in environ.get(API_KEY_ENV, "").split(",") if k.strip())


def bearer_headers(environ=os.environ) -> dict[str, str]:
    """What a client of this cluster (`raycluster status`, loadgen) sends: the first key, if any."""
    keys = keys_from_env(environ)
    return {"Authorization": f"Bearer {keys[0]}"} if keys else {}


_UNAUTHORIZED = json.dumps({"error": {
    "message": "missing or wrong API key: send the header 'Authorization: Bearer <key>'",
    "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}).encode()


class ApiKeyMiddleware:
    def __init__(self, app, keys: Iterable[str]) -> None:
        self.app = app
        self._accepted = [f"Bearer {k}".encode() for k in keys]
        if not self._accepted:
            raise ValueError("ApiKeyMiddleware needs at least one key")

    def _allowed(self, scope) -> bool:
        got = next((v for k, v in scope.get("headers", ()) if k == b"authorization"), b"")
        # compare_digest on every key: the time taken does not tell which prefix matched.
        return any([hmac.compare_digest(got, want) for want in self._accepted])

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope.get("method") == "OPTIONS" \
                or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(_UNAUTHORIZED)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": _UNAUTHORIZED})
