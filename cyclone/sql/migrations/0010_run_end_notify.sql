-- Version 10: a notification on channel cyclone_run_ended, payload the run's id, whenever a run
-- ends (completed, failed or cancelled), sent in the transaction that ends it.
--
-- A trigger rather than a pg_notify in each statement that ends runs: runs end in a dozen
-- places (the last step's completion, run_complete_if_done, run_fail, run_cancel_tree, the
-- deadline sweep, and whatever comes next), and a trigger cannot be forgotten by the next one.
-- Its WHEN clause is evaluated by the executor without calling the function, and only on an
-- UPDATE of cyclone_runs: a step that does not end its run never writes cyclone_runs, so it
-- pays nothing. PostgreSQL delivers the notification at commit, and not at all on rollback.
--
-- Client.wait and AsyncClient.wait LISTEN on the channel (one connection per client), and poll
-- as well, because behind PgBouncer in transaction mode notifications never arrive.

CREATE FUNCTION cyclone_runs_notify_end() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('cyclone_run_ended', NEW.id::text);
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_ended AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW
    WHEN (NEW.state IN ('completed', 'failed', 'cancelled') AND OLD.state IS DISTINCT FROM NEW.state)
    EXECUTE FUNCTION cyclone_runs_notify_end();
