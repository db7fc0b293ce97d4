"""The test server's parent directory is this user's alone (issue 22, item 2): in a shared
/tmp another user could make it first, with a postmaster.pid of their choosing in it."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

from cyclone import embedded
from cyclone.errors import ConfigError


def test_the_test_server_lives_under_a_per_user_directory():
    path = embedded.default_test_data_dir()
    assert path.parent == Path(tempfile.gettempdir()) / f"cyclone-{os.geteuid()}"


def test_a_private_directory_is_made_owner_only(tmp_path: Path):
    made = embedded.private_dir(tmp_path / "mine")
    assert oct(made.stat().st_mode & 0o777) == oct(0o700)
    assert embedded.private_dir(made) == made  # and found again as it is


@pytest.mark.parametrize(
    ("setup", "said"),
    [
        (lambda p: p.mkdir(mode=0o777) or p.chmod(0o777), "other users may write to it"),
        (lambda p: p.symlink_to(p.parent), "not a directory"),
        (lambda p: p.write_text(""), "not a directory"),
    ],
)
def test_a_directory_others_could_have_made_or_changed_is_refused(tmp_path: Path, setup, said):
    path = tmp_path / "planted"
    setup(path)
    with pytest.raises(ConfigError, match=said):
        embedded.private_dir(path)


def test_a_directory_owned_by_another_user_is_refused(tmp_path: Path):
    if os.geteuid() != 0:
        pytest.skip("only root can give a directory to another user")
    path = tmp_path / "theirs"
    path.mkdir(mode=0o700)
    os.chown(path, 65534, 65534)  # nobody
    with pytest.raises(ConfigError, match="owned by uid 65534"):
        embedded.private_dir(path)
