"""The database gauges of /metrics: DLQ depth and active runs, cached, and safe when it is down."""

from __future__ import annotations

import time

from fakes import FakeClock
from prometheus_client import CollectorRegistry, generate_latest

import cyclone
from cyclone import engine
from cyclone.child.channel import Scanned
from cyclone.child.session import connect_briefly
from cyclone.supervisor.gauges import DatabaseGauges
from cyclone.supervisor.metrics import Metrics
from cyclone.testing import TestEnv

wf = cyclone.Workflow("gauge-flow")


@wf.task(max_attempts=1)
def boom(ctx: cyclone.StepContext) -> None:
    if ctx.input.get("fail"):
        raise cyclone.PermanentError("no")


def scrape(collector: DatabaseGauges) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_dlq_depth_and_active_runs_are_read_from_the_database_and_cached() -> None:
    with TestEnv(workflows=[wf]) as env:
        failed = [env.client.submit(wf, {"fail": True}) for _ in range(2)]
        env.run_until_idle()
        paused = env.client.submit(wf, {})
        env.client.pause(paused)
        env.client.submit(wf, {})  # running, its step not yet run
        clock = FakeClock()
        gauges = DatabaseGauges(lambda: connect_briefly(env.dsn), clock=clock)
        text = scrape(gauges)
        assert "cyclone_db_up 1.0" in text
        assert 'cyclone_dlq_depth{reason="error"} 2.0' in text
        assert 'cyclone_dlq_depth{reason="deadline"} 0.0' in text  # present from the start
        assert 'cyclone_runs_active{state="running"} 1.0' in text
        assert 'cyclone_runs_active{state="paused"} 1.0' in text
        assert all(env.client.get_run(r).state == "failed" for r in failed)
        env.client.cancel(paused)
        assert 'cyclone_runs_active{state="paused"} 1.0' in scrape(gauges)  # cached
        clock.now += 6
        assert 'cyclone_runs_active{state="paused"} 0.0' in scrape(gauges)


def test_a_scrape_with_the_database_down_succeeds_and_says_db_up_0() -> None:
    calls = []

    def unreachable():
        calls.append(1)
        return connect_briefly("postgresql://nobody@127.0.0.1:1/x?connect_timeout=2")

    clock = FakeClock()
    gauges = DatabaseGauges(unreachable, clock=clock)
    text = scrape(gauges)  # registering describes, it does not query
    assert "cyclone_db_up 0.0" in text
    assert "cyclone_dlq_depth{" not in text and "cyclone_runs_active{" not in text
    scrape(gauges)
    assert len(calls) == 1  # the failure is cached too: an outage costs one try per TTL


def test_scanner_reports_become_counters_and_the_last_scan_gauge() -> None:
    metrics = Metrics()
    counts = {"deadlines": 2, "expired_leases": 3, "max_wait": 1, "sleeps": 5}
    metrics.scanned(Scanned(at=1_700_000_000.5, ok=True, counts=counts))
    metrics.scanned(Scanned(at=0.0, ok=False, counts={"deadlines": 1}))  # supervisor's own sweep
    metrics.scanned(Scanned(at=0.0, ok=False, counts="junk"))  # type: ignore[arg-type]
    text = generate_latest(metrics.registry).decode()
    assert "cyclone_lease_expirations_total 3.0" in text
    assert 'cyclone_scanner_runs_failed_total{reason="deadline"} 3.0' in text
    assert 'cyclone_scanner_runs_failed_total{reason="max_wait"} 1.0' in text
    assert "cyclone_scanner_last_scan_timestamp_seconds 1.7000000005e+09" in text
    # Kill reasons exist at 0 before the first kill, so rate() and alerts see them.
    assert 'cyclone_worker_kills_total{reason="deadline"} 0.0' in text


