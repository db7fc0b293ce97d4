"""Cyclone: a durable workflow runtime for Python on PostgreSQL.

Every run is bounded (step timeouts, run deadlines), every stuck handler is killed, and
nothing is lost: runs and steps live in PostgreSQL, and the database clock is the only clock.
"""

from __future__ import annotations

from cyclone.clients.aclient import AsyncClient
from cyclone.clients.client import Client, submit
from cyclone.context import StepContext
from cyclone.errors import (
    ConfigError,
    CycloneError,
    GraphError,
    PayloadTooDeep,
    PayloadTooLarge,
    PermanentError,
    RunCancelled,
    RunFailed,
    RunNotFound,
    RunStuck,
    ScheduleNotFound,
    StepNotFound,
    UnheardSignal,
    WorkflowNotFound,
)
from cyclone.migrate import migrate
from cyclone.models import ExhaustedQuery, RunStatus, StepInfo
from cyclone.schedules import Overlap, ScheduleInfo
from cyclone.states import ErrorKind, NodeKind, RunState, StepState
from cyclone.workflow import Concurrency, Node, RateLimit, Registry, Workflow

__all__ = [
    "AsyncClient",
    "Client",
    "Concurrency",
    "ConfigError",
    "CycloneError",
    "ErrorKind",
    "ExhaustedQuery",
    "GraphError",
    "Node",
    "NodeKind",
    "Overlap",
    "PayloadTooDeep",
    "PayloadTooLarge",
    "PermanentError",
    "RateLimit",
    "Registry",
    "RunCancelled",
    "RunFailed",
    "RunNotFound",
    "RunState",
    "RunStatus",
    "RunStuck",
    "ScheduleInfo",
    "ScheduleNotFound",
    "StepContext",
    "StepInfo",
    "StepNotFound",
    "StepState",
    "UnheardSignal",
    "Workflow",
    "WorkflowNotFound",
    "migrate",
    "submit",
]
