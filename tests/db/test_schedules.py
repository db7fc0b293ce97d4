"""Schedules (issue 24, docs/schedules.md): one run per tick, the overlap policies, catch-up,
DST, bad input, trigger, backfill, pause, declared schedules, and TestEnv.advance_time."""

from __future__ import annotations

import asyncio
import threading
from datetime import UTC, datetime, timedelta

import pytest

import cyclone
from cyclone import engine
from cyclone.db import connect
from cyclone.errors import ConfigError, ScheduleNotFound
from cyclone.schedules import tick_key
from cyclone.states import RunState

nightly = cyclone.Workflow("sched-nightly")


@nightly.task()
def report(ctx):
    return ctx.input


# A run that stays active until signalled: what the overlap policies are about.
held = cyclone.Workflow("sched-held")
held.wait("release", signal="go")

declared = cyclone.Workflow("sched-declared")
declared.task(report, name="report")
declared.schedule("declared-hourly", cron="@hourly", input={"from": "code"})

limited = cyclone.Workflow("sched-limited", concurrency=cyclone.Concurrency(key="tenant", limit=1))
limited.task(report, name="report")

limited_held = cyclone.Workflow(
    "sched-limited-held", concurrency=cyclone.Concurrency(key="tenant", limit=1)
)
limited_held.wait("release", signal="go")

T0 = datetime(2026, 1, 5, 0, 0, tzinfo=UTC)


def runs(env, name: str) -> list[dict]:
    """The runs of schedule `name`, by tick (their keys name the schedule and the tick)."""
    return env.conn.execute(
        "SELECT id, state, input, idempotency_key, created_at FROM cyclone_runs "
        "WHERE idempotency_key LIKE %s ORDER BY idempotency_key",
        (f"cyclone-schedule:{name}:%",),
    ).fetchall()


def info(env, name: str):
    return engine.get_schedule(env.conn, name)


def at(env, when: datetime) -> None:
    """Move the env's clock to `when` without firing anything (a scanner that was down)."""
    env._offset += when - env.now()


def sweep(env, now: datetime | None = None) -> int:
    """The schedules sweep at `now` exactly (else the env's clock, which runs on)."""
    return engine.sweep_schedules(env.conn, now=now or env.now())


@pytest.fixture
def env(env):
    env.register(nightly, held)
    at(env, T0)
    return env


# -- ticking ---


def test_three_nightly_runs_after_three_days(env) -> None:
    env.client.schedule("nightly", nightly, cron="0 2 * * *", input={"kind": "daily"})
    env.advance_time(timedelta(days=3))
    got = runs(env, "nightly")
    assert [r["idempotency_key"] for r in got] == [
        tick_key("nightly", T0 + timedelta(days=d, hours=2)) for d in range(3)
    ]
    assert all(r["state"] == "completed" and r["input"] == {"kind": "daily"} for r in got)
    s = info(env, "nightly")
    assert (s.started, s.skipped, s.missed) == (3, 0, 0)
    assert s.next_tick_at == T0 + timedelta(days=3, hours=2)
    assert s.last_tick_at == T0 + timedelta(days=2, hours=2)


def test_a_tick_fires_at_its_time_not_before(env) -> None:
    env.client.schedule("poll", nightly, every=timedelta(minutes=5))
    assert info(env, "poll").next_tick_at == T0 + timedelta(minutes=5)
    tick = T0 + timedelta(minutes=5)
    assert sweep(env, tick - timedelta(microseconds=1)) == 0 and runs(env, "poll") == []
    assert sweep(env, tick) == 1 and len(runs(env, "poll")) == 1
    assert sweep(env, tick) == 0


def test_interval_ticks_fall_on_multiples_of_the_interval(env) -> None:
    at(env, T0 + timedelta(seconds=7))
    env.client.schedule("poll", nightly, every=60)
    assert info(env, "poll").next_tick_at == T0 + timedelta(minutes=1)
    env.advance_time(timedelta(minutes=10))
    assert len(runs(env, "poll")) == 10


