"""Every bench script imports: a module they name that moved is found here, not by the next
person who runs the bench (churn.py and million.py named `cyclone.client` for a stop)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def test_every_bench_script_imports() -> None:
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert "churn" in names and "runtime" in names
    code = "import importlib, sys\nfor n in sys.argv[1:]: importlib.import_module(n)"
    done = subprocess.run(
        [sys.executable, "-c", code, *names], cwd=BENCH, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
