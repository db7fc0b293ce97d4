-- Version 15: retention's SECURITY DEFINER function cannot be turned against its owner, and
-- the runtime role can no longer erase history through it.
--
-- Migration 9 created cyclone_delete_finished with `SET search_path FROM CURRENT`, which leaves
-- pg_temp searched first for relations: a runtime session's temporary view named cyclone_runs,
-- calling a function of its own, ran that function with the migrating role's rights. Now the
-- function's search_path is its schema then pg_temp (searched last), and every name it uses
-- is qualified with the schema, written in by this migration (the schema is the one migrated
-- into, known only when it runs, hence the EXECUTE).
--
-- The runtime role could also pass retention 0 and `at` = 'infinity' and delete every finished
-- run, after setting any run to completed in the past. For a caller that is not a member of
-- the function's owner (the migrating role; superusers are members of every role) the cut-off
-- is now at most the server's clock, less at least a day (the floor, written in the function:
-- a setting of the function's own would need a superuser to create it). The owner (and so TestEnv, which shifts its clock forward) passes any `at` and retention as
-- before: it could delete the rows directly anyway. A trigger refuses a finished_at set in the
-- past by a role that does not own cyclone_runs, and grants.sql narrows the runtime role's
-- UPDATE on runs to the columns its statements write.

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
        SELECT r.id FROM %1$I.cyclone_runs r JOIN doomed d ON r.parent_run_id = d.id
    ), steps AS (
        DELETE FROM %1$I.cyclone_steps WHERE run_id IN (SELECT id FROM doomed) RETURNING id
    ), attempts AS (
        DELETE FROM %1$I.cyclone_step_attempts WHERE step_id IN (SELECT id FROM steps)
    ), runs AS (
        DELETE FROM %1$I.cyclone_runs
         WHERE id IN (SELECT id FROM doomed) AND parent_run_id IS NULL
        RETURNING 1
    )
    SELECT count(*) FROM runs;
$$
$fn$, current_schema());
END
$migration$;

-- A run's finished_at set earlier than the transaction's clock, by a role that does not own
-- the table: retention would take it before its time. The WHEN clause is evaluated without
-- calling the function, so the statements that end runs at now() (or at TestEnv's clock,
-- which only moves forward) pay nothing; the names are qualified because the function runs
-- with the caller's search_path.
CREATE FUNCTION cyclone_runs_finished_not_past() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF pg_catalog.pg_has_role(current_user, (SELECT c.relowner FROM pg_catalog.pg_class c
                                               WHERE c.oid = TG_RELID), 'MEMBER') THEN
        RETURN NEW;
    END IF;
    RAISE insufficient_privilege USING
        MESSAGE = pg_catalog.format('run %s: finished_at %s is before now (%s); role %s may '
                                    'only end a run at the current time', NEW.id,
                                    NEW.finished_at, pg_catalog.now(), current_user);
END
$$;

CREATE TRIGGER cyclone_runs_finished_now BEFORE UPDATE OF finished_at ON cyclone_runs
    FOR EACH ROW
    WHEN (NEW.finished_at < now() AND NEW.finished_at IS DISTINCT FROM OLD.finished_at)
    EXECUTE FUNCTION cyclone_runs_finished_not_past();
