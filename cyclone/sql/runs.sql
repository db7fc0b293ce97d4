-- Runs: creation, locking, and every transition of a whole run.
-- Every time-dependent statement takes %(now)s: NULL means the database clock.

-- name: graph_register
INSERT INTO cyclone_graphs (hash, workflow, graph)
VALUES (%(hash)s, %(workflow)s, %(graph)s::jsonb)
ON CONFLICT (hash) DO NOTHING;

-- name: workflow_register
-- The workflow's current graph, queue and default priority; its queue gets its row.
WITH queue AS (
    INSERT INTO cyclone_queues (name) VALUES (%(queue)s) ON CONFLICT (name) DO NOTHING
)
INSERT INTO cyclone_workflows (name, graph_hash, queue, priority, concurrency_field,
                               concurrency_limit)
VALUES (%(workflow)s, %(hash)s, %(queue)s, %(priority)s, %(concurrency_field)s,
        %(concurrency_limit)s)
ON CONFLICT (name) DO UPDATE SET graph_hash = excluded.graph_hash, queue = excluded.queue,
                                 priority = excluded.priority,
                                 concurrency_field = excluded.concurrency_field,
                                 concurrency_limit = excluded.concurrency_limit,
                                 updated_at = now()
WHERE (cyclone_workflows.graph_hash, cyclone_workflows.queue, cyclone_workflows.priority,
       cyclone_workflows.concurrency_field, cyclone_workflows.concurrency_limit)
      IS DISTINCT FROM (excluded.graph_hash, excluded.queue, excluded.priority,
                        excluded.concurrency_field, excluded.concurrency_limit);

-- name: workflow_get
SELECT g.hash, g.graph, w.concurrency_field, w.concurrency_limit
  FROM cyclone_workflows w JOIN cyclone_graphs g ON g.hash = w.graph_hash
 WHERE w.name = %(workflow)s;

-- name: graph_get
SELECT hash, graph FROM cyclone_graphs WHERE hash = %(hash)s;

-- name: graph_versions
-- Every stored graph of these workflows (cyclone/engine/versions.py): a few per deploy.
SELECT hash, workflow FROM cyclone_graphs
 WHERE workflow = ANY (%(names)s::text[])
 ORDER BY created_at, hash;

