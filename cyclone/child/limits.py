"""A worker's own resource limits, set after the fork so the supervisor stays unbounded."""

from __future__ import annotations

import resource


def limit_memory(max_bytes: int | None) -> None:
    """Cap what this process may allocate (`[worker] max_memory`), and what it starts.

    RLIMIT_DATA, not RLIMIT_AS: since Linux 4.7 it counts the heap and every private writable
    mapping (Python's large objects, thread stacks), while RLIMIT_AS also counts address space
    reserved but never used (glibc reserves 64 MiB per thread arena), which would fail a
    worker with a keeper thread long before it used its memory.
    """
    if max_bytes is None:
        return
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    if hard != resource.RLIM_INFINITY:
        max_bytes = min(max_bytes, hard)  # an unprivileged process cannot raise the hard one
    resource.setrlimit(resource.RLIMIT_DATA, (max_bytes, max_bytes))