def age_gauges(gauges: DatabaseGauges, clock: FakeClock) -> tuple[float, float]:
    clock.now += 60  # past the cache: a new reading
    text = scrape(gauges)
    return sample(text, "cyclone_db_oldest_xact_age_seconds"), sample(text, "cyclone_db_xid_age")


def sample(text: str, name: str) -> float:
    (value,) = [float(line.split()[1]) for line in text.splitlines() if line.startswith(name + " ")]
    return value


def test_the_oldest_open_transaction_and_the_xid_age_are_exported_from_one_cheap_query() -> None:
    from psycopg import connect as plain

    from cyclone.sql import QUERIES

    age = """SELECT extract(epoch FROM now() - xact_start)::float8 AS age,
                    (SELECT age(datfrozenxid) FROM pg_database
                      WHERE datname = current_database())::float8 AS xids
               FROM pg_stat_activity WHERE pid = %s"""
    with TestEnv() as env, plain(env.dsn) as holder:
        clock = FakeClock()
        gauges = DatabaseGauges(lambda: connect_briefly(env.dsn), clock=clock)
        idle_age, _ = age_gauges(gauges, clock)
        holder.execute("SELECT txid_current()")  # a transaction left open, as a stuck client's
        backend = holder.info.backend_pid
        wait_for = idle_age + 0.3
        while (gauge := age_gauges(gauges, clock))[0] < wait_for:
            assert env.conn.execute(age, (backend,)).fetchone()["age"] < 10, "gauge stuck"
            time.sleep(0.05)
        before = env.conn.execute(age, (backend,)).fetchone()
        oldest, xids = age_gauges(gauges, clock)
        after = env.conn.execute(age, (backend,)).fetchone()
        assert before["age"] <= oldest <= after["age"]
        assert before["xids"] <= xids <= after["xids"] and xids > 0
        holder.commit()
        assert age_gauges(gauges, clock)[0] < before["age"]
        assert gauge[0] >= wait_for
        # Cheap at any size of the tables: shared memory and one catalog row.
        plan = env.conn.execute(
            "EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + QUERIES["metrics_database_age"]
        ).fetchone()["QUERY PLAN"][0]["Plan"]
        assert plan.get("Shared Hit Blocks", 0) + plan.get("Shared Read Blocks", 0) <= 4, plan


keyed = cyclone.Workflow("gauge-keyed", concurrency=cyclone.Concurrency(key="k", limit=1))
keyed.wait("go")
held = cyclone.Workflow("gauge-held")


@held.task(concurrency=1)
def one_at_a_time(ctx: cyclone.StepContext) -> None:
    return None


@held.task(rate_limit="gauge-limiter", after=["one_at_a_time"])
def rated(ctx: cyclone.StepContext) -> None:
    return None


def test_queued_runs_and_throttled_steps_are_gauges() -> None:
    with TestEnv(workflows=[keyed, held]) as env:
        env.client.submit_many(keyed, [{"k": 1}] * 3)
        env.client.submit_many(held, [None] * 4)
        gauges = DatabaseGauges(lambda: connect_briefly(env.dsn), clock=FakeClock())
        text = scrape(gauges)
        assert 'cyclone_runs_active{state="queued"} 2.0' in text
        assert 'kind="concurrency"' not in text  # a free slot holds nothing back
        taken = engine.lease_step(env.conn, worker="gauges", workflows=[held.name])
        text = scrape(DatabaseGauges(lambda: connect_briefly(env.dsn), clock=FakeClock()))
        assert (  # its one slot taken: 3 wait for it
            'cyclone_steps_throttled{kind="concurrency",limit="gauge-held/one_at_a_time"} 3.0'
            in text
        )
        assert taken is not None and engine.complete_step(env.conn, taken, None)
        env.run_until_idle()  # the undeclared limiter holds every rated step
        text = scrape(DatabaseGauges(lambda: connect_briefly(env.dsn), clock=FakeClock()))
        assert 'cyclone_steps_throttled{kind="rate",limit="gauge-limiter"} 4.0' in text
