-- Version 7: the lease's candidate scan keeps one plan whatever the statistics say.
--
-- The planner picks between walking cyclone_steps_available_idx in order and stopping at the
-- first lockable row, and reading every available step, joining each to its run and sorting.
-- Which is cheaper depends on how many available steps it believes there are. On a table
-- never analyzed, or analyzed while the queue was empty, it believes there are a handful, and
-- the sort plan then reads the whole backlog for every lease. The scan lives in this
-- function so that the settings below apply to it alone. With no sort, only the index gives
-- the order; with no hash join, no plan builds a table of every run to join against. What is
-- left walks the index and looks each candidate's run up by its primary key, returning
-- the run's columns the lease needs. Settings given
-- to a function last for its call only: nothing leaks into the session or through a pooler.
-- Each setting costs the backend about 10k instructions a call, so only these two are set.
CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[]
) RETURNS TABLE (id bigint, input jsonb, deadline_at timestamptz, graph_hash text,
                parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 1
SET enable_sort = off
SET enable_hashjoin = off
AS $$
    SELECT s.id, r.input, r.deadline_at, r.graph_hash, r.parent_run_id
      FROM cyclone_steps s
      JOIN cyclone_runs r ON r.id = s.run_id
     WHERE go AND s.state = 'available'
       AND s.run_id IS DISTINCT FROM other_than
       AND s.available_at <= at
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.available_at, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

-- The deadline sweep and the counts of live runs share one index. With two (deadline_at of
-- running runs, and state of live runs), statistics taken while few runs were live made the
-- planner sweep through the second and read every live run, due or not. Here the sweep's
-- conditions are this index's leading columns and its order is the sweep's order, so any
-- plan through it reads only the runs due.
CREATE INDEX cyclone_runs_live_idx ON cyclone_runs (state, deadline_at)
    WHERE state IN ('running', 'paused');
DROP INDEX cyclone_runs_deadline_idx;
DROP INDEX cyclone_runs_active_idx;
