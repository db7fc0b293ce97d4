-- Version 23: the row triggers' conditions move out of WHEN clauses into the rules' functions.
--
-- A trigger's WHEN clause is stored as text, and PostgreSQL reads it back (stringToNode), plans
-- it as an expression and compiles it once per statement that may fire the trigger, before it
-- looks at a single row: it is not kept with a prepared statement's plan. With the triggers of
-- migrations 14 (flow control) and 22 (wake), a completed step paid that for nine clauses, about
-- 530,000 of its 1,690,000 server instructions (bench/instructions.py --keep, by function:
-- TriggerEnabled), on workflows that declared no limit at all and with no one waiting. The
-- rules' functions run for every row anyway, and a condition there costs a few thousand
-- instructions. So:
--
--   * what ran BEFORE a row was written is now at the head of cyclone_steps_keep_rules and
--     cyclone_runs_keep_rules, in the order the triggers fired (by name, all before `_rules`):
--     holding a step of a limited node, a run's pass sign, the refusal of a finished_at in the
--     past;
--   * what ran AFTER and only sends a notification (a run's end to its waiters, a wake of a
--     waiting supervisor or of the scanner) is at their end, once the rules passed: NOTIFY is
--     delivered at commit, and never if the transaction rolls back, as before;
--   * admission stays AFTER the row is written (it counts the slot the row lets go, and admits
--     the step just inserted), behind a WHEN of one column test that is false whenever the
--     node or workflow has no limit: cheap to read back, and the function tests the rest.

DROP TRIGGER cyclone_steps_hold ON cyclone_steps;
DROP TRIGGER cyclone_steps_hold_again ON cyclone_steps;
DROP TRIGGER cyclone_steps_slot_freed ON cyclone_steps;
DROP TRIGGER cyclone_steps_wake ON cyclone_steps;
DROP TRIGGER cyclone_steps_wake_again ON cyclone_steps;
DROP TRIGGER cyclone_runs_pass_sign ON cyclone_runs;
DROP TRIGGER cyclone_runs_finished_now ON cyclone_runs;
DROP TRIGGER cyclone_runs_ended ON cyclone_runs;
DROP TRIGGER cyclone_runs_slot_freed ON cyclone_runs;
DROP TRIGGER cyclone_runs_wake ON cyclone_runs;
DROP FUNCTION cyclone_steps_hold();
DROP FUNCTION cyclone_steps_wake();
DROP FUNCTION cyclone_runs_pass_sign();
DROP FUNCTION cyclone_runs_finished_not_past();
DROP FUNCTION cyclone_runs_notify_end();
DROP FUNCTION cyclone_runs_wake();

