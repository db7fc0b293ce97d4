"""Limits on a node: `concurrency=N` (at most N of its steps hold a lease at once, across every
VM: a slot each, claimed by the lease) and `rate_limit` (one token of a PostgreSQL token bucket
per attempt). Steps short of a slot wait available, where only a lease of a node with a free
slot reads them; steps short of a token are held out of the lease indexes, and admitted as
tokens refill."""

from __future__ import annotations

import json
import time
import uuid
from datetime import datetime, timedelta

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)
from psycopg.conninfo import make_conninfo

import cyclone
from cyclone import engine, runner
from cyclone.db import connect
from cyclone.engine.dispatch import release
from cyclone.engine.dlq import retry_dead_step
from cyclone.engine.runs import submit_runs
from cyclone.engine.sweeps import sweep_held_steps
from cyclone.errors import GraphError
from cyclone.testing import TestEnv

narrow = cyclone.Workflow("nl-narrow")
mapped = cyclone.Workflow("nl-mapped")
mailer = cyclone.Workflow("nl-mailer")
tenants = cyclone.Workflow("nl-tenants")


@narrow.task(concurrency=2, max_attempts=3)
def only_two(ctx):
    return None


@mapped.map(items=lambda ctx: list(range(10)), concurrency=3)
def item(ctx):
    return ctx.item


@mailer.task(rate_limit="nl-smtp", max_attempts=3)
def send(ctx):
    return None


@tenants.task(rate_limit=cyclone.RateLimit("nl-api", key="tenant"))
def call(ctx):
    return None


wide = cyclone.Workflow("nl-wide")


@wide.task(concurrency=40)
def one_of_forty(ctx):
    return None


# Rate-limited roots (held until admitted with a token): one, and two whose steps a submit
# inserts interleaved, run by run.
wide_rate = cyclone.Workflow("nl-wide-rate")


@wide_rate.task(rate_limit="nl-unbound")
def one_of_many(ctx):
    return None


unlimited = cyclone.Workflow("nl-unlimited")


@unlimited.task()
def free_step(ctx):
    return None


pair = cyclone.Workflow("nl-pair")


@pair.task(rate_limit="nl-unbound")
def left(ctx):
    return None


@pair.task(rate_limit="nl-unbound")
def right(ctx):
    return None


def unbound(env: TestEnv) -> None:
    env.client.set_rate_limit("nl-unbound", rate=1e9, per=timedelta(seconds=1), burst=1e9)


ALL = [narrow, mapped, mailer, tenants, wide]


def lease(env: TestEnv, wf: cyclone.Workflow) -> engine.Lease | None:
    return engine.lease_step(env.conn, worker="nl", workflows=[wf.name], now=env.now())


def counts(env: TestEnv, wf: cyclone.Workflow) -> dict[str, int]:
    rows = env.conn.execute(
        "SELECT CASE WHEN held THEN 'held' ELSE state END AS s, count(*) AS n"
        " FROM cyclone_steps WHERE workflow = %s GROUP BY 1",
        (wf.name,),
    ).fetchall()
    return {r["s"]: r["n"] for r in rows}


def running_ids(env: TestEnv, wf: cyclone.Workflow) -> set[int]:
    rows = env.conn.execute(
        "SELECT id FROM cyclone_steps WHERE workflow = %s AND state = 'running'", (wf.name,)
    ).fetchall()
    return {r["id"] for r in rows}


def slot_holders(env: TestEnv, wf: cyclone.Workflow) -> set[int]:
    """The steps the node's slots say hold a lease (migration 33)."""
    rows = env.conn.execute(
        "SELECT step_id FROM cyclone_node_slots WHERE workflow = %s AND step_id IS NOT NULL",
        (wf.name,),
    ).fetchall()
    return {r["step_id"] for r in rows}


def test_at_most_n_steps_of_a_node_hold_a_lease(env: TestEnv):
    env.register(*ALL)
    runs = env.client.submit_many(narrow, [None] * 5)
    assert counts(env, narrow) == {"available": 5}  # nothing held for a slot
    first, second = lease(env, narrow), lease(env, narrow)
    assert first and second and lease(env, narrow) is None  # both slots taken
    assert slot_holders(env, narrow) == {first.step_id, second.step_id}
    assert engine.complete_step(env.conn, first, None)
    assert slot_holders(env, narrow) == {second.step_id}
    third = lease(env, narrow)
    assert third is not None and lease(env, narrow) is None
    # A retry lets its slot go, and waits for one like any other step.
    assert engine.fail_step(env.conn, second.step_id, second.token, kind="error", error="x")
    assert slot_holders(env, narrow) == {third.step_id}
    for run_id in runs:
        env.run_until_complete(run_id)
    assert counts(env, narrow) == {"completed": 5} and slot_holders(env, narrow) == set()


def test_every_end_of_a_lease_lets_its_slot_go(env: TestEnv):
    """Completed, failed for a retry, dead, given back by a planned stop, expired, cancelled:
    each end frees the slot in the statement that ends the lease."""
    env.register(*ALL, wide)
    runs = env.client.submit_many(wide, [None] * 8)
    taken = [lease(env, wide) for _ in range(6)]
    assert all(taken) and slot_holders(env, wide) == {t.step_id for t in taken if t}
    a, b, c, d, e, f = (t for t in taken if t)
    assert engine.complete_step(env.conn, a, None)
    assert engine.fail_step(env.conn, b.step_id, b.token, kind="error", error="x")
    assert engine.fail_step(env.conn, c.step_id, c.token, kind="error", error="x", retry=False)
    assert engine.release_step(env.conn, d.step_id, d.token)
    env.client.cancel(next(r for r in runs if r == e.run_id))
    assert slot_holders(env, wide) == {f.step_id}
    env.advance_time(timedelta(minutes=5))
    env.scan()  # f's lease expired
    assert slot_holders(env, wide) == set() and running_ids(env, wide) == set()