def test_jitter_delays_a_tick_the_same_for_every_scanner(env) -> None:
    env.client.schedule("j", nightly, every=timedelta(hours=1), jitter=timedelta(minutes=30))
    tick = T0 + timedelta(hours=1)
    delay = cyclone.schedules.jitter_of("j", 1800.0, tick)
    assert timedelta() < delay < timedelta(minutes=30)
    assert sweep(env, tick + delay - timedelta(microseconds=1)) == 0
    assert sweep(env, tick + delay) == 1
    # The run's key names the tick, not the moment it started.
    assert runs(env, "j")[0]["idempotency_key"] == tick_key("j", tick)


def test_paused_schedules_do_not_tick_and_resume_from_now(env) -> None:
    env.client.schedule("p", nightly, every=timedelta(hours=1))
    env.client.pause_schedule("p")
    env.advance_time(timedelta(hours=5, minutes=30))
    assert runs(env, "p") == []
    env.client.resume_schedule("p")
    s = info(env, "p")
    assert s.next_tick_at == T0 + timedelta(hours=6) and (s.started, s.missed) == (0, 0)
    env.advance_time(timedelta(hours=1))
    assert len(runs(env, "p")) == 1


# -- overlap policies ---


def overlap_case(env, policy: str) -> tuple[list[dict], object]:
    """Three hourly ticks of a run that stays active until signalled."""
    env.client.schedule("o", held, every=timedelta(hours=1), overlap=policy)
    env.advance_time(timedelta(hours=3))
    return runs(env, "o"), info(env, "o")


def test_skip_skips_ticks_while_the_run_is_active(env) -> None:
    got, s = overlap_case(env, "skip")
    assert [r["state"] for r in got] == ["running"]
    assert (s.started, s.skipped, s.buffered) == (1, 2, ())
    # Once the run ended, the next tick starts.
    env.client.signal(str(got[0]["id"]), "go")
    env.advance_time(timedelta(hours=1))
    assert [r["state"] for r in runs(env, "o")] == ["completed", "running"]


def test_buffer_one_keeps_one_tick_and_starts_it_when_the_run_ends(env) -> None:
    got, s = overlap_case(env, "buffer_one")
    assert [r["state"] for r in got] == ["running"]
    assert (s.started, s.skipped) == (1, 1)
    assert s.buffered == (T0 + timedelta(hours=2),)
    env.client.signal(str(got[0]["id"]), "go")
    env.run_until_idle()
    got = runs(env, "o")
    assert [r["state"] for r in got] == ["completed", "running"]
    assert got[1]["idempotency_key"] == tick_key("o", T0 + timedelta(hours=2))
    assert info(env, "o").buffered == ()


def test_buffer_all_keeps_every_tick_and_starts_them_one_after_another(env) -> None:
    got, s = overlap_case(env, "buffer_all")
    assert [r["state"] for r in got] == ["running"]
    assert (s.started, s.skipped) == (1, 0)
    assert s.buffered == (T0 + timedelta(hours=2), T0 + timedelta(hours=3))
    for n in range(2):
        env.client.signal(str(runs(env, "o")[n]["id"]), "go")
        env.run_until_idle()
        assert [r["state"] for r in runs(env, "o")] == ["completed"] * (n + 1) + ["running"]
    assert info(env, "o").buffered == ()


def test_cancel_other_cancels_the_active_run_and_starts_the_tick(env) -> None:
    got, s = overlap_case(env, "cancel_other")
    assert [r["state"] for r in got] == ["cancelled", "cancelled", "running"]
    assert (s.started, s.skipped) == (3, 0)
    assert s.last_run_id == str(got[2]["id"])


def test_allow_all_starts_every_tick(env) -> None:
    got, s = overlap_case(env, "allow_all")
    assert [r["state"] for r in got] == ["running"] * 3
    assert (s.started, s.skipped) == (3, 0)


def test_a_queued_run_counts_as_active(env) -> None:
    # A run waiting for its concurrency slot holds the schedule's place, as a running one.
    env.register(limited_held)
    blocker = env.client.submit(limited_held, {"tenant": "a"})
    assert env.client.get_run(blocker).state == RunState.RUNNING
    env.client.schedule("q", limited_held, every=timedelta(hours=1), input={"tenant": "a"})
    env.advance_time(timedelta(hours=2))
    assert [r["state"] for r in runs(env, "q")] == ["queued"]
    s = info(env, "q")
    assert (s.started, s.skipped) == (1, 1)


