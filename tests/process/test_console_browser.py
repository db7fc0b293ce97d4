"""The web console in a real browser (Debian's chromium, through Selenium), on a real
supervisor: find a failed run by its error text, open it, see why it died, retry it from the
DLQ with a new deadline and watch it complete without reloading; bulk-cancel a set; watch a
supervisor's worker rows appear and go. Each page is checked at a phone's width too: nothing
wider than the screen. CYCLONE_CONSOLE_SCREENSHOTS=DIR keeps the screenshots (docs/console/)."""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

from console_server import TOKEN, serve
from proc_browser import DESKTOP, PHONE, chromium, set_size
from proc_helpers import wait_for

from cyclone.testing import TestEnv

FLOWS = {"workflows__modules": '["proc_console_flows"]'}
PAGES = ["/", "/runs", "/dlq", "/limits", "/schedules", "/fleet"]


def _by(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_element(By.CSS_SELECTOR, css)


def _all(driver, css: str):
    from selenium.webdriver.common.by import By

    return driver.find_elements(By.CSS_SELECTOR, css)


def _until(driver, condition, what: str, timeout: float = 20):
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.support.ui import WebDriverWait

    # An element found on a page that a click or a live refresh has just replaced is stale:
    # looked for again on the next poll.
    return WebDriverWait(
        driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
    ).until(lambda d: condition(d), message=what)


def _shoot(driver, tmp: Path, name: str) -> None:
    """A screenshot at the current size; at a phone's width, the page must fit across."""
    width = driver.execute_script("return window.innerWidth")
    if width < 600:
        wide = driver.execute_script("return document.documentElement.scrollWidth")
        assert wide <= width, f"{name}: {wide}px wide on a {width}px screen"
    path = tmp / f"{name}.png"
    driver.save_screenshot(str(path))
    keep = os.environ.get("CYCLONE_CONSOLE_SCREENSHOTS")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(path, Path(keep) / path.name)


def _shoot_both(driver, tmp: Path, name: str) -> None:
    """The page at 1280x800 and at a phone's 390x844 (NAME-desktop.png, NAME-phone.png)."""
    _shoot(driver, tmp, f"{name}-desktop")
    set_size(driver, PHONE)
    _shoot(driver, tmp, f"{name}-phone")
    set_size(driver, DESKTOP)


def _submit(env: TestEnv, tmp: Path, refs: list[str]) -> dict[str, str]:
    return {
        ref: env.client.submit("console-pay", {"ref": ref, "flag": str(tmp / f"flag-{ref}")})
        for ref in refs
    }


def _ended(env: TestEnv, run_id: str) -> str | None:
    state = env.client.get_run(run_id).state
    return state if state in ("completed", "failed", "cancelled") else None


def test_find_a_failed_run_see_why_retry_it_and_watch_it_complete(
    env: TestEnv, supervisor, tmp_path: Path
):
    supervisor(workers=2, **FLOWS)
    runs = _submit(env, tmp_path, ["ref-A", "ref-B", "ref-C"])
    for run_id in runs.values():
        wait_for(lambda r=run_id: _ended(env, r), 30, "the runs to fail")
    with serve(env.dsn, token=TOKEN) as base, chromium(tmp_path / "profile") as driver:
        # Find it by its error text.
        driver.get(f"{base}/runs")
        _by(driver, "#f-error").send_keys("funds (ref ref-B)")
        _by(driver, "#f-apply").click()
        # The links are read in the wait: those of the page before the filter's went stale
        # under a read after it (as CI saw once); only the filtered page lists ref-B alone.
        _until(
            driver,
            lambda d: [a.text for a in _all(d, "#runs td.id a")] == [runs["ref-B"]],
            "the filtered runs: ref-B's alone",
        )
        _shoot(driver, tmp_path, "runs-filtered-desktop")
        _until(driver, lambda d: _by(d, "#runs td.id a").click() or True, "a click on ref-B")
        # Why it died: the kill reason and the whole error.
        assert _until(driver, lambda d: _by(d, "#kill-reason").text, "the reason") == "error"
        assert "card declined: insufficient funds (ref ref-B)" in _by(driver, "#failure-error").text
        assert "Traceback" in _by(driver, "#failure-error").text
        _shoot_both(driver, tmp_path, "run-failed")

        # Sign in, retry it from the DLQ with a new deadline.
        (tmp_path / "flag-ref-B").touch()
        driver.get(f"{base}/dlq?reason=error")
        _by(driver, "#sign-in").click()
        _by(driver, "#token").send_keys(TOKEN)
        _by(driver, "#sign-in-submit").click()
        _until(driver, lambda d: _all(d, "#retry-selected"), "the retry button")
        row = next(r for r in _all(driver, "#dead tbody tr") if runs["ref-B"] in r.text)
        row.find_element("css selector", 'input[name="step_id"]').click()
        _by(driver, "#retry-deadline").send_keys("10m")
        _shoot_both(driver, tmp_path, "dlq")
        _by(driver, "#retry-selected").click()
        outcomes = _until(driver, lambda d: _by(d, "#outcomes").text, "the outcome")
        assert "is running again" in outcomes and runs["ref-B"] in outcomes
        _by(driver, "#outcomes a.id").click()
        # The page refreshes itself until the run completes: no reload.
        _until(driver, lambda d: _by(d, "#run-state").text == "completed", "completed", 30)
        assert env.client.get_run(runs["ref-B"]).state == "completed"
        assert env.client.get_run(runs["ref-A"]).state == "failed"  # only the one selected
        _shoot(driver, tmp_path, "run-completed-desktop")


def test_bulk_cancel_a_set_of_runs(env: TestEnv, supervisor, tmp_path: Path):
    supervisor(workers=1, **FLOWS)
    held = env.client.submit_many("console-hold", [{"i": i} for i in range(4)])
    other = env.client.submit("console-hold", {"i": "other"})
    with serve(env.dsn, token=TOKEN) as base, chromium(tmp_path / "profile") as driver:
        driver.get(f"{base}/login?back=/runs")
        _by(driver, "#token").send_keys(TOKEN)
        _by(driver, "#sign-in-submit").click()
        driver.get(f"{base}/runs?workflow=console-hold&state=running")
        _until(driver, lambda d: len(_all(d, '#runs input[name="run_id"]')) == 5, "5 runs")
        for box in _all(driver, '#runs input[name="run_id"]'):
            if box.get_attribute("value") != other:
                box.click()
        _shoot_both(driver, tmp_path, "runs")
        _by(driver, "#cancel-selected").click()
        text = _until(
            driver, lambda d: (t := _by(d, "h1").text).startswith("Cancel") and t, "the outcome"
        )
        assert text == "Cancel: 4 of 4 done"
    assert [env.client.get_run(r).state for r in held] == ["cancelled"] * 4
    assert env.client.get_run(other).state == "running"


def test_a_workers_row_appears_and_goes_live(env: TestEnv, supervisor, tmp_path: Path):
    with serve(env.dsn) as base, chromium(tmp_path / "profile") as driver:
        driver.get(f"{base}/fleet")
        assert "No supervisor has published itself." in _by(driver, "#supervisors").text
        proc = supervisor(workers=2, **FLOWS)
        pids = [str(p) for p in proc.wait_ready(2)]

        def rows(d):
            return [r.get_attribute("data-pid") for r in _all(d, "#workers tr.worker")]

        _until(driver, lambda d: sorted(rows(d)) == sorted(pids), "the workers' rows", 30)
        # Something to show on every page of the tour.
        failed = _submit(env, tmp_path, ["ref-X", "ref-Y"])
        env.client.submit_many("console-hold", [{"i": i} for i in range(3)])
        env.client.submit("console-nap", {"secs": 20})
        env.client.submit_many("console-keyed", [{"account": "acme"}] * 3)
        env.client.set_rate_limit("smtp", rate=5, per=1.0, burst=10)
        for run_id in failed.values():
            wait_for(lambda r=run_id: _ended(env, r), 30, "the runs to fail")
        for path in PAGES:
            driver.get(f"{base}{path}")
            name = path.strip("/") or "overview"
            _shoot_both(driver, tmp_path, name)
        driver.get(f"{base}/fleet")
        _until(driver, lambda d: sorted(rows(d)) == sorted(pids), "the workers' rows", 30)
        # A planned stop removes its rows: the page sees them go without a reload.
        proc.popen.send_signal(signal.SIGTERM)
        proc.popen.wait(30)
        _until(driver, lambda d: rows(d) == [], "the rows to go", 30)
        assert "No supervisor has published itself." in _by(driver, "#supervisors").text
