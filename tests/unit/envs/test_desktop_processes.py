"""`port_is_free`, which guards the fixed ports of `agentflow desktop serve`: a listener
makes a port taken; the TIME_WAIT connections a stopped service leaves do not (else a
restarted desktop container would refuse its own ports for a minute)."""

from __future__ import annotations

import socket

from envs.desktop.processes import port_is_free


def test_a_listener_takes_the_port_and_time_wait_does_not() -> None:
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    assert not port_is_free(port)
    client = socket.create_connection(("127.0.0.1", port))
    accepted, _ = listener.accept()
    accepted.close()  # the server's side closes first: its port is left in TIME_WAIT
    client.recv(1)
    client.close()
    listener.close()
    assert port_is_free(port)