def test_a_limited_workflow_s_runs_take_their_key_from_the_schedule_input(env) -> None:
    env.register(limited)
    env.client.schedule("q", "sched-limited", every=timedelta(hours=1), input={"tenant": "a"})
    env.advance_time(timedelta(hours=1))
    (run,) = runs(env, "q")
    assert run["state"] == "completed"
    row = env.conn.execute(
        "SELECT concurrency_key FROM cyclone_runs WHERE id = %s", (run["id"],)
    ).fetchone()
    assert row["concurrency_key"] == "a"
    with pytest.raises(ConfigError, match="no field 'tenant'"):
        env.client.schedule("q2", limited, every=60, input={})


# -- catch-up ---


def test_ticks_older_than_the_catchup_window_are_missed_and_counted(env) -> None:
    env.client.schedule("c", nightly, every=timedelta(minutes=10), overlap="allow_all",
                        catchup_window=timedelta(minutes=25))  # fmt: skip
    # The scanners were down for an hour: the first pass after is at 01:05.
    assert sweep(env, T0 + timedelta(minutes=65)) == 6
    got = runs(env, "c")
    # 00:40 (exactly 25 minutes before: still inside), 00:50 and 01:00 run; 00:10 to 00:30
    # are older than the window.
    assert [r["idempotency_key"] for r in got] == [
        tick_key("c", T0 + timedelta(minutes=m)) for m in (40, 50, 60)
    ]
    s = info(env, "c")
    assert (s.started, s.missed, s.skipped) == (3, 3, 0)
    assert s.next_tick_at == T0 + timedelta(minutes=70)


def test_a_schedule_far_behind_catches_up_a_bounded_number_of_ticks_a_pass(
    env, monkeypatch
) -> None:
    monkeypatch.setattr(engine.schedules, "MAX_TICKS", 4)
    env.client.schedule("far", nightly, every=timedelta(minutes=1), overlap="allow_all",
                        catchup_window=timedelta(minutes=3))  # fmt: skip
    now = T0 + timedelta(minutes=10)
    assert sweep(env, now) == 4  # ticks 00:01 to 00:04, all missed
    assert info(env, "far").next_tick_at == T0 + timedelta(minutes=5)
    assert sweep(env, now) == 4  # 00:05 and 00:06 missed; 00:07 and 00:08 run
    assert sweep(env, now) == 2  # 00:09 and 00:10 run
    s = info(env, "far")
    assert (s.missed, s.started, s.next_tick_at) == (6, 4, T0 + timedelta(minutes=11))


def test_catchup_ticks_go_through_the_overlap_policy(env) -> None:
    env.client.schedule("c", held, every=timedelta(minutes=10), overlap="skip",
                        catchup_window=timedelta(minutes=25))  # fmt: skip
    at(env, T0 + timedelta(hours=1, seconds=1))
    sweep(env)
    s = info(env, "c")
    assert (s.started, s.skipped, s.missed) == (1, 2, 3)
    assert runs(env, "c")[0]["idempotency_key"] == tick_key("c", T0 + timedelta(minutes=40))


# -- exactly once ---


