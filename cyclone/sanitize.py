"""Text from outside (workflow and node names, error text, payloads) made safe for a terminal
and a log line, and log records without a DSN's password.

A name or an error may hold anything: a newline splits a log line in two (a forged second
line, to whoever reads the log), an escape sequence reaches the terminal that shows it (it can
retitle, recolour or hide text), a bidi override reorders what is read. `printable` escapes
them, visibly (`\\n`, `\\x1b`), so nothing is lost and nothing is obeyed.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from cyclone.redact import redact_secrets

# C0 and C1 controls, DEL, the Unicode line and paragraph separators, and the bidirectional
# embeddings, overrides and isolates. A tab too: it breaks a table's columns.
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape(match: re.Match[str]) -> str:
    char = match.group(0)
    if char in _NAMED:
        return _NAMED[char]
    code = ord(char)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: object) -> str:
    """`text` on one line, with every control character escaped."""
    return _UNSAFE.sub(_escape, str(text))


def printable_lines(text: object) -> str:
    """Like `printable`, but keeping the line breaks (a traceback is several lines)."""
    return "\n".join(printable(line) for line in str(text).split("\n"))


def plain_text(text: object, *, lines: bool = True, style: str = "") -> Any:
    """A rich Text of `text`: never read as markup (a workflow named "markup[/oops]" is shown,
    not parsed), control characters escaped, line breaks kept when `lines`."""
    from rich.text import Text

    return Text(printable_lines(text) if lines else printable(text), style=style)


class SafeRecords(logging.Filter):
    """On a handler: every record it writes is one line (a traceback aside), with control
    characters escaped and the DSN's password removed, whatever the message quoted."""

    def __init__(self, dsn: str | None = None) -> None:
        super().__init__()
        self.dsn = dsn

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a bad format string: logging itself would report it
            return True
        record.msg, record.args = printable(redact_secrets(message, self.dsn)), None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            # Lines of a traceback keep their breaks; what they quote is cleaned line by line.
            record.exc_text = "\n".join(
                printable(redact_secrets(line, self.dsn)) for line in record.exc_text.split("\n")
            )
            record.exc_info = None  # the formatter shows exc_text as it is now
        if record.stack_info:
            record.stack_info = printable_lines(record.stack_info)
        return True
