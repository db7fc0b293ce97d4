"""Workflow definitions: a named graph of nodes, checked when each node is defined.

A workflow's graph (names, kinds, edges, limits) is plain JSON so it can live in the database:
any process can advance a run or submit one by name without importing the code. Only workers,
which import the code, evaluate handlers, map items and child inputs.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from cyclone.errors import ConfigError, GraphError, WorkflowNotFound
from cyclone.schedules import DEFAULT_CATCHUP, ScheduleSpec, schedule_spec
from cyclone.states import MAX_DEADLINE_SECONDS, NodeKind

# A step that is never given a timeout still gets one: no handler may run forever by default.
DEFAULT_TIMEOUT = timedelta(minutes=5)
DEFAULT_MAX_ATTEMPTS = 3
_UNSET: Any = object()

Duration = timedelta | float | int


def seconds(value: Duration | None, what: str) -> float | None:
    """A duration in seconds; None stays None. Negative durations are an error."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise GraphError(f"{what}: expected a timedelta or seconds, got {value!r}")
    secs = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if secs < 0:
        raise GraphError(f"{what}: must not be negative, got {value!r}")
    # NaN, infinity and 1e300 are floats too: the database's interval would refuse them
    # only when a step is made, with its own error.
    if not secs <= MAX_DEADLINE_SECONDS:
        raise GraphError(f"{what}: {value!r} is not a usable duration (at most 100 years)")
    return secs


_OPTIONAL_KEYS = ("max_items", "concurrency", "rate_limit", "rate_key")


@dataclass(frozen=True, slots=True)
class RateLimit:
    """A node's rate limit: one token of limiter `name` per attempt (`client.set_rate_limit`
    sets its rate). With `key`, a bucket per value of that field of the run's input."""

    name: str
    key: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or len(self.name) > 100:
            raise GraphError(f"RateLimit name: expected 1 to 100 characters, got {self.name!r}")
        if self.key is not None and (not isinstance(self.key, str) or not self.key):
            raise GraphError(f"RateLimit key: expected an input field name, got {self.key!r}")


@dataclass(frozen=True, slots=True)
class NodeSpec:
    """What the engine needs to know about a node: JSON-safe, no code."""

    name: str
    kind: NodeKind
    after: tuple[str, ...] = ()
    max_attempts: int = 1
    timeout: float | None = None
    signal: str | None = None
    max_wait: float | None = None
    duration: float | None = None
    child: str | None = None
    # Flow control, each left out of the JSON while unset, so that the graphs (and their
    # hashes) of workflows that use none are those registered before it: a map's cap on its
    # items, at most this many steps of the node at once, and the limiter (with the input
    # field keying its buckets) each attempt takes a token of.
    max_items: int | None = None
    concurrency: int | None = None
    rate_limit: str | None = None
    rate_key: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {"name": self.name, "kind": str(self.kind), "after": list(self.after)}
        for key in ("max_attempts", "timeout", "signal", "max_wait", "duration", "child"):
            out[key] = getattr(self, key)
        for key in _OPTIONAL_KEYS:
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> NodeSpec:
        return cls(
            name=data["name"],
            kind=NodeKind(data["kind"]),
            after=tuple(data.get("after", ())),
            max_attempts=data.get("max_attempts", 1),
            timeout=data.get("timeout"),
            signal=data.get("signal"),
            max_wait=data.get("max_wait"),
            duration=data.get("duration"),
            child=data.get("child"),
            **{key: data.get(key) for key in _OPTIONAL_KEYS},
        )


