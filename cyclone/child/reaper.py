"""Ending every process a step started, daemons included.

Killing a worker's process group misses what a handler moved out of it (`setsid`,
`setpgid`, a double fork): such a process was re-parented to PID 1 and outlived its step.
Linux's child subreaper (PR_SET_CHILD_SUBREAPER) keeps them in reach instead: an orphan goes
to its nearest subreaper ancestor rather than to PID 1.

- A worker is a subreaper, so what its handler daemonises stays its descendant while it
  lives, and it ends them all when the step ends (`end_leftovers`).
- The supervisor is a subreaper, so when a worker dies (killed for a timeout, say) its
  descendants come to the supervisor, which kills every child it did not fork
  (`kill_strays`) each time it reaps.

The process tree is read from /proc/PID/stat (this kernel may lack /proc/PID/task/*/children).
Off Linux nothing here does anything: the process-group kill is all there is.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import sys
import time
from collections.abc import Collection

log = logging.getLogger(__name__)

PR_SET_CHILD_SUBREAPER = 36
# How long a worker waits for the processes it killed to be reaped before it goes on; one
# stuck in the kernel (an NFS read) stays a zombie until the next step's end reaps it.
REAP_WAIT = 1.0
# Rounds of kill-and-look: a process may fork between the look and the kill, and its child
# is then found by the next look (a SIGKILLed process forks no more).
ROUNDS = 5


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children; False where unsupported."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def parents() -> dict[int, int]:
    """pid -> parent pid, for every process in /proc (zombies included)."""
    found = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for name in entries:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as fp:
                text = fp.read()
        except OSError:
            continue  # gone meanwhile
        ppid = ppid_of(text)
        if ppid is not None:
            found[int(name)] = ppid
    return found


def ppid_of(stat: bytes) -> int | None:
    """The parent pid in a /proc/PID/stat line: `pid (comm) state ppid ...`. The command may
    hold anything, spaces and ")" too, so the fields are counted after its last ")"."""
    fields = stat.rsplit(b")", 1)[-1].split()
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else None


def descendants(of: int, tree: dict[int, int], skip: Collection[int] = ()) -> list[int]:
    """Every process below `of` in `tree` (pid -> ppid), leaving out `skip` and theirs."""
    below: dict[int, list[int]] = {}
    for pid, ppid in tree.items():
        below.setdefault(ppid, []).append(pid)
    found, todo = [], [pid for pid in below.get(of, []) if pid not in skip]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo.extend(below.get(pid, []))
    return found


def _kill(pids: list[int], tree: dict[int, int]) -> list[int]:
    """SIGKILL `pids`, each only if it is still the process the `tree` snapshot saw: a pid
    freed and reused since (a grandchild reaped by its own parent) must not be signalled. A
    pidfd pins the process; its parent, read after, must be the one seen or us (re-parented
    to this subreaper meanwhile). Returns the pids signalled."""
    me, hit = os.getpid(), []
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        except (AttributeError, OSError):  # no pidfd (before Linux 5.3): the plain kill
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
                hit.append(pid)
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as fp:
                stat = fp.read()
            if stat.rsplit(b")", 1)[-1].split()[:1] == [b"Z"]:
                continue  # dead already: only reaping is left, and counts as no kill
            if ppid_of(stat) in (tree.get(pid), me):
                signal.pidfd_send_signal(fd, signal.SIGKILL)
                hit.append(pid)
        except (OSError, ProcessLookupError):
            pass  # gone meanwhile
        finally:
            os.close(fd)
    return hit


def kill_strays(spare: Collection[int]) -> list[int]:
    """SIGKILL every descendant of this process except `spare` (the children it forked on
    purpose) and theirs; returns the pids killed. Reaping them is the caller's waitpid."""
    tree = parents()
    pids = descendants(os.getpid(), tree, spare)
    return _kill(pids, tree) if pids else []


def has_children() -> bool:
    """Whether this process has any child, running or a zombie: one system call."""
    try:
        os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    except ChildProcessError:
        return False
    return True


def end_leftovers(reap_wait: float = REAP_WAIT) -> int:
    """Kill and reap everything below this process (a worker, between two steps): what a
    handler started must not outlive its step. Returns how many processes were killed."""
    if not has_children():
        return 0
    killed: set[int] = set()
    for _ in range(ROUNDS):
        tree = parents()
        pids = descendants(os.getpid(), tree)
        if not pids:
            break
        killed.update(_kill(pids, tree))
        _reap(time.monotonic() + reap_wait)
    if killed:
        log.warning(
            "killed %d process(es) the handler left running: %s", len(killed),
            ", ".join(map(str, sorted(killed))), extra={"action": "kill"},
        )  # fmt: skip
    return len(killed)


def _reap(deadline: float) -> None:
    """Reap this process's children until none is left or `deadline` passes. Between steps
    no handler code runs, so no Popen object of a handler waits for one of them."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            if time.monotonic() >= deadline:
                return
            time.sleep(0.005)  # SIGKILL lands within microseconds; a poll costs nothing
