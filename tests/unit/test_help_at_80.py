"""Every program's and command's --help fits 80 columns; positionals are named in capitals;
both programs answer --version (issue 27, item 11)."""

from __future__ import annotations

import pytest

from cyclone.cli import main
from cyclone.cli.reference import commands
from cyclone.supervisor.__main__ import main as supervisor_main
from cyclone.version import package_version

COMMANDS = commands()


@pytest.mark.parametrize(
    ("name", "parser"), [(c[0], c[2]) for c in COMMANDS], ids=[c[0] for c in COMMANDS]
)
def test_help_fits_80_columns(monkeypatch: pytest.MonkeyPatch, name: str, parser) -> None:
    monkeypatch.setenv("COLUMNS", "80")
    text = parser.format_help()
    wide = [line for line in text.splitlines() if len(line) > 80]
    assert not wide, f"{name} --help:\n" + "\n".join(wide)
    for action in parser._actions:
        if not action.option_strings and action.metavar not in (None, "COMMAND"):
            assert str(action.metavar).isupper(), (name, action.metavar)
        if not action.option_strings and action.metavar is None and action.dest != "command":
            pytest.fail(f"{name}: positional {action.dest!r} has no capitalised metavar")


@pytest.mark.parametrize(
    ("program", "run"), [("cyclone", main), ("cyclone-supervisor", supervisor_main)]
)
def test_version(capsys: pytest.CaptureFixture[str], program: str, run) -> None:
    try:
        code = run(["--version"])
    except SystemExit as exit_:  # the supervisor's main lets argparse exit
        code = exit_.code
    assert code == 0
    assert capsys.readouterr().out.strip() == f"{program} {package_version()}"