@pytest.mark.parametrize("told", [True, False], ids=["slot told back", "slot not told"])
def test_the_supervisors_statement_claims_and_lets_go_slots_for_all_its_steps_at_once(
    env: TestEnv, told: bool
):
    """steps_dispatch claims the slots of the steps it leases in one statement for each node,
    and lets go those of the steps it completes (migration 33): never more leases of the node
    than its limit, its slots held by exactly its running steps, to the last step. Each lease
    row names its slot; a completion that tells it back (as a worker's does, migration 34)
    and one that does not (a lease the worker took itself) both let it go."""
    from cyclone.engine.dispatch import Finished, dispatch

    env.register(*ALL)
    env.client.submit_many(wide, [None] * 200)
    finished: list[Finished] = []
    done = 0
    while True:
        result = dispatch(env.conn, finished, [f"nl:{i}" for i in range(30)],
                          workflows=[wide.name])  # fmt: skip
        done += len(result.completed)
        assert len(running_ids(env, wide)) <= 40
        assert slot_holders(env, wide) == running_ids(env, wide)
        if not result.leases:
            break
        rows = env.conn.execute(
            "SELECT step_id, slot FROM cyclone_node_slots WHERE step_id = ANY (%s)",
            ([r["id"] for r in result.leases.values()],),
        ).fetchall()
        assert {r["id"]: r["slot"] for r in result.leases.values()} == {
            r["step_id"]: r["slot"] for r in rows
        }
        finished = [Finished(r["id"], r["lease_token"], r["run_id"], None, last=True,
                             slot=r["slot"] if told else None)
                    for r in result.leases.values()]  # fmt: skip
    assert done == 200 and counts(env, wide) == {"completed": 200}
    assert slot_holders(env, wide) == set()


def test_the_plain_statement_leases_no_step_of_a_limited_node(env: TestEnv):
    """steps_dispatch_plain (a supervisor whose graphs limit no node) leases the other steps
    only: a step of a limited node leased there would hold no slot."""
    from cyclone.engine.dispatch import dispatch

    env.register(*ALL, unlimited)
    env.client.submit_many(wide, [None] * 3)
    free = env.client.submit(unlimited, None)
    names = [wide.name, unlimited.name]
    plain = dispatch(env.conn, [], ["nl:1", "nl:2"], workflows=names, limited=False)
    assert [r["run_id"] for r in plain.leases.values()] == [free]
    assert slot_holders(env, wide) == running_ids(env, wide) == set()
    both = dispatch(env.conn, [], ["nl:1", "nl:2"], workflows=names)
    assert len(both.leases) == 2 and len(slot_holders(env, wide)) == 2


def test_a_completion_that_tells_a_wrong_slot_lets_go_its_own_and_no_other(env: TestEnv):
    """The slot a completion tells back is let go only if its step holds it: another step's
    slot stays that step's, and the step's own is let go all the same (by the rules' trigger)."""
    from cyclone.engine.dispatch import Finished, dispatch

    env.register(*ALL)
    env.client.submit_many(wide, [None] * 3)
    result = dispatch(env.conn, [], ["nl:1", "nl:2"], workflows=[wide.name])
    first, second = sorted(result.leases.values(), key=lambda r: r["id"])
    assert first["slot"] != second["slot"] and None not in (first["slot"], second["slot"])
    wrong = Finished(first["id"], first["lease_token"], first["run_id"], None, last=True,
                     slot=second["slot"])  # fmt: skip
    after = dispatch(env.conn, [wrong], [], workflows=[wide.name])
    assert after.completed == {first["id"]}
    assert slot_holders(env, wide) == running_ids(env, wide) == {second["id"]}


@pytest.mark.parametrize("at_once", [1, 4])
def test_workers_draining_a_node_never_exceed_its_limit_nor_wait_for_a_sweep(
    env: TestEnv, at_once: int
):
    """No sweep runs here: a lease that found nothing while the node had a free slot and
    steps waiting would fail the drain."""
    env.register(*ALL)
    env.client.submit_many(wide, [None] * 300)
    done = 0
    while done < 300:
        taken = [lease(env, wide) for _ in range(at_once)]
        assert taken[0] is not None, counts(env, wide)
        assert len(running_ids(env, wide)) <= 40
        assert slot_holders(env, wide) == running_ids(env, wide)
        for one in filter(None, taken):
            assert engine.complete_step(env.conn, one, None)
            done += 1
    assert counts(env, wide) == {"completed": 300}


def test_a_node_with_every_slot_leased_holds_back_only_its_own_steps(env: TestEnv):
    """A full node's backlog is not what the lease reads: a step of another workflow behind it
    is leased, and the node's next step once a slot frees."""
    env.register(*ALL, chained)
    env.client.submit_many(narrow, [None] * 50)
    held = [lease(env, narrow), lease(env, narrow)]
    other = env.client.submit(chained, None)
    taken = engine.lease_step(env.conn, worker="nl", workflows=None, now=env.now())
    assert taken is not None and taken.run_id == other
    assert engine.lease_step(env.conn, worker="nl", workflows=None, now=env.now()) is None
    assert held[0] and engine.complete_step(env.conn, held[0], None)
    nxt = engine.lease_step(env.conn, worker="nl", workflows=None, now=env.now())
    assert nxt is not None and nxt.workflow == narrow.name


