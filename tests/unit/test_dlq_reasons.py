"""`cancelled` is no DLQ reason (issue 27, item 8): a cancelled run's steps are discarded, never
dead, so a filter on it could never match. It is refused, saying why, by the CLI and the API."""

from __future__ import annotations

import pytest

from cyclone.cli import main
from cyclone.models import ExhaustedQuery
from cyclone.states import DEAD_KINDS, ErrorKind
from cyclone.supervisor.gauges import DLQ_REASONS


def test_the_cli_refuses_reason_cancelled(capsys) -> None:
    code = main(["--dsn", "postgresql:///nowhere", "dlq", "list", "--reason", "cancelled"])
    assert code == 2
    assert "invalid choice: 'cancelled'" in capsys.readouterr().err


def test_the_api_refuses_it_saying_why() -> None:
    with pytest.raises(ValueError, match="discarded, not dead-lettered"):
        ExhaustedQuery(reason="cancelled")
    assert ExhaustedQuery(reason="timeout").reason is ErrorKind.TIMEOUT


def test_the_metrics_and_the_filters_list_the_same_reasons() -> None:
    assert tuple(k.value for k in DEAD_KINDS) == DLQ_REASONS
    assert "cancelled" not in DLQ_REASONS
