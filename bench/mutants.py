"""Mutation check of the core rules: each mutant changes one rule by a line or so, and the tests
must fail. Run on demand (not by the suite: a full pass takes minutes per mutant).

    python bench/mutants.py                   # every mutant, against the tests said to guard it
    python bench/mutants.py --tiers           # every mutant, against all of tests/unit + tests/db
    python bench/mutants.py fence expiry      # the mutants whose names contain these words
    python bench/mutants.py --list            # names, files and guarding tests only
    python bench/mutants.py --repeat 3        # each mutant three times: killed every time?
    python bench/mutants.py fence --tests tests/db/test_engine_model.py   # does the model alone?

A mutant is a (file, old text, new text) edit, applied to a copy of the working tree in a
temporary directory (the tree itself is never touched), whose tests then run with that copy
first on sys.path, against the same test PostgreSQL (CYCLONE_TEST_DSN, else the embedded test
server, started here once). Its verdict:

* killed: a test failed (the first one is named);
* SURVIVED: every test passed, so no test guards that rule: write one;
* n/a: its old text is not in the file (the code moved on: update the mutant).

Exit status 1 when any mutant survived. The subset named for each mutant (`tests`) is the
quick check; `--tiers` is the one the issue asks for: would the unit and database tiers catch
it at all (they run whole, the subset first so that a kill comes early; a survivor costs a
whole run of both tiers). Everything runs `-p no:randomly -x`, so a verdict is one pytest run,
with the engine model derandomized (CYCLONE_MODEL=ci), so a verdict is the same every time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]  # the quick subset: tests said to guard this rule
    why: str = ""
    # More edits of the same mutant, when one rule is written in two places (old, new).
    also: tuple[tuple[str, str], ...] = ()


STEPS_SQL = "cyclone/sql/steps.sql"
SWEEPS_SQL = "cyclone/sql/sweeps.sql"
ARBITER = "cyclone/supervisor/arbiter.py"
DISPATCH = "cyclone/supervisor/dispatch.py"
RETRY_TESTS = "tests/db/test_retry_rules.py"
DEPLOYS_SQL = "cyclone/sql/migrations/0016_deploys.sql"
DEPLOY_TESTS = "tests/db/test_deploys.py"

MUTANTS = [
    # --- retry backoff (step_fail) ---------------------------------------------------------
    Mutant(
        "backoff-no-exponent", STEPS_SQL,
        "%(backoff_base)s * power(2, greatest(s.attempt - 1, 0)))",
        "%(backoff_base)s)",
        (RETRY_TESTS,), "every retry waits about a second",
    ),
    Mutant(
        "backoff-no-jitter", STEPS_SQL,
        "* (0.5 + random() * 0.5)),", "* 1.0),",
        (RETRY_TESTS,), "a burst of failures comes back as a burst",
    ),
    Mutant(
        "backoff-jitter-to-zero", STEPS_SQL,
        "* (0.5 + random() * 0.5)),", "* random()),",
        (RETRY_TESTS,), "a retry may come back at once",
    ),
    Mutant(
        "backoff-cap-x10-sql", STEPS_SQL,
        "secs => least(%(backoff_cap)s,", "secs => least(%(backoff_cap)s * 10,",
        (RETRY_TESTS,),
    ),
    Mutant(
        "backoff-cap-x10-constant", "cyclone/engine/steps.py",
        "BACKOFF_CAP = 600.0", "BACKOFF_CAP = 6000.0",
        (RETRY_TESTS,),
    ),
    Mutant(
        "fail-retries-the-last-attempt", STEPS_SQL,
        "SET state = CASE WHEN %(retry)s AND s.attempt < s.max_attempts THEN 'available'",
        "SET state = CASE WHEN %(retry)s AND s.attempt <= s.max_attempts THEN 'available'",
        (RETRY_TESTS, "tests/db/test_workflows.py"),
    ),
    # --- lease expiry (sweep_expired_leases) -----------------------------------------------
    Mutant(
        "expiry-retries-the-last-attempt", SWEEPS_SQL,
        "SET state = CASE WHEN s.attempt < s.max_attempts THEN 'available' ELSE 'dead' END,",
        "SET state = CASE WHEN s.attempt <= s.max_attempts THEN 'available' ELSE 'dead' END,",
        (RETRY_TESTS,), "issue 30: only the random engine model caught it, sometimes",
    ),
    Mutant(
        "expiry-at-the-expiry-instant", SWEEPS_SQL,
        "AND lease_expires_at < coalesce(%(now)s::timestamptz, now())\n     ORDER BY",
        "AND lease_expires_at <= coalesce(%(now)s::timestamptz, now())\n     ORDER BY",
        (RETRY_TESTS,), "a lease is reclaimed while still valid",
        also=((
            "       AND s.lease_expires_at < coalesce(%(now)s::timestamptz, now())",
            "       AND s.lease_expires_at <= coalesce(%(now)s::timestamptz, now())",
        ),),
    ),
    Mutant(
        "expiry-dlq-reason", SWEEPS_SQL,
        "           error_kind = 'lease_expired',\n", "           error_kind = 'crashed',\n",
        (RETRY_TESTS, "tests/db/test_scanner_sweeps.py"),
    ),
    # --- fences ----------------------------------------------------------------------------
    Mutant(
        "fence-step-fail", STEPS_SQL,
        "     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s\n"
        "       AND s.run_id = run.id\n"
        "    RETURNING s.id, s.run_id, s.node, s.state, s.attempt, s.leased_by, s.started_at",
        "     WHERE s.id = %(step_id)s\n       AND s.run_id = run.id\n"
        "    RETURNING s.id, s.run_id, s.node, s.state, s.attempt, s.leased_by, s.started_at",
        (RETRY_TESTS,), "issue 30: only the random engine model guarded it",
    ),
    Mutant(
        "fence-step-complete", STEPS_SQL,
        " WHERE s.id = %(step_id)s AND s.lease_token = %(token)s\n   AND s.run_id = run.id\n"
        "RETURNING s.node, s.kind, run.state AS run_state;",
        " WHERE s.id = %(step_id)s\n   AND s.run_id = run.id\n"
        "RETURNING s.node, s.kind, run.state AS run_state;",
        (RETRY_TESTS, "tests/db/test_revocations.py"),
    ),
    Mutant(
        "fence-step-complete-chain", STEPS_SQL,
        "     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s\n"
        " RETURNING s.run_id, s.workflow, %(next)s::jsonb AS next, false AS last",
        "     WHERE s.id = %(step_id)s\n"
        " RETURNING s.run_id, s.workflow, %(next)s::jsonb AS next, false AS last",
        (RETRY_TESTS,),
    ),
    Mutant(
        "fence-step-complete-last", STEPS_SQL,
        "     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s\n"
        "       AND s.run_id = run.id\n RETURNING s.run_id, s.node, s.output",
        "     WHERE s.id = %(step_id)s\n"
        "       AND s.run_id = run.id\n RETURNING s.run_id, s.node, s.output",
        (RETRY_TESTS,),
    ),
    Mutant(
        "fence-step-release", STEPS_SQL,
        "  FROM run\n WHERE s.id = %(step_id)s AND s.lease_token = %(token)s\n"
        "   AND s.run_id = run.id\nRETURNING s.id;\n\n-- name: steps_settle_late",
        "  FROM run\n WHERE s.id = %(step_id)s\n"
        "   AND s.run_id = run.id\nRETURNING s.id;\n\n-- name: steps_settle_late",
        ("tests/db/test_workflows.py",),
    ),
    # --- run deadlines ---------------------------------------------------------------------
    Mutant(
        "deadline-sweep-takes-paused-runs", SWEEPS_SQL,
        "     WHERE state = 'running' AND deadline_at IS NOT NULL",
        "     WHERE state IN ('running', 'paused') AND deadline_at IS NOT NULL",
        ("tests/db/test_seed_deadlines.py", "tests/db/test_scanner_sweeps.py"),
    ),
    Mutant(
        "deadline-sweep-error-text", SWEEPS_SQL,
        "SET state = 'dead', error_kind = 'deadline', error = 'run deadline exceeded',",
        "SET state = 'dead', error_kind = 'deadline', error = 'deadline exceeded',",
        ("tests/db/test_seed_deadlines.py",),
    ),
    Mutant(
        "deadline-sweep-spares-waiting-steps", SWEEPS_SQL,
        "WHERE s.run_id = failed.id AND s.state IN ('available', 'running', 'waiting')",
        "WHERE s.run_id = failed.id AND s.state IN ('available', 'running')",
        ("tests/db/test_seed_deadlines.py",),
    ),
    Mutant(
        "supervisor-deadline-timer-off", ARBITER,
        "            elif lease is not None and lease.deadline_at is not None and now >= "
        "lease.deadline_at:\n                self.deadline_passed(handle, lease)\n",
        "            elif False:\n                pass\n",
        ("tests/unit/test_supervisor_decisions.py",),
    ),
    # --- kills -----------------------------------------------------------------------------
    Mutant(
        "kill-grace-ignored", ARBITER,
        "reason=reason, ordered_at=now, hard_at=now + grace,",
        "reason=reason, ordered_at=now, hard_at=now,",
        ("tests/unit/test_supervisor_decisions.py",),
    ),
    Mutant(
        "kill-reclaimed-lease-with-grace", ARBITER,
        "NO_GRACE = (KillReason.SILENT, KillReason.LEASE_EXPIRED)",
        "NO_GRACE = (KillReason.SILENT,)",
        ("tests/unit/test_supervisor_decisions.py",),
    ),
    Mutant(
        "boot-failure-by-time-again", ARBITER,
        "        if by is ExitBy.HANDLER or status.code in NOT_BOOT_EXITS:\n"
        "            return False\n",
        "        if status.code in (channel.ExitCode.OK, channel.ExitCode.RECYCLE):\n"
        "            return False\n        return self.clock() - handle.spawned_at < FAST_EXIT\n",
        ("tests/unit/test_exit_decisions.py",), "the pooler flake (issue 30)",
    ),
    Mutant(
        "boot-failure-lease-lost-counts", ARBITER,
        "        if by is ExitBy.HANDLER or status.code in NOT_BOOT_EXITS:",
        "        if by is ExitBy.HANDLER:",
        ("tests/unit/test_exit_decisions.py",),
    ),
    Mutant(
        "handler-exit-taken-for-the-workers", "cyclone/supervisor/children.py",
        "    if handle.lease is not None and handle.exit_said != status.code:",
        "    if False:",
        ("tests/unit/test_exit_decisions.py",), "issue 22 item 7",
    ),
    Mutant(
        "handler-sys-exit-kills-the-worker", "cyclone/runner.py",
        "    except SystemExit as exc:", "    except ZeroDivisionError as exc:",
        ("tests/db/test_handler_misdeeds.py",), "issue 22 item 7",
    ),
    # --- dispatch: leases taken ahead ------------------------------------------------------
    Mutant(
        "dispatch-ready-share-off", DISPATCH,
        "            and (kill_after is None or age <= READY_SHARE * kill_after)\n",
        "",
        ("tests/unit/test_dispatch_rules.py", "tests/db/test_dispatch_ahead.py"),
        "a lease held ready spends more than 5% of its step's time waiting",
    ),
    Mutant(
        "dispatch-taken-retried-forever", DISPATCH,
        "retry = [t for t in session.taken if t.tries + 1 < TAKEN_TRIES]",
        "retry = list(session.taken)",
        ("tests/unit/test_dispatch_rules.py", "tests/db/test_dispatch_ahead.py"),
    ),
    # --- operator reads --------------------------------------------------------------------
    Mutant(
        "runs-paused-time-left-thaws", "cyclone/sql/status.sql",
        "            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - r.paused_at)\n"
        "       END::float8 AS deadline_left\n  FROM (SELECT * FROM cyclone_runs",
        "            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - now())\n"
        "       END::float8 AS deadline_left\n  FROM (SELECT * FROM cyclone_runs",
        ("tests/db/test_cli.py",),
    ),
    Mutant(
        "dlq-list-ignores-reason", STEPS_SQL,
        "   AND (%(reason)s::text IS NULL OR s.error_kind = %(reason)s)\n",
        "",
        ("tests/db/test_dlq.py", "tests/db/test_cli.py"),
    ),
    # --- plan pins -------------------------------------------------------------------------
    Mutant(
        "plan-steps-page-walks-the-pkey", "cyclone/sql/status.sql",
        " ORDER BY s.id + 0\n", " ORDER BY s.id\n",
        ("tests/db/test_plans.py",),
    ),
    Mutant(
        "plan-deadline-sweep-unbatched", SWEEPS_SQL,
        "     ORDER BY deadline_at\n     LIMIT %(batch_size)s\n",
        "     ORDER BY deadline_at\n",
        ("tests/db/test_plans.py", "tests/db/test_scanner_sweeps.py"),
    ),
    Mutant(
        "plan-expiry-sweep-unbatched", SWEEPS_SQL,
        "     ORDER BY lease_expires_at\n     LIMIT %(batch_size)s\n",
        "     ORDER BY lease_expires_at\n",
        ("tests/db/test_plans.py", "tests/db/test_scanner_sweeps.py"),
    ),
    # --- deploys: lease only what you have (issue 26) --------------------------------------
    Mutant(
        "deploy-lease-any-version", DEPLOYS_SQL,
        "       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))\n     ORDER BY s.priority, "
        "s.pass, s.id\n     LIMIT 1\n",
        "     ORDER BY s.priority, s.pass, s.id\n     LIMIT 1\n",
        (DEPLOY_TESTS,), "a worker leases a step its code has no handler for",
    ),
    Mutant(
        "deploy-dispatch-any-version", DEPLOYS_SQL,
        "       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))\n     ORDER BY s.priority, "
        "s.pass, s.id\n     LIMIT greatest(want, 0)\n",
        "     ORDER BY s.priority, s.pass, s.id\n     LIMIT greatest(want, 0)\n",
        (DEPLOY_TESTS,), "the supervisor hands a step to code that has not its node",
    ),
    Mutant(
        "deploy-renamed-node-runs", "cyclone/engine/versions.py",
        "        if have is None or have.kind != spec.kind or have.child != spec.child:",
        "        if have is not None and have.kind != spec.kind:",
        (DEPLOY_TESTS,), "a version that renamed a node is served by code without it",
    ),
    Mutant(
        "deploy-patched-not-recorded", "cyclone/sql/runs.sql",
        "     WHERE r.id = %(run_id)s AND NOT coalesce(r.patches ? %(patch)s::text, false)\n"
        "    RETURNING r.patches -> %(patch)s::text AS patched",
        "     WHERE r.id = %(run_id)s\n    RETURNING r.patches -> %(patch)s::text AS patched",
        (DEPLOY_TESTS,), "a retry or another VM can get another answer from ctx.patched()",
    ),
]


def tree_files() -> list[str]:
    """The working tree as git sees it: tracked and new files, ignored ones left out."""
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, check=True, capture_output=True,
    ).stdout.decode()  # fmt: skip
    return [f for f in out.split("\0") if f and (ROOT / f).is_file()]


def copy_tree(dest: Path) -> None:
    for name in tree_files():
        target = dest / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, target)


def apply(mutant: Mutant, tree: Path) -> bool:
    """Apply the mutant's edits to `tree`; False when an old text is not there exactly once."""
    path = tree / mutant.path
    text = path.read_text()
    for old, new in ((mutant.old, mutant.new), *mutant.also):
        if text.count(old) != 1:
            return False
        text = text.replace(old, new)
    path.write_text(text)
    return True


