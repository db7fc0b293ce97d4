"""The console's pure parts: its [console] settings (the token is never echoed), where an
action may send the browser next, and which Host names a loopback console answers."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from cyclone.config import load_config
from cyclone.console import forms, guard
from cyclone.errors import ConfigError

TOKEN = "a-token-of-more-than-16-chars"


def _config(tmp_path, text: str):
    path = tmp_path / "c.toml"
    path.write_text(text)
    return path


def test_the_token_comes_from_the_file_or_the_environment_and_is_never_shown(tmp_path):
    path = _config(tmp_path, f'[console]\ntoken = "{TOKEN}"\nport = 9000\n')
    settings = load_config(path, env={})
    assert settings.console.token == TOKEN and settings.console.port == 9000
    assert TOKEN not in repr(settings) and "<set>" in repr(settings.console)
    other = "another-token-0123456789"
    assert load_config(path, env={"CYCLONE_CONSOLE_TOKEN": other}).console.token == other
    assert load_config(None, env={}).console.token is None


@pytest.mark.parametrize("bad", ["short", "has a space in it, long", "tab\there-0123456789"])
def test_a_bad_token_is_refused_without_being_echoed(tmp_path, bad: str):
    path = _config(tmp_path, f'[console]\ntoken = "{bad}"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, env={})
    assert "[console] token: expected a string of at least 16 characters" in str(err.value)
    assert bad not in str(err.value)
    with pytest.raises(ConfigError) as err:
        load_config(None, env={"CYCLONE_CONSOLE_TOKEN": bad})
    assert str(err.value).startswith("CYCLONE_CONSOLE_TOKEN: ") and bad not in str(err.value)


def test_a_trace_url_needs_its_trace_id(tmp_path):
    good = _config(tmp_path, '[console]\ntrace_url = "https://j.internal/trace/{trace_id}"\n')
    assert load_config(good, env={}).console.trace_url.endswith("{trace_id}")
    bad = _config(tmp_path, '[console]\ntrace_url = "javascript:alert(1)"\n')
    with pytest.raises(ConfigError, match=r"\[console\] trace_url: expected an http\(s\) URL"):
        load_config(bad, env={})


@pytest.mark.parametrize(
    "value",
    ["//evil.example/x", "https://evil.example/", "/\\evil.example", "javascript:alert(1)",
     "/ok\r\nSet-Cookie: x=1", "", "relative/path"],
)  # fmt: skip
def test_an_action_sends_the_browser_back_to_this_console_only(value: str):
    assert forms.back(value, "/") == "/"


def test_an_action_sends_the_browser_back_to_the_page_it_came_from():
    assert forms.back("/dlq?reason=timeout&before=x", "/") == "/dlq?reason=timeout&before=x"


@given(st.text(max_size=80))
def test_wherever_back_points_it_is_a_path_of_this_site(value: str):
    got = forms.back(value, "/")
    assert got.startswith("/") and not got.startswith("//") and "\\" not in got
    assert all(32 < ord(c) < 127 for c in got)


@pytest.mark.parametrize(
    ("bind", "host", "allowed"),
    [
        ("127.0.0.1", "127.0.0.1:8465", True),
        ("127.0.0.1", "localhost:8465", True),
        ("127.0.0.1", "[::1]:8465", True),
        ("127.0.0.1", "LOCALHOST", True),
        ("127.0.0.1", "evil.example:8465", False),
        ("127.0.0.1", "127.0.0.1.evil.example", False),
        ("127.0.0.1", None, False),
        ("0.0.0.0", "console.internal", True),
    ],
)
def test_a_loopback_console_answers_only_to_loopback_names(bind, host, allowed):
    assert guard.host_allowed(bind, host) is allowed


def test_the_csrf_token_is_the_sessions_own():
    gate = guard.Guard(TOKEN)
    one, two = gate.new_session(), gate.new_session()
    assert gate.signed_in(one) and not gate.signed_in("forged")
    assert gate.csrf_ok(one, gate.csrf(one)) and not gate.csrf_ok(two, gate.csrf(one))
    assert not guard.Guard(TOKEN).csrf_ok(one, gate.csrf(one))  # a key per process
    gate.end_session(one)
    assert not gate.signed_in(one)
    assert not guard.Guard(None).signed_in(two)


def test_without_the_extra_the_command_says_what_to_install(monkeypatch, capsys):
    import sys

    from cyclone.cli import main

    monkeypatch.setitem(sys.modules, "uvicorn", None)  # as if not installed
    assert main(["--dsn", "postgresql://nowhere.invalid/x", "console"]) == 2
    assert "pip install 'cyclone[console]'" in capsys.readouterr().err