-- name: run_submit
-- Create runs and their root steps in one statement. An idempotency key that is already taken
-- inserts nothing (and so no steps); run_by_key then finds the run that owns it. Each run takes
-- its workflow's queue, the priority given (else the workflow's), and its fair pass: the later
-- of its queue's clock and its group's last pass among live runs, plus its rank in the group
-- among the runs of this statement (schema.sql, cyclone_runs.pass). The group's last pass is
-- read, not locked: two submits at once may give the same pass, which only ties the order.
WITH wf AS (
    SELECT coalesce((SELECT w.queue FROM cyclone_workflows w
                      WHERE w.name = %(workflow)s), 'default') AS queue,
           coalesce(%(priority)s::smallint,
                    (SELECT w.priority FROM cyclone_workflows w WHERE w.name = %(workflow)s),
                    3) AS priority
), clock AS (
    SELECT wf.queue, wf.priority,
           coalesce((SELECT q.pass FROM cyclone_queues q WHERE q.name = wf.queue), 0) AS pass
      FROM wf
), v AS (
    SELECT v.id, v.input, v.ckey,
           row_number() OVER (PARTITION BY coalesce(v.ckey, '') ORDER BY v.n) AS rank
      FROM unnest(%(ids)s::uuid[], %(inputs)s::text[], %(ckeys)s::text[])
           WITH ORDINALITY AS v (id, input, ckey, n)
), groups AS MATERIALIZED (
    -- With a concurrency limit, the key's active runs too: the caller holds the key's lock
    -- (concurrency_lock, a statement before this one), so the count is exact.
    -- MATERIALIZED: once per group, not once per run joined to it. The last pass is the first
    -- entry of cyclone_runs_fair_idx read backward; written as max(), the planner may count
    -- every live run of the workflow instead (a bitmap scan, when its statistics say few), and
    -- a submit then costs what the backlog holds (issue 25's churn stalled on it).
    SELECT g.ckey,
           greatest(
            (SELECT r.pass FROM cyclone_runs r WHERE r.workflow = %(workflow)s
              AND coalesce(r.concurrency_key, '') = g.ckey AND NOT r.queued AND r.pass > 0
              ORDER BY r.pass DESC LIMIT 1),
            (SELECT r.pass FROM cyclone_runs r WHERE r.workflow = %(workflow)s
              AND coalesce(r.concurrency_key, '') = g.ckey AND r.queued AND r.pass > 0
              ORDER BY r.pass DESC LIMIT 1)) AS last,
           CASE WHEN %(climit)s::integer IS NOT NULL AND g.ckey <> '' THEN
               (SELECT count(*) FROM cyclone_runs r
                 WHERE r.workflow = %(workflow)s AND coalesce(r.concurrency_key, '') = g.ckey
                   AND r.queued = false AND r.pass > 0)
           END AS active
      FROM (SELECT DISTINCT coalesce(v.ckey, '') AS ckey FROM v) AS g
), runs AS (
    INSERT INTO cyclone_runs (id, workflow, graph_hash, state, input, idempotency_key,
                              parent_run_id, parent_step_id, created_at, deadline_at, queue,
                              priority, pass, concurrency_key, concurrency_limit, queued,
                              trace_parent)
    SELECT v.id, %(workflow)s, %(hash)s,
           CASE WHEN v.rank > %(climit)s::integer - groups.active THEN 'queued'
                ELSE 'running' END,
           v.input::jsonb, %(key)s,
           %(parent_run_id)s, %(parent_step_id)s, coalesce(%(now)s::timestamptz, now()),
           CASE WHEN %(deadline)s::float8 > 0
                THEN coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(deadline)s)
           END,
           clock.queue, clock.priority,
           greatest(clock.pass, groups.last) + v.rank, v.ckey,
           CASE WHEN v.ckey IS NOT NULL THEN %(climit)s::integer END,
           coalesce(v.rank > %(climit)s::integer - groups.active, false),
           -- A child run joins its parent's trace (one lookup by key, once per statement).
           coalesce(%(trace_parent)s::text,
                    (SELECT p.trace_parent FROM cyclone_runs p
                      WHERE p.id = %(parent_run_id)s::uuid))
      FROM v JOIN groups ON groups.ckey = coalesce(v.ckey, ''), clock
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
    RETURNING id, priority, pass, state
), roots AS (
    INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, timeout,
                               signal, available_at, due_at, created_at, priority, pass,
                               node_limit, rate_limit)
    SELECT runs.id, %(workflow)s, n.node, n.kind,
           cyclone_kind_first_state(n.kind),
           n.max_attempts, make_interval(secs => n.timeout), n.signal,
           coalesce(%(now)s::timestamptz, now()),
           coalesce(%(now)s::timestamptz, now()) + make_interval(secs => n.due),
           coalesce(%(now)s::timestamptz, now()), runs.priority, runs.pass, n.node_limit,
           n.rate_limit
      FROM runs,
           unnest(%(nodes)s::text[], %(kinds)s::text[], %(max_attempts)s::int[],
                  %(timeouts)s::float8[], %(signals)s::text[], %(dues)s::float8[],
                  %(limits)s::int[], %(rates)s::text[])
           AS n (node, kind, max_attempts, timeout, signal, due, node_limit, rate_limit)
     WHERE runs.state = 'running'
    RETURNING id
)
SELECT id FROM runs;

-- name: concurrency_lock
-- Before a submit under a concurrency limit: the keys' locks, in one order (no deadlock
-- between two submits of the same keys).
SELECT count(cyclone_slot_lock(%(workflow)s, k.ckey))
  FROM (SELECT DISTINCT ckey FROM unnest(%(ckeys)s::text[]) AS u (ckey)
         WHERE ckey IS NOT NULL ORDER BY ckey) AS k;

-- name: run_by_key
SELECT id FROM cyclone_runs WHERE idempotency_key = %(key)s;

