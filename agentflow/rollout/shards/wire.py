"""The line between a run's coordinator and one controller shard: JSON objects, one per
line, over a Unix socket pair the coordinator hands the shard's process at spawn.

Either side may call the other (`call`: a request with a `seq`, answered by a reply
`{"re": seq, "ok": ...}`) or tell it something (`tell`: no answer). Requests are handled
each in its own task, so a shard's call that waits on the staleness gate does not hold
back a pause sent the other way. When the line closes (the other process died or ended),
every call waiting on it raises `ShardLost`.

Messages are small and rare (a group admitted, a group settled, an episode recorded, a
control request): at 2,000 turns/s and 4 turns per episode about 500 episode messages a
second in all, which JSON over a local socket carries at well under 1% of a core.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from agentflow.errors import AgentFlowError

log = logging.getLogger(__name__)

Message = dict[str, Any]
Handler = Callable[[str, Message], Awaitable[Message | None]]

_LINE_LIMIT = 16 << 20  # a spec carries the run's config, which may hold a long prompt


class ShardLost(AgentFlowError):
    """The other end of a shard's line is gone."""


class RemoteError(AgentFlowError):
    """The other end handled a call and raised; `message` is its one line."""


class Peer:
    """One end of the line. `serve()` reads until the line closes; `handle(op, message)`
    answers the other end's calls and tells (its return value is a call's reply)."""

    def __init__(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, handle: Handler
    ) -> None:
        self._reader = reader
        self._writer = writer
        self._handle = handle
        self._seq = 0
        self._waiting: dict[int, asyncio.Future[Message]] = {}
        self._handling: set[asyncio.Task[None]] = set()
        self.closed = False

    @classmethod
    async def over(cls, sock: Any, handle: Handler) -> Peer:
        reader, writer = await asyncio.open_unix_connection(sock=sock, limit=_LINE_LIMIT)
        return cls(reader, writer, handle)

    async def call(self, op: str, **fields: Any) -> Message:
        """Send a request and wait for its reply; `RemoteError` if the other end raised."""
        if self.closed:
            raise ShardLost(f"the line is closed ({op} not sent)")
        self._seq += 1
        seq = self._seq
        reply = asyncio.get_running_loop().create_future()
        self._waiting[seq] = reply
        try:
            self._send({"op": op, "seq": seq, **fields})
            answer = await reply
        finally:
            self._waiting.pop(seq, None)
        if not answer.get("ok", False):
            raise RemoteError(str(answer.get("error", "no reason given")))
        return answer

    def tell(self, op: str, **fields: Any) -> None:
        """Send without waiting for an answer (dropped once the line is closed)."""
        if not self.closed:
            self._send({"op": op, **fields})

    def _send(self, message: Message) -> None:
        self._writer.write(json.dumps(message, separators=(",", ":")).encode() + b"\n")

    async def serve(self) -> None:
        """Read until the line closes; then every waiting call raises `ShardLost`."""
        try:
            while line := await self._reader.readline():
                message = json.loads(line)
                seq = message.get("re")
                if seq is not None:
                    waiting = self._waiting.get(seq)
                    if waiting is not None and not waiting.done():
                        waiting.set_result(message)
                    continue
                task = asyncio.create_task(self._answer(message))
                self._handling.add(task)
                task.add_done_callback(self._handling.discard)
        except (ConnectionError, OSError, ValueError) as exc:
            log.warning("shard line broken: %s: %s", type(exc).__name__, exc)
        finally:
            self.close()

    async def _answer(self, message: Message) -> None:
        op = str(message.get("op"))
        seq = message.get("seq")
        try:
            result = await self._handle(op, message)
        except Exception as exc:  # noqa: BLE001 - the caller gets the reason, we serve on
            if seq is None:
                log.exception("shard line: %s failed", op)
            else:
                self._reply(seq, {"ok": False, "error": f"{type(exc).__name__}: {exc}"})
            return
        if seq is not None:
            self._reply(seq, {"ok": True, **(result or {})})

    def _reply(self, seq: int, fields: Message) -> None:
        if not self.closed:
            with contextlib.suppress(ConnectionError, RuntimeError):
                self._send({"re": seq, **fields})

    async def drain(self) -> None:
        with contextlib.suppress(ConnectionError):
            await self._writer.drain()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for waiting in self._waiting.values():
            if not waiting.done():
                waiting.set_exception(ShardLost("the other end of the line is gone"))
        self._waiting.clear()
        with contextlib.suppress(Exception):
            self._writer.close()
