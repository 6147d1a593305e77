"""The port a server with frontend workers reserves (transport/workers.py reserve_port): taken
again at once after a server whose connections linger in TIME_WAIT, as gRPC's own listener
takes it; never while another process listens there."""

from __future__ import annotations

import socket

import pytest

from mha_serve.transport.workers import reserve_port


def _time_wait_on_a_port() -> int:
    """A port of 127.0.0.1 whose listener (SO_REUSEADDR, as gRPC's) is gone but whose
    accepted connection, closed by the server's side first, lingers in TIME_WAIT (the active
    closer's state)."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = listener.accept()
    conn.close()  # the server's side first: its socket goes to TIME_WAIT
    assert client.recv(1) == b""  # the FIN arrived
    client.close()
    listener.close()
    return port


def test_a_port_with_connections_in_time_wait_is_reserved_at_once():
    port = _time_wait_on_a_port()
    plain = socket.socket()  # what the reservation was without SO_REUSEADDR: refused
    with pytest.raises(OSError):
        plain.bind(("127.0.0.1", port))
    plain.close()
    sock = reserve_port("127.0.0.1", port)
    try:
        assert sock.getsockname()[1] == port
    finally:
        sock.close()


def test_a_port_another_process_listens_on_is_not_reserved():
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    try:
        with pytest.raises(OSError, match="could not listen on 127.0.0.1:"):
            reserve_port("127.0.0.1", listener.getsockname()[1])
    finally:
        listener.close()


def test_a_reserved_port_keeps_a_server_that_reuses_addresses_out():
    """Reserved with no TIME_WAIT in the way (without SO_REUSEADDR): another server binding
    as gRPC's listeners do (SO_REUSEADDR) is refused until the frontends listen."""
    sock = reserve_port("127.0.0.1", 0)
    other = socket.socket()
    other.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        with pytest.raises(OSError):
            other.bind(("127.0.0.1", sock.getsockname()[1]))
    finally:
        other.close()
        sock.close()