def test_two_sweepers_at_once_start_each_tick_once(env) -> None:
    for n in range(20):
        env.client.schedule(f"x{n:02}", nightly, every=timedelta(minutes=1), overlap="allow_all")
    now = T0 + timedelta(minutes=5, seconds=1)
    barrier = threading.Barrier(2)
    counts: list[int] = []

    def sweeper() -> None:
        with connect(env.dsn) as conn:
            barrier.wait()
            counts.append(engine.sweep_schedules(conn, batch_size=500, now=now))

    threads = [threading.Thread(target=sweeper) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(counts) == 100  # 20 schedules x 5 ticks, split between the two
    total = env.conn.execute(
        "SELECT count(*) AS n, count(DISTINCT idempotency_key) AS keys FROM cyclone_runs"
    ).fetchone()
    assert (total["n"], total["keys"]) == (100, 100)
    assert sweep(env) == 0


def test_a_sweeper_skips_a_schedule_another_holds(env) -> None:
    env.client.schedule("h", nightly, every=timedelta(minutes=1))
    now = T0 + timedelta(minutes=1)
    with connect(env.dsn) as other, other.transaction():
        other.execute("SELECT 1 FROM cyclone_schedules WHERE name = 'h' FOR UPDATE")
        assert engine.sweep_schedules(env.conn, now=now) == 0
    assert engine.sweep_schedules(env.conn, now=now) == 1


def test_a_tick_whose_run_exists_starts_no_second_run(env) -> None:
    # A backfill (or a sweep whose commit was lost and retried) got there first: the key holds.
    env.client.schedule("k", nightly, every=timedelta(hours=1))
    at(env, T0 + timedelta(hours=1, minutes=30))
    hour = T0 + timedelta(hours=1)
    first = env.client.backfill_schedule("k", hour, hour + timedelta(minutes=1))
    assert sweep(env) == 1
    got = runs(env, "k")
    assert [str(r["id"]) for r in got] == first


# -- DST ---


def test_dst_in_berlin_a_skipped_time_fires_once_later_and_a_repeated_one_once(env) -> None:
    # 2026-03-29 02:00 CET jumps to 03:00 CEST: 02:30 does not exist that night.
    # 2026-10-25 03:00 CEST falls back to 02:00 CET: 02:30 happens twice that night.
    start = datetime(2026, 3, 27, 12, tzinfo=UTC)
    at(env, start)
    env.client.schedule("b", nightly, cron="30 2 * * *", timezone="Europe/Berlin")
    env.advance_time(timedelta(days=4))
    keys = [r["idempotency_key"] for r in runs(env, "b")]
    assert keys == [tick_key("b", t) for t in (
        datetime(2026, 3, 28, 1, 30, tzinfo=UTC),  # 02:30 CET
        datetime(2026, 3, 29, 1, 0, tzinfo=UTC),   # no 02:30: 03:00 CEST, once
        datetime(2026, 3, 30, 0, 30, tzinfo=UTC),  # 02:30 CEST
        datetime(2026, 3, 31, 0, 30, tzinfo=UTC),
    )]  # fmt: skip
    at(env, datetime(2026, 10, 24, 12, tzinfo=UTC))
    env.client.delete_schedule("b")
    env.client.schedule("b", nightly, cron="30 2 * * *", timezone="Europe/Berlin")
    env.advance_time(timedelta(days=2))
    keys = [r["idempotency_key"] for r in runs(env, "b")][4:]
    assert keys == [tick_key("b", t) for t in (
        datetime(2026, 10, 25, 0, 30, tzinfo=UTC),  # the first 02:30 (CEST); not the second
        datetime(2026, 10, 26, 1, 30, tzinfo=UTC),  # 02:30 CET
    )]  # fmt: skip


# -- trigger, backfill, delete ---


def test_trigger_starts_one_run_now_under_the_overlap_policy(env) -> None:
    env.client.schedule("t", held, every=timedelta(days=1))
    first = env.client.trigger_schedule("t")
    assert first is not None and env.client.get_run(first).state == RunState.RUNNING
    assert env.client.trigger_schedule("t") is None  # skip: the first is still active
    s = info(env, "t")
    assert (s.started, s.skipped) == (1, 1)
    assert s.next_tick_at == T0 + timedelta(days=1)  # the ticks did not move


def test_backfill_starts_each_tick_of_the_range_once(env) -> None:
    env.client.schedule("bf", held, cron="0 * * * *")
    at(env, T0 + timedelta(days=1))
    ids = env.client.backfill_schedule("bf", T0 + timedelta(hours=2), T0 + timedelta(hours=5))
    keys = [r["idempotency_key"] for r in runs(env, "bf")]
    assert len(ids) == 3 and keys == [
        tick_key("bf", T0 + timedelta(hours=h)) for h in (2, 3, 4)
    ]  # every tick, whatever the policy (skip): a backfill asks for those runs
    again = env.client.backfill_schedule("bf", T0 + timedelta(hours=2), T0 + timedelta(hours=5))
    assert again == ids and len(runs(env, "bf")) == 3
    with pytest.raises(ValueError, match="future"):
        env.client.backfill_schedule("bf", T0, env.now() + timedelta(hours=1))


def test_delete_removes_the_schedule_and_keeps_its_runs(env) -> None:
    env.client.schedule("d", nightly, every=timedelta(hours=1))
    env.advance_time(timedelta(hours=1))
    assert env.client.delete_schedule("d") is True
    assert env.client.delete_schedule("d") is False
    env.advance_time(timedelta(hours=3))
    assert len(runs(env, "d")) == 1
    with pytest.raises(ScheduleNotFound):
        env.client.pause_schedule("d")
    with pytest.raises(ScheduleNotFound):
        env.client.trigger_schedule("d")


def test_changing_a_schedule_keeps_its_ticks_unless_its_timing_changed(env) -> None:
    env.client.schedule("u", nightly, every=timedelta(hours=1))
    at(env, T0 + timedelta(minutes=30))
    s = env.client.schedule("u", nightly, every=timedelta(hours=1), input={"v": 2})
    assert s.next_tick_at == T0 + timedelta(hours=1) and s.input == {"v": 2}
    s = env.client.schedule("u", nightly, every=timedelta(minutes=20))
    assert s.next_tick_at == T0 + timedelta(minutes=40)


# -- bad input: one clear error, nothing written ---


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"cron": "61 * * * *"}, "cron"),
        ({"cron": "0 2 * *"}, "5 fields"),
        ({"cron": "@fortnightly"}, "cron"),
        ({"cron": "0 2 * * *", "timezone": "Mars/Olympus"}, "timezone"),
        ({"every": timedelta(milliseconds=500)}, "every"),
        ({"every": 0}, "every"),
        ({"every": 60, "overlap": "queue"}, "overlap"),
        ({"every": 60, "catchup_window": 1}, "catchup_window"),
        ({"every": 60, "jitter": -1}, "jitter"),
        ({"cron": "0 2 * * *", "every": 60}, "exactly one"),
        ({}, "exactly one"),
    ],
)
def test_bad_input_is_one_clear_error_and_nothing_written(env, kwargs, match) -> None:
    with pytest.raises(ConfigError, match=match):
        env.client.schedule("bad", nightly, **kwargs)
    assert env.client.schedules() == []


