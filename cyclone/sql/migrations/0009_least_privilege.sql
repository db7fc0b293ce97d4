-- Version 9: retention as a function, so that the runtime role needs no DELETE on history.
--
-- Supervisors, workers and scanners run as a role that may read and write runs and steps but
-- not delete them (`cyclone migrate --print-grants`): a bug or a stolen password then cannot
-- erase history. The scanner's retention still has to delete finished runs past
-- `[scanner] retention`: it calls this function, which runs with its owner's rights (the
-- role that migrates) and deletes nothing else. Its search_path is the one it was created
-- with (the schema migrated into), so a caller's search_path cannot point it elsewhere.
--
-- What it deletes: finished top-level runs older than the retention, with their child runs
-- and signals (ON DELETE CASCADE), the steps of all of them (steps carry no foreign key,
-- see migration 3) and those steps' attempts (migration 8). It returns the number of
-- top-level runs deleted.

CREATE FUNCTION cyclone_delete_finished(retention float8, batch_size integer, at timestamptz)
RETURNS bigint LANGUAGE sql SECURITY DEFINER SET search_path FROM CURRENT AS $$
    WITH RECURSIVE doomed AS (
        SELECT id FROM (SELECT id FROM cyclone_runs
                         WHERE finished_at < coalesce(at, now()) - make_interval(secs => retention)
                           AND parent_run_id IS NULL
                         ORDER BY finished_at
                         LIMIT batch_size) AS top
        UNION ALL
        SELECT r.id FROM cyclone_runs r JOIN doomed d ON r.parent_run_id = d.id
    ), steps AS (
        DELETE FROM cyclone_steps WHERE run_id IN (SELECT id FROM doomed) RETURNING id
    ), attempts AS (
        DELETE FROM cyclone_step_attempts WHERE step_id IN (SELECT id FROM steps)
    ), runs AS (
        DELETE FROM cyclone_runs
         WHERE id IN (SELECT id FROM doomed) AND parent_run_id IS NULL
        RETURNING 1
    )
    SELECT count(*) FROM runs;
$$;

REVOKE ALL ON FUNCTION cyclone_delete_finished(float8, integer, timestamptz) FROM PUBLIC;
