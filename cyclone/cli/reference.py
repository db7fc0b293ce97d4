"""docs/cli.md's command reference, made from the argument parsers themselves.

    python -m cyclone.cli.reference > docs/cli.md

The page is this module's output; tests/unit/test_cli_reference.py holds the file to it, so a new
command, option or help text that is not in the page fails the suite until the page is made
again. The text around the generated part lives here too (INTRO, OUTRO).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterator

Command = tuple[str, str, argparse.ArgumentParser]  # full name, help text, its parser

# Options every command takes (the `common` and `listing` parents in cyclone.cli), described
# once in INTRO rather than under each command.
_SHARED = {"--config", "--dsn", "--json", "-h"}

INTRO = """\
# The command line

<!-- Made by `python -m cyclone.cli.reference > docs/cli.md`: edit cyclone/cli/reference.py
or the commands' help texts, not this file. tests/unit/test_cli_reference.py checks it. -->

Two programs: `cyclone`, the operator's command line, and `cyclone-supervisor`, the process
that runs workers and a scanner on a host (docs/operators.md says how to deploy it).

```text
cyclone [--config FILE | --dsn URL] COMMAND [ARGS] [--json]
```

**Which database.** `--dsn URL`, else the config file's `database.url` (given with `--config`;
`CYCLONE_DATABASE_URL` overrides it, as for the supervisor), else `CYCLONE_DATABASE_URL`, else
the embedded server (which only `migrate` and `embedded start` start). `--config` and `--dsn`
may also follow the command. Passwords are never printed. But a command line is not private:
every local user sees `--dsn postgresql://user:PASSWORD@...` in `ps` and `/proc/PID/cmdline`
while the command runs. Give a password through the environment instead
(`CYCLONE_DATABASE_URL`, or libpq's `PGPASSWORD` or `~/.pgpass` with a URL that has none), or
a config file only you can read. A URL libpq would read differently than meant (a bad `%`
escape, a raw `@` or `/` in the password: write `%25`, `%40`, `%2F`) is refused with exit 2.

**Output.** Data goes to stdout: rich tables (no ANSI codes when stdout is not a terminal;
`NO_COLOR` honoured), or with `--json` on any listing, one JSON document with ISO-8601 UTC
timestamps. Messages go to stderr, each starting `cyclone:`. Ids and error text are never cut
or wrapped, at any width: a table too wide for the terminal leaves its timestamps out first,
then prints each row as a record of `name  value` lines. Durations are `500ms`, `30s`, `5m`,
`2h`, `7d`, `1h30m` or a number of seconds.

**Exit status.** 0 done; 1 not found or refused (an unknown run or step, `cancel` of a finished
run, a retry that is not allowed); 2 usage or configuration error (a malformed id or value, a
bad config file, a schema never migrated); 3 the database cannot be reached. No command prints
a traceback.
"""

OUTRO = """\
## Where to read more

docs/operators.md: deploying `cyclone-supervisor` (its config, its signals: SIGTERM drains,
SIGHUP reloads, SIGTTIN and SIGTTOU add and remove a worker), the status view, the DLQ in
practice, metrics. docs/api.md: the same operations from Python. docs/run-deadlines.md:
`--deadline` and what happens when it passes. docs/sql.md: the views to query directly.
"""


def _subcommands(parser: argparse.ArgumentParser) -> Iterator[Command]:
    """(name, help, parser) of each subcommand, in the order they were added."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help or "" for a in action._choices_actions}
            for name, sub in action.choices.items():
                yield name, helps.get(name, ""), sub


def _leaves(prefix: str, help_text: str, parser: argparse.ArgumentParser) -> Iterator[Command]:
    subs = list(_subcommands(parser))
    if not subs:
        yield prefix, help_text, parser
    for name, text, sub in subs:
        yield from _leaves(f"{prefix} {name}", text, sub)


def commands() -> list[Command]:
    """Every command a user can run, as (full name, help, parser)."""
    from cyclone.cli import build_parser
    from cyclone.supervisor.__main__ import build_parser as supervisor_parser

    supervisor = supervisor_parser()
    return [
        *_leaves("cyclone", "", build_parser()),
        ("cyclone-supervisor", supervisor.description or "", supervisor),
    ]


def own_actions(name: str, parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The command's own arguments: not the help, nor the options every `cyclone` command takes."""
    shared = _SHARED if name.startswith("cyclone ") else {"-h"}
    return [
        a
        for a in parser._actions
        if not isinstance(a, argparse._SubParsersAction) and not (set(a.option_strings) & shared)
    ]


def _spelling(action: argparse.Action) -> str:
    if not action.option_strings:
        return str(action.metavar or action.dest).upper()
    flags = ", ".join(action.option_strings)
    if action.nargs == 0:
        return flags
    metavar = action.metavar or action.dest.upper()
    return f"{flags} {metavar}"


def _synopsis(name: str, parser: argparse.ArgumentParser) -> str:
    parts = [name]
    for action in own_actions(name, parser):
        spelled = _spelling(action).split(", ")[-1]
        parts.append(spelled if not action.option_strings or action.required else f"[{spelled}]")
    if any("--json" in a.option_strings for a in parser._actions):
        parts.append("[--json]")
    return " ".join(parts)


def _meaning(action: argparse.Action) -> str:
    text = (action.help or "").replace("%(default)s", str(action.default))
    if action.choices is not None:
        text += f" (one of: {', '.join(f'`{c}`' for c in action.choices)})"
    return text.replace("|", "\\|")


def render() -> str:
    out = [INTRO]
    for name, help_text, parser in commands():
        out.append(f"## `{name}`\n")
        lead = parser.description or help_text
        if lead:
            out.append(lead[0].upper() + lead[1:] + ("" if lead.endswith(".") else ".") + "\n")
        out.append(f"```text\n{_synopsis(name, parser)}\n```\n")
        actions = own_actions(name, parser)
        if actions:
            out.append("| argument | meaning |\n|---|---|")
            out.extend(f"| `{_spelling(a)}` | {_meaning(a)} |" for a in actions)
            out.append("")
    out.append(OUTRO)
    return "\n".join(out)


if __name__ == "__main__":
    print(render(), end="")
