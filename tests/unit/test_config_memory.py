"""`[worker] max_memory`: a size, validated like every other key (one line, exit 2)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cyclone.config import load_config
from cyclone.errors import ConfigError
from cyclone.supervisor.__main__ import main as supervisor_main


def write(tmp_path: Path, value: str) -> Path:
    path = tmp_path / "c.toml"
    path.write_text(f"[worker]\nmax_memory = {value}\n")
    return path


@pytest.mark.parametrize(
    ("value", "size"),
    [('"64M"', 64 << 20), ('"2GiB"', 2 << 30), ('"3G"', 3 << 30), ("268435456", 256 << 20),
     ('"1T"', 1 << 40), ('"65536K"', 64 << 20)],
)  # fmt: skip
def test_sizes_are_read_in_powers_of_1024(tmp_path: Path, value: str, size: int) -> None:
    assert load_config(write(tmp_path, value)).worker.max_memory == size


def test_unset_means_no_limit() -> None:
    assert load_config(None).worker.max_memory is None


@pytest.mark.parametrize(
    "value", ['"63M"', "67108863", '"lots"', '"1.5G"', '"-1G"', "true", '"2 GB"', "0", '"2P"']
)
def test_a_bad_size_is_one_line_naming_the_key(tmp_path: Path, value: str) -> None:
    path = write(tmp_path, value)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{path}: [worker] max_memory: expected a size of at least 64M")


def test_the_supervisor_exits_2_with_one_line_on_a_bad_size(tmp_path: Path, capsys) -> None:
    path = write(tmp_path, '"12M"')
    assert supervisor_main(["--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "[worker] max_memory" in err and '"12M"' in err
