"""The web console (`cyclone console`, the `cyclone[console]` extra; docs/console.md).

app.py      the Starlette application: routes, the read-only and action pools, rendering
reads.py    each page's reads, bounded by their indexes (cyclone/sql/console.sql)
forms.py    query strings and form fields, checked (one clear message for bad input)
guard.py    sign-in with the token, sessions, CSRF, the Host check, security headers
templates/  Jinja2 pages and the fragments the live parts refresh (autoescaped)
static/     the stylesheet and the small script that refreshes the live parts

Imported only by `cyclone console`: the core never needs Starlette, uvicorn or Jinja2.
"""

from __future__ import annotations

from cyclone.console.app import ConsoleSettings, create_app

__all__ = ["ConsoleSettings", "create_app"]
