-- Version 6: the same row rules, with a row that keeps them let through by one boolean test.
--
-- Migration 5 built the text naming the broken rules for every row written, and compared it with
-- '', a cost paid on every row (instruction counts: bench/README.md, "Figures behind the code's
-- comments"). So each rule appears twice: as a condition in the test, and as the text naming it
-- once the test failed. The two lists must say the same thing: tests/db/test_schema.py holds both to
-- one model of the rules on every combination of the columns they read.
--
-- A rule on a NULL is not broken (as in migration 5, and as a CHECK passes on NULL): a NULL
-- in a NOT NULL column reaches that constraint, which names the column.

CREATE OR REPLACE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF ((NEW.lease_token IS NOT NULL) <> (NEW.state = 'running')
        OR (NEW.lease_expires_at IS NOT NULL) <> (NEW.state = 'running')
        OR (NEW.completed_at IS NOT NULL) <> (NEW.state IN ('completed', 'dead', 'discarded'))
        OR (NEW.error_kind IS NULL AND NEW.state = 'dead')
        OR (NEW.output IS NOT NULL AND NEW.state <> 'completed')
        OR NOT (NEW.attempt >= 0 AND NEW.max_attempts >= 1)
        OR NEW.item_index < 0) IS NOT TRUE THEN
        RETURN NEW;
    END IF;
    -- A running step holds a lease; a step that ended has completed_at; a dead step says
    -- why; only a completed step has output.
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_steps_rules', TABLE = 'cyclone_steps',
        MESSAGE = format('step %s (state %s) breaks a rule of cyclone_steps', NEW.id, NEW.state),
        DETAIL = concat_ws('; ',
            CASE WHEN (NEW.lease_token IS NOT NULL) <> (NEW.state = 'running')
                 THEN 'lease_token is set exactly while the step is running' END,
            CASE WHEN (NEW.lease_expires_at IS NOT NULL) <> (NEW.state = 'running')
                 THEN 'lease_expires_at is set exactly while the step is running' END,
            CASE WHEN (NEW.completed_at IS NOT NULL)
                      <> (NEW.state IN ('completed', 'dead', 'discarded'))
                 THEN 'completed_at is set exactly once the step ended' END,
            CASE WHEN NEW.error_kind IS NULL AND NEW.state = 'dead'
                 THEN 'a dead step has an error_kind' END,
            CASE WHEN NEW.output IS NOT NULL AND NEW.state <> 'completed'
                 THEN 'only a completed step has output' END,
            CASE WHEN NOT (NEW.attempt >= 0 AND NEW.max_attempts >= 1)
                 THEN 'attempt >= 0 and max_attempts >= 1' END,
            CASE WHEN NEW.item_index < 0 THEN 'item_index >= 0' END);
END
$$;

CREATE OR REPLACE FUNCTION cyclone_runs_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF ((NEW.finished_at IS NOT NULL) <> (NEW.state IN ('completed', 'failed', 'cancelled'))
        OR (NEW.paused_at IS NOT NULL) <> (NEW.state = 'paused')
        OR (NEW.output IS NOT NULL AND NEW.state <> 'completed')
        OR (NEW.parent_run_id IS NOT NULL AND NEW.deadline_at IS NOT NULL)) IS NOT TRUE THEN
        RETURN NEW;
    END IF;
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_runs_rules', TABLE = 'cyclone_runs',
        MESSAGE = format('run %s (state %s) breaks a rule of cyclone_runs', NEW.id, NEW.state),
        DETAIL = concat_ws('; ',
            CASE WHEN (NEW.finished_at IS NOT NULL)
                      <> (NEW.state IN ('completed', 'failed', 'cancelled'))
                 THEN 'finished_at is set exactly once the run ended' END,
            CASE WHEN (NEW.paused_at IS NOT NULL) <> (NEW.state = 'paused')
                 THEN 'paused_at is set exactly while the run is paused' END,
            CASE WHEN NEW.output IS NOT NULL AND NEW.state <> 'completed'
                 THEN 'only a completed run has output' END,
            -- A child run is bounded by its parent's deadline and its node's max_wait only.
            CASE WHEN NEW.parent_run_id IS NOT NULL AND NEW.deadline_at IS NOT NULL
                 THEN 'a child run has no deadline of its own' END);
END
$$;
