-- Version 16: deploys under running runs (docs/deploys.md).
--
-- A run keeps the graph it was submitted with (by hash), and a worker runs a step with the
-- handler its own code has under the step's node name. So during a rolling deploy a VM must
-- lease only steps of graphs whose nodes its code has: each supervisor publishes the graph
-- hashes it serves (every stored graph of its workflows whose worker-run nodes its code has,
-- cyclone/engine/versions.py), and the lease's candidate scan takes only steps of runs of
-- those graphs.

-- The graph hashes a supervisor's workers lease for (NULL: a supervisor older than this
-- version, taken to serve every graph of the workflows it names).
ALTER TABLE cyclone_supervisors ADD COLUMN graphs text[];

-- When a live supervisor last said it serves the graph (`cyclone workflows`), written at most
-- once a minute by each.
ALTER TABLE cyclone_graphs ADD COLUMN served_at timestamptz;

-- ctx.patched(): the answers a run got, by change id, recorded by the first call so that a
-- retry and any other VM read the same.
ALTER TABLE cyclone_runs ADD COLUMN patches jsonb;

-- When code containing each change first registered: runs created from then on take the
-- patched branch.
CREATE TABLE cyclone_patches (
    workflow      text NOT NULL,
    patch         text NOT NULL,
    registered_at timestamptz NOT NULL,
    PRIMARY KEY (workflow, patch)
);

-- A step of a run whose graph no live supervisor serves is parked (state `waiting`) by the
-- `unserved` sweep, out of the lease index, so that leases do not walk over it every time
-- (a retired version's runs can wait for days); the same sweep makes it available again once a
-- supervisor serves its graph.
ALTER TABLE cyclone_steps ADD COLUMN parked boolean NOT NULL DEFAULT false;
CREATE INDEX cyclone_steps_parked_idx ON cyclone_steps (run_id) WHERE parked AND state = 'waiting';

DROP FUNCTION cyclone_lease_candidate(boolean, uuid, timestamptz, text[], smallint, bigint, bigint);
DROP FUNCTION cyclone_lease_candidates(integer, uuid[], timestamptz, text[], smallint, bigint,
                                       bigint);

-- `graphs`: the graph hashes the caller's code can run (NULL: any), tested on the run the scan
-- reads by primary key anyway.
CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
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
       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))
     ORDER BY s.priority, s.pass, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

CREATE FUNCTION cyclone_lease_candidates(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
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
       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))
     ORDER BY s.priority, s.pass, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;
