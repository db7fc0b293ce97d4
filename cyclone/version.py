"""The installed version, for `--version` on both programs."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    try:
        return version("cyclone")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"