def test_a_lease_whose_slots_another_transaction_holds_takes_none_and_never_waits(
    env: TestEnv,
):
    """A claim skips the slots another transaction holds (a claim in flight): with none left,
    the step is not leased (nor left claimed), and the lease does not wait."""
    env.register(*ALL)
    env.client.submit_many(narrow, [None] * 3)
    with connect(env.dsn) as other, other.transaction():
        other.execute(
            "SELECT 1 FROM cyclone_node_slots WHERE workflow = %s AND slot = 1 FOR UPDATE",
            (narrow.name,),
        )
        env.conn.execute("SET lock_timeout = '2s'")
        first = lease(env, narrow)  # slot 2
        assert first is not None and lease(env, narrow) is None
        assert counts(env, narrow) == {"running": 1, "available": 2}
        assert slot_holders(env, narrow) == {first.step_id}
    env.conn.execute("RESET lock_timeout")
    assert lease(env, narrow) is not None


def test_a_slot_left_claimed_by_a_step_without_a_lease_is_let_go_by_the_sweep(env: TestEnv):
    """Every end of a lease frees its slot; a row changed some other way (triggers off) would
    keep it, and the held_steps sweep lets it go, by the step it read."""
    env.register(*ALL)
    env.client.submit_many(narrow, [None] * 3)
    first, second = lease(env, narrow), lease(env, narrow)
    assert first and second
    with env.conn.transaction():
        env.conn.execute("SET LOCAL session_replication_role = replica")
        env.conn.execute(
            "UPDATE cyclone_steps SET state = 'completed', completed_at = now(),"
            " lease_token = NULL, lease_expires_at = NULL WHERE id = %s", (first.step_id,)
        )
    assert slot_holders(env, narrow) == {first.step_id, second.step_id}
    assert lease(env, narrow) is None
    sweep_held_steps(env.conn, now=env.now())
    assert slot_holders(env, narrow) == {second.step_id}
    assert lease(env, narrow) is not None


def test_a_map_node_limit_bounds_its_items(env: TestEnv):
    env.register(*ALL)
    env.client.submit(mapped, None)
    fanout = lease(env, mapped)
    assert fanout is not None and engine.expand_map(env.conn, fanout, list(range(10)))
    assert counts(env, mapped) == {"available": 10}
    running = [lease(env, mapped) for _ in range(3)]
    assert all(running) and lease(env, mapped) is None
    for held_lease in running:
        assert held_lease and engine.complete_step(env.conn, held_lease, held_lease.item)
    env.run_until_idle()
    assert counts(env, mapped) == {"completed": 10}


def test_an_undeclared_limiter_holds_its_steps_until_it_is_set(env: TestEnv):
    env.register(*ALL)
    run_id = env.client.submit(mailer, None)
    env.run_until_idle()
    assert counts(env, mailer) == {"held": 1}
    env.client.set_rate_limit("nl-smtp", rate=10, per=timedelta(seconds=1), burst=10)
    env.run_until_complete(run_id)


def _lease_at(env: TestEnv, wf: cyclone.Workflow, at: datetime) -> engine.Lease | None:
    return engine.lease_step(env.conn, worker="nl", workflows=[wf.name], now=at)


def _available(env: TestEnv, wf: cyclone.Workflow, at: datetime) -> list[float]:
    """Seconds from `at` to each admitted, unstarted step's token (its available_at)."""
    rows = env.conn.execute(
        "SELECT extract(epoch FROM available_at - %s)::float8 AS wait FROM cyclone_steps"
        " WHERE workflow = %s AND state = 'available' ORDER BY available_at",
        (at, wf.name),
    ).fetchall()
    return [r["wait"] for r in rows]


def test_tokens_are_given_at_the_rate_and_a_step_short_of_one_waits_for_its_refill(
    env: TestEnv,
):
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=2, per=timedelta(seconds=1), burst=2)
    env.client.submit_many(mailer, [None] * 8)
    t0 = env.now()
    sweep_held_steps(env.conn, now=t0)
    # The two saved up, now; the bucket promises no more than its burst to steps not started.
    assert _available(env, mailer, t0) == [pytest.approx(0, abs=0.2)] * 2
    assert counts(env, mailer)["held"] == 6
    assert _lease_at(env, mailer, t0) and _lease_at(env, mailer, t0)
    assert _lease_at(env, mailer, t0) is None
    # Those two count as started 0.3 s after their lease (a handler may start that late): the
    # next tokens refill from then, one every half second, given ahead to the next two steps.
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.3))
    assert _available(env, mailer, t0) == [pytest.approx(0.8, abs=0.01),
                                           pytest.approx(1.3, abs=0.01)]  # fmt: skip
    assert _lease_at(env, mailer, t0 + timedelta(seconds=0.75)) is None
    assert _lease_at(env, mailer, t0 + timedelta(seconds=0.8)) is not None
    assert _lease_at(env, mailer, t0 + timedelta(seconds=0.8)) is None


