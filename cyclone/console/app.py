"""The console's web application: routes, the database pools, rendering.

Pages are rendered on the server (Jinja2, every value escaped); the parts that change by
themselves (the fleet, the counts, a live run) are re-fetched as HTML fragments by the small
script in static/console.js. Reads run on a pool of read-only sessions; the actions (DLQ
retry, cancel) call the engine on a session of their own, only with a token configured.
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import resources
from typing import Any
from urllib.parse import urlencode

import psycopg
from jinja2 import Environment, PackageLoader, select_autoescape
from psycopg.rows import dict_row
from psycopg_pool import ConnectionPool
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Receive, Scope, Send

from cyclone.console import forms, guard, reads
from cyclone.db import with_options
from cyclone.display import seconds, when
from cyclone.engine.control import cancel_run
from cyclone.engine.dlq import retry_dead_step
from cyclone.errors import CycloneError
from cyclone.redact import redact_error
from cyclone.sanitize import printable, printable_lines
from cyclone.sql import QUERIES
from cyclone.states import ErrorKind, RunState

READ_TIMEOUT_MS = 5000
ACTION_TIMEOUT_MS = 30_000
REFRESH_MS = 2000  # how often the live parts refresh

# What each kill or failure means, said once for the run page and the DLQ.
REASONS = {
    "error": "the handler raised (or returned something that is not JSON)",
    "timeout": "an attempt ran past its node's timeout: the worker was killed",
    "crashed": "the worker process died during the attempt",
    "lease_expired": "the lease was not renewed (host lost): the scanner reclaimed the step",
    "deadline": "the run's deadline passed: every live step was killed",
    "max_wait": "a wait or child node waited longer than its max_wait",
    "child_failed": "the child run failed or was cancelled",
    "cancelled": "the run was cancelled",
    "too_many_items": "the map's items exceeded its max_items",
}


@dataclass(frozen=True, slots=True)
class ConsoleSettings:
    """What `create_app` needs. `read_dsn`: where pages read (a replica; None: `dsn`)."""

    dsn: str
    token: str | None = None
    bind: str = "127.0.0.1"
    trace_url: str | None = None
    read_dsn: str | None = None


class Database:
    """A pool of read-only sessions for pages; one of writable ones for actions."""

    def __init__(self, settings: ConsoleSettings) -> None:
        self.dsn = settings.dsn
        kwargs = {
            "autocommit": True, "row_factory": dict_row, "prepare_threshold": None,
            "fallback_application_name": "cyclone-console",
        }  # fmt: skip
        # Read-only by the session's default: even a DSN that may write cannot from a page.
        read_options = f"-c default_transaction_read_only=on -c statement_timeout={READ_TIMEOUT_MS}"
        self.reads = ConnectionPool(
            with_options(settings.read_dsn or settings.dsn, read_options),
            kwargs=kwargs, min_size=1, max_size=4, open=False, name="console-reads",
        )  # fmt: skip
        self.writes = None
        if settings.token is not None:
            self.writes = ConnectionPool(
                with_options(settings.dsn, f"-c statement_timeout={ACTION_TIMEOUT_MS}"),
                kwargs=kwargs, min_size=0, max_size=2, open=False, name="console-actions",
            )  # fmt: skip

    def open(self) -> None:
        self.reads.open(wait=False)
        if self.writes is not None:
            self.writes.open(wait=False)

    def close(self) -> None:
        self.reads.close()
        if self.writes is not None:
            self.writes.close()

    @contextlib.contextmanager
    def read(self) -> Iterator[psycopg.Connection[Any]]:
        with self.reads.connection(timeout=10) as conn:
            yield conn

    @contextlib.contextmanager
    def write(self) -> Iterator[psycopg.Connection[Any]]:
        assert self.writes is not None
        with self.writes.connection(timeout=10) as conn:
            yield conn


def _templates() -> Environment:
    env = Environment(
        loader=PackageLoader("cyclone.console", "templates"),
        autoescape=select_autoescape(default=True, default_for_string=True),
        trim_blocks=True,
        lstrip_blocks=True,
    )
    env.filters["when"] = when
    env.filters["dur"] = seconds
    env.filters["name"] = lambda v: "-" if v is None else printable(v)
    env.filters["text"] = lambda v: "" if v is None else printable_lines(v)
    env.filters["first_line"] = lambda v: "" if v is None else printable(str(v).split("\n")[0])
    env.filters["ago"] = _ago
    env.filters["iso"] = lambda v: "" if v is None else v.astimezone(UTC).isoformat()
    env.globals["REASONS"] = REASONS
    env.globals["RUN_STATES"] = [s.value for s in RunState]
    env.globals["ERROR_KINDS"] = [k.value for k in ErrorKind]
    env.globals["REFRESH_MS"] = REFRESH_MS
    return env


def _ago(value: datetime | None, now: datetime | None = None) -> str:
    if value is None:
        return "-"
    now = now or datetime.now(UTC)
    return seconds((now - value).total_seconds())


class Headers:
    """Security headers on every answer; a Host check when bound to loopback."""

    def __init__(self, app: ASGIApp, bind: str) -> None:
        self.app, self.bind = app, bind

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        host = dict(scope["headers"]).get(b"host", b"").decode("latin-1") or None
        if not guard.host_allowed(self.bind, host):
            response = PlainTextResponse("unknown host: open the console by 127.0.0.1", 421)
            await response(scope, receive, send)
            return

        async def send_with_headers(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers", []))
                headers += [(k.lower().encode(), v.encode())
                            for k, v in guard.SECURITY_HEADERS.items()]  # fmt: skip
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)


def create_app(settings: ConsoleSettings) -> ASGIApp:
    """The console as an ASGI application (served by `cyclone console` with uvicorn)."""
    db = Database(settings)
    gate = guard.Guard(settings.token)
    env = _templates()

    def page(request: Request, template: str, status: int = 200, **context: Any) -> Response:
        sid = request.cookies.get(guard.SESSION_COOKIE)
        signed_in = gate.signed_in(sid)
        html = env.get_template(template).render(
            request=request, path=request.url.path, actions=gate.actions,
            signed_in=signed_in, csrf=gate.csrf(sid) if signed_in and sid else "",
            trace_url=settings.trace_url, **context,
        )  # fmt: skip
        return HTMLResponse(html, status_code=status)

    def reading(template: str, fragment: str | None = None) -> Callable[..., Any]:
        """A page: its `load(request, conn)` gives its context; bad input and database
        failures are pages of their own, with one clear message."""

        def wrap(load: Callable[[Request, Any], dict[str, Any]]) -> Callable[[Request], Response]:
            def endpoint(request: Request) -> Response:
                live = fragment is not None and request.query_params.get("fragment") == "1"
                try:
                    with db.read() as conn:
                        context = load(request, conn)
                except forms.BadInput as exc:
                    return page(request, "error.html", 400, message=str(exc))
                except NotFound as exc:
                    return page(request, "error.html", 404, message=str(exc))
                except (psycopg.Error, TimeoutError) as exc:
                    text = redact_error(str(exc), settings.dsn)
                    return page(request, "error.html", 503, message=f"database: {text}")
                return page(request, fragment if live and fragment else template, **context)

            return endpoint

        return wrap

    @reading("overview.html", "_overview.html")
    def overview(request: Request, conn: Any) -> dict[str, Any]:
        return {"snap": reads.overview(conn)}

    @reading("runs.html")
    def runs(request: Request, conn: Any) -> dict[str, Any]:
        q = request.query_params
        now = reads.clock(conn)
        flt = reads.RunFilter(
            state=forms.run_state(q), workflow=forms.text(q, "workflow"),
            queue=forms.text(q, "queue"), ckey=forms.text(q, "key"),
            error=forms.text(q, "error"), since=forms.moment(q, "since", now),
            until=forms.moment(q, "until", now),
        )  # fmt: skip
        result = reads.runs_page(conn, flt, forms.run_cursor(q))
        return {"now": now, **_listing(request, result)}

    @reading("run.html", "_run_live.html")
    def run(request: Request, conn: Any) -> dict[str, Any]:
        run_id = forms.run_id(request.path_params["run_id"])
        view = reads.run_view(conn, run_id)
        if view is None:
            raise NotFound(f"no run {run_id}")
        return {"v": view, "now": view.run["now"]}

    @reading("dlq.html")
    def dlq(request: Request, conn: Any) -> dict[str, Any]:
        q = request.query_params
        now = reads.clock(conn)
        flt = reads.DlqFilter(
            reason=forms.reason(q), workflow=forms.text(q, "workflow"),
            error=forms.text(q, "error"), since=forms.moment(q, "since", now),
        )  # fmt: skip
        result = reads.dlq_page(conn, flt, forms.step_cursor(q))
        return {"now": now, "depth": reads.dlq_depth(conn), **_listing(request, result)}

    @reading("limits.html", "_limits.html")
    def limits(request: Request, conn: Any) -> dict[str, Any]:
        got = reads.limits(conn)
        return {"l": got, "queues": reads.queues(got["use"], got["workflows"])}

    @reading("schedules.html")
    def schedules(request: Request, conn: Any) -> dict[str, Any]:
        return {"schedules": reads.schedules(conn), "now": reads.clock(conn)}

    @reading("fleet.html", "_fleet.html")
    def fleet(request: Request, conn: Any) -> dict[str, Any]:
        return {"snap": reads.fleet(conn)}

    # --- signing in, and the actions ----------------------------------------------------------

    def login_form(request: Request, status: int = 200, message: str = "") -> Response:
        nonce = request.cookies.get(guard.LOGIN_COOKIE) or secrets.token_urlsafe(24)
        response = page(request, "login.html", status, nonce=nonce, message=message)
        _cookie(request, response, guard.LOGIN_COOKIE, nonce, max_age=3600)
        return response

    def no_actions(request: Request) -> Response:
        message = "actions are off: no [console] token is configured"
        return page(request, "error.html", 403, message=message)

    def login(request: Request) -> Response:
        return login_form(request)

    async def login_post(request: Request) -> Response:
        form = await request.form()
        nonce = request.cookies.get(guard.LOGIN_COOKIE)
        if not gate.actions:
            return no_actions(request)
        if (
            not nonce
            or not guard.same_origin(request.headers.get("origin"), request.headers.get("host"))
            or not _equal(nonce, str(form.get("nonce", "")))
        ):
            return login_form(request, 403, "the sign-in form expired: try again")
        if not gate.check_token(str(form.get("token", ""))):
            return login_form(request, 403, "wrong token")
        response = RedirectResponse(forms.back(str(form.get("back", "")), "/"), 303)
        _cookie(request, response, guard.SESSION_COOKIE, gate.new_session(), max_age=None)
        response.delete_cookie(guard.LOGIN_COOKIE, path="/")
        return response

    async def logout(request: Request) -> Response:
        form = await request.form()
        sid = request.cookies.get(guard.SESSION_COOKIE)
        if gate.csrf_ok(sid, str(form.get("csrf", ""))):
            gate.end_session(sid)
        response = RedirectResponse("/", 303)
        response.delete_cookie(guard.SESSION_COOKIE, path="/")
        return response

    async def act(
        request: Request, fn: Callable[[Any, Any], list[dict[str, Any]]], title: str
    ) -> Response:
        form = await request.form()
        sid = request.cookies.get(guard.SESSION_COOKIE)
        if not gate.actions:
            return no_actions(request)
        if not gate.signed_in(sid):
            return page(request, "error.html", 403, message="sign in first: actions need the token")
        if not guard.same_origin(
            request.headers.get("origin"), request.headers.get("host")
        ) or not gate.csrf_ok(sid, str(form.get("csrf", ""))):
            return page(request, "error.html", 403,
                        message="this form did not come from the console (CSRF check failed): "
                                "reload the page and try again")  # fmt: skip
        back = forms.back(str(form.get("back", "")), "/")
        try:
            outcomes = await run_in_threadpool(fn, form, db)
        except forms.BadInput as exc:
            return page(request, "error.html", 400, message=str(exc), back=back)
        except (psycopg.Error, TimeoutError) as exc:
            text = redact_error(str(exc), settings.dsn)
            return page(request, "error.html", 503, message=f"database: {text}", back=back)
        return page(request, "done.html", title=title, outcomes=outcomes, back=back)

    async def retry(request: Request) -> Response:
        return await act(request, _retry, "Retry")

    async def cancel(request: Request) -> Response:
        return await act(request, _cancel, "Cancel")

    static = resources.files("cyclone.console") / "static"

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        db.open()
        try:
            yield
        finally:
            await run_in_threadpool(db.close)

    routes = [
        Route("/", overview),
        Route("/runs", runs),
        Route("/runs/{run_id}", run),
        Route("/dlq", dlq),
        Route("/limits", limits),
        Route("/schedules", schedules),
        Route("/fleet", fleet),
        Route("/login", login, methods=["GET"]),
        Route("/login", login_post, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/actions/retry", retry, methods=["POST"]),
        Route("/actions/cancel", cancel, methods=["POST"]),
        Mount("/static", StaticFiles(directory=str(static)), name="static"),
    ]
    return Headers(Starlette(routes=routes, lifespan=lifespan), settings.bind)


class NotFound(CycloneError):
    pass


def _equal(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def _cookie(
    request: Request, response: Response, name: str, value: str, max_age: int | None
) -> None:
    response.set_cookie(
        name, value, max_age=max_age, path="/", httponly=True, samesite="strict",
        secure=request.url.scheme == "https",
    )  # fmt: skip


def _listing(request: Request, page: reads.Page) -> dict[str, Any]:
    """A listing's context: its page, its filters, and the links to the next and first page
    (the same filters, with or without a cursor)."""
    params = [(k, v) for k, v in request.query_params.multi_items() if k != "before"]
    path = request.url.path
    next_url = None
    if page.next_cursor is not None:
        cursor = ("before", forms.cursor_text(page.next_cursor))
        next_url = f"{path}?{urlencode([*params, cursor])}"
    return {
        "page": page, "q": request.query_params, "next_url": next_url,
        "first_url": f"{path}?{urlencode(params)}",
    }  # fmt: skip


# --- the actions: each through the engine, one run per transaction ---------------------------


def _retry(form: Any, db: Database) -> list[dict[str, Any]]:
    """Retry the selected dead steps: one retry per run (it re-drives every dead step of it)."""
    step_ids = forms.step_ids([str(v) for v in form.getlist("step_id")])
    deadline = forms.deadline(str(form.get("deadline", "")))
    outcomes = []
    with db.write() as conn:
        done: set[str] = set()
        for step_id in step_ids:
            owner = conn.execute(QUERIES["dlq_step_owner"], {"step_id": step_id}).fetchone()
            run_id = str(owner["run_id"]) if owner else None
            if run_id is not None and run_id in done:
                continue  # an earlier step of this run re-drove it
            try:
                got = retry_dead_step(conn, step_id, deadline=deadline)
            except CycloneError as exc:
                outcomes.append({"ok": False, "step_id": step_id, "run_id": run_id,
                                 "message": str(exc)})  # fmt: skip
                continue
            done.add(got.run_id)
            deadline_note = f"; deadline {when(got.deadline_at)}" if got.deadline_at else ""
            outcomes.append({
                "ok": True, "step_id": step_id, "run_id": got.run_id,
                "message": f"run {got.run_id} ({printable(got.workflow)}) is running again: "
                           f"{len(got.step_ids)} step(s) back{deadline_note}",
            })  # fmt: skip
    return outcomes


def _cancel(form: Any, db: Database) -> list[dict[str, Any]]:
    run_ids = forms.run_ids([str(v) for v in form.getlist("run_id")])
    outcomes = []
    with db.write() as conn:
        for run_id in run_ids:
            try:
                changed = cancel_run(conn, run_id)
            except CycloneError as exc:
                outcomes.append({"ok": False, "run_id": run_id, "message": str(exc)})
                continue
            outcomes.append({
                "ok": changed, "run_id": run_id,
                "message": "cancelled" if changed else "already finished: nothing to cancel",
            })  # fmt: skip
    return outcomes
