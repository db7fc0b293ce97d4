"""`cyclone.testing` works without pytest (issue 27, item 17): `pip install cyclone` has no
pytest, and a script or another runner may drive TestEnv; only the fixture needs pytest."""

from __future__ import annotations

import importlib.util
import sys

import pytest

import cyclone.testing


def test_the_harness_imports_without_pytest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pytest", None)  # `import pytest` raises ImportError
    spec = importlib.util.spec_from_file_location("testing_alone", cyclone.testing.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.TestEnv.__name__ == "TestEnv"
    assert not hasattr(module, "cyclone_env")  # the fixture alone needs pytest


def test_with_pytest_the_fixture_is_there() -> None:
    assert callable(cyclone.testing.cyclone_env)
