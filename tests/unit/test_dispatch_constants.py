"""Constants of the supervisor's dispatcher that the SQL relies on."""

from __future__ import annotations

import re
from pathlib import Path

import cyclone
from cyclone.supervisor.dispatch import READY_FOR

SQL = Path(cyclone.__file__).parent / "sql"


def _slack(text: str) -> float:
    found = re.search(r"slack CONSTANT interval := interval '(\d+) milliseconds'", text)
    assert found is not None, "cyclone_admit_steps has no start slack"
    return int(found.group(1)) / 1000


def test_a_rate_buckets_start_slack_covers_a_lease_taken_ahead():
    """A lease taken ahead starts its handler within READY_FOR of its statement, or goes back;
    the bucket counts its token taken `slack` after the lease (migration 29): a slack shorter
    than READY_FOR lets a late handler start with the next one's token."""
    for path in (SQL / "schema.sql", *sorted((SQL / "migrations").glob("0029_*.sql"))):
        assert _slack(path.read_text()) >= READY_FOR + 0.05, path.name
