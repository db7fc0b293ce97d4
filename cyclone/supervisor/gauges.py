"""Gauges read from the database at scrape time: DLQ depth by reason, runs by state, the steps
due now and how long the oldest has waited (steps of paused runs are not due), running runs of
workflows no live supervisor serves, schedules' ticks by outcome and their latest lag, the
oldest open transaction's age and age(datfrozenxid), and whether the database answered at all.

A scrape is served inside the supervisor's loop, so the query is bounded on every side: a
short connect timeout, a statement timeout, and a cache (CACHE_TTL) so that several Prometheus
servers, or a dashboard hammering `/metrics`, cost one query every few seconds. A failure is
cached too: while the database is down the scrape still succeeds, says `cyclone_db_up 0`, and
leaves the database gauges out rather than showing stale numbers; the next try comes after
CACHE_TTL, so an outage cannot stall the loop once per scrape.

Every supervisor on a shared database exports the same database-wide numbers: aggregate them
with `max by (reason)`, not `sum`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import psycopg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from cyclone.outage import one_line
from cyclone.sql import QUERIES
from cyclone.states import DEAD_KINDS, RunState
from cyclone.supervisor.labels import MAX_WORKFLOWS, LabelCap, top

log = logging.getLogger(__name__)

CACHE_TTL = 5.0
# Due steps are counted up to this many, as `cyclone status` counts them.
MAX_DUE_COUNT = 10_000
# A supervisor not seen for this long no longer counts as serving its workflows (the same
# threshold after which `cyclone status` calls it lost).
LOST_AFTER = 10.0
# Runs that are not finished; `cyclone_runs_active{state}` always has these series.
ACTIVE_STATES = (RunState.RUNNING.value, RunState.PAUSED.value, RunState.QUEUED.value)
# Every error kind is a possible DLQ reason; each series exists (at 0) from the first scrape,
# so that alerts on `increase()` work for the first dead step too.
# (`cancelled` marks discarded steps, never dead ones.)
DLQ_REASONS = tuple(kind.value for kind in DEAD_KINDS)

AGE_GAUGES = (
    ("cyclone_db_oldest_xact_age_seconds", "oldest_xact_age_seconds",
     "Age of the oldest open transaction of a client session on the database (0: none)"),
    ("cyclone_db_xid_age", "xid_age",
     "age(datfrozenxid) of the database: transactions since its oldest unfrozen one"),
    ("cyclone_db_replica_lag_seconds", "replica_lag",
     "How far behind the primary the read replica the gauges come from is ([database] "
     "read_url; absent: they come from the primary)"),
)  # fmt: skip


@dataclass(slots=True)
class Reading:
    at: float
    up: bool
    dlq: dict[str, int] = field(default_factory=dict)
    runs: dict[str, int] = field(default_factory=dict)
    due: int = 0
    oldest_due_age: float = 0.0
    unserved: dict[str, int] = field(default_factory=dict)
    throttled: dict[str, int] = field(default_factory=dict)  # "kind:limit" -> held steps
    ages: dict[str, float] = field(default_factory=dict)  # metrics_database_age, by metric
    # Schedules: (schedule, outcome) -> ticks so far; schedule -> its latest tick's lag.
    ticks: dict[tuple[str, str], float] = field(default_factory=dict)
    lag: dict[str, float] = field(default_factory=dict)


class DatabaseGauges(Collector):
    """A custom collector: Prometheus calls `collect()` on every scrape."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        *,
        primary: Callable[[], psycopg.Connection[Any]] | None = None,
        ttl: float = CACHE_TTL,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.connect = connect
        # With a read replica (`connect`), the ages are the primary's: its oldest transaction
        # is what holds back its VACUUM, and its xids what wrap around.
        self.primary = primary
        self.ttl = ttl
        self.clock = clock
        self.reading: Reading | None = None
        # Schedule names are chosen by clients: the first MAX_WORKFLOWS keep a series of
        # their own for good (counters never move to another series), later ones go to OTHER.
        self.schedules = LabelCap(MAX_WORKFLOWS)

    def describe(self) -> Iterator[Any]:
        # Registration calls describe(), never collect(): no query until the first scrape.
        yield from self.families(Reading(at=0.0, up=False))

    def collect(self) -> Iterator[Any]:
        yield from self.families(self.read())

    def read(self) -> Reading:
        now = self.clock()
        if self.reading is not None and now - self.reading.at < self.ttl:
            return self.reading
        try:
            with self.connect() as conn:
                rows = conn.execute(
                    QUERIES["metrics_gauges"],
                    {"cap": MAX_DUE_COUNT, "lost_after": LOST_AFTER, "served": [],
                     "graphs": None, "self_id": None},
                ).fetchall()
                lag = conn.execute(QUERIES["replica_lag"]).fetchone()["lag"]
                if self.primary is None:
                    ages = conn.execute(QUERIES["metrics_database_age"]).fetchall()
            if self.primary is not None:
                with self.primary() as conn:
                    ages = conn.execute(QUERIES["metrics_database_age"]).fetchall()
        except psycopg.Error as exc:
            if self.reading is None or self.reading.up:
                log.warning(
                    "metrics: database unavailable: %s", one_line(exc),
                    extra={"action": "metrics"},
                )  # fmt: skip
            self.reading = Reading(at=now, up=False)
            return self.reading
        reading = Reading(
            at=now, up=True, dlq=dict.fromkeys(DLQ_REASONS, 0), runs=dict.fromkeys(ACTIVE_STATES, 0)
        )
        for row in rows:
            metric, label, value = row["metric"], row["label"] or "unknown", row["value"]
            if metric == "due":
                if label == "steps":
                    reading.due = int(value)
                else:
                    reading.oldest_due_age = float(value)
                continue
            if metric.startswith("schedule_"):
                name, outcome = self.schedules(label), metric.removeprefix("schedule_")
                if outcome == "lag":
                    reading.lag[name] = max(reading.lag.get(name, 0.0), float(value))
                else:
                    key = (name, outcome)
                    reading.ticks[key] = reading.ticks.get(key, 0.0) + float(value)
                continue
            if metric == "throttled":  # nodes of one limiter: one row each, added up
                reading.throttled[label] = reading.throttled.get(label, 0) + int(value)
                continue
            if metric == "unserved":  # `workflow graph_hash`
                reading.unserved[label] = int(value)
                continue
            target = {"dlq": reading.dlq, "runs": reading.runs}
            target[metric][label] = int(value)
        reading.ages = {row["metric"]: float(row["value"]) for row in ages}
        if lag is not None:
            reading.ages["replica_lag"] = float(lag)
        self.reading = reading
        return reading

    @staticmethod
    def families(reading: Reading) -> Iterator[GaugeMetricFamily]:
        yield GaugeMetricFamily(
            "cyclone_db_up", "Whether the database answered the last metrics query (1) or not",
            value=1 if reading.up else 0,
        )  # fmt: skip
        dlq = GaugeMetricFamily(
            "cyclone_dlq_depth", "Dead-lettered steps in the database, by error kind",
            labels=["reason"],
        )  # fmt: skip
        runs = GaugeMetricFamily(
            "cyclone_runs_active", "Unfinished runs in the database, by state", labels=["state"]
        )
        if reading.up:
            for reason, count in sorted(reading.dlq.items()):
                dlq.add_metric([reason], count)
            for state, count in sorted(reading.runs.items()):
                runs.add_metric([state], count)
        due = GaugeMetricFamily(
            "cyclone_steps_due",
            f"Steps a worker could lease now (counted up to {MAX_DUE_COUNT}); paused runs' "
            "steps are not due",
        )  # fmt: skip
        oldest = GaugeMetricFamily(
            "cyclone_steps_due_oldest_seconds",
            "How long the oldest due step has waited to be leased: how far behind workers are",
        )  # fmt: skip
        unserved = GaugeMetricFamily(
            "cyclone_runs_unserved",
            "Running runs of a workflow's graph version that no live supervisor's workers lease",
            labels=["workflow", "graph"],
        )  # fmt: skip
        if reading.up:
            due.add_metric([], reading.due)
            oldest.add_metric([], reading.oldest_due_age)
            # Any client may register a workflow name: the series are capped (labels.py).
            for label, count in top(reading.unserved, MAX_WORKFLOWS):
                workflow, space, graph = label.rpartition(" ")
                if not space:  # `other`: the versions past the cap, summed
                    workflow, graph = label, label
                unserved.add_metric([workflow, graph], count)
        throttled = GaugeMetricFamily(
            "cyclone_steps_throttled",
            "Steps held back by a node's limit: kind concurrency (limit: workflow/node) or rate "
            "(limit: the limiter)",
            labels=["kind", "limit"],
        )  # fmt: skip
        if reading.up:
            for label, count in top(reading.throttled, MAX_WORKFLOWS):
                kind, _, limit = label.partition(":")
                throttled.add_metric([kind or "other", limit or label], count)
        ticks = CounterMetricFamily(
            "cyclone_schedule_ticks",
            "Ticks of each schedule by outcome: started (a run), skipped (overlap policy) or "
            "missed (older than the catch-up window); kept in the database",
            labels=["schedule", "outcome"],
        )  # fmt: skip
        lag = GaugeMetricFamily(
            "cyclone_schedule_lag_seconds",
            "How long after its tick the latest run of each schedule started (jitter included)",
            labels=["schedule"],
        )  # fmt: skip
        if reading.up:
            for (name, outcome), value in sorted(reading.ticks.items()):
                ticks.add_metric([name, outcome], value)
            for name, value in sorted(reading.lag.items()):
                lag.add_metric([name], value)
        yield ticks
        yield lag
        yield dlq
        yield runs
        yield due
        yield oldest
        yield unserved
        yield throttled
        # What bloat and wraparound come from: alerts.yml fires on both.
        for name, key, text in AGE_GAUGES:
            family = GaugeMetricFamily(name, text)
            if key in reading.ages:
                family.add_metric([], reading.ages[key])
            yield family