def test_a_rate_limit_holds_at_the_starts_when_leases_stall_and_resume(env: TestEnv):
    """Tokens are counted at the starts: steps admitted while no lease was taken (a
    PostgreSQL restart, every worker busy, a frozen supervisor) do not start together when
    leases resume. Counted at admission, 6 of these started at once (bench/chaos.py found 4
    within 61 ms with burst 2 at 4/s, after a restart)."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=2, per=timedelta(seconds=1), burst=2)
    env.client.submit_many(mailer, [None] * 8)
    t0 = env.now()
    for second in range(4):  # the sweeps go on; nothing is leased
        sweep_held_steps(env.conn, now=t0 + timedelta(seconds=second))
    resumed = t0 + timedelta(seconds=3)
    started = []
    while (lease := _lease_at(env, mailer, resumed)) is not None:
        started.append(lease)
    assert len(started) == 2  # the burst, not burst + rate x the stall
    # Then one per half second from those starts, whenever the sweep comes.
    sweep_held_steps(env.conn, now=resumed + timedelta(seconds=5))
    at = resumed + timedelta(seconds=5)
    assert _lease_at(env, mailer, at) and _lease_at(env, mailer, at)
    assert _lease_at(env, mailer, at) is None
    assert counts(env, mailer) == {"running": 4, "held": 4}


def test_a_leased_step_keeps_its_token_until_its_handler_must_have_started(env: TestEnv):
    """A lease taken ahead waits in its worker's queue up to READY_FOR before its handler
    starts: the bucket counts its token taken 0.3 s after the lease, not at the lease (chaos
    run 4 of 5 found a start with no token when it counted the lease)."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=10, per=timedelta(seconds=1), burst=1)
    env.client.submit_many(mailer, [None] * 3)
    t0 = env.now()
    assert _lease_at(env, mailer, t0) is not None
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.1))
    assert _available(env, mailer, t0) == []  # its handler may not have started yet
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.35))
    # Taken at t0 + 0.3 s: the next token refills a tenth of a second later.
    assert _available(env, mailer, t0) == [pytest.approx(0.4, abs=0.01)]


def test_a_step_that_never_started_still_counts_against_the_burst(env: TestEnv):
    """A pending step whose start is not on record (its run cancelled before a lease) took
    its token at the next admission's time: the latest it could have started."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1, per=timedelta(seconds=10), burst=1)
    runs = env.client.submit_many(mailer, [None] * 3)
    t0 = env.now()
    sweep_held_steps(env.conn, now=t0)
    [first] = env.conn.execute(
        "SELECT run_id::text FROM cyclone_steps WHERE workflow = %s AND state = 'available'",
        (mailer.name,),
    ).fetchall()
    env.client.cancel(first["run_id"])
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=1))
    # Its token was taken at t0 + 1 s: the next refills at t0 + 11 s, too far ahead to give yet.
    assert _available(env, mailer, t0) == [] and counts(env, mailer)["held"] == 2
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=10))
    assert _available(env, mailer, t0) == [pytest.approx(11, abs=0.01)]
    assert len(runs) == 3


def test_each_key_has_a_bucket_of_its_own(env: TestEnv):
    env.register(*ALL)
    env.client.set_rate_limit("nl-api", rate=1, per=timedelta(minutes=1), burst=1)
    env.client.submit_many(tenants, [{"tenant": "a"}, {"tenant": "a"}, {"tenant": "b"}])
    env.scan()
    due = env.conn.execute(
        "SELECT count(*) AS n FROM cyclone_steps WHERE workflow = %s AND NOT held"
        " AND available_at <= %s",
        (tenants.name, env.now()),
    ).fetchone()["n"]
    assert due == 2  # a's first and b's first; a's second waits a minute for its token
    assert counts(env, tenants)["held"] == 1


def test_a_retry_and_a_handler_stopped_by_a_planned_stop_each_take_a_new_token(env: TestEnv):
    """A handler that started spent its token: a retry takes another, and so does a step
    whose handler a planned stop killed (its attempt not spent) or whose lease lapsed while
    the database restarted. Kept, chaos found a bucket of burst 2 start three at once."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1, per=timedelta(hours=1), burst=2)
    env.client.submit_many(mailer, [None] * 2)
    first = lease(env, mailer)
    assert first is not None
    assert engine.release_step(env.conn, first.step_id, first.token)  # a planned stop
    assert counts(env, mailer) == {"available": 1, "held": 1}
    again = lease(env, mailer)
    assert again is not None and again.step_id != first.step_id
    assert engine.fail_step(env.conn, again.step_id, again.token, kind="error", error="x")
    env.advance_time(timedelta(seconds=10))  # past the backoff, but not the refill
    env.scan()
    assert counts(env, mailer) == {"held": 2}


def _give_back(env: TestEnv, taken: engine.Lease) -> None:
    """steps_release, as the dispatcher gives back a lease no worker started in time."""
    assert release(env.conn, [(taken.step_id, taken.token)]) == 1


def test_a_lease_given_back_unstarted_keeps_its_token_while_the_bucket_counts_it_pending(
    env: TestEnv,
):
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1, per=timedelta(hours=1), burst=1)
    env.client.submit_many(mailer, [None] * 2)
    t0 = env.now()
    taken = _lease_at(env, mailer, t0)
    assert taken is not None
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.1))  # its handler may start yet
    _give_back(env, taken)
    assert counts(env, mailer) == {"available": 1, "held": 1}  # on the token it had
    again = _lease_at(env, mailer, env.now())
    assert again is not None and again.step_id == taken.step_id


