"""A free TCP port, for a server or a process group that is about to bind one."""

from __future__ import annotations

import socket


def free_port(host: str) -> int:
    """A port on `host` that nothing listens on now. Another process may take it before
    the caller binds it; callers that can bind port 0 themselves should."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])
