"""Debian's chromium, driven by Selenium through Debian's chromium-driver: headless, on a
fresh profile, with nothing fetched from the network (no Selenium Manager, no updates)."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

CHROMIUM = "/usr/bin/chromium"
DRIVER = "/usr/bin/chromedriver"
DESKTOP = (1280, 800)
PHONE = (390, 844)
FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage", "--hide-scrollbars",
]  # fmt: skip


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    if not (os.access(CHROMIUM, os.X_OK) and shutil.which(DRIVER)):
        pytest.fail(f"{CHROMIUM} and {DRIVER} are needed: apt-get install chromium chromium-driver")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=DRIVER))
    try:
        set_size(driver, DESKTOP)
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def set_size(driver: Any, size: tuple[int, int]) -> None:
    """The viewport (not the window) at `size`, as a device of that screen shows the page."""
    driver.execute_cdp_cmd("Emulation.setDeviceMetricsOverride", {
        "width": size[0], "height": size[1], "deviceScaleFactor": 1,
        "mobile": size[0] < 600,
    })  # fmt: skip
