"""Refuse request bodies past `max_body_bytes` before anything parses them.

The OpenAI-compatible chat routes carry images inline (base64 data URLs), so they have a
limit of their own, `max_chat_body_bytes`.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class BodySizeLimit:
    """ASGI middleware: a body over the limit gets 422 naming `body`, read no further.

    The body is read here first (bounded by the limit) and replayed to the app, because a
    route that fails half-way through reading its body would answer 400, not 422.
    """

    def __init__(
        self, app: ASGIApp, max_body_bytes: int, max_chat_body_bytes: int | None = None
    ) -> None:
        self.app = app
        self.limit = max_body_bytes
        self.chat_limit = max_chat_body_bytes or max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS", "DELETE"):
            await self.app(scope, receive, send)
            return
        chat = str(scope.get("path", "")).endswith("/chat/completions")
        limit = self.chat_limit if chat else self.limit
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            await self._reject(send, limit)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await self._reject(send, limit)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send, limit: int) -> None:
        detail = [{"type": "too_long", "loc": ["body"], "msg": f"body exceeds {limit} bytes"}]
        body = json.dumps({"detail": detail}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": 422, "headers": headers})
        await send({"type": "http.response.body", "body": body})
