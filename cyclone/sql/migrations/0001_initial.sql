-- Cyclone schema, version 1. Tables, constraints and indexes only: every transition is a plain
-- statement in cyclone/sql/*.sql, so behaviour changes without a migration.

-- One row per distinct graph a workflow has had; runs point at the graph they started with, so
-- a deploy that changes a workflow never changes the shape of runs already in flight.
CREATE TABLE cyclone_graphs (
    hash        text PRIMARY KEY,
    workflow    text NOT NULL,
    graph       jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE cyclone_workflows (
    name        text PRIMARY KEY,
    graph_hash  text NOT NULL REFERENCES cyclone_graphs (hash),
    updated_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE cyclone_runs (
    id              uuid PRIMARY KEY,
    workflow        text NOT NULL,
    graph_hash      text NOT NULL REFERENCES cyclone_graphs (hash),
    state           text NOT NULL
        CHECK (state IN ('running', 'paused', 'completed', 'failed', 'cancelled')),
    input           jsonb NOT NULL,
    output          jsonb,
    idempotency_key text UNIQUE,
    parent_run_id   uuid REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    parent_step_id  bigint,
    created_at      timestamptz NOT NULL,
    deadline_at     timestamptz,
    paused_at       timestamptz,
    finished_at     timestamptz,
    CHECK ((finished_at IS NOT NULL) = (state IN ('completed', 'failed', 'cancelled'))),
    CHECK ((paused_at IS NOT NULL) = (state = 'paused')),
    CHECK (output IS NULL OR state = 'completed'),
    -- A child run is bounded by its parent's deadline and its node's max_wait, never its own.
    CHECK (parent_run_id IS NULL OR deadline_at IS NULL)
);

-- The deadline sweep: cost grows with the runs due, not with history.
CREATE INDEX cyclone_runs_deadline_idx ON cyclone_runs (deadline_at)
    WHERE state = 'running' AND deadline_at IS NOT NULL;
CREATE INDEX cyclone_runs_parent_idx ON cyclone_runs (parent_run_id)
    WHERE parent_run_id IS NOT NULL;
-- Retention and listings of finished runs.
CREATE INDEX cyclone_runs_finished_idx ON cyclone_runs (finished_at)
    WHERE finished_at IS NOT NULL;
CREATE INDEX cyclone_runs_active_idx ON cyclone_runs (state)
    WHERE state IN ('running', 'paused');

CREATE TABLE cyclone_steps (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    workflow         text NOT NULL,
    node             text NOT NULL,
    kind             text NOT NULL CHECK (kind IN ('task', 'map', 'wait', 'sleep', 'child')),
    -- Map items carry their index; a map row without one is the fan-out itself, waiting for a
    -- worker (which has the code) to evaluate the items.
    item_index       integer CHECK (item_index IS NULL OR item_index >= 0),
    item             jsonb,
    state            text NOT NULL
        CHECK (state IN ('available', 'running', 'waiting', 'completed', 'dead', 'discarded')),
    attempt          integer NOT NULL DEFAULT 0 CHECK (attempt >= 0),
    max_attempts     integer NOT NULL CHECK (max_attempts >= 1),
    timeout          interval,
    signal           text,
    available_at     timestamptz NOT NULL,
    -- Sleep wake-up, or the max_wait expiry of a wait or child node.
    due_at           timestamptz,
    lease_token      uuid,
    lease_expires_at timestamptz,
    leased_by        text,
    child_run_id     uuid,
    output           jsonb,
    error            text,
    error_kind       text CHECK (error_kind IN ('error', 'timeout', 'crashed', 'lease_expired',
                                                'deadline', 'max_wait', 'child_failed',
                                                'cancelled')),
    created_at       timestamptz NOT NULL,
    started_at       timestamptz,
    completed_at     timestamptz,
    CHECK ((state = 'running') = (lease_token IS NOT NULL)),
    CHECK ((state = 'running') = (lease_expires_at IS NOT NULL)),
    CHECK ((state IN ('completed', 'dead', 'discarded')) = (completed_at IS NOT NULL)),
    CHECK (state <> 'dead' OR error_kind IS NOT NULL),
    CHECK (output IS NULL OR state = 'completed')
);

-- One step per node instance: advancing a run twice cannot create a node twice.
CREATE UNIQUE INDEX cyclone_steps_node_idx
    ON cyclone_steps (run_id, node, coalesce(item_index, -1));
-- Lease candidates. Ordered by (available_at, id) so the planner never leases through the
-- primary key, whatever the share of available rows.
CREATE INDEX cyclone_steps_available_idx ON cyclone_steps (available_at, id)
    WHERE state = 'available';
-- Expired-lease reclaim.
CREATE INDEX cyclone_steps_lease_idx ON cyclone_steps (lease_expires_at)
    WHERE state = 'running';
-- Sleep wake-ups and max_wait expiry.
CREATE INDEX cyclone_steps_due_idx ON cyclone_steps (due_at)
    WHERE state = 'waiting' AND due_at IS NOT NULL;
-- The DLQ.
CREATE INDEX cyclone_steps_dead_idx ON cyclone_steps (completed_at)
    WHERE state = 'dead';
CREATE INDEX cyclone_steps_child_idx ON cyclone_steps (child_run_id)
    WHERE child_run_id IS NOT NULL;

-- Signals are kept until their wait node is reached (consumed_by is then the step).
CREATE TABLE cyclone_signals (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    payload     jsonb,
    created_at  timestamptz NOT NULL,
    consumed_by bigint
);
CREATE INDEX cyclone_signals_pending_idx ON cyclone_signals (run_id, name, id)
    WHERE consumed_by IS NULL;

CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, s.lease_expires_at, s.leased_by, s.child_run_id
  FROM cyclone_steps s;

CREATE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_steps s WHERE s.run_id = r.id) AS steps_total,
       (SELECT count(*) FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state = 'completed') AS steps_completed
  FROM cyclone_runs r;
