-- Version 5: the same row rules, kept by a BEFORE trigger on each table instead of a CHECK.
--
-- A CHECK constraint's expression is stored as a node tree in text, and PostgreSQL reads it
-- back from that text in every statement that writes the table. Migration 3 shrank the text to
-- one call of a rule function, but the call's nine arguments still had to be read back, two or
-- three times a step. A trigger's function is compiled once per session (instruction counts:
-- bench/README.md, "Figures behind the code's comments").
--
-- A broken rule still fails the statement with SQLSTATE 23514 (check_violation), naming
-- cyclone_steps_rules or cyclone_runs_rules as the constraint, as the CHECKs did; the detail
-- says which rule. Like every trigger, these do not fire while session_replication_role is
-- `replica` (logical replication applies rows its origin already checked).

-- Each rule is written once, as the text naming it when it is broken: a row passes when no
-- rule names itself. A rule on a NULL is NULL, not broken (a CHECK passes on NULL too), so a
-- NULL in a NOT NULL column gets through to that constraint, checked after the trigger, which
-- names the column.

CREATE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    broken text;
BEGIN
    -- A running step holds a lease; a step that ended has completed_at; a dead step says
    -- why; only a completed step has output.
    broken := concat_ws('; ',
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
    IF broken = '' THEN
        RETURN NEW;
    END IF;
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_steps_rules', TABLE = 'cyclone_steps', DETAIL = broken,
        MESSAGE = format('step %s (state %s) breaks a rule of cyclone_steps', NEW.id, NEW.state);
END
$$;

CREATE FUNCTION cyclone_runs_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    broken text;
BEGIN
    broken := concat_ws('; ',
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
    IF broken = '' THEN
        RETURN NEW;
    END IF;
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_runs_rules', TABLE = 'cyclone_runs', DETAIL = broken,
        MESSAGE = format('run %s (state %s) breaks a rule of cyclone_runs', NEW.id, NEW.state);
END
$$;

ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_rules;
ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_rules;
DROP FUNCTION cyclone_step_rules(text, boolean, boolean, boolean, boolean, boolean, integer,
                                 integer, integer);
DROP FUNCTION cyclone_run_rules(text, boolean, boolean, boolean, boolean, boolean);

CREATE TRIGGER cyclone_steps_rules BEFORE INSERT OR UPDATE ON cyclone_steps
    FOR EACH ROW EXECUTE FUNCTION cyclone_steps_keep_rules();
CREATE TRIGGER cyclone_runs_rules BEFORE INSERT OR UPDATE ON cyclone_runs
    FOR EACH ROW EXECUTE FUNCTION cyclone_runs_keep_rules();
