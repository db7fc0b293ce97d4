"""What the supervisor reads of a worker's process to vouch for it (supervisor/processes.py)."""

from __future__ import annotations

import builtins
import os

from cyclone.supervisor import processes


def test_a_running_process_reads_as_running_with_its_cpu_time() -> None:
    state, cpu = processes.proc_state(os.getpid())
    assert state == "R" and cpu >= 0
    assert processes.proc_state(2**22 + 12345) is None  # beyond pid_max: gone


def test_without_proc_a_live_process_reads_as_running(monkeypatch) -> None:
    def no_proc(path, *args, **kwargs):
        raise FileNotFoundError(path)

    monkeypatch.setattr(processes, "_HAS_PROC", False)
    monkeypatch.setattr(builtins, "open", no_proc)
    assert processes.proc_state(os.getpid()) == ("R", 0)
    assert processes.proc_state(2**22 + 12345) is None
