"""The bubblewrap backend: the default sandbox on Linux.

Each exec is a fresh ``bwrap`` process tree:

What it isolates
    * Filesystem: the sandbox sees a read-only ``/usr`` (with the ``/bin``, ``/lib*``
      links), a handful of read-only ``/etc`` files (passwd, group, the loader cache,
      ...; never ``shadow``, never ``/root`` or home directories), a fresh ``/dev`` and
      ``/proc``, a private capped tmpfs ``/tmp`` (kept between the sandbox's execs where
      it is host-mounted, see below), and its work dir at ``/work``,
      the only host directory it can write. The root is remounted read-only.
    * Work-dir size: where this process may mount (root or ``CAP_SYS_ADMIN``), the work
      dir is a tmpfs mounted on the host with ``size=`` and ``nr_inodes=``
      (``max_workdir_bytes``, ``max_workdir_files``), so writing past either cap fails
      with ``ENOSPC`` inside and never touches the host disk. Its pages live in memory
      and are charged to the sandbox's memory cgroup, whose limit is therefore
      ``memory_mb + max_workdir_bytes + tmp_size_mb``; ``RLIMIT_AS`` still holds each process at
      ``memory_mb``. The tmpfs is unmounted on close (and by the finalizer).
    * ``/tmp``: like the work dir, where this process may mount, a tmpfs mounted on the
      host with ``size=`` (``tmp_size_mb``) and ``nr_inodes=`` (``tmp_max_files``) and
      bound at ``/tmp``; elsewhere bwrap's own size-capped tmpfs (no file-count cap).
      Either way its pages are charged to the sandbox's memory cgroup, so the cgroup's
      limit adds ``tmp_size_mb`` on top: a full ``/tmp`` never eats into ``memory_mb``.
    * Identity: runs as uid/gid 65534 (``nobody``) inside a new user namespace; when the
      host process is root, bwrap itself is started as host uid 65534 too, so even an
      escape from the namespaces lands as ``nobody``. All capabilities are dropped, new
      user namespaces are refused inside, and the command gets a new session (no TTY
      injection).
    * Network: a new, empty network namespace (only a down-to-itself loopback), unless
      ``network=True``. Processes: a new PID namespace, so the command cannot see or
      signal host processes, and killing ``bwrap`` kills every process in it.
    * Limits: wall time (the whole tree is killed), CPU time (``RLIMIT_CPU`` per process),
      address space (``RLIMIT_AS`` per process), file size (``RLIMIT_FSIZE``), captured
      output (the tree is killed past ``max_output_bytes``), and, where the host lets us
      create a cgroup (v2 with memory+pids, or v1 ``memory`` and ``pids`` hierarchies),
      total memory and process count of the whole sandbox. Without a writable cgroup it
      falls back to ``RLIMIT_NPROC``, counted per host uid and so shared by every sandbox
      on the host, and memory is bounded per process only: ``cgroup_enforced`` says
      which applies.

What it does not isolate
    * The kernel: it is shared; a kernel exploit escapes (use the Docker backend in a VM,
      or a VM, for hostile code that may carry one).
    * Total disk use of the work dir where this process may not mount (not root, no
      ``CAP_SYS_ADMIN``): the work dir is then a plain host directory and only per-file
      size is capped; ``workdir_capped`` says which applies.
    * Memory of files put in with ``write_file``: the host process writes them, so the
      kernel charges them to the caller's own memory cgroup, not the sandbox's (they
      still count against ``max_workdir_bytes``). Processes of one sandbox together may
      use ``memory_mb`` plus whatever part of ``max_workdir_bytes`` its files leave free.
    * CPU share (no CPU quota; RLIMIT_CPU bounds each process's total CPU time, wall time
      bounds the tree).
    * Timing side channels, ``/usr`` contents (readable, e.g. installed source code), and
      the host's kernel information in ``/proc`` such as ``/proc/cpuinfo``.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import resource
import shutil
import signal
import stat
import tempfile
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from sandbox.base import (
    Command,
    ExecResult,
    ExecStatus,
    SandboxClosed,
    SandboxError,
    SandboxLimits,
    SandboxUnavailable,
)
from sandbox.cgroups import SandboxCgroup, create_cgroup
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
from sandbox.process import ProcessRun, run_captured
from sandbox.tmpfs import mount_tmpfs, unmount
from sandbox.workdir import list_files, read_beneath, write_beneath

NOBODY = 65534
# Read-only /etc files a typical command needs; anything else stays invisible.
ETC_FILES = (
    "passwd",
    "group",
    "nsswitch.conf",
    "ld.so.cache",
    "ld.so.conf",
    "ld.so.conf.d",
    "alternatives",
    "localtime",
    "mime.types",
    "os-release",
    "debian_version",
    "python3",
    "python3.11",
    "python3.12",
    "python3.13",
    "protocols",
    "services",
)
NETWORK_ETC_FILES = ("resolv.conf", "hosts", "host.conf", "gai.conf", "ssl", "ca-certificates")
ROOT_LINKS = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
SETUP_RETRIES = 2
_SIGNALED = 128  # bwrap reports a signalled command as 128 + signal number


def default_workdir_root() -> Path:
    return Path(tempfile.gettempdir()) / "agentflow-sandboxes"


def _check_traversable(root: Path) -> None:
    """bwrap runs as host ``nobody``: every directory above the work dirs must let it pass."""
    for d in (root.resolve(), *root.resolve().parents):
        if not d.stat().st_mode & stat.S_IXOTH:
            raise ValueError(f"workdir_root {root}: {d} is not searchable by uid {NOBODY}")


def _release(
    workdir: str, tmpdir: str, cgroup: SandboxCgroup | None, mounted: bool, tmp_mounted: bool
) -> None:
    try:
        if cgroup:
            cgroup.kill_all()  # nothing left to write into, or hold open, the work dir
        # Before the cgroup goes: the tmpfs pages are charged to it until freed here.
        if mounted:
            unmount(workdir)
        if tmp_mounted:
            unmount(tmpdir)
    finally:
        if cgroup:
            cgroup.remove()
        shutil.rmtree(workdir, ignore_errors=True)
        shutil.rmtree(tmpdir, ignore_errors=True)


def namespace_args(bwrap: str, *, network: bool, hostname: str = "sandbox") -> list[str]:
    """bwrap's isolation common to every sandboxed process tree: new namespaces (the
    network's only with `network=False`), uid/gid 65534, no capabilities, no new user
    namespaces, a new session, read-only ``/usr`` and the root links, the allowed
    ``/etc`` files, a fresh ``/dev`` and ``/proc``. Mounts and the command come after."""
    args = [
        bwrap,
        "--unshare-all",
        "--unshare-user",
        "--disable-userns",
        "--die-with-parent",
        "--new-session",
        "--cap-drop",
        "ALL",
        "--uid",
        str(NOBODY),
        "--gid",
        str(NOBODY),
        "--hostname",
        hostname,
        "--ro-bind",
        "/usr",
        "/usr",
    ]
    if network:
        args.append("--share-net")
    for name in ROOT_LINKS:
        host = Path("/") / name
        if host.is_symlink():
            args += ["--symlink", os.readlink(host), str(host)]
        elif host.is_dir():
            args += ["--ro-bind", str(host), str(host)]
    args += ["--dir", "/etc"]
    for name in ETC_FILES + (NETWORK_ETC_FILES if network else ()):
        args += ["--ro-bind-try", f"/etc/{name}", f"/etc/{name}"]
    return [*args, "--dev", "/dev", "--proc", "/proc"]


def enter_sandbox(
    procs_files: Sequence[str], rlimits: Sequence[tuple[int, tuple[int, int]]], drop: bool
) -> None:
    """In a forked child before it execs bwrap: join the sandbox's cgroup, set the
    rlimits, and drop from root to uid/gid 65534 (`drop`)."""
    # Only async-signal-safe-ish calls: this runs between fork and exec.
    for path in procs_files:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)
    for res, value in rlimits:
        resource.setrlimit(res, value)
    if drop:
        os.setgroups([])
        os.setresgid(NOBODY, NOBODY, NOBODY)
        os.setresuid(NOBODY, NOBODY, NOBODY)


def tmp_args(tmpdir: str | None, size_bytes: int) -> list[str]:
    """``/tmp``: the host-mounted capped tmpfs at `tmpdir`, else bwrap's own of `size_bytes`."""
    if tmpdir is not None:
        return ["--bind", tmpdir, "/tmp"]
    return ["--size", str(size_bytes), "--tmpfs", "/tmp"]