-- name: run_lock
-- Serialises every change to one run and its steps: take it before touching the run's steps.
SELECT id, workflow, graph_hash, state, parent_run_id, parent_step_id, deadline_at, paused_at
  FROM cyclone_runs WHERE id = %(run_id)s
   FOR NO KEY UPDATE;

-- name: _run_status
-- What RunStatus reads of a run r: its columns, and why it failed (its first dead step).
SELECT id, workflow, state, input, output, parent_run_id, created_at, deadline_at, paused_at,
       finished_at,
       (SELECT jsonb_build_object('error_kind', s.error_kind, 'error', s.error)
          FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state = 'dead'
         ORDER BY s.completed_at, s.id LIMIT 1) AS failure

-- name: _history_run_status
-- The same, of a run r of history (migration 18).
SELECT id, workflow, state, input, output, parent_run_id, created_at, deadline_at, paused_at,
       finished_at,
       (SELECT jsonb_build_object('error_kind', s.error_kind, 'error', s.error)
          FROM cyclone_history_steps s
         WHERE s.run_id = r.id AND s.state = 'dead'
         ORDER BY s.completed_at, s.id LIMIT 1) AS failure

-- name: run_get
-- A run is in the hot tables or, once the history sweep moved it, in history: one statement,
-- so it is found in one or the other even while it moves.
-- include: _run_status
  FROM cyclone_runs r WHERE id = %(run_id)s
 UNION ALL
-- include: _history_run_status
  FROM cyclone_history_runs r WHERE id = %(run_id)s
 LIMIT 1;

-- name: run_complete_if_done
-- The run completes when every node has a step and every step completed; its output is the
-- outputs of its sinks (a map sink's output is its items' outputs in order).
UPDATE cyclone_runs r
   SET state = 'completed', finished_at = coalesce(%(now)s::timestamptz, now()), paused_at = NULL,
       output = (SELECT coalesce(jsonb_object_agg(o.node, o.output), '{}'::jsonb)
                   FROM (SELECT s.node,
                                CASE WHEN bool_or(s.kind = 'map' AND s.item_index IS NOT NULL)
                                     THEN jsonb_agg(s.output ORDER BY s.item_index)
                                     ELSE (array_agg(s.output))[1] END AS output
                           FROM cyclone_steps s
                          WHERE s.run_id = r.id AND s.node = ANY(%(sinks)s::text[])
                          GROUP BY s.node) AS o)
 WHERE r.id = %(run_id)s AND r.state IN ('running', 'paused')
   AND NOT EXISTS (SELECT 1 FROM cyclone_steps s
                    WHERE s.run_id = r.id AND s.state <> 'completed')
   AND (SELECT count(DISTINCT s.node) FROM cyclone_steps s WHERE s.run_id = r.id)
       = %(node_count)s
RETURNING r.id, r.parent_run_id, r.parent_step_id, r.output;

-- name: run_fail
-- A dead step fails its run: the other live steps are discarded and their leases revoked.
WITH run AS (
    UPDATE cyclone_runs
       SET state = 'failed', finished_at = coalesce(%(now)s::timestamptz, now()), paused_at = NULL
     WHERE id = %(run_id)s AND state IN ('running', 'paused')
 RETURNING id, parent_run_id, parent_step_id
), discarded AS (
    UPDATE cyclone_steps s
       SET state = 'discarded', error = 'run failed', completed_at = coalesce(%(now)s::timestamptz, now()),
           lease_token = NULL, lease_expires_at = NULL
      FROM run
     WHERE s.run_id = run.id AND s.state IN ('available', 'running', 'waiting')
 RETURNING s.child_run_id
)
SELECT run.id, run.parent_run_id, run.parent_step_id,
       (SELECT array_agg(d.child_run_id) FROM discarded d WHERE d.child_run_id IS NOT NULL)
           AS child_run_ids
  FROM run;

