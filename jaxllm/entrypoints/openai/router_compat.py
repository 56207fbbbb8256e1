"""The fields ``vllm-router`` writes into every request it forwards, accepted at the values that mean what jaxllm does.

:class:`RouterDefaults` drops such an undeclared field (``no_stop_trim``, ``return_hidden_states``,
``separate_reasoning``, ``stream_reasoning``) only when it holds the router's default; any other value is
refused by validation, naming the field.
"""

from __future__ import annotations

import json
from typing import Any

_COMPLETION = {"no_stop_trim": False, "return_hidden_states": False}
_CHAT = {**_COMPLETION, "separate_reasoning": True, "stream_reasoning": True}
# The render routes take the generation routes' bodies, which the router forwards the same way.
ROUTER_DEFAULTS: dict[str, dict[str, bool]] = {
    "/v1/completions": _COMPLETION, "/v1/completions/render": _COMPLETION,
    "/v1/chat/completions": _CHAT, "/v1/chat/completions/render": _CHAT,
}


def strip_router_defaults(body: bytes, defaults: dict[str, bool]) -> bytes:
    """``body`` without the fields holding their value in ``defaults`` (a non-object body is returned as it is)."""
    try:
        request = json.loads(body)
    except ValueError:
        return body
    if not isinstance(request, dict):
        return body
    kept = {k: v for k, v in request.items() if not (k in defaults and v is defaults[k])}
    return body if len(kept) == len(request) else json.dumps(kept).encode()


class RouterDefaults:
    """ASGI middleware: POST bodies of :data:`ROUTER_DEFAULTS`' routes go through :func:`strip_router_defaults`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive, send) -> None:
        defaults = ROUTER_DEFAULTS.get(scope.get("path", "")) if scope["type"] == "http" else None
        if defaults is None or scope.get("method") != "POST":
            await self.app(scope, receive, send)
            return
        body = strip_router_defaults(await _read_body(receive), defaults)
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
        scope = {**scope, "headers": headers + [(b"content-length", str(len(body)).encode())]}
        pending = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> dict:
            return pending.pop() if pending else await receive()

        await self.app(scope, replay, send)


async def _read_body(receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            return b"".join(chunks)
