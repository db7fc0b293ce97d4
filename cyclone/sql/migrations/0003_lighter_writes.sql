-- Version 3: the same rules, enforced at a fraction of the cost of every step's writes.
-- Each change below was measured with concurrent workers (figures: bench/README.md, "Figures
-- behind the code's comments").
--
-- 1. CHECK constraints. PostgreSQL rebuilds a table's CHECK expressions from their stored text
--    on every statement that writes the table: for cyclone_steps, two or three times a step, the
--    largest single cost of a step. The value lists become domains, whose checks a session keeps
--    compiled, and the cross-column rules move into one PL/pgSQL function per table, also compiled
--    once a session; each table keeps one small CHECK calling it. The rules are unchanged, and the
--    states are still text checked against their lists.
-- 2. The foreign key from steps to runs. Its check locked the run's row for every step
--    inserted. Steps are only ever made by statements that hold their run, and the retention
--    sweep, the one place runs are deleted, deletes their steps itself.
-- 3. The unique index on a step's node instance now indexes columns only (NULLS NOT
--    DISTINCT, PostgreSQL 15), not an expression to evaluate on every write.
-- 4. The idempotency key's unique index skips the runs without a key (most of them).
-- 5. Running steps are indexed by id, not by lease expiry. Every lease inserted a timestamp at
--    the right edge of the old index, where all workers met. The expired-lease sweep reads
--    all running steps, at most one per worker in the fleet, so it still grows with the work
--    in flight, never with the table. And a heartbeat no longer changes an indexed column, so
--    PostgreSQL can apply it in place (a HOT update).

CREATE DOMAIN cyclone_run_state AS text
    CHECK (VALUE IN ('running', 'paused', 'completed', 'failed', 'cancelled'));
CREATE DOMAIN cyclone_step_state AS text
    CHECK (VALUE IN ('available', 'running', 'waiting', 'completed', 'dead', 'discarded'));
CREATE DOMAIN cyclone_node_kind AS text
    CHECK (VALUE IN ('task', 'map', 'wait', 'sleep', 'child'));
CREATE DOMAIN cyclone_error_kind AS text
    CHECK (VALUE IN ('error', 'timeout', 'crashed', 'lease_expired', 'deadline', 'max_wait',
                     'child_failed', 'cancelled'));

-- A run's rules. The arguments are whether each column is set, so no payload is copied.
CREATE FUNCTION cyclone_run_rules(
    state text, finished boolean, paused boolean, has_output boolean, child boolean,
    has_deadline boolean
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN finished = (state IN ('completed', 'failed', 'cancelled'))
       AND paused = (state = 'paused')
       AND (NOT has_output OR state = 'completed')
       -- A child run is bounded by its parent's deadline and its node's max_wait, never its own.
       AND NOT (child AND has_deadline);
END
$$;

-- A step's rules. A running step holds a lease; a step that ended has completed_at; a dead
-- step says why; only a completed step has output.
CREATE FUNCTION cyclone_step_rules(
    state text, leased boolean, expiring boolean, ended boolean, has_error_kind boolean,
    has_output boolean, attempt integer, max_attempts integer, item_index integer
) RETURNS boolean LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE AS $$
BEGIN
    RETURN leased = (state = 'running')
       AND expiring = (state = 'running')
       AND ended = (state IN ('completed', 'dead', 'discarded'))
       AND (has_error_kind OR state <> 'dead')
       AND (NOT has_output OR state = 'completed')
       AND attempt >= 0 AND max_attempts >= 1
       AND (item_index IS NULL OR item_index >= 0);
END
$$;

-- The views read the columns whose type changes: set them aside, then make them again as
-- they were.
DROP VIEW cyclone_v_steps;
DROP VIEW cyclone_v_runs;

DO $$
DECLARE
    c record;
BEGIN
    FOR c IN
        SELECT t.relname, k.conname
          FROM pg_constraint k JOIN pg_class t ON t.oid = k.conrelid
         WHERE k.contype = 'c' AND t.relnamespace = current_schema()::regnamespace
           AND t.relname IN ('cyclone_runs', 'cyclone_steps')
    LOOP
        EXECUTE format('ALTER TABLE %I DROP CONSTRAINT %I', c.relname, c.conname);
    END LOOP;
END
$$;

ALTER TABLE cyclone_runs
    ALTER COLUMN state TYPE cyclone_run_state,
    ADD CONSTRAINT cyclone_runs_rules CHECK (cyclone_run_rules(
        state, finished_at IS NOT NULL, paused_at IS NOT NULL, output IS NOT NULL,
        parent_run_id IS NOT NULL, deadline_at IS NOT NULL));

ALTER TABLE cyclone_steps
    ALTER COLUMN state TYPE cyclone_step_state,
    ALTER COLUMN kind TYPE cyclone_node_kind,
    ALTER COLUMN error_kind TYPE cyclone_error_kind,
    ADD CONSTRAINT cyclone_steps_rules CHECK (cyclone_step_rules(
        state, lease_token IS NOT NULL, lease_expires_at IS NOT NULL, completed_at IS NOT NULL,
        error_kind IS NOT NULL, output IS NOT NULL, attempt, max_attempts, item_index));

ALTER TABLE cyclone_steps DROP CONSTRAINT cyclone_steps_run_id_fkey;

DROP INDEX cyclone_steps_node_idx;
-- One step per node instance: advancing a run twice cannot create a node twice. Its leading
-- column also serves every lookup of a run's steps.
CREATE UNIQUE INDEX cyclone_steps_node_idx
    ON cyclone_steps (run_id, node, item_index) NULLS NOT DISTINCT;

DROP INDEX cyclone_steps_lease_idx;
CREATE INDEX cyclone_steps_running_idx ON cyclone_steps (id) WHERE state = 'running';

ALTER TABLE cyclone_runs DROP CONSTRAINT cyclone_runs_idempotency_key_key;
CREATE UNIQUE INDEX cyclone_runs_idempotency_idx ON cyclone_runs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;

CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, s.lease_expires_at, s.leased_by, s.child_run_id
  FROM cyclone_steps s;

CREATE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_steps s WHERE s.run_id = r.id) AS steps_total,
       (SELECT count(*) FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state = 'completed') AS steps_completed
  FROM cyclone_runs r;