def test_a_schedule_of_an_unknown_workflow_is_refused(env) -> None:
    with pytest.raises(ConfigError, match="no workflow named 'nope'"):
        env.client.schedule("bad", "nope", every=60)
    assert env.client.schedules() == []


def test_an_input_that_is_not_json_is_refused(env) -> None:
    with pytest.raises(TypeError, match="input"):
        env.client.schedule("bad", nightly, every=60, input={"at": datetime(2026, 1, 1)})
    assert env.client.schedules() == []


def test_a_bad_name_is_refused(env) -> None:
    for name in ("", " x", "x" * 101, "a\nb", 7):
        with pytest.raises(ConfigError, match="schedule name"):
            env.client.schedule(name, nightly, every=60)
    assert env.client.schedules() == []


# -- declared in code ---


def test_declared_schedules_are_upserted_when_workflows_register(env, caplog) -> None:
    env.register(declared)
    (s,) = env.client.schedules()
    assert (s.name, s.workflow, s.declared, s.cron) == (
        "declared-hourly", "sched-declared", True, "0 * * * *",
    )  # fmt: skip
    env.advance_time(timedelta(hours=2))
    assert len(runs(env, "declared-hourly")) == 2
    # Registering again (another supervisor) keeps the ticks where they were.
    engine.register_workflows(env.conn, [declared])
    assert info(env, "declared-hourly").next_tick_at == T0 + timedelta(hours=3)
    # The code no longer declares it: reported, kept.
    bare = cyclone.Workflow("sched-declared")
    bare.task(report, name="report")
    engine.register_workflows(env.conn, [bare])
    assert "'declared-hourly' is no longer declared in code" in caplog.text
    assert [x.name for x in env.client.schedules()] == ["declared-hourly"]


