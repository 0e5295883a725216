"""A path from a network-less sandbox to the gateway, and to nothing else.

Sharing the host's network namespace (`bwrap --share-net`) would give an agent program
every address the host has: all loopback services (the database, other gateways, env
and sandbox services, anything bound to 127.0.0.1) and whatever outside network the
host reaches. Instead the program runs with no network at all (its own namespace, with
only its own loopback) and reaches the gateway through a Unix socket:

    agent --TCP--> 127.0.0.1:<port> in the sandbox (`INNER_RELAY`, started by the
    sandbox command, then runs the agent as its child) --Unix socket in the work dir-->
    `GatewayRelay` in the gateway process --TCP--> the gateway's host:port

The host side connects every accepted stream to the one gateway address it was built
with, so the program can speak only to the gateway, under the gateway's auth (its key
is bound to its episode). Unix sockets are files, not network-namespace objects, which
is what lets the stream cross.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from urllib.parse import urlsplit

# Runs inside the sandbox under its python3: standard library only.
INNER_RELAY = r"""
import socket, subprocess, sys, threading

port, unix_path, command = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind(("127.0.0.1", port))
server.listen(128)

def pipe(src, dst):
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

def serve():
    while True:
        inner, _ = server.accept()
        outer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            outer.connect(unix_path)
        except OSError:
            inner.close()
            continue
        threading.Thread(target=pipe, args=(inner, outer), daemon=True).start()
        threading.Thread(target=pipe, args=(outer, inner), daemon=True).start()

threading.Thread(target=serve, daemon=True).start()
sys.exit(subprocess.call(command))
"""


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        with contextlib.suppress(OSError, RuntimeError):
            if writer.can_write_eof():
                writer.write_eof()


class GatewayRelay:
    """Accept streams on a Unix socket at `path` and connect each to `gateway_url`."""

    def __init__(self, path: str, gateway_url: str) -> None:
        parts = urlsplit(gateway_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"the relay forwards plain http://host:port, got {gateway_url!r}")
        self.path = path
        self.host = parts.hostname
        self.port = parts.port or 80
        self._server: asyncio.AbstractServer | None = None
        self._streams: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._server = await asyncio.start_unix_server(self._handle, path=self.path)
        # The sandbox runs as another user: it must be able to connect.
        os.chmod(self.path, 0o666)

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection(self.host, self.port)
        except OSError:
            writer.close()
            return
        task = asyncio.current_task()
        if task is not None:
            self._streams.add(task)
        try:
            await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
        finally:
            for w in (writer, up_writer):
                w.close()
            if task is not None:
                self._streams.discard(task)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            for task in list(self._streams):
                task.cancel()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
