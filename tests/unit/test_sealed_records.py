"""The bulk path's sealed records (`wire.bulk.sealed`) on real sockets of 127.0.0.1: the handover
from a mutual-TLS session, bytes through whole in any cut, and a record changed, replayed, cut,
oversized or past the key's limit breaking the connection."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from jaxps_runtime.wire import credentials
from jaxps_runtime.wire.bulk import sealed
from jaxps_runtime.wire.credentials import Identity


def _pair() -> tuple[socket.socket, socket.socket]:
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname(), timeout=30)
        server, _ = listener.accept()
    server.settimeout(30)
    return client, server


@pytest.fixture
def handed_over() -> Iterator[tuple[sealed.Sealed, sealed.Sealed]]:
    """A client and a server connection through the handover, as the bulk path makes them."""
    ca = credentials.authority("job")
    client_creds = credentials.issue(ca, Identity("job", "worker", 0), hosts=["127.0.0.1"])
    server_creds = credentials.issue(ca, Identity("job", "ps", 0), hosts=["127.0.0.1"])
    raw_client, raw_server = _pair()
    made: dict[str, sealed.Sealed] = {}

    def serve() -> None:
        tls = server_creds.ssl_context(server=True).wrap_socket(raw_server, server_side=True)
        theirs = tls.recv(sealed.RANDOM_BYTES)
        mine = sealed.draw()
        tls.sendall(mine)
        made["server"] = sealed.hand_over(
            tls, client_random=theirs, server_random=mine, server=True
        )

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    tls = client_creds.ssl_context(server=False).wrap_socket(
        raw_client, server_hostname=server_creds.server_name("127.0.0.1")
    )
    mine = sealed.draw()
    tls.sendall(mine)
    theirs = tls.recv(sealed.RANDOM_BYTES)
    client = sealed.hand_over(tls, client_random=mine, server_random=theirs, server=False)
    thread.join(timeout=30)
    server = made["server"]
    yield client, server
    client.close()
    server.close()


def _receive(conn: socket.socket, size: int, piece: int) -> bytes:
    got = bytearray(size)
    view, at = memoryview(got), 0
    while at < size:
        n = conn.recv_into(view[at:], min(piece, size - at))
        assert n, f"closed after {at} of {size} bytes"
        at += n
    return bytes(got)


@pytest.mark.parametrize("piece", [13, 70_000, 1 << 20, 5 << 20])
def test_bytes_go_through_whole_both_ways_however_they_are_read(
    handed_over: tuple[sealed.Sealed, sealed.Sealed], piece: int
) -> None:
    client, server = handed_over
    request = os.urandom((3 << 20) + 12_345)  # records of 1 MiB and a short one
    sender = threading.Thread(target=client.sendall, args=(request,), daemon=True)
    sender.start()
    assert _receive(server, len(request), piece) == request
    sender.join(timeout=30)
    server.sendall(b"reply")
    assert _receive(client, 5, piece) == b"reply"
    assert not client.worn
    assert not server.worn


def test_many_small_records_read_ahead_in_one_go_come_out_in_order(
    handed_over: tuple[sealed.Sealed, sealed.Sealed],
) -> None:
    client, server = handed_over
    pieces = [os.urandom(1 + i % 300) for i in range(500)]
    for piece in pieces:  # all in the socket before the first read: read ahead together
        client.sendall(piece)
    whole = b"".join(pieces)
    assert _receive(server, len(whole), 7) == whole


def _keyed() -> tuple[sealed.Sealed, socket.socket, socket.socket, sealed.Sealed]:
    """A sealing end, the raw bytes it sends (to change them), and where they go to be opened."""
    key = AESGCM(AESGCM.generate_key(bit_length=128))
    out, tap = _pair()
    into, opened = _pair()
    sender = sealed.Sealed(out, sealing=key, opening=key)
    receiver = sealed.Sealed(opened, sealing=key, opening=key)
    return sender, tap, into, receiver


def _wire(sender: sealed.Sealed, tap: socket.socket, data: bytes) -> bytearray:
    sender.sendall(data)
    size = 4 + len(data) + sealed.TAG_BYTES
    return bytearray(_receive(tap, size, size))


def test_a_record_changed_on_the_wire_breaks_the_connection() -> None:
    sender, tap, into, receiver = _keyed()
    record = _wire(sender, tap, b"gradients")
    record[7] ^= 1
    into.sendall(record)
    with pytest.raises(ConnectionError, match="failed its tag"):
        receiver.recv(100)


def test_a_record_replayed_breaks_the_connection() -> None:
    sender, tap, into, receiver = _keyed()
    record = _wire(sender, tap, b"push once")
    into.sendall(record + record)
    assert receiver.recv(100) == b"push once"
    with pytest.raises(ConnectionError, match="failed its tag"):
        receiver.recv(100)


def test_a_record_cut_short_or_claiming_too_much_breaks_the_connection() -> None:
    sender, tap, into, receiver = _keyed()
    record = _wire(sender, tap, b"half of it")
    into.sendall(record[:-3])
    into.shutdown(socket.SHUT_WR)
    with pytest.raises(ConnectionError, match="in the middle of a record"):
        receiver.recv(100)

    _, _, into, receiver = _keyed()
    into.sendall((sealed.RECORD_BYTES + 1).to_bytes(4, "little"))
    with pytest.raises(ConnectionError, match="1 to"):
        receiver.recv(100)


def test_a_key_seals_no_more_than_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sealed, "MAX_RECORDS", 4)
    sender, tap, _, _ = _keyed()
    _wire(sender, tap, b"1")
    assert not sender.worn
    _wire(sender, tap, b"2")
    assert sender.worn  # halfway: a client opens a new connection
    _wire(sender, tap, b"3")
    _wire(sender, tap, b"4")
    with pytest.raises(ConnectionError, match="4 records"):
        sender.sendall(b"5")