@dataclass(frozen=True)
class Graph:
    """An immutable, validated graph; `hash` identifies it in cyclone_graphs."""

    workflow: str
    nodes: Mapping[str, NodeSpec]
    hash: str = ""
    downstream: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    sinks: tuple[str, ...] = ()
    roots: tuple[str, ...] = ()

    @classmethod
    def build(cls, workflow: str, specs: Iterable[NodeSpec]) -> Graph:
        nodes: dict[str, NodeSpec] = {}
        for spec in specs:
            if spec.name in nodes:
                raise GraphError(f"workflow {workflow!r}: node {spec.name!r} is defined twice")
            nodes[spec.name] = spec
        down: dict[str, list[str]] = {name: [] for name in nodes}
        for spec in nodes.values():
            for dep in spec.after:
                if dep not in nodes:
                    raise GraphError(
                        f"workflow {workflow!r}: node {spec.name!r} runs after unknown node {dep!r}"
                    )
                down[dep].append(spec.name)
        _check_acyclic(workflow, nodes)
        body = {"workflow": workflow, "nodes": [n.to_json() for n in nodes.values()]}
        digest = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:32]
        return cls(
            workflow=workflow,
            nodes=nodes,
            hash=digest,
            downstream={k: tuple(v) for k, v in down.items()},
            sinks=tuple(n for n, d in down.items() if not d),
            roots=tuple(n for n, s in nodes.items() if not s.after),
        )

    def to_json(self) -> dict[str, Any]:
        return {"workflow": self.workflow, "nodes": [n.to_json() for n in self.nodes.values()]}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Graph:
        return cls.build(data["workflow"], (NodeSpec.from_json(n) for n in data["nodes"]))


def _check_acyclic(workflow: str, nodes: Mapping[str, NodeSpec]) -> None:
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(name: str) -> None:
        state[name] = 1
        for dep in nodes[name].after:
            if state.get(dep) == 1:
                raise GraphError(f"workflow {workflow!r}: node {name!r} is part of a cycle")
            if dep not in state:
                visit(dep)
        state[name] = 2

    for name in nodes:
        if name not in state:
            visit(name)


class Node:
    """A node of a workflow, as returned by the decorators; calling it calls the handler."""

    def __init__(
        self,
        workflow: Workflow,
        spec: NodeSpec,
        fn: Callable[..., Any] | None = None,
        items: Callable[..., Any] | None = None,
        child: Workflow | str | None = None,
        child_input: Any = _UNSET,
    ) -> None:
        self.workflow = workflow
        self.spec = spec
        self.fn = fn
        self.items = items
        self.child = child
        self.child_input = child_input
        # Checked once here rather than on every step.
        self._is_async = fn is not None and inspect.iscoroutinefunction(fn)

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def is_async(self) -> bool:
        return self._is_async

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fn is None:
            raise TypeError(f"node {self.name!r} has no handler to call")
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Node {self.workflow.name}/{self.name} {self.spec.kind}>"


@dataclass(frozen=True, slots=True)
class Concurrency:
    """At most `limit` runs of the workflow with the same key are active at once; the others
    wait as `queued` and start, oldest first within priority, as active ones end.

    `key` names a field of the run's input, or is a callable(input) -> str | int, computed at
    submit (a client that submits by name can only use a field name)."""

    key: str | Callable[[Any], Any]
    limit: int

    def __post_init__(self) -> None:
        if not (isinstance(self.key, str) and self.key) and not callable(self.key):
            raise GraphError(
                f"Concurrency key: expected an input field name or a callable(input), "
                f"got {self.key!r}"
            )
        if isinstance(self.limit, bool) or not isinstance(self.limit, int) or self.limit < 1:
            raise GraphError(f"Concurrency limit: expected an integer >= 1, got {self.limit!r}")

    @property
    def field(self) -> str | None:
        """The input field the key is read from (None: computed by a callable)."""
        return self.key if isinstance(self.key, str) else None


def concurrency_key(key: str | Callable[[Any], Any], input: Any) -> str:
    """A run's concurrency key from its input; ValueError naming what is missing or wrong."""
    if isinstance(key, str):
        if not isinstance(input, dict) or key not in input:
            raise ValueError(f"concurrency key: the input has no field {key!r}")
        value = input[key]
    else:
        value = key(input)
    if isinstance(value, bool) or not isinstance(value, str | int) or value == "":
        raise ValueError(
            f"concurrency key: expected a non-empty string or an integer, got {value!r}"
        )
    text = str(value)
    if len(text) > 200:
        raise ValueError(f"concurrency key: at most 200 characters, got {len(text)}")
    return text


DEFAULT_QUEUE = "default"
DEFAULT_PRIORITY = 3
# A map whose items exceed this fails its step (kind too_many_items) unless the node says more:
# the items are made in one transaction, and a runaway list must not make millions of steps.
DEFAULT_MAX_ITEMS = 10_000