def test_a_lease_given_back_after_its_bucket_counted_it_started_takes_a_new_token(
    env: TestEnv,
):
    """The bucket counts a leased step as started 0.3 s after its lease and forgets it: given
    back later, the step would start again on a token already counted, beside the steps the
    bucket admitted on the tokens it had left."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1, per=timedelta(hours=1), burst=2)
    env.client.submit_many(mailer, [None] * 3)
    t0 = env.now()
    taken = _lease_at(env, mailer, t0)
    assert taken is not None and counts(env, mailer) == {"running": 1, "available": 1, "held": 1}
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.35))  # counted as started
    _give_back(env, taken)
    assert counts(env, mailer) == {"available": 1, "held": 2}
    at = env.now()
    assert _lease_at(env, mailer, at) is not None
    assert _lease_at(env, mailer, at) is None  # two tokens of the burst: two starts, not three


@pytest.mark.parametrize(
    "define",
    [
        lambda wf: wf.task(concurrency=0)(lambda ctx: None),
        lambda wf: wf.task(concurrency=True)(lambda ctx: None),
        lambda wf: wf.task(rate_limit="")(lambda ctx: None),
        lambda wf: wf.task(rate_limit=5)(lambda ctx: None),
        lambda wf: wf.task(rate_limit=cyclone.RateLimit("x", key=""))(lambda ctx: None),
    ],
)
def test_bad_node_limits_are_refused_when_defined(define):
    with pytest.raises(GraphError):
        define(cyclone.Workflow("nl-bad"))


@pytest.mark.parametrize(
    "kwargs",
    [{"rate": 0}, {"rate": float("nan")}, {"rate": 1, "per": -1}, {"rate": 1, "burst": 0},
     {"rate": True}],
)  # fmt: skip
def test_a_bad_rate_limit_is_refused_and_writes_nothing(env: TestEnv, kwargs):
    with pytest.raises(ValueError):
        env.client.set_rate_limit("nl-bad", **kwargs)
    assert env.conn.execute("SELECT count(*) AS n FROM cyclone_rate_limits").fetchone()["n"] == 0


def test_cyclone_limits_shows_slots_in_use_held_steps_and_buckets(
    env: TestEnv, capsys: pytest.CaptureFixture[str]
):
    from cli_support import run_cli

    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1, per=timedelta(hours=1), burst=1)
    env.client.submit_many(narrow, [None] * 5)
    assert lease(env, narrow) and lease(env, narrow)
    env.client.submit_many(mailer, [None] * 3)
    r = run_cli(capsys, env, "limits", "--json")
    assert r.code == 0
    doc = json.loads(r.out)
    assert {"workflow": narrow.name, "node": "only_two", "limit": 2, "in_use": 2,
            "held": 3} in doc["nodes"]  # fmt: skip
    [smtp] = [b for b in doc["rates"] if b["name"] == "nl-smtp"]
    assert smtp["held"] == 2 and smtp["key"] == "" and smtp["tokens"] < 0.01
    r = run_cli(capsys, env, "limits")
    assert r.code == 0 and "nl-narrow/only_two" in r.out and "nl-smtp" in r.out


chained = cyclone.Workflow("nl-chained")


@chained.task()
def first(ctx):
    return None


@chained.task(after=[first], concurrency=1)
def second(ctx):
    return None


def test_a_limited_step_made_by_a_chain_completion_waits_for_a_slot_like_a_root(env: TestEnv):
    env.register(chained)
    env.client.submit_many(chained, [None] * 3)
    firsts = [lease_of(env, chained, "first") for _ in range(3)]
    for one in firsts:
        assert engine.complete_step(env.conn, one, None)  # the one-statement chain path
    assert counts(env, chained) == {"completed": 3, "available": 3}
    assert lease_of(env, chained, "second") and lease(env, chained) is None


def lease_of(env: TestEnv, wf: cyclone.Workflow, node: str) -> engine.Lease:
    taken = lease(env, wf)
    assert taken is not None and taken.node == node, taken
    return taken


def in_use(env: TestEnv, wf: cyclone.Workflow) -> int:
    return counts(env, wf).get("running", 0)


def test_a_step_of_a_cancelled_run_waiting_for_a_slot_is_let_go_and_its_node_goes_on(
    env: TestEnv,
):
    env.register(*ALL)
    runs = env.client.submit_many(narrow, [None] * 4)
    first, second = lease(env, narrow), lease(env, narrow)
    assert first and second
    env.client.cancel(runs[2])
    assert counts(env, narrow) == {"running": 2, "available": 1, "discarded": 1}
    assert engine.complete_step(env.conn, first, None)
    assert engine.complete_step(env.conn, second, None)
    env.run_until_complete(runs[3])
    assert counts(env, narrow) == {"completed": 3, "discarded": 1}
    assert slot_holders(env, narrow) == set()


failing = cyclone.Workflow("nl-failing")
BROKEN = {"now": True}  # until the test mends it, before the DLQ retry


@failing.task(max_attempts=1)
def breaks(ctx):
    if ctx.input.get("broken") and BROKEN["now"]:
        raise cyclone.PermanentError("broken")
    return None


@failing.task(concurrency=1)
def one_at_a_time(ctx):
    return None


def test_a_dlq_retry_of_a_run_whose_waiting_step_was_discarded_waits_for_a_slot_again(
    env: TestEnv, monkeypatch: pytest.MonkeyPatch
):
    """The run failed while its step of a limited node waited for a slot: re-driven by the
    DLQ, that step waits for a slot like any other, and the node's limit holds."""
    env.register(failing)
    _, broken = env.client.submit_many(failing, [{}, {"broken": True}])
    step = env.conn.execute(
        "SELECT id FROM cyclone_steps WHERE run_id = %s AND node = 'one_at_a_time'", (broken,)
    ).fetchone()["id"]
    taken = [lease(env, failing) for _ in range(3)]  # both `breaks`, and the free slot
    assert all(taken) and lease(env, failing) is None
    [fails] = [t for t in taken if t and t.run_id == broken and t.node == "breaks"]
    outcome = runner.execute(env.conn, env.registry, fails)  # a PermanentError
    runner.record(env.conn, fails, outcome, now=env.now())
    assert env.client.get_run(broken).state == "failed"  # its waiting step was discarded
    dead = env.conn.execute(
        "SELECT id FROM cyclone_steps WHERE run_id = %s AND state = 'dead'", (broken,)
    ).fetchone()["id"]
    monkeypatch.setitem(BROKEN, "now", False)
    retry_dead_step(env.conn, dead)
    row = env.conn.execute("SELECT state, held FROM cyclone_steps WHERE id = %s", (step,))
    assert row.fetchone() == {"state": "available", "held": False}
    for t in taken:
        if t is not fails:
            assert t and engine.complete_step(env.conn, t, None)
    env.run_until_complete(broken)
    assert counts(env, failing) == {"completed": 4}


