-- Version 10: a notification on channel cyclone_run_ended, payload the run's id, when a run
-- that a client waits for ends (completed, failed or cancelled), sent in the transaction that
-- ends it (so delivered at its commit, never on rollback).
--
-- Only runs with a waiter: a transaction that sent a NOTIFY holds a database-wide lock from
-- its commit's start to its end, WAL flush included, so such commits happen one at a time.
-- Notifying every run end cost 1-step runs a quarter of their throughput with 4 workers
-- (bench/engine.py, 0.56-0.63 of the baseline against 0.83); a run nobody waits for now pays
-- a trigger call and a probe of an empty index. Client.wait registers its run in
-- cyclone_run_waiters (run_wait_register, cyclone/sql/waits.sql) and the trigger deletes the
-- rows as it notifies. A row whose waiter went away goes with the run's end, or its deletion.
--
-- A trigger rather than a NOTIFY in each statement that ends runs: runs end in a dozen places
-- (the last step's completion, run_complete_if_done, run_fail, run_cancel_tree, the deadline
-- sweep...), and a trigger cannot be forgotten by the next one. Its WHEN clause is evaluated
-- without calling the function, and only on an UPDATE of cyclone_runs: a step that does not
-- end its run never writes cyclone_runs.

CREATE TABLE cyclone_run_waiters (
    run_id  uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    watcher uuid NOT NULL,                       -- one client's watcher (cyclone/waiting.py)
    since   timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (run_id, watcher)
);

CREATE FUNCTION cyclone_runs_notify_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    DELETE FROM cyclone_run_waiters WHERE run_id = NEW.id;
    IF FOUND THEN
        PERFORM pg_notify('cyclone_run_ended', NEW.id::text);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_ended AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW
    WHEN (NEW.state IN ('completed', 'failed', 'cancelled') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION cyclone_runs_notify_end();