class Workflow:
    """A named graph of nodes. Nodes may only run after nodes defined before them.

    `queue` names the queue its runs go to (`[supervisor] queues` says which a VM serves);
    `priority` (1 leased first, 5 last) is its runs' default, which a submit may override;
    `concurrency` bounds its active runs per key (`Concurrency`).
    """

    def __init__(
        self,
        name: str,
        *,
        queue: str = DEFAULT_QUEUE,
        priority: int = DEFAULT_PRIORITY,
        concurrency: Concurrency | None = None,
    ) -> None:
        if not isinstance(name, str) or not name.strip():
            raise GraphError(f"a workflow needs a non-empty name, got {name!r}")
        if not isinstance(queue, str) or not queue or queue != queue.strip() or len(queue) > 100:
            raise GraphError(
                f"workflow {name!r}: queue: expected a name of 1 to 100 characters, got {queue!r}"
            )
        if isinstance(priority, bool) or not isinstance(priority, int) or not 1 <= priority <= 5:
            raise GraphError(
                f"workflow {name!r}: priority: expected an integer from 1 (first) to 5, "
                f"got {priority!r}"
            )
        if concurrency is not None and not isinstance(concurrency, Concurrency):
            raise GraphError(
                f"workflow {name!r}: concurrency: expected cyclone.Concurrency(key=..., "
                f"limit=N), got {concurrency!r}"
            )
        self.name = name
        self.queue = queue
        self.priority = priority
        self.concurrency = concurrency
        self._nodes: dict[str, Node] = {}
        self._graph: Graph | None = None
        self._schedules: dict[str, ScheduleSpec] = {}

    def __repr__(self) -> str:
        return f"<Workflow {self.name} nodes={list(self._nodes)}>"

    @property
    def nodes(self) -> Mapping[str, Node]:
        return self._nodes

    @property
    def graph(self) -> Graph:
        if self._graph is None:
            if not self._nodes:
                raise GraphError(f"workflow {self.name!r} has no nodes")
            self._graph = Graph.build(self.name, (n.spec for n in self._nodes.values()))
        return self._graph

    @property
    def schedules(self) -> list[ScheduleSpec]:
        """The schedules declared in code (`schedule`), upserted when a supervisor starts."""
        return list(self._schedules.values())

    def schedule(
        self,
        name: str,
        *,
        cron: str | None = None,
        every: timedelta | float | None = None,
        timezone: str = "UTC",
        input: Any = None,
        overlap: str = "skip",
        catchup_window: timedelta | float = DEFAULT_CATCHUP,
        jitter: timedelta | float | None = None,
        run_deadline: timedelta | float | None = None,
    ) -> ScheduleSpec:
        """Declare a schedule of this workflow in code: `cron` (5 fields or @daily...) in
        `timezone`, or `every` (at least 1 s). Every supervisor that registers the workflow
        upserts it; one removed from the code is reported, not deleted (docs/schedules.md).
        ConfigError here, when declared, for bad input (TypeError for an input that is
        not JSON, as submit's)."""
        from cyclone.db import encode_json  # here: defining workflows needs no database code

        encode_json(input, f"schedule {name!r}: input")
        spec = schedule_spec(
            name, self.name, cron=cron, every=every, timezone=timezone, input=input,
            overlap=overlap, catchup_window=catchup_window, jitter=jitter,
            run_deadline=run_deadline,
        )  # fmt: skip
        if name in self._schedules:
            raise ConfigError(f"workflow {self.name!r}: schedule {name!r} is declared twice")
        self._schedules[name] = spec
        return spec

    def children(self) -> Iterator[Workflow]:
        """Workflows this one starts as child runs (those given as objects), recursively."""
        for node in self._nodes.values():
            if isinstance(node.child, Workflow):
                yield node.child
                yield from node.child.children()

    # -- node definitions ---

    def task(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        name: str | None = None,
        after: Sequence[Node | str] = (),
        timeout: Duration | None = DEFAULT_TIMEOUT,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        concurrency: int | None = None,
        rate_limit: str | RateLimit | None = None,
    ) -> Any:
        """Decorate a handler `fn(ctx) -> JSON` (sync or async) as a task node.

        `concurrency`: at most this many of its steps at once, all VMs together; `rate_limit`:
        a limiter's name (or a `RateLimit`), one token per attempt."""

        def wrap(f: Callable[..., Any]) -> Node:
            spec = self._spec(name or f.__name__, NodeKind.TASK, after, timeout, max_attempts)
            spec = self._limits(spec, concurrency, rate_limit)
            return self._add(Node(self, spec, fn=f))

        return wrap(fn) if fn is not None else wrap

    def map(
        self,
        fn: Callable[..., Any] | None = None,
        *,
        items: Callable[..., Any],
        name: str | None = None,
        after: Sequence[Node | str] = (),
        timeout: Duration | None = DEFAULT_TIMEOUT,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        max_items: int = DEFAULT_MAX_ITEMS,
        concurrency: int | None = None,
        rate_limit: str | RateLimit | None = None,
    ) -> Any:
        """Fan out: `items(ctx)` gives a list; the handler runs once per item (`ctx.item`).

        More than `max_items` items fail the step at once (kind `too_many_items`)."""
        if not callable(items):
            raise GraphError(f"workflow {self.name!r}: map items must be a callable(ctx) -> list")

        def wrap(f: Callable[..., Any]) -> Node:
            node_name = name or f.__name__
            if isinstance(max_items, bool) or not isinstance(max_items, int) or max_items < 1:
                raise GraphError(
                    f"{self._what(node_name, 'max_items')}: expected an integer >= 1, "
                    f"got {max_items!r}"
                )
            spec = self._spec(node_name, NodeKind.MAP, after, timeout, max_attempts)
            spec = self._limits(_replace(spec, max_items=max_items), concurrency, rate_limit)
            return self._add(Node(self, spec, fn=f, items=items))

        return wrap(fn) if fn is not None else wrap

    def wait(
        self,
        name: str,
        *,
        signal: str | None = None,
        after: Sequence[Node | str] = (),
        max_wait: Duration | None = None,
    ) -> Node:
        """Park until `signal` (default: the node's name) is sent to the run."""
        spec = self._spec(name, NodeKind.WAIT, after, None, 1)
        sig = signal if signal is not None else name
        if not isinstance(sig, str) or not sig:
            raise GraphError(f"workflow {self.name!r}: node {name!r} needs a signal name")
        spec = _replace(spec, signal=sig, max_wait=seconds(max_wait, self._what(name, "max_wait")))
        return self._add(Node(self, spec))

    def sleep(self, name: str, duration: Duration, *, after: Sequence[Node | str] = ()) -> Node:
        """Park for `duration`, measured on the database clock."""
        spec = self._spec(name, NodeKind.SLEEP, after, None, 1)
        dur = seconds(duration, self._what(name, "duration"))
        if dur is None:
            raise GraphError(f"{self._what(name, 'duration')}: a sleep needs a duration")
        return self._add(Node(self, _replace(spec, duration=dur)))

    def child(
        self,
        name: str,
        workflow: Workflow | str,
        *,
        after: Sequence[Node | str] = (),
        input: Any = _UNSET,
        max_wait: Duration | None = None,
    ) -> Node:
        """Start `workflow` as a child run and wait for it; its output is this node's output.

        `input` is a callable(ctx) or a JSON value; by default the child gets the run's input.
        """
        if not isinstance(workflow, Workflow | str):
            raise GraphError(f"{self._what(name, 'workflow')}: expected a Workflow or a name")
        child_name = workflow.name if isinstance(workflow, Workflow) else workflow
        if child_name == self.name:
            raise GraphError(f"{self._what(name, 'workflow')}: a workflow cannot start itself")
        spec = self._spec(name, NodeKind.CHILD, after, None, 1)
        spec = _replace(
            spec, child=child_name, max_wait=seconds(max_wait, self._what(name, "max_wait"))
        )
        return self._add(Node(self, spec, child=workflow, child_input=input))

    # -- helpers ---

    def _what(self, node: str, key: str) -> str:
        return f"workflow {self.name!r}: node {node!r}: {key}"

    def _spec(
        self,
        name: str,
        kind: NodeKind,
        after: Sequence[Node | str],
        timeout: Duration | None,
        max_attempts: int,
    ) -> NodeSpec:
        if not isinstance(name, str) or not name or name != name.strip():
            raise GraphError(f"workflow {self.name!r}: invalid node name {name!r}")
        if name in self._nodes:
            raise GraphError(f"workflow {self.name!r}: node {name!r} is defined twice")
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise GraphError(f"{self._what(name, 'max_attempts')}: expected an integer >= 1")
        if isinstance(after, Node | str):
            after = [after]
        deps: list[str] = []
        for dep in after:
            dep_name = self._dep_name(name, dep)
            if dep_name not in deps:
                deps.append(dep_name)
        secs = seconds(timeout, self._what(name, "timeout"))
        return NodeSpec(
            name=name,
            kind=kind,
            after=tuple(deps),
            max_attempts=max_attempts,
            timeout=secs if secs else None,
        )

    def _limits(
        self, spec: NodeSpec, concurrency: int | None, rate_limit: str | RateLimit | None
    ) -> NodeSpec:
        if concurrency is not None and (
            isinstance(concurrency, bool) or not isinstance(concurrency, int) or concurrency < 1
        ):
            raise GraphError(
                f"{self._what(spec.name, 'concurrency')}: expected an integer >= 1, "
                f"got {concurrency!r}"
            )
        if isinstance(rate_limit, str):
            try:
                rate_limit = RateLimit(rate_limit)
            except GraphError as exc:
                raise GraphError(f"{self._what(spec.name, 'rate_limit')}: {exc}") from None
        if rate_limit is not None and not isinstance(rate_limit, RateLimit):
            raise GraphError(
                f"{self._what(spec.name, 'rate_limit')}: expected a limiter name or "
                f"cyclone.RateLimit, got {rate_limit!r}"
            )
        return _replace(
            spec,
            concurrency=concurrency,
            rate_limit=rate_limit.name if rate_limit else None,
            rate_key=rate_limit.key if rate_limit else None,
        )

    def _dep_name(self, name: str, dep: Node | str) -> str:
        if isinstance(dep, Node):
            if dep.workflow is not self:
                raise GraphError(
                    f"workflow {self.name!r}: node {name!r} runs after {dep.name!r}, "
                    f"a node of another workflow ({dep.workflow.name!r})"
                )
            dep = dep.name
        if not isinstance(dep, str) or dep not in self._nodes:
            raise GraphError(
                f"workflow {self.name!r}: node {name!r} runs after unknown node {dep!r}"
            )
        return dep

    def _add(self, node: Node) -> Node:
        self._nodes[node.name] = node
        self._graph = None
        return node


