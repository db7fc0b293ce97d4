"""The loop watches a database session through a descriptor of its own (Supervisor.watch_session).

libpq closes its socket when it finds the connection broken, before the loop unwatches it; a
worker forked meanwhile still holds that socket, so epoll kept reporting it, hung up, under
its old number, which a new worker's channel had taken by then: the supervisor spun on reads
of the new channel (bench/chaos.py, after a PostgreSQL restart). Real sockets, a real epoll.
"""

from __future__ import annotations

import contextlib
import os
import selectors
import socket

from cyclone.supervisor.supervisor import Supervisor


class Loop:
    """The two attributes watch_session and unwatch_session use."""

    def __init__(self) -> None:
        self.selector = selectors.EpollSelector()

    def unwatch(self, fd: int) -> None:
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(fd)


def ghost(watch) -> list[int]:
    """Watch a session's socket, let a 'worker' keep a copy, break and close it the way libpq
    does, give its number to a new quiet channel, and list what epoll then says is readable."""
    loop = Loop()
    session, server = socket.socketpair()
    worker_copy = os.dup(session.fileno())  # what a fork leaves in a worker
    number = session.fileno()
    watched = watch(loop, number)
    server.close()  # the server ends the session: the socket is hung up
    session.close()  # libpq drops it; the loop has not unwatched it yet
    quiet, peer = socket.socketpair()  # the next worker's channel takes the number
    try:
        if quiet.fileno() != number:
            os.dup2(quiet.fileno(), number)
            quiet.close()
            quiet = socket.socket(fileno=number)
        if watched == number:  # the socket itself was watched: only its number is left
            loop.unwatch(watched)
        else:
            Supervisor.unwatch_session(loop, watched)
        loop.selector.register(number, selectors.EVENT_READ, "child")
        return [key.fd for key, _ in loop.selector.select(0)]
    finally:
        quiet.close()
        peer.close()
        os.close(worker_copy)
        loop.selector.close()


def test_a_broken_session_watched_through_its_own_descriptor_leaves_no_ghost():
    assert ghost(lambda loop, fd: Supervisor.watch_session(loop, fd, "dispatch")) == []


def test_the_socket_watched_itself_left_one_the_loop_would_spin_on():
    """What the loop did before: the check above can tell the two apart."""

    def register(loop: Loop, fd: int) -> int:
        loop.selector.register(fd, selectors.EVENT_READ, "dispatch")
        return fd

    assert ghost(register) != []
