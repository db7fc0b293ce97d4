"""A worker's environment without the database's secrets, before any handler runs.

Whatever a handler starts inherits the worker's environment: the supervisor's
`CYCLONE_DATABASE_URL` (password included) would be in every subprocess's environment, in
what crash reporters and `env` dumps show, and in each one's /proc/PID/environ. A worker needs
none of it: its DSN came with its options, built before the fork. So it drops, in its own
process only, the variables that carry the password: by name, and any other whose value is
the password or a connection string holding it (a platform's DATABASE_URL, say).

This is not a sandbox: the handler runs in the worker, which holds the DSN in memory, and as
the same user it can read the supervisor's /proc/PID/environ (a systemd credential avoids
that: see the unit file). It keeps the password out of what is passed on.
"""

from __future__ import annotations

import os

from psycopg.conninfo import conninfo_to_dict, make_conninfo

from cyclone.config import ENV_DATABASE_URL
from cyclone.redact import secrets_of

# libpq reads PGPASSWORD at every connection: a DSN without a password relies on it.
PGPASSWORD = "PGPASSWORD"
SECRET_VARIABLES = (ENV_DATABASE_URL, PGPASSWORD)
# A shorter password would match unrelated values (and guards nothing anyway).
MIN_SECRET = 4


def scrub_environment(dsn: str) -> str:
    """Drop the secret-bearing variables from this process's environment; returns the DSN to
    connect with from now on (PGPASSWORD, if the DSN relied on it, moved into it)."""
    password = os.environ.get(PGPASSWORD)
    if password and not conninfo_to_dict(dsn).get("password"):
        dsn = make_conninfo(dsn, password=password)
    secrets = [s for s in secrets_of(dsn) if len(s) >= MIN_SECRET]
    for name, value in list(os.environ.items()):
        if name in SECRET_VARIABLES or any(_carries(value, secret) for secret in secrets):
            del os.environ[name]  # unsetenv too: what subprocesses inherit
    return dsn


def _carries(value: str, secret: str) -> bool:
    """Whether a variable's value is the password, or a connection string holding it. Not
    any value that contains it: with a password "postgres", HOME=/var/lib/postgresql must
    stay (a handler without HOME breaks in ways that hide the cause)."""
    if value == secret:
        return True
    return secret in value and ("://" in value or "password" in value.lower())