def test_a_bad_declared_schedule_fails_where_it_is_declared() -> None:
    wf = cyclone.Workflow("sched-bad-declared")
    with pytest.raises(ConfigError, match="timezone"):
        wf.schedule("x", cron="0 2 * * *", timezone="Nowhere/Else")
    with pytest.raises(TypeError, match="input"):
        wf.schedule("x", every=60, input={"when": datetime(2026, 1, 1)})
    wf.schedule("x", every=60)
    with pytest.raises(ConfigError, match="declared twice"):
        wf.schedule("x", every=60)


# -- the async client ---


def test_the_async_client_manages_schedules_too(env) -> None:
    async def main() -> None:
        async with env.async_client() as client:
            s = await client.schedule("a", nightly, every=timedelta(hours=1))
            assert s.next_tick_at == T0 + timedelta(hours=1)
            assert [x.name for x in await client.schedules()] == ["a"]
            await client.pause_schedule("a")
            assert (await client.schedules())[0].paused
            await client.resume_schedule("a")
            assert await client.trigger_schedule("a") is not None
            assert await client.delete_schedule("a") is True

    asyncio.run(main())


def test_the_schedule_table_is_index_backed(env) -> None:
    env.client.schedule("i", nightly, every=60)
    with env.conn.transaction():
        env.conn.execute("SET LOCAL enable_seqscan = off")
        plan = env.conn.execute(
            "EXPLAIN " + engine.schedules.QUERIES["sweep_schedules"],
            {"now": T0, "batch_size": 10},
        ).fetchall()
    text = "\n".join(r["QUERY PLAN"] for r in plan)
    assert "cyclone_schedules_due" in text, text


# -- metrics ---


def test_ticks_and_lag_are_exported_from_the_schedule_rows(env) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from cyclone.child.session import connect_briefly
    from cyclone.supervisor import gauges as gauges_module

    env.client.schedule("m", held, every=timedelta(minutes=10), overlap="skip",
                        catchup_window=timedelta(minutes=25))  # fmt: skip
    at(env, T0 + timedelta(hours=1, seconds=1))
    sweep(env)
    collector = gauges_module.DatabaseGauges(lambda: connect_briefly(env.dsn))
    registry = CollectorRegistry()
    registry.register(collector)
    text = generate_latest(registry).decode()
    assert 'cyclone_schedule_ticks_total{outcome="started",schedule="m"} 1.0' in text
    assert 'cyclone_schedule_ticks_total{outcome="skipped",schedule="m"} 2.0' in text
    assert 'cyclone_schedule_ticks_total{outcome="missed",schedule="m"} 3.0' in text
    # The 00:40 tick started at 01:00:01 (its lag, to the env's clock, >= 20 min 1 s).
    (lag,) = [line for line in text.splitlines() if line.startswith("cyclone_schedule_lag")]
    assert lag.startswith('cyclone_schedule_lag_seconds{schedule="m"} 120')


def test_schedule_series_past_the_cap_are_counted_as_other(env, monkeypatch) -> None:
    from cyclone.supervisor import gauges as gauges_module

    monkeypatch.setattr(gauges_module, "MAX_WORKFLOWS", 2)
    for name in ("a", "b", "c"):
        env.client.schedule(name, nightly, every=timedelta(minutes=10), overlap="allow_all")
    env.advance_time(timedelta(minutes=10))
    collector = gauges_module.DatabaseGauges(lambda: connect(env.dsn))
    reading = collector.read()
    assert reading.ticks[("a", "started")] == 1 and reading.ticks[("b", "started")] == 1
    assert reading.ticks[("other", "started")] == 1 and ("c", "started") not in reading.ticks


def test_a_schedule_that_cannot_tick_leaves_the_others_ticking(env, caplog) -> None:
    env.client.schedule("broken", nightly, every=timedelta(minutes=1))
    env.client.schedule("fine", nightly, every=timedelta(minutes=1))
    env.conn.execute("UPDATE cyclone_schedules SET cron = 'nonsense', every = NULL "
                     "WHERE name = 'broken'")  # fmt: skip
    assert sweep(env, T0 + timedelta(minutes=1)) == 1
    assert len(runs(env, "fine")) == 1 and runs(env, "broken") == []
    assert "schedule 'broken' could not tick" in caplog.text
    assert info(env, "broken").next_tick_at == T0 + timedelta(minutes=1)  # still due
