"""Fakes of the supervisor's ports, and the harness that drives an arbiter with them.

The arbiter's decisions are tested without processes, a database or real time: `FakeOps`
spawns nothing and records signals, `FakeStore` records what would be written, `FakeClock`
moves only when told, and `Harness` wires them to an `Arbiter` and plays a child's messages.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from cyclone.child import channel
from cyclone.states import ErrorKind
from cyclone.supervisor.arbiter import Arbiter, ArbiterConfig
from cyclone.supervisor.children import ExitStatus
from cyclone.supervisor.processes import ChildMain


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class FakeOps:
    def __init__(self) -> None:
        self.next_pid = 100
        self.spawned: list[int] = []
        self.sent: list[tuple[str, int, int]] = []
        self.exits: list[tuple[int, ExitStatus]] = []
        self.pipes: dict[int, list[bytes]] = {}
        self.closed: list[int] = []
        self.fail_fork = False
        # What /proc says of each pid (state letter, CPU ticks); running, by default.
        self.states: dict[int, tuple[str, int] | None] = {}

    def spawn(self, main: ChildMain, *, close_fds: Sequence[int]) -> tuple[int, int]:
        if self.fail_fork:
            raise BlockingIOError("fork: resource temporarily unavailable")
        self.next_pid += 1
        self.spawned.append(self.next_pid)
        fd = self.next_pid + 1000
        self.pipes[fd] = []
        return self.next_pid, fd

    def signal(self, pid: int, sig: int) -> None:
        self.sent.append(("pid", pid, sig))

    def signal_group(self, pgid: int, sig: int) -> None:
        self.sent.append(("group", pgid, sig))

    def reap(self) -> list[tuple[int, ExitStatus]]:
        found, self.exits = self.exits, []
        return found

    def read(self, fd: int) -> bytes | None:
        queue = self.pipes.get(fd)
        return queue.pop(0) if queue else None

    def close(self, fd: int) -> None:
        self.closed.append(fd)

    def state(self, pid: int) -> tuple[str, int] | None:
        return self.states.get(pid, ("R", 0))

    def signals_to(self, pid: int) -> list[tuple[str, int]]:
        return [(kind, sig) for kind, target, sig in self.sent if target == pid]


class FakeStore:
    def __init__(self) -> None:
        self.failed: list[tuple[int, str, ErrorKind, str]] = []
        self.revocations: dict[int, str | None] = {}
        self.revoked_calls = 0
        self.swept = 0
        self.sweep_revokes: dict[int, str | None] = {}
        self.released: list[tuple[int, str]] = []

    def revoked(self, held: Mapping[int, str]) -> dict[int, str | None]:
        self.revoked_calls += 1
        return {k: v for k, v in self.revocations.items() if k in held}

    def fail_step(self, step_id: int, token: str, kind: ErrorKind, error: str) -> bool:
        self.failed.append((step_id, token, kind, error))
        return True

    def sweep_deadlines(self) -> int:
        self.swept += 1
        self.revocations.update(self.sweep_revokes)
        return len(self.sweep_revokes)

    def release_step(self, step_id: int, token: str) -> bool:
        self.released.append((step_id, token))
        return True


class FakeRenewer:
    """The renewal session: records each statement; the test answers it (`Harness.renewed`)."""

    def __init__(self) -> None:
        self.sent: list[list[tuple[int, str]]] = []
        self.in_flight = False
        self.fail: Exception | None = None

    def send(self, leases: list[tuple[int, str]]) -> None:
        if self.fail is not None:
            raise self.fail
        self.sent.append(leases)
        self.in_flight = True

    def close(self) -> None:
        self.in_flight = False


class FakeFactory:
    def worker_main(self, number: int, slot: int | None = None) -> ChildMain:
        return lambda fd: 0

    def scanner_main(self) -> ChildMain:
        return lambda fd: 0


def tok(step_id: int) -> str:
    """The lease token the harness's leases carry: a UUID, as the channel requires."""
    return f"00000000-0000-4000-8000-{step_id:012d}"


CONFIG = ArbiterConfig(
    workers=2, kill_grace=0.5, shutdown_timeout=5.0, lease_ttl=10.0, poll_interval=1.0,
    scanner=True, heartbeat_interval=2.0,
)  # fmt: skip


class Harness:
    def __init__(self, config: ArbiterConfig = CONFIG) -> None:
        self.clock = FakeClock()
        self.ops = FakeOps()
        self.store = FakeStore()
        self.renewer = FakeRenewer()
        self.reloaded: list[ArbiterConfig] = []
        self.arbiter = Arbiter(
            config, ops=self.ops, clock=self.clock, store=self.store, factory=FakeFactory(),
            reload=self.reload, renewer=self.renewer,
        )  # fmt: skip
        self.next_config = config

    def reload(self) -> tuple[ArbiterConfig, FakeFactory]:
        self.reloaded.append(self.next_config)
        return self.next_config, FakeFactory()

    def workers(self) -> list[int]:
        return [h.pid for h in self.arbiter.workers()]

    def send(self, pid: int, message: channel.Message) -> None:
        handle = self.arbiter.children[pid]
        self.ops.pipes[handle.fd].append(channel.encode(message))
        self.arbiter.on_readable(handle.fd)

    def boot(self, pid: int) -> None:
        self.send(pid, channel.Ready())

    def lease(self, pid: int, step_id: int = 7, kill_after: float | None = 2.0,
              deadline_left: float | None = None, since: float | None = None) -> None:  # fmt: skip
        self.send(pid, channel.Leased(
            step_id=step_id, token=tok(step_id), run_id="r1", workflow="wf", node="n",
            attempt=1, kill_after=kill_after, deadline_left=deadline_left, since=since,
        ))  # fmt: skip

    def renewed(self, *step_ids: int) -> None:
        """The renewal statement in flight answers: these leases were renewed."""
        self.renewer.in_flight = False
        self.arbiter.renewed(set(step_ids))

    def exit(self, pid: int, status: ExitStatus) -> None:
        self.ops.exits.append((pid, status))
        self.arbiter.tick()

    def leave(self, pid: int, code: int) -> None:
        """The child's own exit, announced as `channel.leave` does, then reaped."""
        self.send(pid, channel.Exit(code=code))
        self.exit(pid, ExitStatus(code=code))

    def started(self) -> list[int]:
        self.arbiter.start()
        pids = self.workers()
        for pid in list(self.arbiter.children):
            self.boot(pid)
        return pids
