"""`cyclone migrate --print-grants`: the names it prints are quoted, in its comments too, and
a name that would break a comment line is refused (issue 22, item 12)."""

from __future__ import annotations

import pytest
from cli_support import run_cli

from cyclone.testing import TestEnv


def test_every_name_is_quoted_in_the_comments_as_in_the_statements(capsys, env: TestEnv):
    done = run_cli(
        capsys, env, "migrate", "--print-grants", "--migrator", "Mig Role",
        "--runtime", "run", "--readonly", "ro",
    )  # fmt: skip
    assert done.code == 0, done.err
    head = done.out.splitlines()[:2]
    assert head[0] == (
        f'-- Cyclone\'s roles on schema "{env.schema}": run as its owner or a superuser, after'
    )
    assert head[1].startswith('-- `cyclone migrate` ran as "Mig Role";')
    assert 'TO "Mig Role";' in done.out


@pytest.mark.parametrize("flag", ["--migrator", "--runtime", "--readonly"])
@pytest.mark.parametrize(
    "name", ["x\nDROP TABLE cyclone_runs; --", "x\rDROP TABLE cyclone_runs", "", "a" * 64]
)
def test_a_role_name_that_could_break_a_line_or_is_no_name_is_refused(
    capsys, env: TestEnv, flag: str, name: str
):
    done = run_cli(capsys, env, "migrate", "--print-grants", flag, name)
    assert (done.code, done.out) == (2, "")
    assert f"argument {flag}: not a role name" in done.err.splitlines()[-1]
