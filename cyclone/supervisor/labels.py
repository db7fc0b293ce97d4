"""Bounded label values for the supervisor's metrics: workflow and node names, capped.

Workflow and node names are chosen by whoever registers a graph, clients included (a
`Client` registers the workflows it submits, and `cyclone_runs_unserved` reads every
workflow in the database). Each distinct value is a series kept for the supervisor's lifetime
and scraped every interval, so a name generated per tenant or per request would grow
Prometheus without bound. The first `cap` distinct values of a label keep their own series;
later ones are counted under `OTHER`.

Counters must never go down, so a value admitted once keeps its series for good (first come,
first served); gauges computed at scrape time keep the largest values (`top`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

# The value that every name past the cap is counted under.
OTHER = "other"
# Distinct workflow names with a series of their own, per supervisor; node names likewise
# (graphs of a few dozen nodes, a few dozen workflows a VM: far below either).
MAX_WORKFLOWS = 100
MAX_NODES = 200


class LabelCap:
    """Maps a label's values onto at most `cap` of them plus `OTHER`, stably."""

    def __init__(self, cap: int) -> None:
        self.cap = cap
        self.admitted: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self.admitted:
            return value
        if len(self.admitted) < self.cap:
            self.admitted.add(value)
            return value
        return OTHER


def top(counts: Mapping[str, int], cap: int) -> Iterable[tuple[str, int]]:
    """The `cap` largest values by count (ties by name), then the rest summed as `OTHER`."""
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))
    shown = dict(ranked[:cap])
    if len(ranked) > cap:
        # Added to, not set: a workflow really named "other" must not give a second sample.
        shown[OTHER] = shown.get(OTHER, 0) + sum(count for _, count in ranked[cap:])
    return sorted(shown.items())
