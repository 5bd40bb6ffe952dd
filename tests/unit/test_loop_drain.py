"""The loop's read of a socket (``Daemon._drain``): a batch of agent messages looks at the
operators' sockets every ``OPERATORS_EVERY`` messages, so a ``ps`` never waits behind a
whole batch of heartbeats. Real ZeroMQ sockets; the handler and the look are counters."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import zmq

from profd.daemon.loop import BATCH, OPERATORS_EVERY, Daemon
from profd.daemon.runtime.peers import PeerCred


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://drain")
    push.connect("inproc://drain")
    yield pull, push
    push.close(0)
    pull.close(0)
    ctx.term()


def _wait_queued(pull: zmq.Socket[bytes]) -> None:
    assert pull.poll(2000), "the first message never arrived"


def test_a_batch_looks_at_the_operators_between_its_messages(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    pull, push = pair
    n = 3 * OPERATORS_EVERY + 5
    for i in range(n):
        push.send_multipart([b"hb", str(i).encode()])
    _wait_queued(pull)
    handled: list[int] = []
    looks: list[int] = []

    def handle(frames: list[bytes], peer: PeerCred | None) -> None:
        handled.append(int(frames[1]))

    got = Daemon._drain(None, pull, handle, between=lambda: looks.append(len(handled)))  # type: ignore[arg-type]
    assert got == n and handled == list(range(n))
    # After each OPERATORS_EVERY messages, never before the first nor after the last.
    assert looks == [OPERATORS_EVERY, 2 * OPERATORS_EVERY, 3 * OPERATORS_EVERY]


def test_without_a_look_a_batch_stops_at_its_limit(
    pair: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
) -> None:
    pull, push = pair
    for i in range(10):
        push.send(str(i).encode())
    _wait_queued(pull)
    handled: list[bytes] = []
    got = Daemon._drain(None, pull, lambda f, p: handled.append(f[0]), limit=4)  # type: ignore[arg-type]
    assert got == 4 and handled == [b"0", b"1", b"2", b"3"] and BATCH > OPERATORS_EVERY