def test_admission_skips_a_held_step_another_transaction_holds_and_never_waits(
    env: TestEnv, pg_dsn: str
):
    """Admission runs inside whatever made a step: it must not wait for a row lock (a client's
    open transaction, a cancel in flight), so it admits the next held step instead."""
    env.register(*ALL)
    env.client.submit_many(mailer, [None] * 2)  # undeclared limiter: both held
    held = [r["id"] for r in env.conn.execute(
        "SELECT id FROM cyclone_steps WHERE workflow = %s AND held ORDER BY id", (mailer.name,)
    ).fetchall()]  # fmt: skip
    env.client.set_rate_limit("nl-smtp", rate=1e6, per=timedelta(seconds=1), burst=1e6)
    with connect(env.dsn) as other, other.transaction():
        other.execute("SELECT 1 FROM cyclone_steps WHERE id = %s FOR UPDATE", (held[0],))
        env.conn.execute("SET lock_timeout = '2s'")
        assert sweep_held_steps(env.conn, now=env.now()) == 1
        rows = env.conn.execute(
            "SELECT id, held FROM cyclone_steps WHERE id = ANY(%s) ORDER BY id", (held,)
        ).fetchall()
        assert [r["held"] for r in rows] == [True, False]
    env.conn.execute("RESET lock_timeout")


def _admission_calls(env: TestEnv) -> int:
    """cyclone_admit_steps's calls counted so far, by the sessions that track them
    (`_counted`) and have ended (a session sends its function counts as it ends)."""
    row = env.conn.execute(
        "SELECT coalesce((SELECT calls FROM pg_stat_user_functions"
        " WHERE funcid = 'cyclone_admit_steps'::regproc), 0) AS n"
    ).fetchone()
    return int(row["n"])


def _counted(env: TestEnv) -> str:
    return make_conninfo(env.dsn, options=f"-c search_path={env.schema} -c track_functions=pl")


def _calls_since(env: TestEnv, before: int, expected: int) -> int:
    """The calls since `before`, once `expected` of them arrived or ten seconds passed (the
    counts reach the statistics a moment after the session ends)."""
    deadline = time.monotonic() + 10
    while (calls := _admission_calls(env) - before) < expected and time.monotonic() < deadline:
        time.sleep(0.05)
    return calls


def test_a_statement_that_inserts_held_steps_admits_their_node_once(env: TestEnv):
    """100 held steps of a node in one submit_many: the first row's trigger admits them all;
    the others' would only repeat it (migration 28). One call, not 100."""
    env.register(*ALL, wide_rate)
    unbound(env)
    before = _admission_calls(env)
    with cyclone.Client(_counted(env)) as client:
        client.submit_many(wide_rate, [None] * 100)
    assert counts(env, wide_rate) == {"available": 100}
    assert _calls_since(env, before, 1) == 1


def _submit(conn, wf: cyclone.Workflow, n: int) -> None:
    roots = [wf.graph.nodes[name] for name in wf.graph.roots]
    ids = [str(uuid.uuid4()) for _ in range(n)]
    submit_runs(conn, wf.name, wf.graph.hash, ids, ["null"] * n, roots)


def test_each_statement_and_each_node_of_a_statement_admits(env: TestEnv):
    """The mark that skips the repeated calls is one statement's and one node's: a second
    insert in the same transaction admits again, and so does the other node of a statement
    that interleaves two limited nodes' steps."""
    env.register(*ALL, wide_rate, pair)
    unbound(env)
    before = _admission_calls(env)
    with connect(_counted(env)) as conn, conn.transaction():
        _submit(conn, wide_rate, 10)
        _submit(conn, wide_rate, 10)
        _submit(conn, pair, 5)
    assert counts(env, wide_rate) == {"available": 20}
    assert counts(env, pair) == {"available": 10}
    assert _calls_since(env, before, 4) == 4