class BwrapSandbox:
    """A sandbox whose commands run under bubblewrap; see the module docstring."""

    def __init__(
        self,
        *,
        limits: SandboxLimits | None = None,
        network: bool = False,
        workdir_root: str | os.PathLike[str] | None = None,
        extra_ro_binds: Sequence[str] = (),
        tmp_size_mb: int = 64,
        tmp_max_files: int = 16_384,
        use_cgroup: bool = True,
        cgroup_parent: str | None = None,
        bwrap_path: str | None = None,
    ) -> None:
        self.limits = limits or SandboxLimits()
        self.network = network
        self.id = uuid.uuid4().hex[:12]
        bwrap = bwrap_path or shutil.which("bwrap")
        if not bwrap:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed")
        self._bwrap = bwrap
        if not 1 <= tmp_size_mb <= 65536:
            raise ValueError("tmp_size_mb must be between 1 and 65536")
        self._tmp_bytes = tmp_size_mb * 1024 * 1024
        if not 16 <= tmp_max_files <= 10_000_000:
            raise ValueError("tmp_max_files must be between 16 and 10000000")
        self._tmp_files = tmp_max_files
        for path in extra_ro_binds:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise ValueError(f"extra_ro_binds: {path!r} is not an existing absolute path")
        self._extra_ro_binds = tuple(extra_ro_binds)
        self._as_root = os.geteuid() == 0
        self._owner = (NOBODY, NOBODY) if self._as_root else None

        root = Path(workdir_root) if workdir_root else default_workdir_root()
        root.mkdir(mode=0o711, parents=True, exist_ok=True)
        if self._as_root:
            _check_traversable(root)
        self.workdir = tempfile.mkdtemp(prefix=f"sbx-{self.id}-", dir=root)
        self.tmpdir = self.workdir + "-tmp"
        self.cgroup: SandboxCgroup | None = None
        self._workdir_capped = self._tmp_capped = False
        try:
            self._workdir_capped = self._mount_workdir()
            if self._owner and not self._workdir_capped:
                os.chown(self.workdir, *self._owner)
            if self._workdir_capped:  # mounting works here: /tmp gets its own capped tmpfs
                os.mkdir(self.tmpdir, 0o700)
                self._tmp_capped = self._mount_tmp()
            if use_cgroup:
                self.cgroup = create_cgroup(f"agentflow-sandbox-{self.id}", cgroup_parent)
            if self.cgroup:
                self.cgroup.set_limits(self._cgroup_memory_bytes(), self.limits.max_processes)
        except BaseException:
            _release(self.workdir, self.tmpdir, self.cgroup, self._workdir_capped, self._tmp_capped)
            raise
        self._closed = False
        # A sandbox dropped without close() still gives back its cgroup, mounts and dirs.
        self._finalizer = weakref.finalize(
            self,
            _release,
            self.workdir,
            self.tmpdir,
            self.cgroup,
            self._workdir_capped,
            self._tmp_capped,
        )

    def _mount_workdir(self) -> bool:
        """Put the work dir on a capped tmpfs; False where this process may not mount."""
        uid, gid = self._owner or (os.getuid(), os.getgid())
        try:
            return mount_tmpfs(
                self.workdir,
                size_bytes=self.limits.max_workdir_bytes,
                max_inodes=self.limits.max_workdir_files + 1,  # the root dir takes one
                uid=uid,
                gid=gid,
            )
        except OSError as exc:
            raise SandboxError(f"could not mount the work dir {self.workdir}: {exc}") from exc

    def _mount_tmp(self) -> bool:
        """Put /tmp on a host-mounted tmpfs capped in bytes and files (sticky, like /tmp)."""
        uid, gid = self._owner or (os.getuid(), os.getgid())
        try:
            return mount_tmpfs(
                self.tmpdir,
                size_bytes=self._tmp_bytes,
                max_inodes=self._tmp_files + 1,
                uid=uid,
                gid=gid,
                mode=0o1777,
            )
        except OSError as exc:
            raise SandboxError(f"could not mount /tmp at {self.tmpdir}: {exc}") from exc

    def _cgroup_memory_bytes(self) -> int:
        # /tmp's pages are charged to the cgroup too: its own budget on top, so a full
        # /tmp is ENOSPC there and memory_mb stays whole for the processes.
        memory = (self.limits.memory_mb * 1024 * 1024) + self._tmp_bytes
        if self._workdir_capped:
            # The work dir's pages are charged here too. Giving them their own budget on
            # top makes a growing work dir stop at ENOSPC (the tmpfs cap) instead of
            # getting the command OOM-killed, and keeps memory_mb for the processes.
            memory += self.limits.max_workdir_bytes
        return memory

    @property
    def cgroup_enforced(self) -> bool:
        """True when memory and process count are bounded for the whole tree."""
        return self.cgroup is not None

    @property
    def workdir_capped(self) -> bool:
        """True when the kernel caps the work dir's total bytes and file count."""
        return self._workdir_capped

    @property
    def tmp_capped(self) -> bool:
        """True when /tmp is capped in file count too (its bytes are capped either way)."""
        return self._tmp_capped

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
        argv = self._bwrap_argv(argv_of(cmd), env_of(env), cwd_of(cwd))
        deadline = timeout_of(timeout_s, self.limits)
        oom_before = self._oom_kills()
        for attempt in range(SETUP_RETRIES + 1):
            run = await run_captured(
                argv,
                stdin=stdin_of(stdin),
                timeout_s=deadline,
                max_output_bytes=self.limits.max_output_bytes,
                env={},
                preexec_fn=self._child_setup(),
            )
            # bwrap failing to fork its namespace init is a transient host condition
            # (EAGAIN) hit before the command ran, so running it again is safe.
            if not (
                run.returncode == 1
                and run.stderr.startswith(b"bwrap: Can't fork")
                and attempt < SETUP_RETRIES
            ):
                break
            await asyncio.sleep(0.05 * (attempt + 1))
        return self._result(run, oom_hit=self._oom_kills() > oom_before)

    def _result(self, run: ProcessRun, *, oom_hit: bool) -> ExecResult:
        stderr = run.stderr
        code = run.returncode
        if run.output_overflow:
            status = ExecStatus.ERROR
            note = f"output limit of {self.limits.max_output_bytes} bytes exceeded; killed"
            stderr += f"\n[sandbox] {note}\n".encode()
        elif oom_hit:  # the kernel's OOM kill is the root cause even if time ran out after
            status = ExecStatus.MEMORY_LIMIT
        elif run.timed_out:
            status = ExecStatus.TIME_LIMIT
        elif code not in (0, None) and looks_like_memory_error(stderr[-4096:]):
            status = ExecStatus.MEMORY_LIMIT
        elif code is not None and code == _SIGNALED + signal.SIGXCPU:
            status = ExecStatus.TIME_LIMIT
        elif code is not None and (code > _SIGNALED or stderr.startswith(b"bwrap: ")):
            # Killed by a signal (SIGSEGV, SIGXFSZ, ...) or bwrap could not start it.
            status = ExecStatus.ERROR
        else:
            status = ExecStatus.FINISHED
        return ExecResult(
            stdout=decode(run.stdout),
            stderr=decode(stderr),
            exit_code=code,
            status=status,
            duration_s=run.duration_s,
            output_truncated=run.output_overflow,
        )

    def _oom_kills(self) -> int:
        if self.cgroup is None:
            return 0
        with contextlib.suppress(OSError):
            return self.cgroup.oom_kills()
        return 0

    def _bwrap_argv(self, argv: list[str], env: dict[str, str], cwd: str) -> list[str]:
        args = namespace_args(self._bwrap, network=self.network)
        args += tmp_args(self.tmpdir if self._tmp_capped else None, self._tmp_bytes)
        args += ["--bind", self.workdir, WORKDIR]
        for path in self._extra_ro_binds:
            args += ["--ro-bind", path, path]
        args += ["--remount-ro", "/", "--chdir", cwd, "--clearenv"]
        for key, value in env.items():
            args += ["--setenv", key, value]
        return [*args, "--", *argv]

    def _child_setup(self) -> Callable[[], None]:
        """Runs in the forked child before exec: join the cgroup, set rlimits, drop root."""
        mb = 1024 * 1024
        cpu = math.ceil(self.limits.cpu_time_s)
        rlimits = [
            (resource.RLIMIT_CPU, (cpu, cpu + 1)),  # SIGXCPU first, SIGKILL a second later
            (resource.RLIMIT_AS, (self.limits.memory_mb * mb,) * 2),
            (resource.RLIMIT_FSIZE, (self.limits.max_file_bytes,) * 2),
            (resource.RLIMIT_CORE, (0, 0)),
        ]
        if self.cgroup is None:
            rlimits.append((resource.RLIMIT_NPROC, (self.limits.max_processes,) * 2))
        procs_files = self.cgroup.procs_files if self.cgroup else []
        drop = self._as_root

        def setup() -> None:
            enter_sandbox(procs_files, rlimits, drop)

        return setup

    # -- files --------------------------------------------------------------------------

    async def write_file(self, path: str, data: str | bytes) -> None:
        self._check_open()
        raw = data.encode() if isinstance(data, str) else bytes(data)
        await asyncio.to_thread(
            write_beneath,
            self.workdir,
            path,
            raw,
            max_bytes=self.limits.max_file_bytes,
            owner=self._owner,
        )

    async def read_file(self, path: str) -> bytes:
        self._check_open()
        return await asyncio.to_thread(
            read_beneath, self.workdir, path, max_bytes=self.limits.max_file_bytes
        )

    async def list_files(self) -> list[str]:
        """Regular files in the work dir, relative to it."""
        self._check_open()
        return await asyncio.to_thread(list_files, self.workdir)

    # -- lifecycle ----------------------------------------------------------------------

    async def reset(self) -> None:
        """Empty the work dir and /tmp so the sandbox can be handed to someone else."""
        self._check_open()
        await asyncio.to_thread(self._empty_workdir)

    def _empty_workdir(self) -> None:
        if self.cgroup:
            self.cgroup.kill_all()
        # A host-mounted /tmp lasts as long as the sandbox (as a container's does), so the
        # next user must not find this one's files there either.
        for folder in (self.workdir, self.tmpdir) if self._tmp_capped else (self.workdir,):
            for entry in os.scandir(folder):
                if entry.is_dir(follow_symlinks=False):
                    shutil.rmtree(entry.path)
                else:
                    os.unlink(entry.path)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._finalizer)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxClosed(f"sandbox {self.id} is closed")

    def __repr__(self) -> str:
        return f"BwrapSandbox(id={self.id!r}, network={self.network}, limits={self.limits!r})"