-- name: run_cancel_tree
-- Cancel runs and every descendant still in progress, discarding their live steps.
WITH RECURSIVE tree AS (
    SELECT id FROM cyclone_runs WHERE id = ANY(%(run_ids)s::uuid[])
    UNION
    SELECT r.id FROM cyclone_runs r JOIN tree t ON r.parent_run_id = t.id
), runs AS (
    UPDATE cyclone_runs r
       SET state = 'cancelled', finished_at = coalesce(%(now)s::timestamptz, now()), paused_at = NULL,
           queued = false
      FROM tree
     WHERE r.id = tree.id AND r.state IN ('running', 'paused', 'queued')
 RETURNING r.id, r.parent_run_id, r.parent_step_id
), steps AS (
    UPDATE cyclone_steps s
       SET state = 'discarded', error_kind = 'cancelled', error = 'run cancelled',
           completed_at = coalesce(%(now)s::timestamptz, now()),
           lease_token = NULL, lease_expires_at = NULL
      FROM runs
     WHERE s.run_id = runs.id AND s.state IN ('available', 'running', 'waiting')
 RETURNING s.id
)
SELECT id, parent_run_id, parent_step_id, (SELECT count(*) FROM steps) AS steps FROM runs;

-- name: run_pause
-- A queued run may be paused too: it keeps `queued`, and resumes to the queue.
UPDATE cyclone_runs SET state = 'paused', paused_at = coalesce(%(now)s::timestamptz, now())
 WHERE id = %(run_id)s AND state IN ('running', 'queued')
RETURNING id;

-- name: run_resume
-- The run keeps the time it had left: its deadline and other time gates move forward by the
-- length of the pause.
WITH run AS (
    SELECT id, paused_at, coalesce(%(now)s::timestamptz, now()) AS now
      FROM cyclone_runs WHERE id = %(run_id)s AND state = 'paused'
), resumed AS (
    UPDATE cyclone_runs r
       SET state = CASE WHEN r.queued THEN 'queued' ELSE 'running' END, paused_at = NULL,
           deadline_at = r.deadline_at + greatest(run.now - run.paused_at, '0'::interval)
      FROM run WHERE r.id = run.id
 RETURNING r.id
), gates AS (
    -- A gate set during the pause (a wait reached, a child parked) starts counting at resume;
    -- one set before it gets back the whole pause. A gate is set when the step is made
    -- (created_at) or re-set later (gated_at, NULL until then).
    UPDATE cyclone_steps s
       SET due_at = s.due_at + greatest(
               run.now - greatest(run.paused_at, coalesce(s.gated_at, s.created_at)),
               '0'::interval)
      FROM run
     WHERE s.run_id = run.id AND s.state = 'waiting' AND s.due_at IS NOT NULL
 RETURNING s.id
), retries AS (
    UPDATE cyclone_steps s
       SET available_at = s.available_at + greatest(
               run.now - greatest(run.paused_at, coalesce(s.gated_at, s.created_at)),
               '0'::interval)
      FROM run
     WHERE s.run_id = run.id AND s.state = 'available' AND s.attempt > 0
       AND s.available_at > run.paused_at
 RETURNING s.id
)
SELECT id, (SELECT count(*) FROM gates) + (SELECT count(*) FROM retries) AS gates FROM resumed;

-- name: run_steps
-- A run's steps, hot or in history (a run's steps are all in one place).
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index
  FROM cyclone_steps s WHERE s.run_id = %(run_id)s
 UNION ALL
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index
  FROM cyclone_history_steps s WHERE s.run_id = %(run_id)s
 ORDER BY id;

-- name: run_exists
SELECT state FROM cyclone_runs WHERE id = %(run_id)s
 UNION ALL
SELECT state FROM cyclone_history_runs WHERE id = %(run_id)s
 LIMIT 1;

-- name: run_results
-- Outputs of the run's completed steps, for ctx.results.
SELECT node, kind, item_index, state, output FROM cyclone_steps
 WHERE run_id = %(run_id)s ORDER BY node, item_index NULLS FIRST;

-- name: revoked_notify
-- A hint to every supervisor that leases were revoked; they check which of theirs.
SELECT pg_notify('cyclone_revoked', current_schema());

