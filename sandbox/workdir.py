"""Host-side access to a sandbox's work dir that sandboxed code cannot redirect.

The work dir is writable from inside the sandbox, so it may hold symlinks planted by the
command (``out -> /etc/shadow``). The host side runs with more rights than the sandbox,
so it must never follow them: every component is opened relative to the previous one
with ``O_NOFOLLOW``, and ``..`` or absolute paths are refused up front.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import PurePosixPath

from sandbox.base import SandboxFileError

MAX_PATH_CHARS = 1024
# The work dir's size or file cap is reached (ENOSPC on a capped tmpfs, EDQUOT on quotas).
_FULL = (errno.ENOSPC, errno.EDQUOT)


def relative_path(path: str) -> PurePosixPath:
    """Validate a work-dir-relative path; raise :class:`SandboxFileError` otherwise."""
    if not isinstance(path, str) or not path or len(path) > MAX_PATH_CHARS or "\0" in path:
        raise SandboxFileError(f"invalid path {path!r}")
    p = PurePosixPath(path)
    if p.is_absolute():
        raise SandboxFileError(f"path must be relative to the work dir: {path!r}")
    parts = [part for part in p.parts if part != "."]
    if not parts or ".." in parts:
        raise SandboxFileError(f"path must stay inside the work dir: {path!r}")
    return PurePosixPath(*parts)


@contextlib.contextmanager
def _open_dir(
    root: str, parts: tuple[str, ...], create: bool, owner: tuple[int, int] | None
) -> Iterator[int]:
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        for part in parts:
            if create:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                    if owner is not None:
                        os.chown(part, *owner, dir_fd=fd, follow_symlinks=False)
            try:
                nxt = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=fd)
            except OSError as exc:
                raise SandboxFileError(f"not a directory inside the work dir: {part!r}") from exc
            os.close(fd)
            fd = nxt
        yield fd
    finally:
        os.close(fd)


def write_beneath(
    root: str, path: str, data: bytes, *, max_bytes: int, owner: tuple[int, int] | None = None
) -> None:
    """Write ``data`` to ``root/path`` without following any symlink; parents are created.

    A full work dir (its size or file cap reached) raises :class:`SandboxFileError` and
    leaves no partial file behind.
    """
    rel = relative_path(path)
    if len(data) > max_bytes:
        raise SandboxFileError(f"{path!r}: {len(data)} bytes is over the {max_bytes} limit")
    try:
        _write(root, rel, path, data, owner)
    except OSError as exc:
        if exc.errno in _FULL:  # from mkdir or write; other errors are the host's own
            raise _cannot_write(path, exc) from exc
        raise


def _cannot_write(path: str, exc: OSError) -> SandboxFileError:
    if exc.errno in _FULL:
        return SandboxFileError(f"cannot write {path!r}: the work dir is full ({exc.strerror})")
    return SandboxFileError(f"cannot write {path!r}: {exc.strerror}")


def _write(
    root: str, rel: PurePosixPath, path: str, data: bytes, owner: tuple[int, int] | None
) -> None:
    with _open_dir(root, rel.parts[:-1], create=True, owner=owner) as dir_fd:
        try:
            fd = os.open(
                rel.name,
                os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_NONBLOCK,
                0o644,
                dir_fd=dir_fd,
            )
        except OSError as exc:  # ELOOP for a symlink, EISDIR, ENXIO for a FIFO, ENOSPC
            raise _cannot_write(path, exc) from exc
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxFileError(f"{path!r} is not a regular file")
            if owner is not None:
                os.fchown(fd, *owner)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            # A truncated file would read back as if it were whole.
            with contextlib.suppress(OSError):
                os.unlink(rel.name, dir_fd=dir_fd)
            raise
        finally:
            os.close(fd)


def read_beneath(root: str, path: str, *, max_bytes: int) -> bytes:
    """Read the regular file ``root/path`` without following any symlink."""
    rel = relative_path(path)
    with _open_dir(root, rel.parts[:-1], create=False, owner=None) as dir_fd:
        try:
            fd = os.open(rel.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dir_fd)
        except OSError as exc:
            raise SandboxFileError(f"cannot read {path!r}: {exc.strerror}") from exc
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):  # a FIFO or device would block or lie
                raise SandboxFileError(f"{path!r} is not a regular file")
            if st.st_size > max_bytes:
                raise SandboxFileError(f"{path!r}: {st.st_size} bytes is over {max_bytes}")
            chunks, total = [], 0
            while chunk := os.read(fd, 1 << 20):
                total += len(chunk)
                if total > max_bytes:
                    raise SandboxFileError(f"{path!r} grew over {max_bytes} bytes")
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)


def list_files(root: str, *, max_files: int = 10_000) -> list[str]:
    """Relative paths of the regular files under ``root`` (symlinks are not followed)."""
    found: list[str] = []
    for dirpath, _dirs, files in os.walk(root, followlinks=False):
        for name in files:
            full = os.path.join(dirpath, name)
            if stat.S_ISREG(os.lstat(full).st_mode):
                found.append(os.path.relpath(full, root))
                if len(found) >= max_files:
                    return sorted(found)
    return sorted(found)
