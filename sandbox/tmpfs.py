"""A size- and inode-capped tmpfs for a sandbox's work dir, mounted with mount(2).

The work dir is the only place sandboxed code can write that outlives an exec; on a
plain host directory nothing but ``RLIMIT_FSIZE`` (per file) stops it filling the host
disk. A tmpfs with ``size=`` and ``nr_inodes=`` makes the kernel answer ``ENOSPC`` past
the cap, and its pages are charged to the memory cgroup of the process that writes them.

mount(2) and umount2(2) are called through libc rather than the ``mount`` binary: no
fork of a large Python process per sandbox, the exact errno comes back (``EPERM`` means
"not allowed here", so the caller falls back to a plain directory), and the unmount also
works from a weakref finalizer at interpreter exit, where starting processes is unreliable.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import functools
import os

MS_NOSUID = 0x2
MS_NODEV = 0x4
MNT_DETACH = 0x2
# Errors that mean "this process may not mount here", not "the request was wrong".
NOT_PERMITTED = frozenset({errno.EPERM, errno.EACCES, errno.ENOSYS, errno.ENODEV})


@functools.cache
def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mount.argtypes = [
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_char_p,
        ctypes.c_ulong,
        ctypes.c_char_p,
    ]
    libc.mount.restype = ctypes.c_int
    libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    libc.umount2.restype = ctypes.c_int
    return libc


def mount_tmpfs(
    path: str, *, size_bytes: int, max_inodes: int, uid: int, gid: int, mode: int = 0o700
) -> bool:
    """Mount a capped tmpfs on ``path``; False when this process is not allowed to.

    ``max_inodes`` counts every file and directory, the root of the mount included.
    Any other failure raises :class:`OSError`: a wrong request must not quietly turn
    into an uncapped work dir.
    """
    options = f"size={size_bytes},nr_inodes={max_inodes},mode={mode:o},uid={uid},gid={gid}"
    # nosuid/nodev: nothing written into the work dir may gain privileges or reach devices.
    flags = MS_NOSUID | MS_NODEV
    if _libc().mount(b"tmpfs", os.fsencode(path), b"tmpfs", flags, options.encode()) == 0:
        return True
    err = ctypes.get_errno()
    if err in NOT_PERMITTED:
        return False
    raise OSError(err, f"mount tmpfs on {path}: {os.strerror(err)}")


def unmount(path: str) -> None:
    """Detach the mount on ``path``; its pages are freed once nothing holds it open."""
    if _libc().umount2(os.fsencode(path), MNT_DETACH) == 0:
        return
    err = ctypes.get_errno()
    if err not in (errno.EINVAL, errno.ENOENT):  # not a mount point (any more): nothing to do
        raise OSError(err, f"unmount {path}: {os.strerror(err)}")