-- name: signal_insert
INSERT INTO cyclone_signals (run_id, name, payload, created_at, consumed_by)
VALUES (%(run_id)s, %(name)s, %(payload)s::jsonb, coalesce(%(now)s::timestamptz, now()),
        %(consumed_by)s);

-- name: signal_consume
-- The oldest signal kept for this wait, if one was sent before the wait was reached.
UPDATE cyclone_signals SET consumed_by = %(step_id)s
 WHERE id = (SELECT id FROM cyclone_signals
              WHERE run_id = %(run_id)s AND name = %(name)s AND consumed_by IS NULL
              ORDER BY id LIMIT 1)
RETURNING payload;

-- name: clock_now
SELECT now() AS now;

-- name: run_admit
-- A queued run was resumed: admit what fits under its key's limit (cyclone_admit).
SELECT cyclone_admit(workflow, concurrency_key, concurrency_limit,
                     coalesce(%(now)s::timestamptz, now())) AS admitted
  FROM cyclone_runs
 WHERE id = %(run_id)s AND state = 'queued';

-- name: rate_limit_set
-- Declare or change a limiter; its buckets keep their tokens (capped at the new burst).
WITH lim AS (
    INSERT INTO cyclone_rate_limits (name, rate, per, burst)
    VALUES (%(name)s, %(rate)s, %(per)s, %(burst)s)
    ON CONFLICT (name) DO UPDATE SET rate = excluded.rate, per = excluded.per,
                                     burst = excluded.burst, updated_at = now()
    RETURNING name, burst
)
UPDATE cyclone_rate_buckets b SET tokens = least(b.tokens, lim.burst)
  FROM lim WHERE b.name = lim.name;

-- name: run_trace_parents
-- The traceparents of runs whose attempts the supervisor traces (supervisor/tracing.py).
SELECT id::text AS run_id, trace_parent FROM cyclone_runs WHERE id = ANY(%(run_ids)s::uuid[]);

-- name: patches_register
-- Registration (cyclone/engine/patches.py): the changes a workflow's handlers name, each kept
-- with the first time code containing it registered; returns the time of this registration.
WITH found AS (
    INSERT INTO cyclone_patches (workflow, patch, registered_at)
    SELECT %(workflow)s, p, coalesce(%(now)s::timestamptz, now())
      FROM unnest(%(patches)s::text[]) AS p
    ON CONFLICT (workflow, patch) DO NOTHING
)
SELECT coalesce(%(now)s::timestamptz, now()) AS registered_at;

-- name: run_patched
-- ctx.patched(): the run's recorded answer for a change, else the answer recorded now: whether
-- the run was created once code containing the change had registered. A change no registration
-- found (an id computed at run time) is recorded here, with the time the caller's process
-- registered its code. The run's row is written only the first time (its lock, as any write's;
-- the handler holds no other). NULL when a concurrent first call recorded the answer after this
-- statement's snapshot was taken: the caller asks again.
WITH fallback AS (
    INSERT INTO cyclone_patches (workflow, patch, registered_at)
    VALUES (%(workflow)s, %(patch)s, coalesce(%(registered_at)s::timestamptz, now()))
    ON CONFLICT (workflow, patch) DO NOTHING
    RETURNING registered_at
), since AS (
    SELECT coalesce((SELECT registered_at FROM fallback),
                    (SELECT p.registered_at FROM cyclone_patches p
                      WHERE p.workflow = %(workflow)s AND p.patch = %(patch)s)) AS at
), answer AS (
    UPDATE cyclone_runs r
       SET patches = coalesce(r.patches, '{}'::jsonb)
                     || jsonb_build_object(%(patch)s::text, r.created_at >= since.at)
      FROM since
     WHERE r.id = %(run_id)s AND NOT coalesce(r.patches ? %(patch)s::text, false)
    RETURNING r.patches -> %(patch)s::text AS patched
)
SELECT coalesce((SELECT patched FROM answer), r.patches -> %(patch)s::text) AS patched
  FROM cyclone_runs r WHERE r.id = %(run_id)s;
