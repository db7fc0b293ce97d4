"""The configuration registry, the TOML loader and the generated example (no database needed)."""

from __future__ import annotations

import dataclasses
import json
import tomllib
import urllib.parse
from decimal import Decimal
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from cyclone.config import (
    MAX_CONFIG_BYTES,
    SECTION_CLASSES,
    SECTION_DOCS,
    SETTINGS,
    DatabaseConfig,
    Settings,
    load_config,
    render_example,
    settings_as_dict,
)
from cyclone.durations import MAX_DURATION, format_duration, parse_duration
from cyclone.errors import ConfigError, CycloneError
from cyclone.redact import redact_dsn

ROOT = Path(__file__).resolve().parents[2]
CONFIG_FILES = sorted((ROOT / "config").glob("*.toml"))
EXAMPLE = ROOT / "config" / "cyclone.example.toml"
URL = "postgresql://cyclone:hunter2@db.internal:5432/cyclone"


def write(tmp_path: Path, text: str, name: str = "x.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def config_error(path: Path, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env={} if env is None else env)
    return str(info.value)


# --- defaults, files in config/, the example -------------------------------------------------


def test_no_file_gives_the_defaults_from_the_registry() -> None:
    settings = load_config(None, env={})
    assert settings == Settings()
    assert settings.database.url is None
    assert settings.supervisor.workers == 4
    assert settings.supervisor.kill_grace == 2.0
    assert settings.worker.lease_ttl == 30.0
    assert settings.scanner.retention == 7 * 86400.0
    assert settings.metrics.port == 9464
    assert settings.workflows.modules == ()
    assert settings.logging.level == "info"


def test_config_dir_holds_at_least_the_example() -> None:
    assert EXAMPLE in CONFIG_FILES


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_every_toml_file_in_config_dir_loads(path: Path) -> None:
    assert isinstance(load_config(path, env={}), Settings)


def test_the_example_file_is_exactly_what_render_example_generates() -> None:
    assert EXAMPLE.read_text(encoding="utf-8") == render_example(), (
        "regenerate it: python -m cyclone.config --example > config/cyclone.example.toml"
    )


def test_the_example_loads_to_exactly_the_defaults() -> None:
    assert load_config(EXAMPLE, env={}) == Settings()


def test_the_example_documents_every_setting_and_a_placeholder_url() -> None:
    text = render_example()
    for setting in SETTINGS:
        assert setting.doc
        assert f"{setting.key} = " in text
    assert '# url = "postgresql://cyclone:PASSWORD@db.internal:5432/cyclone"' in text
    assert all(len(line) <= 100 for line in text.splitlines())


def test_the_registry_and_the_dataclasses_list_the_same_keys_and_defaults() -> None:
    assert [f.name for f in dataclasses.fields(Settings)] == list(SECTION_DOCS)
    assert list(SECTION_CLASSES) == list(dict.fromkeys(s.section for s in SETTINGS))
    for section, cls in SECTION_CLASSES.items():
        registry = [s for s in SETTINGS if s.section == section]
        fields = dataclasses.fields(cls)
        assert [f.name for f in fields] == [s.key for s in registry], section
        assert [f.default for f in fields] == [s.default for s in registry], section


def test_every_default_passes_its_own_validation() -> None:
    for setting in SETTINGS:
        if setting.default is not None:
            value = setting.type.coerce(
                tomllib.loads(f"v = {setting.type.render(setting.default)}")["v"]
            )
            assert value == setting.default, setting.label
            assert setting.validator is None or setting.validator.test(value), setting.label


def test_settings_are_frozen() -> None:
    settings = load_config(None, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.supervisor.workers = 8  # type: ignore[misc]


# --- good values -------------------------------------------------------------------------------


def test_a_full_file_sets_every_section(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
        [database]
        url = "postgresql://cyclone@db/cyclone"
        migrate = false
        [supervisor]
        workers = 8
        kill_grace = "500ms"
        shutdown_timeout = 60
        max_steps_per_worker = 0
        [worker]
        lease_ttl = "1m"
        heartbeat_interval = 2.5
        poll_interval = "250ms"
        [scanner]
        enabled = false
        interval = "1h30m"
        batch_size = 100000
        retention = "2d"
        [metrics]
        enabled = false
        bind = "0.0.0.0"
        port = 0
        [workflows]
        modules = ["myapp.workflows", "billing"]
        [logging]
        level = "debug"
        format = "json"
        """,
    )
    s = load_config(str(path), env={})
    assert s.database == DatabaseConfig(url="postgresql://cyclone@db/cyclone", migrate=False)
    assert (s.supervisor.workers, s.supervisor.kill_grace) == (8, 0.5)
    assert (s.supervisor.shutdown_timeout, s.supervisor.max_steps_per_worker) == (60.0, 0)
    assert (s.worker.lease_ttl, s.worker.heartbeat_interval, s.worker.poll_interval) == (
        60.0,
        2.5,
        0.25,
    )
    assert (s.scanner.enabled, s.scanner.interval, s.scanner.retention) == (False, 5400.0, 172800.0)
    assert s.scanner.batch_size == 100000
    assert (s.metrics.enabled, s.metrics.bind, s.metrics.port) == (False, "0.0.0.0", 0)
    assert s.workflows.modules == ("myapp.workflows", "billing")
    assert (s.logging.level, s.logging.format) == ("debug", "json")


def test_a_key_value_connection_string_is_a_valid_url(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\nurl = "host=db dbname=cyclone"\n')
    assert load_config(path, env={}).database.url == "host=db dbname=cyclone"


# --- bad files -----------------------------------------------------------------------------------


def test_an_unknown_key_suggests_the_closest_key(tmp_path: Path) -> None:
    path = write(tmp_path, '[worker]\nlease_tl = "30s"\n')
    assert (
        config_error(path) == f'{path}: [worker] unknown key "lease_tl" (did you mean "lease_ttl"?)'
    )


def test_a_key_in_the_wrong_section_says_which_section_it_belongs_in(tmp_path: Path) -> None:
    path = write(tmp_path, "[scanner]\nworkers = 4\n")
    assert (
        config_error(path)
        == f'{path}: [scanner] unknown key "workers" (it belongs in [supervisor])'
    )


def test_an_unknown_section_suggests_the_closest_section(tmp_path: Path) -> None:
    path = write(tmp_path, "[superviser]\nworkers = 4\n")
    assert (
        config_error(path) == f'{path}: unknown section "superviser" (did you mean [supervisor]?)'
    )


def test_a_key_outside_any_section_suggests_its_section(tmp_path: Path) -> None:
    path = write(tmp_path, "workers = 4\n")
    assert config_error(path) == (
        f'{path}: unknown top-level key "workers" (did you mean [supervisor] workers?)'
    )


def test_a_section_given_as_a_plain_value_is_rejected(tmp_path: Path) -> None:
    path = write(tmp_path, "logging = 3\n")
    assert config_error(path) == f"{path}: logging: expected a table [logging], got 3"


def test_a_wrong_type_names_the_key_what_was_expected_and_what_was_given(tmp_path: Path) -> None:
    path = write(tmp_path, '[supervisor]\nworkers = "four"\n')
    assert config_error(path) == (
        f'{path}: [supervisor] workers: expected an integer >= 1, got "four"'
    )


BAD_VALUES = [
    ("supervisor", "workers", "0", "an integer >= 1"),
    ("supervisor", "workers", "4.0", "an integer >= 1"),
    ("supervisor", "max_steps_per_worker", "-1", "an integer >= 0"),
    ("scanner", "batch_size", "0", "an integer from 1 to 100000"),
    ("scanner", "batch_size", "100001", "an integer from 1 to 100000"),
    ("metrics", "port", "65536", "an integer from 0 to 65535"),
    ("metrics", "bind", "127", "a string"),
    ("database", "migrate", '"yes"', "true or false"),
    ("scanner", "enabled", "1", "true or false"),
    ("database", "url", "5", "connection string"),
    ("database", "url", '""', "connection string"),
    ("database", "url", '"mysql://u@h/db"', "connection string"),
    ("logging", "level", '"verbose"', 'one of "debug", "info", "warning", "error"'),
    ("logging", "level", '"INFO"', "one of"),
    ("logging", "format", '"xml"', 'one of "text", "json"'),
    ("workflows", "modules", '"myapp.workflows"', "importable dotted module names"),
    ("workflows", "modules", '["myapp..workflows"]', "importable dotted module names"),
    ("workflows", "modules", '["1st"]', "importable dotted module names"),
    ("workflows", "modules", "[1]", "importable dotted module names"),
    ("worker", "lease_ttl", '"0s"', "a duration > 0"),
    ("worker", "poll_interval", "0", "a duration > 0"),
    ("scanner", "interval", "{ seconds = 1 }", "a duration > 0"),
]


@pytest.mark.parametrize(("section", "key", "toml", "expected"), BAD_VALUES)
def test_a_bad_value_fails_with_one_line_naming_the_file_and_the_key(
    tmp_path: Path, section: str, key: str, toml: str, expected: str
) -> None:
    path = write(tmp_path, f"[{section}]\n{key} = {toml}\n")
    message = config_error(path)
    assert message.startswith(f"{path}: [{section}] {key}: expected ")
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize(
    ("section", "key"),
    [("supervisor", "workers"), ("metrics", "port"), ("scanner", "batch_size"),
     ("supervisor", "kill_grace"), ("worker", "lease_ttl")],
)  # fmt: skip
@pytest.mark.parametrize("flag", ["true", "false"])
def test_a_boolean_is_not_accepted_as_a_number(
    tmp_path: Path, section: str, key: str, flag: str
) -> None:
    path = write(tmp_path, f"[{section}]\n{key} = {flag}\n")
    assert config_error(path).endswith(f"got {flag}")


@pytest.mark.parametrize(
    "duration", ['"-5s"', "-1", '"5 minutes"', '""', '"1e3s"', '"s"', '"5x"', '"1h-30m"', "nan",
                 "inf", '"36501d"', '"٣s"', "[30]"],
)  # fmt: skip
def test_a_malformed_or_negative_duration_is_rejected(tmp_path: Path, duration: str) -> None:
    path = write(tmp_path, f"[supervisor]\nkill_grace = {duration}\n")
    assert config_error(path).startswith(f"{path}: [supervisor] kill_grace: expected a duration")


@pytest.mark.parametrize(
    ("duration", "why"),
    [('"-5s"', "must not be negative"), ("-1", "must not be negative"),
     ("-0.5", "must not be negative"), ('"36501d"', "longer than 36500d")],
)  # fmt: skip
def test_a_negative_or_too_long_duration_is_named_as_such(
    tmp_path: Path, duration: str, why: str
) -> None:
    """Issue 27, item 12: the message says what is wrong with a value that reads as one."""
    path = write(tmp_path, f"[worker]\nlease_ttl = {duration}\n")
    assert config_error(path).endswith(f"got {duration}: a duration {why}")


@pytest.mark.parametrize(
    ("lease_ttl", "heartbeat"),
    [("30s", "15s"), ("30s", "20s"), ("10s", "5s"), ("1s", "1s"), ("3s", "1001ms")],
)
def test_a_heartbeat_over_a_third_of_the_lease_ttl_is_rejected(
    tmp_path: Path, lease_ttl: str, heartbeat: str
) -> None:
    # A silent worker dies a heartbeat before its lease lapses: two heartbeats must fit before.
    path = write(
        tmp_path, f'[worker]\nlease_ttl = "{lease_ttl}"\nheartbeat_interval = "{heartbeat}"\n'
    )
    message = config_error(path)
    assert message.startswith(f"{path}: [worker] heartbeat_interval: expected at most a third")
    assert "lease_ttl" in message


@pytest.mark.parametrize(("lease_ttl", "heartbeat"), [("3s", "1s"), ("10s", "3333ms")])
def test_a_heartbeat_of_a_third_of_the_lease_ttl_is_accepted(
    tmp_path: Path, lease_ttl: str, heartbeat: str
) -> None:
    path = write(
        tmp_path, f'[worker]\nlease_ttl = "{lease_ttl}"\nheartbeat_interval = "{heartbeat}"\n'
    )
    settings = load_config(path, env={})
    assert settings.worker.heartbeat_interval * 3 <= settings.worker.lease_ttl


def test_a_shorter_lease_ttl_checks_the_default_heartbeat_too(tmp_path: Path) -> None:
    path = write(tmp_path, '[worker]\nlease_ttl = "8s"\n')
    assert "heartbeat_interval" in config_error(path)


def test_the_message_stays_on_one_line_even_for_a_file_name_with_line_breaks(
    tmp_path: Path,
) -> None:
    path = write(tmp_path, "[worker]\nlease_tl = 1\n", name="odd\nname\u2028.toml")
    message = config_error(path)
    assert len(message.splitlines()) == 1
    assert 'unknown key "lease_tl"' in message


def test_a_toml_syntax_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    path = write(tmp_path, "[supervisor]\nworkers = 4\nkill_grace = \n")
    message = config_error(path)
    assert message.startswith(f"{path}: invalid TOML: line 3")
    assert "\n" not in message


def test_a_duplicate_key_is_a_toml_error(tmp_path: Path) -> None:
    path = write(tmp_path, "[supervisor]\nworkers = 4\nworkers = 5\n")
    assert config_error(path).startswith(f"{path}: invalid TOML: ")


def test_a_file_over_one_mib_is_refused_before_parsing(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * MAX_CONFIG_BYTES + b"\n")
    assert (
        config_error(path) == f"{path}: the config file is larger than 1 MiB; refusing to parse it"
    )


def test_a_file_of_exactly_one_mib_is_parsed(tmp_path: Path) -> None:
    path = tmp_path / "big.toml"
    path.write_bytes(b"#" * (MAX_CONFIG_BYTES - 1) + b"\n")
    assert load_config(path, env={}) == Settings()


def test_deeply_nested_toml_is_a_config_error_not_a_crash(tmp_path: Path) -> None:
    path = write(tmp_path, "x = " + "[" * 100_000)
    assert config_error(path).startswith(f"{path}: invalid TOML")


def test_a_file_that_is_not_utf8_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes('[metrics]\nbind = "café"\n'.encode("latin-1"))
    assert config_error(path).startswith(f"{path}: not UTF-8")


def test_a_missing_file_is_a_config_error_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"
    assert config_error(path) == f"{path}: cannot read the config file: No such file or directory"


def test_config_error_is_a_cyclone_error() -> None:
    assert issubclass(ConfigError, CycloneError)


# --- the environment -----------------------------------------------------------------------------


def test_cyclone_database_url_overrides_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\nurl = "postgresql://file@db/cyclone"\n')
    env = {"CYCLONE_DATABASE_URL": "postgresql://env@db/cyclone"}
    assert load_config(path, env=env).database.url == "postgresql://env@db/cyclone"
    assert load_config(None, env=env).database.url == "postgresql://env@db/cyclone"


def test_an_empty_cyclone_database_url_counts_as_unset(tmp_path: Path) -> None:
    path = write(tmp_path, '[database]\nurl = "postgresql://file@db/cyclone"\n')
    env = {"CYCLONE_DATABASE_URL": ""}
    assert load_config(path, env=env).database.url == "postgresql://file@db/cyclone"


def test_the_environment_defaults_to_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CYCLONE_DATABASE_URL", "postgresql://env@db/cyclone")
    assert load_config(None).database.url == "postgresql://env@db/cyclone"


def test_a_bad_cyclone_database_url_is_reported_under_its_name() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env={"CYCLONE_DATABASE_URL": "mysql://u:hunter2@db/x"})
    assert str(info.value) == (
        'CYCLONE_DATABASE_URL: [database] url: expected a "postgresql://" URL or a "key=value" '
        'connection string, got "mysql://u:***@db/x"'
    )


# --- secrets --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("dsn", "redacted"),
    [
        (URL, "postgresql://cyclone:***@db.internal:5432/cyclone"),
        ("postgres://:s3cret@h/db", "postgres://:***@h/db"),
        ("postgresql://u:p@ss/w@rd@host/db", "postgresql://u:***@host/db"),
        ("postgresql://u@host/db", "postgresql://u@host/db"),
        ("postgresql://host/db", "postgresql://host/db"),
        ("host=h password=secret user=u", "host=h password=*** user=u"),
        ("host=h password = 'se cr\\'et' user=u", "host=h password = *** user=u"),
        ("host=h PASSWORD='unterminated secret", "host=h PASSWORD=***"),
        ("postgresql://h/db?password=secret", "postgresql://h/db?password=***"),
    ],
)
def test_redact_dsn_hides_the_password_in_both_forms(dsn: str, redacted: str) -> None:
    assert redact_dsn(dsn) == redacted


def test_settings_as_dict_is_plain_data_with_the_password_redacted() -> None:
    data = settings_as_dict(load_config(None, env={"CYCLONE_DATABASE_URL": URL}))
    assert data["database"]["url"] == "postgresql://cyclone:***@db.internal:5432/cyclone"
    assert data["workflows"]["modules"] == []
    assert json.loads(json.dumps(data)) == data
    assert set(data) == set(SECTION_DOCS)


def test_the_repr_of_settings_hides_the_password() -> None:
    settings = load_config(None, env={"CYCLONE_DATABASE_URL": URL})
    assert "hunter2" not in repr(settings)
    assert "cyclone:***@db.internal" in repr(settings)


# Markers on both ends: a leak of either end of the password shows up whatever its middle is.
passwords = st.text(st.characters(blacklist_categories=("Cc", "Cs")), max_size=24).map(
    lambda middle: f"Sekr1t{middle}Tk3s"
)


def toml_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)  # a TOML basic string, given no control chars


def assert_hidden(password: str, text: str) -> None:
    assert "Sekr1t" not in text and "Tk3s" not in text, (password, text)


def dsns(password: str) -> list[str]:
    quoted = password.replace("\\", "\\\\").replace("'", "\\'")
    return [
        f"postgresql://cyclone:{password}@db.internal:5432/cyclone",
        f"postgresql://cyclone:{urllib.parse.quote(password, safe='')}@db.internal/cyclone",
        f"host=db.internal user=cyclone password='{quoted}' dbname=cyclone",
        f"host=db.internal password={password.replace(' ', '')} dbname=cyclone",
    ]


@hsettings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(password=passwords)
def test_passwords_never_appear_in_error_messages(tmp_path: Path, password: str) -> None:
    for dsn in dsns(password):
        bad = [f"[metrics]\nport = {toml_string(dsn)}\n", f"database = {toml_string(dsn)}\n"]
        if dsn.startswith("postgresql://"):  # a mistyped scheme makes the url the bad value
            typo = "postgresq" + dsn.removeprefix("postgresql")
            bad.append(f"[database]\nurl = {toml_string(typo)}\n")
            with pytest.raises(ConfigError) as info:
                load_config(None, env={"CYCLONE_DATABASE_URL": typo})
            assert_hidden(password, str(info.value))
        for toml in bad:
            assert_hidden(password, config_error(write(tmp_path, toml)))


@hsettings(max_examples=60, deadline=None)
@given(password=passwords)
def test_passwords_never_appear_in_settings_as_dict_or_repr(password: str) -> None:
    for dsn in dsns(password):
        settings = load_config(None, env={"CYCLONE_DATABASE_URL": dsn})
        assert settings.database.url == dsn
        assert_hidden(password, json.dumps(settings_as_dict(settings), ensure_ascii=False))
        assert_hidden(password, repr(settings))
        assert_hidden(password, redact_dsn(dsn))


# --- durations ------------------------------------------------------------------------------------

UNIT_SECONDS = {"ms": Decimal("0.001"), "s": Decimal(1), "m": Decimal(60), "h": Decimal(3600)}
UNIT_SECONDS["d"] = Decimal(86400)
unit_parts = st.tuples(st.integers(0, 10**6), st.sampled_from(list(UNIT_SECONDS)))


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("500ms", 0.5), ("30s", 30.0), ("5m", 300.0), ("2h", 7200.0), ("7d", 604800.0),
     ("1h30m", 5400.0), ("1.5s", 1.5), (" 30s ", 30.0), ("30", 30.0), (0, 0.0), (2.5, 2.5)],
)  # fmt: skip
def test_parse_duration_reads_units_and_plain_seconds(text: object, seconds: float) -> None:
    assert parse_duration(text) == seconds


@given(parts=st.lists(unit_parts, min_size=1, max_size=5))
def test_parse_duration_round_trips_generated_unit_strings(parts: list[tuple[int, str]]) -> None:
    text = "".join(f"{n}{unit}" for n, unit in parts)
    exact = sum(n * UNIT_SECONDS[unit] for n, unit in parts)
    if exact > Decimal(MAX_DURATION):
        with pytest.raises(ValueError):
            parse_duration(text)
    else:
        assert parse_duration(text) == float(exact)


@given(seconds=st.floats(0, MAX_DURATION) | st.integers(0, 10**7).map(lambda ms: ms / 1000))
def test_format_duration_is_read_back_exactly(seconds: float) -> None:
    assert parse_duration(format_duration(seconds)) == seconds


garbage = (
    st.text()
    | st.text(alphabet="0123456789.smhd -+e_ ", max_size=12)
    | st.integers()
    | st.floats()
    | st.booleans()
    | st.none()
    | st.binary()
    | st.timedeltas()
    | st.lists(st.integers(), max_size=3)
    | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2)
)


@hsettings(max_examples=500)
@given(value=garbage)
def test_parse_duration_accepts_or_raises_value_error_and_nothing_else(value: object) -> None:
    try:
        seconds = parse_duration(value)
    except ValueError as exc:
        assert "\n" not in str(exc)
    else:
        assert isinstance(seconds, float)
        assert 0 <= seconds <= MAX_DURATION
        assert not isinstance(value, bool)


@pytest.mark.parametrize("value", [True, False, None, "", "-5s", "5 minutes", -0.5, float("nan")])
def test_parse_duration_rejects_bools_garbage_and_negatives(value: object) -> None:
    with pytest.raises(ValueError, match="invalid duration"):
        parse_duration(value)
