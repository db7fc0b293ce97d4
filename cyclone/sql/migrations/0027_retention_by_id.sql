-- Version 27: retention finds the rows it deletes by their ids.
--
-- cyclone_delete_finished deleted the doomed runs' steps, attempts and runs with `IN (SELECT
-- ... FROM doomed)` and found child runs with a join. The scanner plans its statements once
-- (db.HOT_PLANS); a plan made while the tables were empty (a supervisor started on a fresh
-- install) joined from the big side, and with sequential scans off walked a whole index: every
-- pass of retention read the 20,000 runs of the plan tests' backlog (27,900 buffers) though it
-- deleted none. `= ANY (ARRAY(...))` is an index lookup per id whatever the estimates, and
-- each run's children are looked up by parent (OFFSET 0 keeps it a lookup).

DO $migration$
BEGIN
EXECUTE format($fn$
CREATE OR REPLACE FUNCTION %1$I.cyclone_delete_finished(
    retention float8, batch_size integer, at timestamptz
) RETURNS bigint LANGUAGE sql SECURITY DEFINER
SET search_path = %1$I, pg_temp
AS $$
    WITH RECURSIVE trusted AS (
        -- Inside the function current_user is its owner; session_user is who logged in.
        SELECT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') AS owner
    ), cutoff AS (
        SELECT CASE WHEN trusted.owner
                    THEN coalesce(at, pg_catalog.now())
                         - pg_catalog.make_interval(secs => retention)
                    ELSE least(coalesce(at, pg_catalog.now()), pg_catalog.now())
                         - pg_catalog.make_interval(secs => greatest(
                               coalesce(retention, 0), 86400))  -- the floor: one day
               END AS before
          FROM trusted
    ), doomed AS (
        SELECT id FROM (SELECT r.id FROM %1$I.cyclone_runs r, cutoff
                         WHERE r.finished_at < cutoff.before
                           AND r.parent_run_id IS NULL
                         ORDER BY r.finished_at
                         LIMIT batch_size) AS top
        UNION ALL
        SELECT c.id FROM doomed d,
               LATERAL (SELECT r.id FROM %1$I.cyclone_runs r
                         WHERE r.parent_run_id = d.id OFFSET 0) AS c
    ), steps AS (
        DELETE FROM %1$I.cyclone_steps
         WHERE run_id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING id
    ), attempts AS (
        DELETE FROM %1$I.cyclone_step_attempts
         WHERE step_id = ANY (ARRAY(SELECT id FROM steps))
    ), runs AS (
        DELETE FROM %1$I.cyclone_runs
         WHERE id = ANY (ARRAY(SELECT id FROM doomed)) AND parent_run_id IS NULL
        RETURNING 1
    )
    SELECT count(*) FROM runs;
$$
$fn$, current_schema());
END
$migration$;
