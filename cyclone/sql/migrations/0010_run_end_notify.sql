-- Version 10: a notification on channel cyclone_run_ended, payload the run's id, when a run
-- that a client waited for ends (completed, failed or cancelled), sent in the transaction that
-- ends it (so delivered at its commit, never on rollback).
--
-- Only waited-for runs (`waited`, set by a client's wait: run_wait_register in waits.sql): a
-- transaction that sent a NOTIFY holds a database-wide lock from the start of its commit to
-- its end, WAL flush included, so such commits happen one at a time: notifying every run end
-- cost 1-step runs a large part of their throughput (bench/README.md, "What run-end
-- notifications cost the engine"). The test is in the trigger's WHEN
-- clause, which the executor evaluates without calling the function: a run nobody waits for
-- pays nothing more. A trigger rather than a NOTIFY in each statement that ends runs: runs end
-- in a dozen places (the last step's completion, run_complete_if_done, run_fail,
-- run_cancel_tree, the deadline sweep...), and a trigger cannot be forgotten by the next one.
-- A step that does not end its run never writes cyclone_runs.

-- A constant default: no table rewrite.
ALTER TABLE cyclone_runs ADD COLUMN waited boolean NOT NULL DEFAULT false;

CREATE FUNCTION cyclone_runs_notify_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cyclone_run_ended', NEW.id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_ended AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW
    WHEN (NEW.waited AND NEW.state IN ('completed', 'failed', 'cancelled')
          AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION cyclone_runs_notify_end();
