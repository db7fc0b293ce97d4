-- The DLQ's write side: re-driving a failed run from its dead steps (`cyclone dlq retry`).
-- The listing (`dlq_list`) lives with the other step reads in steps.sql. Runs are locked
-- (run_lock) before any of these run, as everywhere in the engine.

-- name: dlq_step_owner
-- Which run a step belongs to, read without a lock: the caller then locks that run and
-- re-checks everything under the lock.
SELECT id, run_id FROM cyclone_steps WHERE id = %(step_id)s;

-- name: dlq_retry_check
-- Under the run lock: the step, its run, and whether the run's deadline is what failed it.
SELECT s.id AS step_id, s.state AS step_state, s.node, s.error_kind,
       r.id AS run_id, r.state AS run_state, r.parent_run_id, r.workflow,
       coalesce(r.concurrency_key, '') AS concurrency_key, r.concurrency_limit,
       p.state AS parent_state, r.deadline_at,
       coalesce(%(now)s::timestamptz, now()) AS now,
       (r.deadline_at IS NOT NULL
        AND r.deadline_at <= coalesce(%(now)s::timestamptz, now())) AS past_deadline,
       EXISTS (SELECT 1 FROM cyclone_steps d
                WHERE d.run_id = r.id AND d.state = 'dead' AND d.error_kind = 'deadline')
           AS deadline_killed
  FROM cyclone_steps s
  JOIN cyclone_runs r ON r.id = s.run_id
  LEFT JOIN cyclone_runs p ON p.id = r.parent_run_id
 WHERE s.id = %(step_id)s;

-- name: dlq_key_active
-- Under the key's lock (concurrency_lock, the statement before, so that this one sees every
-- run that committed before it was granted): the runs of the key that hold a slot, counted as
-- cyclone_admit counts them. The failed run to re-drive holds none (its pass is negative).
SELECT count(*) AS active
  FROM cyclone_runs r
 WHERE r.workflow = %(workflow)s AND coalesce(r.concurrency_key, '') = %(key)s
   AND r.queued = false AND r.pass > 0;

-- name: dlq_run_redrive
-- The failed run is running again; with %(deadline)s it gets a new deadline from now.
UPDATE cyclone_runs
   SET state = 'running', finished_at = NULL, paused_at = NULL, output = NULL,
       deadline_at = CASE WHEN %(deadline)s::float8 IS NULL THEN deadline_at
                          ELSE coalesce(%(now)s::timestamptz, now())
                               + make_interval(secs => %(deadline)s::float8) END
 WHERE id = %(run_id)s AND state = 'failed'
RETURNING id, workflow, graph_hash, deadline_at;

-- name: dlq_steps_redrive
-- Every step the failure stopped comes back in place (same row, same node instance, so the
-- unique (run_id, node, item) index and map items stay intact): dead steps and the steps the
-- failure discarded. Tasks, maps and child nodes become available with their attempts reset
-- (a child node starts a new child run; the old one was cancelled or failed); waits and sleeps
-- wait again with a fresh due_at from their node (%(nodes)s / %(dues)s, NULL: no max_wait).
-- Nodes that never got a step get one as their dependencies complete, as always.
-- The errors cleared here stay in cyclone_step_attempts: the statements that dead-letter a
-- step write them there; `kept` adds any one that is not there yet (a child run's failure).
WITH kept AS (
    INSERT INTO cyclone_step_attempts
           (step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at)
    SELECT s.id, s.run_id, s.attempt, s.error_kind, s.error, s.leased_by, s.started_at,
           s.completed_at
      FROM cyclone_steps s
     WHERE s.run_id = %(run_id)s AND s.node = ANY(%(nodes)s::text[]) AND s.state = 'dead'
       AND NOT EXISTS (SELECT 1 FROM cyclone_step_attempts a
                        WHERE a.step_id = s.id AND a.error_kind = s.error_kind
                          AND a.ended_at = s.completed_at)
)
UPDATE cyclone_steps s
   SET state = cyclone_kind_first_state(s.kind),
       attempt = 0, error = NULL, error_kind = NULL, output = NULL,
       completed_at = NULL, started_at = NULL, leased_by = NULL, child_run_id = NULL,
       lease_token = NULL, lease_expires_at = NULL,
       available_at = coalesce(%(now)s::timestamptz, now()),
       gated_at = coalesce(%(now)s::timestamptz, now()),
       due_at = CASE WHEN cyclone_kind_first_state(s.kind) = 'waiting'
                     THEN coalesce(%(now)s::timestamptz, now())
                          + make_interval(secs => g.due) END
  FROM unnest(%(nodes)s::text[], %(dues)s::float8[]) AS g (node, due)
 WHERE s.run_id = %(run_id)s AND s.node = g.node AND s.state IN ('dead', 'discarded')
RETURNING s.id, s.node, s.kind, s.signal, s.state, s.item_index;

-- name: step_attempts
-- A step's failed, killed and dead-lettered attempts, oldest first (cyclone_step_attempts).
-- A step's attempts are all in one place, hot or in history.
SELECT id, attempt, error_kind, error, worker, started_at, ended_at
  FROM cyclone_step_attempts WHERE step_id = %(step_id)s
 UNION ALL
SELECT id, attempt, error_kind, error, worker, started_at, ended_at
  FROM cyclone_history_attempts WHERE step_id = %(step_id)s
 ORDER BY id;