CREATE OR REPLACE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- PL/pgSQL compiles a test the first time a transaction reaches it, and the cost grows
    -- with its size: so each step starts with a small test that the hot path fails (a lease and
    -- a completion make no step available or waiting), and the larger ones sit behind it.
    IF NEW.state = 'available' OR NEW.state = 'waiting' THEN
        -- A step of a limited node made available waits, held, until admitted: a new one, and
        -- one made available again other than by a planned stop giving it back (a retry of a
        -- rate-limited step takes a token per attempt; a DLQ retry takes a slot anew). A retry
        -- of a node limited by concurrency only keeps its slot.
        IF NEW.node_limit IS NOT NULL OR NEW.rate_limit IS NOT NULL THEN
            IF NEW.state = 'available'
               AND (TG_OP = 'INSERT'
                    OR (OLD.state <> 'available' AND NOT OLD.held
                        AND (OLD.state <> 'running'
                             OR (NEW.attempt >= OLD.attempt AND NEW.rate_limit IS NOT NULL))))
            THEN
                NEW.state := 'waiting';
                NEW.held := true;
            END IF;
        END IF;
        -- Wake whoever waits for this step: a supervisor whose workers found nothing (the flag
        -- is set only while one waits), or the scanner asleep past the step's time. (Should a
        -- rule below fail the row, the transaction rolls back its notification with it.) The
        -- flag or time is read once the transaction has its id (pg_current_xact_id): whoever
        -- sets one then waits for the transactions in progress (cyclone_wake_settle), which
        -- counts only those with an id, and a BEFORE trigger runs before the row's write
        -- gives the first write of a transaction its id.
        IF NEW.state = 'available' THEN
            IF NEW.available_at <= now() THEN
                IF (TG_OP = 'INSERT' OR OLD.state <> 'available')
                   AND pg_current_xact_id() IS NOT NULL
                   AND pg_sequence_last_value('cyclone_wake_ready') = 1 THEN
                    PERFORM cyclone_wake_ready();
                END IF;
            ELSIF (TG_OP = 'INSERT' OR OLD.state <> 'available'
                   OR OLD.available_at <> NEW.available_at)
                  AND pg_current_xact_id() IS NOT NULL
                  AND cyclone_epoch_ms(NEW.available_at)
                      < pg_sequence_last_value('cyclone_wake_timer') THEN
                PERFORM cyclone_wake_timer(NEW.available_at);
            END IF;
        ELSIF NEW.due_at < now() + interval '1 minute' THEN
            IF (TG_OP = 'INSERT' OR OLD.state <> 'waiting'
                OR OLD.due_at IS DISTINCT FROM NEW.due_at)
               AND pg_current_xact_id() IS NOT NULL
               AND cyclone_epoch_ms(NEW.due_at) < pg_sequence_last_value('cyclone_wake_timer')
            THEN
                PERFORM cyclone_wake_timer(NEW.due_at);
            END IF;
        END IF;
    END IF;
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
    -- (On an INSERT, OLD is NULL: the state differs from it and was never an end.)
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        -- A run's pass is negative once it ended (positive again if the DLQ re-drives it),
        -- and a client waiting for its end (`waited`: run_wait_register in waits.sql) hears
        -- of it at commit.
        IF NEW.state IN ('completed', 'failed', 'cancelled') THEN
            NEW.pass := -abs(NEW.pass);
            IF NEW.waited AND TG_OP = 'UPDATE' THEN
                PERFORM pg_notify('cyclone_run_ended', NEW.id::text);
            END IF;
        ELSIF OLD.state IN ('completed', 'failed', 'cancelled') THEN
            NEW.pass := abs(NEW.pass);
        END IF;
    END IF;
    -- A finished_at earlier than the transaction's clock, set by a role that does not own the
    -- table: retention would take the run before its time. (Qualified names: this runs with
    -- the caller's search_path.)
    IF NEW.finished_at < pg_catalog.now() THEN
        IF TG_OP = 'UPDATE' AND NEW.finished_at IS DISTINCT FROM OLD.finished_at
           AND NOT pg_catalog.pg_has_role(current_user,
                                          (SELECT c.relowner FROM pg_catalog.pg_class c
                                            WHERE c.oid = TG_RELID), 'MEMBER') THEN
            RAISE insufficient_privilege USING
                MESSAGE = pg_catalog.format('run %s: finished_at %s is before now (%s); role %s'
                                            ' may only end a run at the current time', NEW.id,
                                            NEW.finished_at, pg_catalog.now(), current_user);
        END IF;
    END IF;
    -- A deadline earlier than the scanner sleeps.
    IF NEW.deadline_at < now() + interval '1 minute' THEN
        IF NEW.state IN ('running', 'queued')
           AND pg_current_xact_id() IS NOT NULL
           AND cyclone_epoch_ms(NEW.deadline_at) < pg_sequence_last_value('cyclone_wake_timer')
        THEN
            PERFORM cyclone_wake_timer(NEW.deadline_at);
        END IF;
    END IF;
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

-- A step that held a slot let it go (ended, parked, or held again for a token).
CREATE FUNCTION cyclone_steps_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state IN ('available', 'running') AND NEW.state NOT IN ('available', 'running') THEN
        PERFORM cyclone_admit_steps(NEW.workflow, NEW.node, now());
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_steps_slot_freed AFTER UPDATE OF state ON cyclone_steps
    FOR EACH ROW WHEN (OLD.node_limit IS NOT NULL)
    EXECUTE FUNCTION cyclone_steps_free_slot();

-- A run that held a slot ended: admit what now fits. (A queued run that ends held none.)
CREATE OR REPLACE FUNCTION cyclone_runs_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state IN ('running', 'paused') AND NOT OLD.queued
       AND NEW.state IN ('completed', 'failed', 'cancelled') THEN
        PERFORM cyclone_admit(NEW.workflow, NEW.concurrency_key, NEW.concurrency_limit, now());
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_slot_freed AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW WHEN (NEW.concurrency_limit IS NOT NULL)
    EXECUTE FUNCTION cyclone_runs_free_slot();
