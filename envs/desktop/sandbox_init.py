"""The first process inside a sandboxed desktop (envs/desktop/sandboxed.py starts it).

It runs under bubblewrap as uid 65534 with the system's `python3 -I` and the standard
library only (nothing of the project is mounted in), in the desktop's own network, pid and
mount namespaces. It starts the desktop's servers, makes the two ports the host may reach
available as Unix sockets in the folder bound at `/run/desktop`, and then serves the
host's requests. Everything else the policy's apps might listen on stays unreachable:
the namespace's loopback is the sandbox's own.

* Xvfb on display `:N` (its socket is in the sandbox's own network namespace, so `:0`
  never collides with another desktop); ready once that socket accepts.
* openbox; ready once it announces itself on the root window.
* x11vnc on the Unix socket `/run/desktop/vnc.sock` only (`-rfbport 0`).
* websockify serving noVNC on the namespace's 127.0.0.1:6080, relaying to that socket,
  and a relay from `/run/desktop/ws.sock` to it (websockify cannot listen on a socket).

Protocol, JSON lines: requests on stdin `{"id", "op": "run", "command", "timeout_s"}` or
`{"id", "op": "launch", "argv"}`; answers on stdout `{"id", "exit_code", "stdout",
"stderr"}`, `{"id", "ok": true}` or `{"id", "error"}`; events `{"event": "ready",
"display"}`, `{"event": "exited", "service", "code"}`, `{"event": "failed", "error"}`.
stdin closing (the host went away) ends the desktop.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from typing import Any

RUN = "/run/desktop"
VNC_SOCKET = f"{RUN}/vnc.sock"
WS_SOCKET = f"{RUN}/ws.sock"
WS_PORT = 6080  # inside the desktop's own network namespace
MAX_CAPTURE = 1 << 20  # bytes of a command's stdout and of its stderr sent back


def emit(message: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


class Desktop:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.env = dict(os.environ)
        self.services: dict[str, asyncio.subprocess.Process] = {}
        self.apps: list[asyncio.subprocess.Process] = []

    async def spawn(self, argv: list[str], log: str, **kw: Any) -> asyncio.subprocess.Process:
        with open(f"/tmp/{log}.log", "ab") as out:
            return await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=out,
                env=self.env,
                cwd=self.env["HOME"],
                start_new_session=True,
                **kw,
            )

    async def service(self, name: str, argv: list[str], **kw: Any) -> None:
        proc = await self.spawn(argv, name, **kw)
        self.services[name] = proc

        async def watch() -> None:
            emit({"event": "exited", "service": name, "code": await proc.wait()})

        asyncio.ensure_future(watch())

    async def start(self) -> None:
        width, height = self.config["screen"]
        number = int(self.config["display"])
        argv = [
            "Xvfb", f":{number}", "-screen", "0", f"{width}x{height}x24", "-nolisten", "tcp",
            "-noreset",
        ]  # fmt: skip
        await self.service("Xvfb", argv)
        # The display is ours alone (a private /tmp and network namespace), so its number
        # is known; ready once its socket accepts. (-displayfd here failed now and then
        # with "Cannot write display number".)
        x_socket = f"\0/tmp/.X11-unix/X{number}"  # abstract: /tmp/.X11-unix is not ours
        await self.until(lambda: asyncio.open_unix_connection(x_socket), "Xvfb")
        self.env["DISPLAY"] = display = f":{number}"
        await self.service("openbox", ["openbox"])
        while "#" not in (await self.run("xprop -root _NET_SUPPORTING_WM_CHECK", 5.0))["stdout"]:
            if self.services["openbox"].returncode is not None:
                raise RuntimeError(f"openbox exited: {log_tail('openbox')}")
            await asyncio.sleep(0.02)
        await self.service("x11vnc", [
            "x11vnc", "-display", display, "-rfbport", "0", "-unixsock", VNC_SOCKET, "-nopw",
            "-forever", "-shared", "-quiet", "-defer", "10", "-wait", "10",
        ])  # fmt: skip
        await self.service("websockify", [
            "websockify", "--web", self.config["novnc_dir"], f"--unix-target={VNC_SOCKET}",
            f"127.0.0.1:{WS_PORT}",
        ])  # fmt: skip
        await self.until(lambda: asyncio.open_unix_connection(VNC_SOCKET), "x11vnc")
        await self.until(lambda: asyncio.open_connection("127.0.0.1", WS_PORT), "websockify")
        await asyncio.start_unix_server(self.relay, WS_SOCKET)
        emit({"event": "ready", "display": display})

    async def until(self, connect: Any, name: str) -> None:
        while True:
            if self.services[name].returncode is not None:
                raise RuntimeError(f"{name} exited: {log_tail(name)}")
            try:
                _, writer = await connect()
            except OSError:
                await asyncio.sleep(0.02)
                continue
            writer.close()
            return

    async def relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", WS_PORT)
        except OSError:
            writer.close()
            return
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))

    async def run(self, command: str, timeout_s: float) -> dict[str, Any]:
        proc = await asyncio.create_subprocess_exec(
            "sh", "-c", command,
            stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=self.env, cwd=self.env["HOME"],
            start_new_session=True,
        )  # fmt: skip
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            kill_group(proc.pid)
            await proc.wait()
            return {"exit_code": 124, "stdout": "", "stderr": f"timed out after {timeout_s} s"}
        return {
            "exit_code": proc.returncode or 0,
            "stdout": out[:MAX_CAPTURE].decode(errors="replace"),
            "stderr": err[:MAX_CAPTURE].decode(errors="replace"),
        }

    async def launch(self, argv: list[str]) -> dict[str, Any]:
        self.apps.append(await self.spawn(argv, "apps"))
        return {"ok": True}

    async def answer(self, request: dict[str, Any]) -> None:
        reply: dict[str, Any]
        try:
            if request.get("op") == "run":
                reply = await self.run(str(request["command"]), float(request["timeout_s"]))
            elif request.get("op") == "launch":
                reply = await self.launch([str(a) for a in request["argv"]])
            else:
                reply = {"error": f"unknown op {request.get('op')!r}"}
        except Exception as exc:  # an app that is not installed, a bad request
            reply = {"error": f"{type(exc).__name__}: {exc}"}
        emit({"id": request.get("id"), **reply})

    def stop(self) -> None:
        for proc in [*self.apps, *self.services.values()]:
            kill_group(proc.pid)


async def pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except OSError:
        pass
    finally:
        writer.close()


def log_tail(name: str) -> str:
    """The end of a service's log, for the error that says why the desktop did not start."""
    try:
        with open(f"/tmp/{name}.log", "rb") as f:
            return f.read()[-600:].decode(errors="replace").strip() or "(no output)"
    except OSError:
        return "(no log)"


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def main() -> int:
    desktop = Desktop(json.loads(sys.argv[1]))
    try:
        await desktop.start()
    except Exception as exc:
        emit({"event": "failed", "error": str(exc)})
        desktop.stop()
        return 1
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=1 << 22)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    pending: set[asyncio.Future[None]] = set()
    while line := await reader.readline():
        try:
            request = json.loads(line)
        except ValueError:
            continue
        task = asyncio.ensure_future(desktop.answer(request))
        pending.add(task)
        task.add_done_callback(pending.discard)
    desktop.stop()  # the host closed our stdin: it is gone or stopping the desktop
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
