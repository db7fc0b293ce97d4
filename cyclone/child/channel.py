"""The worker-supervisor channel: one line per message, and the exit codes a child leaves with.

A line is a verb, optionally followed by a space and a JSON object:

    ready
    leased {"step_id": 7, "token": "...", "run_id": "...", "workflow": "fulfill-order",
            "node": "reserve", "attempt": 2, "kill_after": 30.0, "deadline_left": 1795.2,
            "since": 81234.5}
    done {"step_id": 7, "outcome": "failed", "duration": 0.012, "error": "ConnectionError: ...",
          "retry": true, "token": "..."}
    idle                              (or, giving back a lease never started:)
    idle {"step_id": 8, "token": "..."}
    scanned {"at": 1767225600.5, "ok": true, "counts": {"deadlines": 1, "expired_leases": 0}}
    want {"lease": true, "duration": 0.004, "finished": {"step_id": 7, "token": "...", ...}}
    took {"step_id": 9, "token": "...", "at": 81234.7, "duration": 0.004, "finished": {...}}
    exit {"code": 4}

and, the other way, the supervisor's answer to a `want`, the leases it queues in a worker's
name, and a queued lease taken back (see cyclone/supervisor/dispatch.py):

    given {"recorded": true, "since": 81234.6, "lease": {"id": 8, "lease_token": "...", ...}}
    queued {"since": 81234.6, "until": 81234.85, "lease": {"id": 9, "lease_token": "...", ...}}
    drop {"step_id": 9, "token": "..."}

Times are durations read from the database clock (`kill_after`, `deadline_left`, seconds from
the lease), which the supervisor adds to its own monotonic clock: wall clocks of different hosts
and the database are never compared. `since` is a time on the host's monotonic clock, which a
worker shares with its supervisor (CLOCK_MONOTONIC is one clock for the whole host). The
channel is a socket pair; a worker's threads write whole lines under one lock, so lines from one
worker never interleave.

A worker's lines are not trusted (its handler can write to the socket too): `decode` checks
every field's type and range, and the supervisor kills a worker that writes anything that is
not a message, or floods its channel (Arbiter.read_channel).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import mmap
import os
import re
import select
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields
from enum import IntEnum
from typing import Any, ClassVar, NoReturn

from cyclone import codec
from cyclone.frozen import quick_init

# A longer line from a worker is garbage (or an attack on the supervisor's memory): it is
# dropped. A finished step whose output would make a longer `want` line is recorded by its
# worker instead.
MAX_LINE = 65536


class ExitCode(IntEnum):
    """How a child process leaves (always through os._exit); part of the protocol."""

    OK = 0  # asked to stop and stopped, or drained
    CRASHED = 1  # an unexpected exception escaped the child's loop
    BOOT_ERROR = 3  # could not start (no database): the supervisor backs off, then halts
    LEASE_LOST = 4  # could not renew its lease in time: it stopped acting on stale authority
    RECYCLE = 5  # ran max_steps_per_worker steps and wants a fresh process
    STOPPED = 6  # left its step when asked (SIGTERM); the supervisor records the outcome
    ORPHANED = 7  # its supervisor is gone


def leave(code: int) -> NoReturn:
    """End a child now, from any of its threads, without running what belongs to the parent
    (atexit handlers, finalizers: rq's work horse does the same); whatever the child's main
    thread was running dies with it. The child says so first (`exit`), so that the supervisor
    can tell this exit from a handler's own `os._exit`."""
    with contextlib.suppress(Exception):  # saying it is a courtesy; leaving is not
        # Only a channel this process opened: a forked child inherits its parent's reference
        # (in tests, a channel long closed, whose fd number may be another file by now).
        if _opened is not None and _opened.pid == os.getpid():
            _opened.say_exit(code)
    try:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


@dataclass(frozen=True, slots=True)
class Ready:
    verb: ClassVar[str] = "ready"


@quick_init
@dataclass(frozen=True, slots=True)
class Leased:
    verb: ClassVar[str] = "leased"
    step_id: int
    token: str
    run_id: str
    workflow: str
    node: str
    attempt: int
    # Seconds until the attempt must be dead (the smaller of its timeout and its run's time
    # left), and the run's time left alone; None: unbounded.
    kill_after: float | None
    deadline_left: float | None
    # When the statement that took the lease was sent, on the host's monotonic clock (which
    # worker and supervisor share): the database's lease runs from no earlier than this.
    since: float | None = None
    # A map item's index (its log lines name it); None for any other step.
    item: int | None = None


EXPANDED = "expanded"  # Done.outcome of a map's row that made its items


@quick_init
@dataclass(frozen=True, slots=True)
class Done:
    verb: ClassVar[str] = "done"
    step_id: int
    # "completed", "failed", "lost" (the fenced write matched nothing), or "expanded": a map's
    # row that evaluated its items (no step of its own: neither counted nor timed as one).
    outcome: str
    duration: float
    # A failure's first line, cut to ERROR_CHARS (the whole text is in the database), and
    # whether the worker expects a retry: both only for the supervisor's log.
    error: str | None = None
    retry: bool | None = None
    # The lease's token: a `done` clears the supervisor's record of a lease only when it names
    # the step and its token, so a line a handler forges cannot switch its timeout off.
    token: str | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Scanned:
    """The scanner finished a pass: rows changed by each sweep, and when (wall clock, for the
    `cyclone_scanner_last_scan_timestamp_seconds` gauge). `ok` is false when the database
    went away mid-pass."""

    verb: ClassVar[str] = "scanned"
    at: float
    ok: bool
    counts: dict[str, int]


@quick_init
@dataclass(frozen=True, slots=True)
class Idle:
    """The worker holds no step. Naming a step and its token, it gives back that lease (one
    the supervisor took for it and it never started); a bare `idle` clears no lease."""

    verb: ClassVar[str] = "idle"
    step_id: int | None = None
    token: str | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Want:
    """A worker waits for its next step (`lease` false: for the answer only, it is leaving),
    having finished the task in `finished` (a dispatch.Finished's fields, `duration` long), if
    any, for the supervisor to record. `park`: it found no step last time; the supervisor
    keeps the want until a step is ready for it (or it stops), instead of answering none."""

    verb: ClassVar[str] = "want"
    lease: bool = True
    duration: float | None = None
    finished: dict[str, Any] | None = None
    park: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class Given:
    """The supervisor's answer to a `want`: whether the finished step was recorded (None: not
    tried, the worker records it itself), and the lease taken for the worker (a row of
    steps_dispatch, sent at `since`), if any. `own`: the supervisor cannot lease for now
    (its database session failed): the worker leases for itself until told otherwise.
    `taken`: the supervisor answered at once with a lease it held ready, and records the
    finished step itself afterwards (`recorded` is then None, and not the worker's to act on)."""

    verb: ClassVar[str] = "given"
    recorded: bool | None = None
    lease: dict[str, Any] | None = None
    since: float | None = None
    own: bool = False
    taken: bool = False


@quick_init
@dataclass(frozen=True, slots=True)
class Took:
    """The worker started a lease from its queue (`Queued`) at `at` (the host's monotonic
    clock), having finished the task in `finished` (a dispatch.Finished's fields, `duration`
    long), if any, for the supervisor to record with its next statement. Without `finished`,
    the step before was reported by a `done` line of its own (written just before), or there
    was none. The worker wrote this line before it checked that the lease was still young
    (`Queued.until`): one that was not, it gives back at once (`idle`)."""

    verb: ClassVar[str] = "took"
    step_id: int
    token: str
    at: float
    duration: float | None = None
    finished: dict[str, Any] | None = None


@quick_init
@dataclass(frozen=True, slots=True)
class Queued:
    """A lease the supervisor took in this worker's name (a row of steps_dispatch, its
    statement sent at `since`): the worker starts it once it finishes what it runs, if that is
    no later than `until` (the host's monotonic clock); later, it is no longer the worker's."""

    verb: ClassVar[str] = "queued"
    lease: dict[str, Any]
    since: float
    until: float


@quick_init
@dataclass(frozen=True, slots=True)
class Drop:
    """A queued lease the worker must not start (its run was cancelled, or failed)."""

    verb: ClassVar[str] = "drop"
    step_id: int
    token: str


@quick_init
@dataclass(frozen=True, slots=True)
class Exit:
    """The child leaves with `code`, by its own decision (`leave`). An exit status that no
    such line announced came from code the child ran: a handler's `os._exit`."""

    verb: ClassVar[str] = "exit"
    code: int


Message = Ready | Leased | Done | Idle | Scanned | Want | Given | Took | Queued | Drop | Exit
_BY_VERB: dict[str, type[Any]] = {
    cls.verb: cls
    for cls in (Ready, Leased, Done, Idle, Scanned, Want, Given, Took, Queued, Drop, Exit)
}
# The lines only a supervisor sends: one from a worker is a bad message.
SUPERVISORS = (Given, Queued, Drop)
# How much of a failure's text travels in a `done` line: with JSON's \uXXXX escapes, even the
# worst case stays far below MAX_LINE.
ERROR_CHARS = 200


def first_line(error: str | None) -> str | None:
    if not error:
        return None
    line = error.strip().splitlines()[0] if error.strip() else ""
    return line if len(line) <= ERROR_CHARS else line[: ERROR_CHARS - 3] + "..."


class ProtocolError(ValueError):
    """A line that is not a message."""


def _names(cls: type[Any]) -> tuple[str, ...]:
    names = _FIELDS.get(cls)
    if names is None:
        names = _FIELDS[cls] = tuple(f.name for f in fields(cls))
    return names


# Field names per message class, looked up once: encoding and decoding are on every step's path.
_FIELDS: dict[type[Any], tuple[str, ...]] = {}


# Built once: encoding and decoding are on every step's path, at both ends of the pipe.
_ENCODER = json.JSONEncoder(separators=(",", ":"))
_DECODER = json.JSONDecoder()


def encode(message: Message) -> bytes:
    fast = _FAST.get(type(message))
    if fast is not None:
        line = fast(message)
    else:
        # Flat messages: a dict of the fields, without asdict's deep copy.
        data = {name: getattr(message, name) for name in _names(type(message))}
        body = _ENCODER.encode(data) if data else ""
        line = f"{message.verb} {body}".rstrip() + "\n"
    raw = line.encode()
    if len(raw) > MAX_LINE:
        raise ProtocolError(f"{message.verb} message is {len(raw)} bytes, over {MAX_LINE}")
    return raw


# The two messages of every step, written out by hand: the same bytes as the generic path
# above (a test holds them to it), without building a dict for the JSON encoder, which was the
# largest part of what the worker adds to the engine's own loop (see bench/README.md,
# "Figures behind the code's comments").
def _str(value: str | None) -> str:
    if value is None:
        return "null"
    # Nothing in it that JSON escapes (checked by str methods: a regex cost three times more).
    if value.isascii() and value.isprintable() and '"' not in value and "\\" not in value:
        return f'"{value}"'
    return _ENCODER.encode(value)


def _num(value: float | None) -> str:
    if value is None:
        return "null"
    return repr(value) if math.isfinite(value) else _ENCODER.encode(value)


def _bool(value: bool | None) -> str:
    return "null" if value is None else ("true" if value else "false")


def _encode_leased(m: Leased) -> str:
    return (
        f'leased {{"step_id":{m.step_id},"token":{_str(m.token)},"run_id":{_str(m.run_id)},'
        f'"workflow":{_str(m.workflow)},"node":{_str(m.node)},"attempt":{m.attempt},'
        f'"kill_after":{_num(m.kill_after)},"deadline_left":{_num(m.deadline_left)},'
        f'"since":{_num(m.since)},"item":{_num(m.item)}}}\n'
    )


def _encode_done(m: Done) -> str:
    return (
        f'done {{"step_id":{m.step_id},"outcome":{_str(m.outcome)},"duration":{_num(m.duration)},'
        f'"error":{_str(m.error)},"retry":{_bool(m.retry)},"token":{_str(m.token)}}}\n'
    )


_FAST: dict[type[Any], Callable[[Any], str]] = {Leased: _encode_leased, Done: _encode_done}


def decode(line: bytes) -> Message:
    """The message a line holds, its fields of the types they are read as (see _KINDS): a line
    that is anything else is a ProtocolError, whatever its bytes, so the code acting on a
    message never meets a field of the wrong type (a worker's line is not trusted)."""
    text = line.decode("utf-8", "replace").strip()
    verb, _, body = text.partition(" ")
    cls = _BY_VERB.get(verb)
    if cls is None:
        raise ProtocolError(f"unknown verb {verb!r}")
    try:
        data = codec.loads(body) if body else {}
        if not isinstance(data, dict):
            raise ProtocolError(f"bad {verb} message: not a JSON object")
        # Fields this version does not know are left out: a newer peer's, or garbage.
        if not _NAME_SETS[cls].issuperset(data):
            names = _names(cls)
            data = {k: v for k, v in data.items() if k in names}
        for name, kind in _KINDS[cls].items():
            if name in data and not kind(data[name]):
                raise ProtocolError(f"bad {verb} message: {name} is {_shown(data[name])}")
        return cls(**data)
    # RecursionError: JSON nested deeper than the decoder's stack allows.
    except (ValueError, TypeError, AttributeError, RecursionError) as exc:
        if isinstance(exc, ProtocolError):
            raise
        raise ProtocolError(f"bad {verb} message: {exc}") from None


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# What each field of a message may hold, as decoded from JSON. Ids are positive bigints, as in
# the database; numbers are finite (a NaN timeout would never fire); lease tokens and a finished
# task's run id are UUIDs, as the statements that take them in arrays read them: one worker's
# malformed token must not fail the renewal or revocation statement of every worker.
def _is_id(v: Any) -> bool:
    return type(v) is int and 0 < v < 2**63


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v < 2**31


def _is_num(v: Any) -> bool:
    return type(v) in (int, float) and math.isfinite(v)


def _is_text(v: Any) -> bool:
    return type(v) is str


def _is_flag(v: Any) -> bool:
    return type(v) is bool


def _maybe(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    inline = _MAYBE.get(check)
    return inline if inline is not None else lambda v: v is None or check(v)


def _is_object(v: Any) -> bool:
    return type(v) is dict


def _is_uuid(v: Any) -> bool:
    return type(v) is str and _UUID.fullmatch(v) is not None


_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")


def _is_counts(v: Any) -> bool:
    return type(v) is dict and all(type(k) is str and _is_count(n) for k, n in v.items())


_FINISHED = frozenset({"step_id", "token", "run_id", "output", "next", "last", "slot"})


def _is_finished(v: Any) -> bool:
    """A dispatch.Finished's fields (see Worker.hand_over), as the dispatcher reads them. A
    `slot` is an `integer` column's value: a larger one would fail the whole statement."""
    return (
        type(v) is dict and _FINISHED.issuperset(v)
        and _is_id(v.get("step_id")) and _is_uuid(v.get("token")) and _is_uuid(v.get("run_id"))
        and "output" in v and type(v.get("next")) in (list, type(None))
        and type(v.get("last", False)) is bool
        and (v.get("slot") is None or (type(v["slot"]) is int and 0 < v["slot"] < 2**31))
    )  # fmt: skip


# The same checks as _maybe(check) makes them, one call each instead of two: every line of a
# step is checked field by field.
_MAYBE: dict[Callable[[Any], bool], Callable[[Any], bool]] = {
    _is_num: lambda v: v is None or (type(v) in (int, float) and math.isfinite(v)),
    _is_flag: lambda v: v is None or type(v) is bool,
    _is_object: lambda v: v is None or type(v) is dict,
    _is_text: lambda v: v is None or type(v) is str,
}

_KINDS: dict[type[Any], dict[str, Callable[[Any], bool]]] = {
    Ready: {},
    Leased: {
        "step_id": _is_id, "token": _is_uuid, "run_id": _is_text, "workflow": _is_text,
        "node": _is_text, "attempt": _is_count, "kill_after": _maybe(_is_num),
        "deadline_left": _maybe(_is_num), "since": _maybe(_is_num), "item": _maybe(_is_count),
    },
    Done: {
        "step_id": _is_id, "outcome": _is_text, "duration": _is_num, "error": _maybe(_is_text),
        "retry": _maybe(_is_flag), "token": _maybe(_is_uuid),
    },
    Idle: {"step_id": _maybe(_is_id), "token": _maybe(_is_uuid)},
    Scanned: {"at": _is_num, "ok": _is_flag, "counts": _is_counts},
    Want: {
        "lease": _is_flag, "duration": _maybe(_is_num), "finished": _maybe(_is_finished),
        "park": _is_flag,
    },
    Given: {
        "recorded": _maybe(_is_flag), "lease": _maybe(_is_object), "since": _maybe(_is_num),
        "own": _is_flag, "taken": _is_flag,
    },
    Took: {
        "step_id": _is_id, "token": _is_uuid, "at": _is_num, "duration": _maybe(_is_num),
        "finished": _maybe(_is_finished),
    },
    Queued: {"lease": _is_object, "since": _is_num, "until": _is_num},
    Drop: {"step_id": _is_id, "token": _is_uuid},
    Exit: {"code": lambda v: type(v) is int and 0 <= v < 256},
}  # fmt: skip


# The fields each message may carry, to tell at once a line with none other (all of them).
_NAME_SETS: dict[type[Any], frozenset[str]] = {
    cls: frozenset(_names(cls)) for cls in _BY_VERB.values()
}


class LineBuffer:
    """Collects bytes read from a pipe and hands out whole lines."""

    def __init__(self, max_line: int = MAX_LINE) -> None:
        self._pending = b""
        self.max_line = max_line
        self.dropped = 0  # lines longer than max_line, left out (the reader decides what it means)

    def feed(self, data: bytes) -> list[bytes]:
        if self._pending:
            data = self._pending + data
        lines = data.split(b"\n")
        self._pending = lines.pop()
        whole = len(data) - len(self._pending)  # the whole lines' bytes, newlines included
        if len(self._pending) > self.max_line:
            self._pending = b""
            self.dropped += 1
        if whole <= self.max_line:  # none of them can be too long: no length to check
            return [line for line in lines if line]
        kept = [line for line in lines if line and len(line) <= self.max_line]
        self.dropped += sum(1 for line in lines if len(line) > self.max_line)
        return kept


# How much of the supervisor's lines one read takes (a large input arrives in several).
READ_SIZE = 1 << 20

# The child's channel once opened: `leave` announces the exit on it.
_opened: Channel | None = None


class Channel:
    """The worker's end of the channel. A supervisor that is gone raises a ConnectionError
    (a broken pipe, or a reset when it died with lines of ours unread)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._lock = threading.Lock()  # one line at a time, whichever thread writes
        # The supervisor's lines carry a step's input: no bound but the supervisor's own.
        self._incoming = LineBuffer(max_line=1 << 40)
        self._received: list[bytes] = []
        # Anonymous memory: its pages are taken only as lines fill them (a bytearray would be
        # zeroed, all of it, at once).
        self._buffer = mmap.mmap(-1, READ_SIZE)
        self._view = memoryview(self._buffer)
        self._timed = True  # reads wait on the socket's own timeout, set to _timeout (seconds)
        self._timeout = 0.0
        # For reads that do not wait (`poll`): a socket object on a copy of the descriptor
        # (closing it closes the copy only); False when the channel is no socket (a pipe).
        self._nowait: socket.socket | bool | None = None
        self.pid = os.getpid()
        global _opened
        _opened = self

    def say_exit(self, code: int, wait: float = 0.2) -> None:
        """Best effort, from any thread or a signal handler, as the child leaves: the line is
        skipped when the lock stays taken (the thread holding it may be the one interrupted,
        or stuck on a full socket). Without it, the supervisor takes an exit mid-step for the
        handler's."""
        if not self._lock.acquire(timeout=wait):
            return
        try:
            os.write(self.fd, b'exit {"code":%d}\n' % int(code))
        except OSError:
            pass  # the supervisor is gone: nobody to tell
        finally:
            self._lock.release()

    def send(self, *messages: Message) -> None:
        """Write the messages' lines in one write: the supervisor wakes once for all of them."""
        self.send_raw(b"".join([encode(m) for m in messages]))

    def send_raw(self, data: bytes) -> None:
        with self._lock:
            while data:
                written = os.write(self.fd, data)
                data = data[written:]

    def receive(self, timeout: float) -> Message | None:
        """The supervisor's next line, waiting at most `timeout`; EOFError once it is gone."""
        if not self._received:
            size = self._read(timeout)
            if size is None:
                return None
            if not size:
                raise EOFError("the supervisor closed the channel")
            self._received = self._incoming.feed(self._view[:size].tobytes())
            if not self._received:
                return None
        return decode(self._received.pop(0))

    def poll(self) -> list[Message]:
        """The supervisor's lines that came already, without waiting: one system call when
        none did (a receive that does not block). EOFError once the supervisor is gone."""
        lines, self._received = self._received, []
        while True:
            size = self._read_now()
            if size is None:
                break
            if not size:
                raise EOFError("the supervisor closed the channel")
            lines += self._incoming.feed(self._view[:size].tobytes())
            if size < READ_SIZE:
                break  # what was there is read; a line still coming is read next time
        return [decode(line) for line in lines]

    def _read_now(self) -> int | None:
        sock = self._nowait
        if sock is None:
            copy = os.dup(self.fd)
            try:
                sock = self._nowait = socket.socket(fileno=copy)
            except OSError:
                os.close(copy)
                sock = self._nowait = False
        if sock is False:
            if not select.select([self.fd], [], [], 0)[0]:
                return None
            return os.readv(self.fd, [self._buffer])
        try:
            return sock.recv_into(self._buffer, READ_SIZE, socket.MSG_DONTWAIT)  # type: ignore[union-attr]
        except BlockingIOError:
            return None

    def _read(self, timeout: float) -> int | None:
        """Read what came into the buffer, waiting at most `timeout`: how many bytes (0: the
        supervisor is gone), or None when nothing came.

        Into a buffer made once: os.read(fd, 1 MiB) has the allocator map a fresh MiB, shrink
        it and unmap it for every line. One system call: a blocking read that the socket's
        receive timeout (SO_RCVTIMEO) ends, where a select before every read made two. A
        channel that is no socket (a pipe, in tests), or does not block, is waited on with
        select (a read that does not block would return at once, and the caller spin)."""
        if self._timed and timeout > 0:
            if timeout != self._timeout:
                self._set_timeout(timeout)
            if self._timed:
                start = time.monotonic()
                try:
                    return os.readv(self.fd, [self._buffer])
                except BlockingIOError:
                    waited = time.monotonic() - start
                    if waited >= timeout / 2:
                        return None
                    self._timed = False  # it does not block: select from now on
                    timeout -= waited
        ready, _, _ = select.select([self.fd], [], [], max(timeout, 0.0))
        if not ready:
            return None
        return os.readv(self.fd, [self._buffer])

    def _set_timeout(self, timeout: float) -> None:
        try:
            sock = socket.socket(fileno=self.fd)  # borrowed: detached below, never closed
        except OSError:
            self._timed = False
            return
        try:
            whole = int(timeout)
            sock.setsockopt(
                socket.SOL_SOCKET, socket.SO_RCVTIMEO,
                struct.pack("@ll", whole, max(1, int((timeout - whole) * 1e6))),
            )  # fmt: skip
            self._timeout = timeout
        except OSError:
            self._timed = False
        finally:
            sock.detach()
