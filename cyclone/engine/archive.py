"""Archival of history before retention drops it (`[scanner] archive_dir`, `archive_command`).

A partition of history leaves as JSON lines: one line per run of it, the run's columns with
its steps (each with its failed attempts) nested, as `COPY ... TO STDOUT` streams them from the
server to the scanner. Written to `archive_dir/cyclone-history-<start>.jsonl` (whole or not
at all: a temporary name, renamed once complete), or piped to `archive_command`'s standard
input (run by the shell, with CYCLONE_ARCHIVE_FROM and CYCLONE_ARCHIVE_TO in its environment,
the partition's range), which must exit 0. Either failing raises ArchiveFailed and the
partition is kept, to be tried again on the next pass: history is never dropped unarchived.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import IO, Any

import psycopg

from cyclone.errors import CycloneError
from cyclone.sql import QUERIES

Conn = psycopg.Connection[Any]
Archive = Callable[[Conn, datetime, datetime], None]


class ArchiveFailed(CycloneError):
    """A partition could not be archived; it is kept."""


def _copy(conn: Conn, lo: datetime, hi: datetime, out: IO[bytes]) -> int:
    """Stream the partition's runs to `out`; returns the bytes written."""
    written = 0
    with (
        conn.transaction(),
        conn.cursor().copy(QUERIES["history_archive"], {"lo": lo, "hi": hi}) as copy,
    ):
        for chunk in copy:
            out.write(chunk)
            written += len(chunk)
    return written


def to_directory(directory: str) -> Archive:
    def archive(conn: Conn, lo: datetime, hi: datetime) -> None:
        final = Path(directory) / f"cyclone-history-{lo.strftime('%Y%m%dT%H%M%SZ')}.jsonl"
        partial = final.with_suffix(".jsonl.partial")
        try:
            with partial.open("wb") as out:
                _copy(conn, lo, hi, out)
                out.flush()
                os.fsync(out.fileno())
            partial.replace(final)
        except OSError as exc:
            raise ArchiveFailed(f"cannot archive history to {final}: {exc}") from None

    return archive


def to_command(command: str) -> Archive:
    def archive(conn: Conn, lo: datetime, hi: datetime) -> None:
        env = dict(
            os.environ, CYCLONE_ARCHIVE_FROM=lo.isoformat(), CYCLONE_ARCHIVE_TO=hi.isoformat()
        )
        proc = subprocess.Popen(command, shell=True, stdin=subprocess.PIPE, env=env)
        assert proc.stdin is not None
        try:
            _copy(conn, lo, hi, proc.stdin)
            proc.stdin.close()
        except BrokenPipeError:
            pass  # its exit status says what happened
        finally:
            code = proc.wait()
        if code != 0:
            raise ArchiveFailed(f"archive_command exited with status {code}: history kept")

    return archive


def archiver(archive_dir: str | None, archive_command: str | None) -> Archive | None:
    """The archive the scanner's settings ask for, or None (drop without archiving)."""
    if archive_command:
        return to_command(archive_command)
    if archive_dir:
        return to_directory(archive_dir)
    return None
