-- Version 12: the supervisor leases for its idle workers, several steps in one statement.
--
-- cyclone_lease_candidate, for up to `want` steps at once: the same walk of the candidate index
-- with the same settings (migration 7 says why each holds the plan), locking every row it
-- returns. `other_than`: runs none of whose steps may be leased (those being completed in the
-- same statement: see steps_dispatch in cyclone/sql/steps.sql).
CREATE FUNCTION cyclone_lease_candidates(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_at timestamptz,
    after_id bigint
) RETURNS TABLE (id bigint, available_at timestamptz, input jsonb, deadline_at timestamptz,
                graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 8
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, r.input, r.deadline_at, r.graph_hash, r.parent_run_id
      FROM cyclone_steps s
      JOIN cyclone_runs r ON r.id = s.run_id
     WHERE want > 0 AND s.state = 'available'
       AND NOT (s.run_id = ANY (coalesce(other_than, '{}')))
       AND s.available_at <= at
       AND (s.available_at, s.id) > (coalesce(after_at, '-infinity'), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.available_at, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;