def _replace(spec: NodeSpec, **changes: Any) -> NodeSpec:
    from dataclasses import replace

    return replace(spec, **changes)


class Registry(Mapping[str, Workflow]):
    """Workflows by name, with the code to run them; child workflows are included."""

    def __init__(self, workflows: Iterable[Workflow] = ()) -> None:
        self._by_name: dict[str, Workflow] = {}
        for wf in workflows:
            self.add(wf)

    def add(self, workflow: Workflow) -> None:
        if not isinstance(workflow, Workflow):
            raise TypeError(f"expected a Workflow, got {workflow!r}")
        for wf in (workflow, *workflow.children()):
            known = self._by_name.get(wf.name)
            if known is not None and known is not wf:
                raise GraphError(f"two different workflows are named {wf.name!r}")
            wf.graph  # noqa: B018 - validates now, not at the first run
            self._by_name[wf.name] = wf

    def __getitem__(self, name: str) -> Workflow:
        try:
            return self._by_name[name]
        except KeyError:
            raise WorkflowNotFound(
                f"no workflow named {name!r} is loaded in this process"
            ) from None

    def __contains__(self, name: object) -> bool:
        return name in self._by_name

    def only(self, keep: Callable[[Workflow], bool]) -> Registry:
        """The workflows `keep` keeps, without adding their children."""
        out = Registry()
        out._by_name = {name: wf for name, wf in self._by_name.items() if keep(wf)}
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(self._by_name)

    def __len__(self) -> int:
        return len(self._by_name)

    def node(self, workflow: str, node: str) -> Node:
        wf = self[workflow]
        try:
            return wf.nodes[node]
        except KeyError:
            raise WorkflowNotFound(
                f"workflow {workflow!r} has no node {node!r} in this process"
            ) from None


def load_modules(names: Iterable[str]) -> Registry:
    """Import each module and collect the Workflow objects defined at its top level."""
    registry = Registry()
    for module_name in names:
        module = importlib.import_module(module_name)
        for value in vars(module).values():
            if isinstance(value, Workflow):
                registry.add(value)
    return registry
