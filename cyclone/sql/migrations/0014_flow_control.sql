-- Version 14: flow control, part one: queues, priorities and fair leasing.
--
-- A workflow names its queue and its default priority (cyclone_workflows, at registration); a
-- run takes both at submit (a submit may give its own priority), and its steps carry the
-- priority and a fairness pass. Steps are leased in (priority, pass, id) order: priority 1
-- first; among one priority, by pass. A run's pass is its place in a start-time fair queue
-- (docs/flow-control.md): the queue's clock (cyclone_queues.pass, the largest pass in service,
-- kept by the fair_clock sweep) or, when its group (workflow and concurrency key) already has
-- live runs, one past the group's last, whichever is later. A backlog of one group therefore
-- holds passes far ahead of the clock, and a run of another group submitted meanwhile lands
-- near the head of the line instead of behind the backlog. A map's items take their fan-out's
-- pass plus their index: a big fan-out spreads over passes and interleaves with other runs.

ALTER TABLE cyclone_workflows
    ADD COLUMN queue text NOT NULL DEFAULT 'default',
    ADD COLUMN priority smallint NOT NULL DEFAULT 3 CHECK (priority BETWEEN 1 AND 5);

ALTER TABLE cyclone_runs
    ADD COLUMN queue text NOT NULL DEFAULT 'default',
    ADD COLUMN priority smallint NOT NULL DEFAULT 3,
    ADD COLUMN pass bigint NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text;

ALTER TABLE cyclone_steps
    ADD COLUMN priority smallint NOT NULL DEFAULT 3,
    ADD COLUMN pass bigint NOT NULL DEFAULT 0;

-- One row per queue a registered workflow names; `pass` is the queue's fair clock.
CREATE TABLE cyclone_queues (
    name       text PRIMARY KEY,
    pass       bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO cyclone_queues (name) VALUES ('default');

-- The lease order. available_at is the last key column so that steps not yet due (a retry in
-- its backoff) are passed over inside the index, without a visit to the table.
CREATE INDEX cyclone_steps_ready_idx ON cyclone_steps (priority, pass, id, available_at)
    WHERE state = 'available';

-- A group's last pass among its live runs, at submit.
CREATE INDEX cyclone_runs_fair_idx
    ON cyclone_runs (workflow, (coalesce(concurrency_key, '')), pass)
    WHERE state IN ('running', 'paused') AND pass > 0;

DROP FUNCTION cyclone_lease_candidate(boolean, uuid, timestamptz, text[], timestamptz, bigint);
DROP FUNCTION cyclone_lease_candidates(integer, uuid[], timestamptz, text[], timestamptz, bigint);

CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 1
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, s.priority, s.pass, r.input, r.deadline_at, r.graph_hash,
           r.parent_run_id
      FROM cyclone_steps s
      -- By primary key, always: OFFSET 0 keeps the lookup a subquery of its own, whose one
      -- condition is the id, so the run's state below cannot lead the planner to walk
      -- cyclone_runs_live_idx for each step (it did, on statistics of a drained history).
      JOIN LATERAL (SELECT r.input, r.deadline_at, r.graph_hash, r.parent_run_id, r.state
                      FROM cyclone_runs r WHERE r.id = s.run_id OFFSET 0) AS r ON true
     WHERE go AND s.state = 'available'
       AND s.run_id IS DISTINCT FROM other_than
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.priority, s.pass, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

CREATE FUNCTION cyclone_lease_candidates(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 8
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, s.priority, s.pass, r.input, r.deadline_at, r.graph_hash,
           r.parent_run_id
      FROM cyclone_steps s
      JOIN LATERAL (SELECT r.input, r.deadline_at, r.graph_hash, r.parent_run_id, r.state
                      FROM cyclone_runs r WHERE r.id = s.run_id OFFSET 0) AS r ON true
     WHERE want > 0 AND s.state = 'available'
       AND NOT (s.run_id = ANY (coalesce(other_than, '{}')))
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.priority, s.pass, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;

-- A map whose items exceed its max_items fails its step with a kind of its own.
ALTER DOMAIN cyclone_error_kind DROP CONSTRAINT cyclone_error_kind_check;
ALTER DOMAIN cyclone_error_kind ADD CONSTRAINT cyclone_error_kind_check
    CHECK (VALUE IN ('error', 'timeout', 'crashed', 'lease_expired', 'deadline', 'max_wait',
                     'child_failed', 'cancelled', 'too_many_items'));

-- The fair_clock sweep: each queue's clock moves up to the largest pass in service.
