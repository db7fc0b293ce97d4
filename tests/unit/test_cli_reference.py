"""docs/cli.md documents every command and option, as cyclone.cli.reference makes it."""

from __future__ import annotations

from pathlib import Path

from cyclone.cli.reference import commands, own_actions, render

PAGE = Path(__file__).resolve().parents[2] / "docs" / "cli.md"


def test_every_subcommand_has_its_section_in_docs_cli_md():
    text = PAGE.read_text()
    names = [name for name, _, _ in commands()]
    # The walk found the nested ones too (dlq list, embedded stop) and the supervisor.
    assert {"cyclone dlq list", "cyclone embedded stop", "cyclone-supervisor"} <= set(names)
    missing = [name for name in names if f"## `{name}`\n" not in text]
    assert not missing, f"not in docs/cli.md: {missing}; run python -m cyclone.cli.reference"


def test_docs_cli_md_is_what_the_parsers_say_now():
    assert PAGE.read_text() == render(), (
        "docs/cli.md is out of date: python -m cyclone.cli.reference > docs/cli.md"
    )


def test_every_command_and_argument_has_a_help_text():
    for name, help_text, parser in commands():
        assert help_text or parser.description, name
        for action in own_actions(name, parser):
            assert action.help, f"{name}: {action.option_strings or action.dest} has no help"
