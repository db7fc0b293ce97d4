"""A throw-away PgBouncer in transaction mode in front of a PostgreSQL's unix socket.

Used by tests/process/test_pooler.py and bench/pooler.py. It listens on a free loopback port
with `auth_type = any` (every client logs in as the server user of the database entry: the
embedded server trusts its socket) and no unix socket of its own. PgBouncer refuses to run as
root; as root it is started with `-u` as the owner of the server's socket directory (the
embedded server's `pgserver` user), and its files live in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict, make_conninfo


def pgbouncer_binary() -> str | None:
    """The pgbouncer executable (Debian installs it in /usr/sbin, often not on PATH)."""
    return shutil.which("pgbouncer") or shutil.which("pgbouncer", path="/usr/sbin:/usr/local/sbin")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class PgBouncer:
    """`with PgBouncer(server_dsn, pool_size=10) as pooler:` then connect to `pooler.dsn()`."""

    def __init__(
        self,
        server_dsn: str,
        *,
        pool_size: int = 10,
        search_path: str | None = None,
        max_client_conn: int = 400,
    ) -> None:
        self.binary = pgbouncer_binary()
        if self.binary is None:
            raise FileNotFoundError("pgbouncer is not installed")
        params = conninfo_to_dict(server_dsn)
        host = str(params.get("host") or "/tmp")
        if not host.startswith("/"):
            raise ValueError("the harness fronts a server's unix socket; got host " + host)
        self.server = params
        self.pool_size = pool_size
        self.search_path = search_path
        self.max_client_conn = max_client_conn
        self.dir = Path(tempfile.mkdtemp(prefix="cyclone-pgbouncer-"))
        self.port = 0
        self.proc: subprocess.Popen[bytes] | None = None
        self.user = pwd.getpwuid(os.stat(host).st_uid).pw_name if os.getuid() == 0 else None

    @property
    def log_path(self) -> Path:
        return self.dir / "pgbouncer.log"

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def dsn(self, **extra: str) -> str:
        """A client DSN through the pooler (no password: `auth_type = any`)."""
        return make_conninfo(
            host="127.0.0.1", port=str(self.port), dbname="cyclone", user="cyclone", **extra
        )

    def config(self) -> str:
        server = self.server
        entry = (
            f"host={server['host']} port={server.get('port') or 5432} "
            f"dbname={server.get('dbname') or 'postgres'} user={server.get('user') or 'postgres'}"
        )
        if self.search_path:
            # Run once per server connection: the way to give every session of this database
            # entry a schema when clients cannot send `options` through the pooler.
            entry += f" connect_query='SET search_path = {self.search_path}'"
        return "\n".join(
            [
                "[databases]",
                f"cyclone = {entry}",
                "[pgbouncer]",
                "listen_addr = 127.0.0.1",
                f"listen_port = {self.port}",
                "unix_socket_dir =",
                "auth_type = any",
                "pool_mode = transaction",
                f"default_pool_size = {self.pool_size}",
                "min_pool_size = 0",
                "reserve_pool_size = 0",
                f"max_client_conn = {self.max_client_conn}",
                # Cyclone's processes send statement timeouts as startup options; PgBouncer
                # refuses unknown startup parameters unless told to ignore them.
                "ignore_startup_parameters = options",
                f"logfile = {self.log_path}",
                f"pidfile = {self.dir / 'pgbouncer.pid'}",
                "log_connections = 0",
                "log_disconnections = 0",
                "",
            ]
        )

    def start(self, timeout: float = 10.0) -> None:
        for _ in range(5):  # another process may take the free port before PgBouncer does
            self.port = free_port()
            ini = self.dir / "pgbouncer.ini"
            ini.write_text(self.config())
            self.log_path.touch()
            command = [self.binary or "pgbouncer", "-q"]
            if self.user:
                shutil.chown(self.dir, self.user)
                for path in self.dir.iterdir():
                    shutil.chown(path, self.user)
                command += ["-u", self.user]
            # Its own complaints before the log file is open (a bad config) go there too.
            with self.log_path.open("ab") as log:
                self.proc = subprocess.Popen(
                    [*command, str(ini)], stdout=subprocess.DEVNULL, stderr=log
                )
            if self._wait_listening(timeout):
                return
            self.stop()
        raise RuntimeError(f"pgbouncer did not start:\n{self.log()}")

    def _wait_listening(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        assert self.proc is not None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                return False
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2),
            ):
                return True
            time.sleep(0.02)
        return False

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # immediate shutdown: no client is waited for
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> PgBouncer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
