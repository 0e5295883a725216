"""The Docker backend: one long-lived container per sandbox, driven by the docker SDK.

The container runs ``sleep infinity`` under docker's init, both as uid 65533, out of reach
of the commands' ``kill -9 -1`` clean-up (run as 65534); every exec is a ``docker
exec`` of ``timeout -s KILL <t> sh -c 'ulimit -v ...' <cmd>`` with an outer deadline on
our side, and files go in and out with ``put_archive``/``get_archive`` through a
per-sandbox volume at ``/work``: a tmpfs volume capped by ``size=`` and ``nr_inodes=``
(``max_workdir_bytes``, ``max_workdir_files``). It is a volume rather than a ``tmpfs=``
mount because archives can be put into a volume but not into a container's tmpfs mount
or read-only root.

What it isolates
    * Everything the container runtime isolates: own mount, PID, IPC, UTS and network
      namespaces; ``network_mode="none"`` unless ``network=True``; a read-only root
      filesystem with a private tmpfs ``/tmp`` and a size- and file-capped ``/work``
      (``ENOSPC`` past either cap); all capabilities dropped, ``no-new-privileges``;
      commands run as uid/gid 65534.
    * Limits for the whole container: memory (``mem_limit`` = ``memswap_limit``, so no
      swap: ``memory_mb + max_workdir_bytes``, since the work dir's tmpfs pages written
      from inside are charged to the container), CPU share (``nano_cpus``), process
      count (``pids_limit``), per-process address space (``memory_mb``, set by each
      command's ``sh`` wrapper: the engine cannot take it as a container ulimit, since
      its runtime's own init would start under it and fail), per-process CPU time and
      file size (ulimits), wall time per exec (``timeout -s KILL`` inside, and
      an outer deadline that kills every sandbox process if the engine stalls), output
      size (the stream is cut and the command killed past ``max_output_bytes``).

What it does not isolate
    * The kernel is shared with the host (as with bwrap); run the engine in a VM for
      code that may carry a kernel exploit. The image's contents are readable.
    * Concurrent execs in one sandbox share its limits, and a kill at the output cap or
      the outer deadline kills all of that sandbox's running commands.
    * The command's stdin is staged as a file in ``/work/.sandbox/`` (the engine's exec
      API has no simple stdin), so the command can see it there, and it takes room in
      the work dir while the command runs.
    * Files put in with ``write_file`` are written by the engine, so their memory is
      charged to the engine, not the container (they still count against the caps).
    * ``read_file`` goes through the engine, which reads as root and follows symlinks in
      the path's directories (inside the container). So it first checks, as the sandbox
      user, that no component of the path is a symlink, and returns only files the
      sandbox user owns or everyone may read. A process left running in the sandbox
      could still swap a directory for a symlink between that check and the engine's
      read; the ownership check then limits what it can get to world-readable files of
      the image. ``write_file`` replaces a planted symlink with a directory or file of
      its own (writes stay in the work dir).
    * A process killed by the container's OOM killer while its command still exits 0
      (a parent that ignores its children's deaths) is ``finished``, not
      ``memory_limit``: the engine records no OOM kill for exec'd processes, and reading
      the container's OOM counter would cost one more exec per command. A command that
      hits its own address-space limit is ``memory_limit`` as with bwrap.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import math
import tarfile
import time
import uuid
from collections.abc import Iterable, Mapping
from pathlib import PurePosixPath
from typing import Any

from sandbox.base import (
    Command,
    ExecResult,
    ExecStatus,
    SandboxClosed,
    SandboxError,
    SandboxFileError,
    SandboxLimits,
    SandboxUnavailable,
)
from sandbox.commands import (
    WORKDIR,
    argv_of,
    cwd_of,
    decode,
    env_of,
    looks_like_memory_error,
    stdin_of,
    timeout_of,
)
from sandbox.workdir import relative_path

DEFAULT_IMAGE = "python:3.11-slim"
LABEL = "org.agentflow.sandbox"
USER = "65534:65534"
NOBODY = 65534
# The container's own init and ``sleep infinity`` run as another unprivileged uid, so the
# ``kill -9 -1`` (run as USER) that clears a sandbox cannot end the container with them.
KEEPER_USER = "65533:65533"
# Extra time the engine gets past the in-container timeout before we kill from outside.
OUTER_GRACE_S = 5.0
_STDIN_DIR = ".sandbox"
# RLIMIT_AS (in KiB) for the command and everything it starts.
_AS_LIMIT = 'ulimit -v {kib} && exec "$@"'
# Exits 3 when a component of $1/$2/$3/... is a symlink (run as USER before a read).
_NO_SYMLINK = 'p="$1"; shift; for c; do p="$p/$c"; if [ -L "$p" ]; then exit 3; fi; done'
_SYMLINK_FOUND = 3


def _tar_one(name: str, data: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        parts = PurePosixPath(name).parts
        for i in range(1, len(parts)):  # parent directories, owned by the sandbox user
            info = tarfile.TarInfo("/".join(parts[:i]))
            info.type, info.mode, info.uid, info.gid = tarfile.DIRTYPE, 0o755, NOBODY, NOBODY
            tar.addfile(info)
        info = tarfile.TarInfo(name)
        info.size, info.mode, info.uid, info.gid = len(data), 0o644, NOBODY, NOBODY
        info.mtime = int(time.time())
        tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def _untar_one(chunks: Iterable[bytes], max_bytes: int) -> bytes:
    buf = io.BytesIO()
    for chunk in chunks:
        buf.write(chunk)
        if buf.tell() > max_bytes + 1024 * 1024:  # tar headers and padding on top of the data
            raise SandboxFileError(f"file is over {max_bytes} bytes")
    buf.seek(0)
    with tarfile.open(fileobj=buf, mode="r") as tar:
        member = tar.next()
        if member is None or not member.isfile():
            raise SandboxFileError("not a regular file")
        if member.size > max_bytes:
            raise SandboxFileError(f"file is over {max_bytes} bytes")
        if member.uid != NOBODY and not member.mode & 0o004:
            # The engine read it as root: had a swapped-in symlink led it out of the work
            # dir, this keeps files the sandbox user could not read out of the answer.
            raise SandboxFileError("not readable by the sandbox user")
        f = tar.extractfile(member)
        assert f is not None
        return f.read()


class DockerSandbox:
    """A sandbox backed by one Docker container; see the module docstring."""

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        network: bool = False,
        image: str = DEFAULT_IMAGE,
        client: Any = None,
        cpus: float = 1.0,
        tmp_size_mb: int = 64,
    ) -> None:
        if not 0 < cpus <= 256:
            raise ValueError("cpus must be in (0, 256]")
        self.limits = limits or SandboxLimits()
        self.network = network
        self.image = image
        self.id = uuid.uuid4().hex[:12]
        self._client = client if client is not None else _client_from_env()
        self._closed = False
        labels = {LABEL: self.id}
        memory_bytes = self.limits.memory_mb * 1024 * 1024
        # The work dir's pages count against the container's memory: they get their own
        # budget on top, so a growing work dir stops at ENOSPC rather than an OOM kill,
        # and each command's address-space limit keeps a process at memory_mb (as bwrap).
        container_memory = memory_bytes + self.limits.max_workdir_bytes
        work_opts = (
            f"size={self.limits.max_workdir_bytes},"
            f"nr_inodes={self.limits.max_workdir_files + 1},"  # the root dir takes one
            f"uid={NOBODY},gid={NOBODY},mode=0755"
        )
        cpu = math.ceil(self.limits.cpu_time_s)  # as bwrap: SIGXCPU at the limit, SIGKILL 1 s on
        try:
            self._volume = self._client.volumes.create(
                name=f"agentflow-sandbox-{self.id}",
                driver="local",
                driver_opts={"type": "tmpfs", "device": "tmpfs", "o": work_opts},
                labels=labels,
            )
            self.container = self._client.containers.run(
                image,
                ["sleep", "infinity"],
                detach=True,
                name=f"agentflow-sandbox-{self.id}",
                init=True,
                user=KEEPER_USER,
                working_dir=WORKDIR,
                mem_limit=container_memory,
                memswap_limit=container_memory,
                nano_cpus=int(cpus * 1e9),
                pids_limit=self.limits.max_processes,
                ulimits=[
                    _ulimit("cpu", cpu, cpu + 1),
                    _ulimit("fsize", self.limits.max_file_bytes, self.limits.max_file_bytes),
                    _ulimit("core", 0, 0),
                ],
                network_mode="bridge" if network else "none",
                read_only=True,
                tmpfs={"/tmp": f"size={tmp_size_mb}m,mode=1777"},
                volumes={self._volume.name: {"bind": WORKDIR, "mode": "rw"}},
                cap_drop=["ALL"],
                security_opt=["no-new-privileges"],
                labels=labels,
                environment={},
            )
        except Exception as exc:
            remove_by_label(self._client, self.id)
            raise SandboxError(f"could not start a sandbox from image {image!r}: {exc}") from exc

    # -- exec ---------------------------------------------------------------------------

    async def exec(
        self,
        cmd: Command,
        *,
        stdin: str | bytes | None = None,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout_s: float | None = None,
    ) -> ExecResult:
        self._check_open()
        argv, environment, workdir = argv_of(cmd), env_of(env), cwd_of(cwd)
        deadline = timeout_of(timeout_s, self.limits)
        data = stdin_of(stdin)
        as_limit = _AS_LIMIT.format(kib=self.limits.memory_mb * 1024)
        inner = ["timeout", "-s", "KILL", f"{deadline:.3f}s", "sh", "-c", as_limit, "sh", *argv]
        stdin_path = None
        if data is not None:
            stdin_path = f"{_STDIN_DIR}/stdin-{uuid.uuid4().hex}"
            await self.write_file(stdin_path, data)
            # Redirect inside the container; the file is removed once the command ends.
            inner = [
                "sh",
                "-c",
                'f="$1"; shift; "$@" < "$f"; rc=$?; rm -f "$f"; exit $rc',
                "sh",
                f"{WORKDIR}/{stdin_path}",
                *inner,
            ]
        start = time.monotonic()
        try:
            run = await asyncio.wait_for(
                asyncio.to_thread(self._run_exec, inner, environment, workdir),
                timeout=deadline + OUTER_GRACE_S,
            )
        except TimeoutError:
            await asyncio.to_thread(self._kill_all)
            return ExecResult(
                stdout="",
                stderr="[sandbox] engine missed the deadline; killed",
                exit_code=None,
                status=ExecStatus.TIME_LIMIT,
                duration_s=time.monotonic() - start,
            )
        out, err, code, overflow = run
        duration = time.monotonic() - start
        if overflow:
            status = ExecStatus.ERROR
            cap = self.limits.max_output_bytes
            err += f"\n[sandbox] output limit of {cap} bytes exceeded; killed\n".encode()
            code = None
        elif code == 137 and duration >= deadline:  # `timeout -s KILL` fired
            status, code = ExecStatus.TIME_LIMIT, None
        elif code in (137, 152) and self._oom_killed():
            status = ExecStatus.MEMORY_LIMIT
        elif code == 152:  # 128 + SIGXCPU: the CPU-time ulimit
            status = ExecStatus.TIME_LIMIT
        elif code not in (0, None) and looks_like_memory_error(err[-4096:]):
            status = ExecStatus.MEMORY_LIMIT
        elif code is None or code > 128 or code in (125, 126, 127):
            # Signalled, or timeout/sh could not run the command (126/127), or exec failed.
            status = ExecStatus.ERROR
        else:
            status = ExecStatus.FINISHED
        return ExecResult(
            stdout=decode(out),
            stderr=decode(err),
            exit_code=code,
            status=status,
            duration_s=duration,
            output_truncated=overflow,
        )

    def _run_exec(
        self, argv: list[str], environment: dict[str, str], workdir: str
    ) -> tuple[bytes, bytes, int | None, bool]:
        api = self._client.api
        exec_id = api.exec_create(
            self.container.id, argv, user=USER, environment=environment, workdir=workdir
        )["Id"]
        cap = self.limits.max_output_bytes
        out, err, overflow = bytearray(), bytearray(), False
        stream = api.exec_start(exec_id, stream=True, demux=True)
        try:
            for chunk_out, chunk_err in stream:
                out += chunk_out or b""
                err += chunk_err or b""
                if len(out) > cap or len(err) > cap:
                    overflow = True
                    break
        finally:
            close = getattr(stream, "close", None)
            if close is not None:
                close()
            # The SDK's stream close() shuts the socket but leaves the response's file
            # object holding it open until garbage collection; close that too.
            response = getattr(stream, "_response", None)
            if response is not None:
                response.close()
        if overflow:
            self._kill_all()
            return bytes(out[:cap]), bytes(err[:cap]), None, True
        return bytes(out), bytes(err), api.exec_inspect(exec_id).get("ExitCode"), False

    def _kill_all(self) -> None:
        """Kill every sandbox process; the container's own (KEEPER_USER) processes stay."""
        with contextlib.suppress(Exception):
            self.container.exec_run(["kill", "-9", "-1"], user=USER)

    def _remove(self, path: str) -> None:
        with contextlib.suppress(Exception):
            self.container.exec_run(["rm", "-f", "--", path], user=USER)

    def _refuse_symlinks(self, path: str, rel: PurePosixPath) -> None:
        try:
            code = self.container.exec_run(
                ["sh", "-c", _NO_SYMLINK, "sh", WORKDIR, *rel.parts], user=USER
            )[0]
        except Exception as exc:  # docker.errors.APIError: e.g. no process slot left
            raise SandboxFileError(f"cannot check {path!r} for symlinks: {exc}") from exc
        if code == _SYMLINK_FOUND:
            raise SandboxFileError(f"cannot read {path!r}: a symlink in its path")
        if code != 0:
            raise SandboxFileError(f"cannot check {path!r} for symlinks (exit {code})")

    def _oom_killed(self) -> bool:
        with contextlib.suppress(Exception):
            self.container.reload()
            return bool(self.container.attrs.get("State", {}).get("OOMKilled"))
        return False

    # -- files --------------------------------------------------------------------------

    async def write_file(self, path: str, data: str | bytes) -> None:
        self._check_open()
        rel = relative_path(path)
        raw = data.encode() if isinstance(data, str) else bytes(data)
        if len(raw) > self.limits.max_file_bytes:
            raise SandboxFileError(f"{path!r}: {len(raw)} bytes is over the limit")
        try:
            ok = await asyncio.to_thread(
                self.container.put_archive, WORKDIR, _tar_one(str(rel), raw)
            )
        except Exception as exc:  # docker.errors.APIError: the engine could not extract it
            if "no space left on device" in str(exc).lower():
                # The engine leaves the file it could not finish; a truncated file would
                # read back as if it were whole.
                await asyncio.to_thread(self._remove, f"{WORKDIR}/{rel}")
                raise SandboxFileError(f"cannot write {path!r}: the work dir is full") from exc
            raise SandboxFileError(f"could not write {path!r}: {exc}") from exc
        if not ok:
            raise SandboxFileError(f"could not write {path!r}")

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        rel = relative_path(path)
        # The engine resolves symlinks in the parent directories as root: a command that
        # planted ``out -> /etc`` would otherwise get read_file("out/shadow").
        await asyncio.to_thread(self._refuse_symlinks, path, rel)
        try:
            chunks, _stat = await asyncio.to_thread(self.container.get_archive, f"{WORKDIR}/{rel}")
        except Exception as exc:  # docker.errors.NotFound and friends
            raise SandboxFileError(f"cannot read {path!r}: {exc}") from exc
        return await asyncio.to_thread(_untar_one, chunks, self.limits.max_file_bytes)

    # -- lifecycle ----------------------------------------------------------------------

    async def reset(self) -> None:
        """Empty the work dir so the sandbox can be handed to someone else."""
        self._check_open()
        await asyncio.to_thread(self._kill_all)
        await self.exec(["find", WORKDIR, "-mindepth", "1", "-delete"])

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(remove_by_label, self._client, self.id)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed")


def remove_by_label(client: Any, sandbox_id: str | None = None) -> int:
    """Remove sandbox containers and volumes (one sandbox's, or all of them after a crash)."""
    selector = f"{LABEL}={sandbox_id}" if sandbox_id else LABEL
    removed = 0
    for container in client.containers.list(all=True, filters={"label": selector}):
        with contextlib.suppress(Exception):
            container.remove(force=True)
            removed += 1
    for volume in client.volumes.list(filters={"label": selector}):
        with contextlib.suppress(Exception):
            volume.remove(force=True)
    return removed


def _ulimit(name: str, soft: int, hard: int) -> Any:
    from docker.types import Ulimit

    return Ulimit(name=name, soft=soft, hard=hard)


def _client_from_env() -> Any:
    try:
        import docker
    except ImportError as exc:
        raise SandboxUnavailable("the docker SDK is not installed (pip install docker)") from exc
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:
        raise SandboxUnavailable(f"no Docker engine reachable: {exc}") from exc
    return client
