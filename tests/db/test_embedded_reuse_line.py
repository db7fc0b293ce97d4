"""A supervisor that finds the embedded PostgreSQL already running says it reuses it (issue 27,
item 13): a second process on one machine otherwise cannot tell it shares the first's data."""

from __future__ import annotations

import os

import pytest

from cyclone import embedded


def test_reusing_a_running_embedded_server_is_said(pg_dsn: str) -> None:
    if os.environ.get("CYCLONE_TEST_DSN"):
        pytest.skip("CYCLONE_TEST_DSN: the tests run on a server that is not the embedded one")
    where = embedded.default_test_data_dir()
    said: list[str] = []
    dsn = embedded.ensure_server(where, announce=said.append, allow_root=True, reused=said.append)
    assert dsn == pg_dsn or embedded.probe(dsn) is None
    assert said == [
        f"reusing the embedded PostgreSQL already running in {os.path.abspath(where)} "
        f"(`cyclone embedded stop --dir {os.path.abspath(where)}` stops it)"
    ]
