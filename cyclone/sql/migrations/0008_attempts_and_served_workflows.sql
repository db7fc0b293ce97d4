-- Version 8: every failed attempt's error is kept, and supervisors say which workflows their
-- workers serve.
--
-- A step row holds only its latest error: the next failure overwrote it, a completion cleared
-- it, and `dlq retry` erased the error that dead-lettered the step (a deadline's, say). Each
-- failed, killed or dead-lettered attempt now adds a row here, written by the statement that
-- records the failure, never by a step's success path. No foreign key: cyclone_steps carries
-- none either (migration 3), and retention deletes these rows with their steps.
CREATE TABLE cyclone_step_attempts (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    step_id     bigint NOT NULL,
    run_id      uuid NOT NULL,
    attempt     integer NOT NULL,
    error_kind  cyclone_error_kind NOT NULL,
    error       text,
    worker      text,
    started_at  timestamptz,
    ended_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX cyclone_step_attempts_step_idx ON cyclone_step_attempts (step_id, id);

-- The workflow names a supervisor's workers lease for (NULL: a supervisor older than this
-- version, taken to serve every workflow). `cyclone status` and the metrics warn about runs
-- of workflows that no live supervisor serves: after a SIGHUP that could not load new code,
-- their steps would wait for ever with workers idle.
ALTER TABLE cyclone_supervisors ADD COLUMN workflows text[];

-- The history, oldest first, as the last column of the steps view.
CREATE OR REPLACE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, s.lease_expires_at, s.leased_by, s.child_run_id,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt', a.attempt, 'error_kind', a.error_kind, 'error', a.error,
                   'worker', a.worker, 'started_at', a.started_at, 'ended_at', a.ended_at)
                   ORDER BY a.id), '[]'::jsonb)
          FROM cyclone_step_attempts a WHERE a.step_id = s.id) AS attempts
  FROM cyclone_steps s;
