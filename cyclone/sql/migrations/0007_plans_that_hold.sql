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
-- Each setting has a cost on every call, so only these are set. The third keeps the query's plan
-- made once per session: the plan cache otherwise compares the generic plan's estimate with custom
-- plans made for each call's arguments, and on tables never analyzed it kept planning anew for
-- every lease (instruction counts: bench/README.md, "Figures behind the code's comments").
--
-- `after_at, after_id`: where this caller's last lease was in the index (NULL: from the
-- start). A queue leaves the entries of leased steps at the left edge of the index until
-- VACUUM removes them, and a scan from the start walks them all: tens of thousands after a
-- burst, between two autovacuums. Starting after the caller's last lease skips them. A step
-- that becomes available behind that point (its transaction started before the last lease
-- and committed after it) is found by a scan from the start, which callers make when a
-- lease from their point finds nothing, and at least once a second (cyclone/engine/steps.py).
CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_at timestamptz,
    after_id bigint
) RETURNS TABLE (id bigint, available_at timestamptz, input jsonb, deadline_at timestamptz,
                graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 1
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, r.input, r.deadline_at, r.graph_hash, r.parent_run_id
      FROM cyclone_steps s
      JOIN cyclone_runs r ON r.id = s.run_id
     WHERE go AND s.state = 'available'
       AND s.run_id IS DISTINCT FROM other_than
       AND s.available_at <= at
       AND (s.available_at, s.id) > (coalesce(after_at, '-infinity'), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.available_at, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

-- How far behind the workers are: the oldest step due of a running run (cyclone status, the
-- metrics), by the same walk of the candidate index, without locking anything.
CREATE FUNCTION cyclone_oldest_due(at timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_hashjoin = off
AS $$
    SELECT s.available_at
      FROM cyclone_steps s
      JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'available' AND s.available_at <= at AND r.state = 'running'
     ORDER BY s.available_at, s.id
     LIMIT 1
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