def test_a_node_limited_by_rate_only_admits_while_a_call_fills_its_batch(env: TestEnv):
    """Nothing but the sweep admits a rate-limited node's steps after they are made (no slot
    is freed), and one call gives at most 200 tokens: the rows of a statement call again while
    the last call filled its batch, so a submit of 300 with tokens to spare makes all 300
    available at once."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=1e6, per=timedelta(seconds=1), burst=1e6)
    env.client.submit_many(mailer, [None] * 300)
    assert counts(env, mailer) == {"available": 300}


def test_a_bucket_written_by_a_later_transaction_keeps_its_time(env: TestEnv):
    """An admission whose transaction began before another admission wrote the bucket refills
    nothing for the time before the bucket's, gives its token from the bucket's time, and
    leaves that time where it was: set back, the next admission would refill those seconds
    twice."""
    env.register(*ALL)
    env.client.set_rate_limit("nl-smtp", rate=4, per=timedelta(seconds=1), burst=1)
    ahead = env.conn.execute(
        "INSERT INTO cyclone_rate_buckets (name, key, tokens, updated_at)"
        " VALUES ('nl-smtp', '', 0, now() + interval '1 second') RETURNING updated_at"
    ).fetchone()["updated_at"]
    env.client.submit(mailer, None)
    step = env.conn.execute(
        "SELECT held, available_at FROM cyclone_steps WHERE workflow = %s", (mailer.name,)
    ).fetchone()
    bucket = env.conn.execute(
        "SELECT tokens, updated_at FROM cyclone_rate_buckets WHERE name = 'nl-smtp'"
    ).fetchone()
    assert not step["held"]
    # The level at the bucket's time, its pending step's token not yet taken (migration 29).
    assert bucket["updated_at"] == ahead and bucket["tokens"] == pytest.approx(0)
    assert step["available_at"] == ahead + timedelta(seconds=0.25)


def _admit(env: TestEnv, wf: cyclone.Workflow, node: str, at: datetime) -> int:
    return env.conn.execute(
        "SELECT cyclone_admit_steps(%s, %s, %s) AS n", (wf.name, node, at)
    ).fetchone()["n"]


def _bucket(env: TestEnv, name: str) -> dict:
    return env.conn.execute(
        "SELECT tokens, updated_at, cardinality(pending) AS pending,"
        " cardinality(fresh) AS fresh FROM cyclone_rate_buckets WHERE name = %s",
        (name,),
    ).fetchone()


def _stopped(env: TestEnv, at: datetime) -> None:
    """A step leased, then given back by a planned stop: held again for a new token."""
    taken = _lease_at(env, mailer, at)
    assert taken is not None and engine.release_step(env.conn, taken.step_id, taken.token)


def test_a_bucket_with_tokens_to_spare_reads_its_pending_steps_at_most_every_100_ms(
    env: TestEnv,
):
    """An admission reads a bucket's pending steps (given a token, not yet counted as started)
    only 100 ms after the last read, while the bucket has tokens for them all and for a whole
    batch more (migration 32); in between, the steps it gives tokens to join `fresh` and its
    level and time stay as they were. Read and written at every admission, a busy bucket's
    list cost more than the rest of the admission under a node limit of 64."""
    env.register(*ALL)
    env.client.submit_many(mailer, [None] * 3)  # held: its limiter is not declared yet
    env.client.set_rate_limit("nl-smtp", rate=1000, per=timedelta(seconds=1), burst=1000)
    t0 = env.now()
    assert _admit(env, mailer, "send", t0) == 3
    assert _bucket(env, "nl-smtp") == {"tokens": 1000, "updated_at": t0, "pending": 0, "fresh": 3}
    _stopped(env, t0)
    assert _admit(env, mailer, "send", t0 + timedelta(seconds=0.05)) == 1
    assert _bucket(env, "nl-smtp") == {"tokens": 1000, "updated_at": t0, "pending": 0, "fresh": 4}
    _stopped(env, t0 + timedelta(seconds=0.05))
    later = t0 + timedelta(seconds=0.1)
    assert _admit(env, mailer, "send", later) == 1
    # Read: the stopped step's two tokens taken (its handler may have started each time), the
    # other two still pending with the one just given. Refilled to the burst meanwhile.
    assert _bucket(env, "nl-smtp") == {
        "tokens": 998, "updated_at": later, "pending": 3, "fresh": 0
    }  # fmt: skip
    assert counts(env, mailer) == {"available": 3}


def test_a_lease_given_back_keeps_its_token_while_its_bucket_has_it_fresh(env: TestEnv):
    env.register(*ALL)
    env.client.submit_many(mailer, [None] * 2)
    env.client.set_rate_limit("nl-smtp", rate=1000, per=timedelta(seconds=1), burst=1000)
    t0 = env.now()
    assert _admit(env, mailer, "send", t0) == 2
    taken = _lease_at(env, mailer, t0)
    assert taken is not None and _bucket(env, "nl-smtp")["fresh"] == 2
    _give_back(env, taken)
    assert counts(env, mailer) == {"available": 2}  # not held for another


def test_a_bucket_reads_its_pending_steps_once_it_gave_200_tokens_since(env: TestEnv):
    """`fresh` stays short: written at every admission, it costs nothing while it fits its
    row (about 250 ids), and a list moved out of line cost as much as the read it saves."""
    env.register(*ALL)
    env.client.submit_many(mailer, [None] * 406)
    env.client.set_rate_limit("nl-smtp", rate=1000, per=timedelta(seconds=1), burst=1000)
    t0 = env.now()
    assert _admit(env, mailer, "send", t0) == 200
    assert _bucket(env, "nl-smtp")["fresh"] == 200
    at = t0 + timedelta(seconds=0.01)
    assert _admit(env, mailer, "send", at) == 200
    assert _bucket(env, "nl-smtp") == {"tokens": 1000, "updated_at": at, "pending": 400, "fresh": 0}
    assert _admit(env, mailer, "send", at + timedelta(seconds=0.01)) == 6
    assert _bucket(env, "nl-smtp") == {"tokens": 1000, "updated_at": at, "pending": 400, "fresh": 6}


def test_a_bucket_short_of_tokens_reads_its_pending_steps_at_every_admission(env: TestEnv):
    """Unread, a step counted as started since the last read would keep its token: the next
    step would wait for the burst to free up, not for the next token."""
    env.register(*ALL)
    env.client.submit_many(mailer, [None] * 2)
    env.client.set_rate_limit("nl-smtp", rate=10, per=timedelta(seconds=1), burst=1)
    t0 = env.now()
    sweep_held_steps(env.conn, now=t0)
    assert _lease_at(env, mailer, t0) is not None
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.25))  # not started yet, maybe
    assert _available(env, mailer, t0) == []
    # 70 ms after that read: the lease counts as started at t0 + 0.3 s, the next token
    # refills a tenth of a second later.
    sweep_held_steps(env.conn, now=t0 + timedelta(seconds=0.32))
    assert _available(env, mailer, t0) == [pytest.approx(0.4, abs=0.01)]


sm_tight = cyclone.Workflow("nl-sm-tight")
sm_roomy = cyclone.Workflow("nl-sm-roomy")


@sm_tight.task(concurrency=2, max_attempts=3)
def sm_tight_step(ctx):
    return None


@sm_roomy.task(concurrency=18, max_attempts=3, rate_limit="nl-sm-unbound")
def sm_roomy_step(ctx):
    return None


class LimitedSteps(RuleBasedStateMachine):
    """Random submits, leases, completions, failures (retried or not), planned stops, expired
    leases, cancels, pauses, resumes and DLQ retries of steps of two limited nodes (2, and 18
    with an unbound rate limit as well): never more steps of a node running than its limit,
    its slots held by exactly its running steps; a lease of a node finds a step whenever the
    node has a free slot and a step of a running run due; and every run ends once the
    workers drain what is left."""

    env: TestEnv
    NODES = {"tight": (sm_tight, 2), "roomy": (sm_roomy, 18)}

    def __init__(self) -> None:
        super().__init__()
        self.env.conn.execute("DELETE FROM cyclone_steps")
        self.env.conn.execute("DELETE FROM cyclone_runs")
        self.leases: list[engine.Lease] = []
        self.runs: list[str] = []

    @rule(node=st.sampled_from(["tight", "roomy"]), n=st.integers(1, 25))
    def submit(self, node: str, n: int) -> None:
        self.runs += self.env.client.submit_many(self.NODES[node][0], [None] * n)

    @rule(node=st.sampled_from(["tight", "roomy"]), n=st.integers(1, 6))
    def take(self, node: str, n: int) -> None:
        wf, limit = self.NODES[node]
        for _ in range(n):
            taken = lease(self.env, wf)
            if taken is None:
                due = self.env.conn.execute(
                    "SELECT count(*) AS n FROM cyclone_steps s JOIN cyclone_runs r"
                    " ON r.id = s.run_id WHERE s.workflow = %s AND s.state = 'available'"
                    " AND NOT s.held AND s.available_at <= %s AND r.state = 'running'",
                    (wf.name, self.env.now()),
                ).fetchone()["n"]
                assert not due or in_use(self.env, wf) == limit, counts(self.env, wf)
                break
            self.leases.append(taken)

    def _pop(self, data: st.DataObject) -> engine.Lease:
        return self.leases.pop(data.draw(st.integers(0, len(self.leases) - 1)))

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), how=st.sampled_from(["complete", "retry", "dead", "release"]))
    def finish(self, data: st.DataObject, how: str) -> None:
        done = self._pop(data)
        conn, now = self.env.conn, self.env.now()
        if how == "complete":
            engine.complete_step(conn, done, None, now=now)
        elif how == "release":
            engine.release_step(conn, done.step_id, done.token, now=now)
        else:
            engine.fail_step(conn, done.step_id, done.token, kind="error", error="x",
                             retry=how == "retry", now=now)  # fmt: skip

    @precondition(lambda self: self.leases)
    @rule()
    def leases_expire(self) -> None:
        self.env.advance_time(timedelta(minutes=5))
        self.env.scan()
        self.leases.clear()

    @precondition(lambda self: self.runs)
    @rule(data=st.data(), how=st.sampled_from(["cancel", "pause", "resume", "dlq"]))
    def operate(self, data: st.DataObject, how: str) -> None:
        run_id = data.draw(st.sampled_from(self.runs))
        if how == "cancel":
            self.env.client.cancel(run_id)
        elif how == "pause":
            self.env.client.pause(run_id)
        elif how == "resume":
            self.env.client.resume(run_id)
        else:
            dead = self.env.conn.execute(
                "SELECT s.id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id"
                " WHERE s.run_id = %s AND s.state = 'dead' AND r.state = 'failed'",
                (run_id,),
            ).fetchone()
            if dead is not None:
                retry_dead_step(self.env.conn, dead["id"], now=self.env.now())

    @rule()
    def sweep(self) -> None:
        self.env.scan()

    @invariant()
    def each_limit_holds_and_its_slots_are_its_leases(self) -> None:
        for wf, limit in self.NODES.values():
            c = counts(self.env, wf)
            assert in_use(self.env, wf) <= limit, (wf.name, c)
            assert slot_holders(self.env, wf) == running_ids(self.env, wf), (wf.name, c)

    def teardown(self) -> None:
        conn, now = self.env.conn, self.env.now()
        for done in self.leases:
            engine.complete_step(conn, done, None, now=now)
        for run_id in self.runs:
            self.env.client.resume(run_id)
        self.env.advance_time(timedelta(hours=1))  # past every retry's backoff
        self.env.run_until_idle()
        left = conn.execute(
            "SELECT state, count(*) AS n FROM cyclone_runs GROUP BY state"
        ).fetchall()
        assert {r["state"] for r in left} <= {"completed", "failed", "cancelled"}, left


@pytest.mark.property
def test_node_limits_hold_whatever_happens(env: TestEnv) -> None:
    env.register(sm_tight, sm_roomy)
    env.client.set_rate_limit("nl-sm-unbound", rate=1e9, per=timedelta(seconds=1), burst=1e9)
    LimitedSteps.env = env
    run_state_machine_as_test(LimitedSteps, settings=settings(
        max_examples=20, stateful_step_count=20, deadline=None, derandomize=True,
        suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    ))  # fmt: skip