FAILED = re.compile(r"^(?:FAILED|ERROR) (\S+)", re.MULTILINE)


def run_tests(tree: Path, tests: list[str], dsn: str, timeout: float) -> tuple[str, str, float]:
    # CYCLONE_MODEL=ci: the engine model derandomized, so that a verdict is the same each run.
    env = {
        **os.environ, "PYTHONPATH": str(tree), "CYCLONE_TEST_DSN": dsn, "CYCLONE_MODEL": "ci",
    }  # fmt: skip
    env.pop("PYTEST_ADDOPTS", None)
    started = time.monotonic()
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:randomly", *tests]
    try:
        proc = subprocess.run(
            cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return "killed", f"timed out after {timeout:.0f}s", time.monotonic() - started
    took = time.monotonic() - started
    if proc.returncode == 0:
        return "SURVIVED", "", took
    if proc.returncode == 5:
        return "error", "no tests ran", took
    found = FAILED.search(proc.stdout)
    first = found.group(1) if found else proc.stdout.strip().splitlines()[-1:] or ["?"]
    return "killed", first if isinstance(first, str) else first[0], took


def test_dsn() -> str:
    dsn = os.environ.get("CYCLONE_TEST_DSN")
    if dsn:
        return dsn
    sys.path.insert(0, str(ROOT))
    from cyclone.testing import server_dsn

    return server_dsn()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("words", nargs="*", help="run the mutants whose names contain these")
    parser.add_argument("--tiers", action="store_true",
                        help="run tests/unit and tests/db whole, not each mutant's subset")
    parser.add_argument("--tests", nargs="+", metavar="TEST",
                        help="run these tests (pytest arguments) for every mutant instead")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each mutant")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds per pytest run")
    args = parser.parse_args(argv)  # fmt: skip
    chosen = [m for m in MUTANTS if not args.words or any(w in m.name for w in args.words)]
    if args.list:
        for m in chosen:
            print(f"{m.name:40} {m.path:34} {' '.join(m.tests)}")
        return 0
    dsn = test_dsn()
    survived = 0
    with tempfile.TemporaryDirectory(prefix="cyclone-mutants-") as tmp:
        base = Path(tmp) / "base"
        copy_tree(base)
        # The unmutated tree must pass its subsets first, or a "killed" means nothing.
        if args.tests:
            chosen = [replace(m, tests=tuple(args.tests)) for m in chosen]
        subsets = sorted({t for m in chosen for t in m.tests})
        verdict, detail, took = run_tests(
            base, ["tests/unit", "tests/db"] if args.tiers else subsets, dsn, args.timeout
        )
        print(f"{'(unmutated)':40} {'passes' if verdict == 'SURVIVED' else verdict:9} "
              f"{took:6.1f}s {detail}", flush=True)  # fmt: skip
        if verdict != "SURVIVED":
            return 2
        for mutant in chosen:
            for _ in range(args.repeat):
                tree = Path(tmp) / mutant.name
                shutil.copytree(base, tree)
                try:
                    if not apply(mutant, tree):
                        verdict, detail, took = "n/a", f"old text not in {mutant.path}", 0.0
                    else:
                        # With --tiers, the subset first: pytest collects a file once, so
                        # this is the two tiers whole, in an order that fails early.
                        tiers = ["tests/unit", "tests/db"] if args.tiers else []
                        tests = [*mutant.tests, *tiers]
                        verdict, detail, took = run_tests(tree, tests, dsn, args.timeout)
                finally:
                    shutil.rmtree(tree, ignore_errors=True)
                survived += verdict == "SURVIVED"
                print(f"{mutant.name:40} {verdict:9} {took:6.1f}s {detail}", flush=True)
    print(f"{len(chosen)} mutants x {args.repeat}: {survived} survived")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
