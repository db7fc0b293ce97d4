-- Steps: lease, heartbeat, and the fenced writes of a lease holder. A write names the lease
-- token it holds; when the lease was revoked or reclaimed, it matches no row and changes nothing.
-- The fence is `id` and `lease_token` alone: a token is set only while the step is running (a
-- rule says so), and leaving `state = 'running'` out keeps the generic plan on the primary
-- key: with it, the planner may pick the partial index of running steps instead and walk
-- every dead entry completed steps left in it since the last vacuum (see bench/README.md,
-- "Figures behind the code's comments").

-- name: step_insert
-- Make nodes' steps; a node that already has its step is left alone (advancing is idempotent).
-- They take their run's priority and pass.
INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, timeout, signal,
                           available_at, due_at, created_at, priority, pass, node_limit,
                           rate_limit)
SELECT %(run_id)s, %(workflow)s, n.node, n.kind,
       cyclone_kind_first_state(n.kind),
       n.max_attempts, make_interval(secs => n.timeout), n.signal,
       coalesce(%(now)s::timestamptz, now()),
       coalesce(%(now)s::timestamptz, now()) + make_interval(secs => n.due),
       coalesce(%(now)s::timestamptz, now()), r.priority, r.pass, n.node_limit, n.rate_limit
  FROM cyclone_runs r, unnest(%(nodes)s::text[], %(kinds)s::text[], %(max_attempts)s::int[],
              %(timeouts)s::float8[], %(signals)s::text[], %(dues)s::float8[],
              %(limits)s::int[], %(rates)s::text[])
       AS n (node, kind, max_attempts, timeout, signal, due, node_limit, rate_limit)
 WHERE r.id = %(run_id)s
ON CONFLICT DO NOTHING
RETURNING id, node, kind, signal;

-- name: step_insert_items
-- The rest of a map's items (item 0 reuses the fan-out row).
-- Each item's pass is its fan-out's plus its index: a big fan-out spreads over the passes of
-- its queue and other runs interleave with it.
INSERT INTO cyclone_steps (run_id, workflow, node, kind, item_index, item, state, max_attempts,
                           timeout, available_at, created_at, priority, pass, node_limit,
                           rate_limit)
SELECT s.run_id, s.workflow, s.node, 'map', i.idx, i.item::jsonb, 'available', s.max_attempts,
       s.timeout, coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now()),
       s.priority, s.pass + i.idx, s.node_limit, s.rate_limit
  FROM cyclone_steps s,
       unnest(%(indexes)s::int[], %(items)s::text[]) AS i (idx, item)
 WHERE s.id = %(step_id)s
ON CONFLICT DO NOTHING;

-- name: _lease_next
-- A fragment (see cyclone/sql/__init__.py): lease the oldest due step of a running run,
-- skipping rows other workers hold, once the `done` CTE before it produced a row. With
-- `lease` false the candidate scan is not run at all (a completion that leases nothing next).
-- One row comes back either way: `completed` counts `done`, the lease columns are NULL when
-- none was taken.
--
-- The candidate, with its run's columns, comes from cyclone_lease_candidate (migration 7)
-- through cyclone_lease_pick_one (with the steps of nodes limited by concurrency, migration 33),
-- whose settings pin its plan to a walk of the candidate index whatever the statistics say
-- (bench/README.md), from after the connection's last lease (%(after_priority)s, %(after_pass)s,
-- %(after_id)s). Being
-- volatile, it reads with a snapshot of its own, taken as it is called: a step committed between
-- the statement's start and that moment can be locked there and not be seen by `leased`, which
-- then takes nothing; the step stays available for the next lease. The candidate is picked before
-- `done` runs, while the snapshot is fresh (a stale candidate costs a re-check of the row,
-- EvalPlanQual); the `CASE` orders it, as a bare `EXISTS (SELECT 1 FROM done)` would be checked
-- once, before the scan. `held` is what the statement must hold before it locks a candidate, and
-- is evaluated as the function's argument, so before it: a run lock, taken first as every writer
-- does (so no worker waits for a run while holding a step), or `SELECT 1`. A chain completion
-- holds no run lock and waits on its own step's row once it has its candidate, so the candidate is
-- never a step of that run (%(other_than)s): a writer holding the run (a cancel, the deadline
-- sweep) takes that run's steps one by one, and would otherwise meet the worker holding one of
-- them while it waited for another.
candidate AS (
    SELECT * FROM cyclone_lease_pick_one(
               %(lease)s::boolean AND EXISTS (SELECT 1 FROM held), %(other_than)s::uuid,
               coalesce(%(now)s::timestamptz, now()), %(workflows)s::text[],
               %(after_priority)s::smallint, %(after_pass)s::bigint, %(after_id)s::bigint,
               %(graphs)s::text[])
), leased AS (
    UPDATE cyclone_steps s
       SET state = 'running', attempt = s.attempt + 1, lease_token = gen_random_uuid(),
           lease_expires_at = coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => %(ttl)s),
           leased_by = %(worker)s, started_at = coalesce(%(now)s::timestamptz, now())
      FROM candidate
     WHERE s.id = candidate.id
       AND CASE WHEN candidate.id IS NOT NULL THEN EXISTS (SELECT 1 FROM done) ELSE false END
 RETURNING s.id, candidate.available_at, candidate.priority, candidate.pass, s.run_id::text,
           s.workflow, s.node, s.kind,
           s.item_index, s.item, s.attempt,
           s.max_attempts, s.lease_token::text, candidate.input, candidate.deadline_at,
           candidate.graph_hash, candidate.parent_run_id::text,
           extract(epoch FROM least(s.timeout, candidate.deadline_at
                                               - coalesce(%(now)s::timestamptz, now())))::float8
               AS kill_after,
           extract(epoch FROM candidate.deadline_at
                              - coalesce(%(now)s::timestamptz, now()))::float8 AS deadline_left
)
SELECT (SELECT count(*) FROM done) AS completed, leased.*
  FROM (SELECT 1) AS one LEFT JOIN leased ON true;

-- name: step_lease
-- Lease the oldest due step (the fragment, with nothing to complete first).
WITH held AS (SELECT 1), done AS (SELECT 1),
-- include: _lease_next

-- name: step_heartbeat
UPDATE cyclone_steps
   SET lease_expires_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(ttl)s)
 WHERE id = %(step_id)s AND lease_token = %(token)s
RETURNING id;

-- name: _completed
-- What a fenced completion sets, in every statement that completes a step.
   SET state = 'completed', output = %(output)s::jsonb,
       completed_at = coalesce(%(now)s::timestamptz, now()),
       lease_token = NULL, lease_expires_at = NULL, error = NULL, error_kind = NULL

-- name: step_complete
-- Record a result: lock the run first (the order every writer follows), then the fenced step.
WITH run AS (
    SELECT id, state FROM cyclone_runs WHERE id = %(run_id)s FOR NO KEY UPDATE
)
UPDATE cyclone_steps s
-- include: _completed
  FROM run
 WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
   AND s.run_id = run.id
RETURNING s.node, s.kind, run.state AS run_state;

-- name: _make_next
-- A fragment: the steps after the tasks `done` completed, made in the same statement. `done`
-- gives each task's `next` (a JSON array of node rows, as engine/steps.py's _next_nodes_json
-- writes them), whether it was its run's `last` (which makes none), and its priority and pass,
-- which the next steps keep: a run that started goes on from its place in the line.
next AS (
    INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, timeout,
                               signal, available_at, due_at, created_at, priority, pass,
                               node_limit, rate_limit)
    SELECT done.run_id, done.workflow, n.node, n.kind,
           cyclone_kind_first_state(n.kind),
           n.max_attempts, make_interval(secs => n.timeout), n.signal,
           coalesce(%(now)s::timestamptz, now()),
           coalesce(%(now)s::timestamptz, now()) + make_interval(secs => n.due),
           coalesce(%(now)s::timestamptz, now()), done.priority, done.pass, n.node_limit,
           n.rate_limit
      FROM done,
           jsonb_to_recordset(done.next)
           AS n (node text, kind text, max_attempts int, timeout float8, signal text, due float8,
                 node_limit int, rate_limit text)
     WHERE NOT done.last
),

-- name: step_complete_chain
-- The common case in one statement: a task completes and every node after it depends on it
-- alone, so its steps can be made without reading anything else of the run. It takes no run
-- lock (the one thing that made chains slower than a bare queue): the fenced update is what
-- makes the completion happen once, and a run ended concurrently (cancel, failure, deadline)
-- catches the steps inserted here with steps_settle_late, run after it ended the run. The
-- next due step is leased in the same statement when `lease` is true: one commit per step. No
-- ON CONFLICT: the fence lets only one completion through, and the unique index still guards.
WITH held AS (SELECT 1), done AS (
    UPDATE cyclone_steps s
-- include: _completed
     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
 RETURNING s.run_id, s.workflow, %(next)s::jsonb AS next, false AS last, s.priority, s.pass
),
-- include: _make_next
-- include: _lease_next

-- name: step_complete_last
-- The run's only sink completes: every other node is its ancestor and so already complete,
-- and the run completes with this step's output, in one statement (leasing the next due
-- step too when `lease` is true).
WITH run AS (
    SELECT id, state FROM cyclone_runs WHERE id = %(run_id)s FOR NO KEY UPDATE
), held AS (
    SELECT 1 FROM run
), done AS (
    UPDATE cyclone_steps s
-- include: _completed
      FROM run
     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
       AND s.run_id = run.id
 RETURNING s.run_id, s.node, s.output
), finished AS (
    -- The run's state as its lock read it: a test of r.state here could be answered from
    -- cyclone_runs_live_idx, and with statistics of a history (few live runs) the planner
    -- read every live run that way, for each completion.
    UPDATE cyclone_runs r
       SET state = 'completed', finished_at = coalesce(%(now)s::timestamptz, now()),
           paused_at = NULL, output = jsonb_build_object(done.node, done.output)
      FROM done, run
     WHERE r.id = %(run_id)s AND r.id = done.run_id AND run.state IN ('running', 'paused')
),
-- include: _lease_next

-- name: steps_dispatch
-- The supervisor's statement for its workers (cyclone/supervisor/dispatch.py): record the
-- steps they finished and lease a step for each worker that waits, in one statement, so that
-- a statement's fixed cost is paid once for all of them. %(done)s: a JSON array of the tasks
-- finished, each completed as step_complete_chain completes it (`last` false: its `next` steps
-- are made) or as step_complete_last does (`last` true: the run completes, locked first, in id
-- order, before any step is locked). %(workers)s: the names of the waiting workers, leased for
-- in their order; `worker` in the result is a name's position, from 1. Locks are taken in the
-- single statements' order: the runs of `last` completions (evaluated as the candidate scan's
-- argument), the candidates, then the finished steps. The candidates skip the runs of every
-- finished step, for the reason _lease_next gives. One row, one column: a JSON object of the
-- steps whose completion went through the fence (`completed`) and of the leases taken
-- (`leases`), one text value, which the supervisor reads without psycopg's row machinery (it
-- waits for several of these statements at once, on several sessions, from its loop).
-- %(step_ids)s and %(last_runs)s repeat the finished steps' ids and the `last` ones' runs as
-- arrays: a lookup by `= ANY (array)` has one sensible plan, a walk of the primary key, where a
-- join to the JSON rows (which the planner takes for a hundred) read the whole table.
-- Its candidates come from cyclone_lease_pick, which takes the steps of nodes limited by
-- concurrency too and claims their slots (migration 33); steps_dispatch_plain is the same
-- statement for a supervisor whose graphs limit no node (engine/versions.py, Served.limited),
-- from cyclone_lease_candidates alone: the pick, its probe of the limited nodes and its rows
-- passed through PL/pgSQL, costs about 35 us a statement more even when no limited step waits
-- (bench/README.md, "Migration 34").
-- include: _dispatch_head
candidate AS (
    SELECT * FROM cyclone_lease_pick(
               CASE WHEN (SELECT n FROM keys) >= 0 THEN %(want)s::int ELSE 0 END,
               (SELECT array_agg(c.run_id) FROM c), coalesce(%(now)s::timestamptz, now()),
               %(workflows)s::text[], %(after_priority)s::smallint, %(after_pass)s::bigint,
               %(after_id)s::bigint, %(graphs)s, true)
),
-- include: _dispatch_tail

-- name: steps_dispatch_plain
-- steps_dispatch with the steps of no node limit alone (see there).
-- include: _dispatch_head
candidate AS (
    SELECT *, NULL::integer AS slot FROM cyclone_lease_candidates(
               CASE WHEN (SELECT n FROM keys) >= 0 THEN %(want)s::int ELSE 0 END,
               (SELECT array_agg(c.run_id) FROM c), coalesce(%(now)s::timestamptz, now()),
               %(workflows)s::text[], %(after_priority)s::smallint, %(after_pass)s::bigint,
               %(after_id)s::bigint, %(graphs)s)
),
-- include: _dispatch_tail

-- name: _dispatch_head
-- steps_dispatch up to its candidates: the finished steps, the runs they end, the keys.
WITH c AS (
    SELECT * FROM jsonb_to_recordset(%(done)s::jsonb)
        AS c (step_id bigint, token uuid, run_id uuid, last boolean, output jsonb, next jsonb,
              slot integer)
), run AS (
    SELECT r.id, r.state, r.workflow, r.concurrency_key, r.concurrency_limit
      FROM cyclone_runs r
     WHERE r.id = ANY (%(last_runs)s::uuid[])
     ORDER BY r.id
       FOR NO KEY UPDATE
), keys AS (
    -- The keys' locks of the runs it ends that hold a slot of one (cyclone_admit takes them
    -- again as each run ends: an advisory lock is taken once a transaction), all before, in
    -- one order, as submits take them: taken run by run, two such statements took them in
    -- opposite orders and deadlocked, each stalled for a second (deadlock_timeout).
    SELECT count(cyclone_slot_lock(k.workflow, k.ckey)) AS n
      FROM (SELECT DISTINCT run.workflow, run.concurrency_key AS ckey FROM run
             WHERE run.concurrency_limit IS NOT NULL
             ORDER BY 1, 2) AS k
),

-- name: _dispatch_tail
-- steps_dispatch after its candidates: the completions, the steps after them, the leases.
done AS (
    -- Each step's slot (migration 33), which its lease row told and its `done` row tells
    -- back (c.slot), is let go below, for them all at once: `slot` set to NULL here tells
    -- the rules' trigger not to let it go again, a statement for each. A slot not told (a
    -- lease the worker took itself) stays set, and the trigger lets it go.
    UPDATE cyclone_steps s
       SET state = 'completed', output = c.output,
           completed_at = coalesce(%(now)s::timestamptz, now()),
           lease_token = NULL, lease_expires_at = NULL, error = NULL, error_kind = NULL,
           slot = nullif(s.slot, c.slot)
      FROM c
     WHERE s.id = ANY (%(step_ids)s::bigint[])
       AND s.id = c.step_id AND s.lease_token = c.token
       AND (NOT c.last OR s.run_id IN (SELECT run.id FROM run))
 RETURNING s.id, s.run_id, s.workflow, s.node, s.output, c.last, c.next, s.priority, s.pass,
           c.slot AS freed
), freed AS (
    -- Only the slot this step holds: a slot told wrongly is some other step's, or free.
    UPDATE cyclone_node_slots sl SET step_id = NULL
      FROM done
     WHERE sl.workflow = done.workflow AND sl.node = done.node AND sl.slot = done.freed
       AND sl.step_id = done.id
),
-- include: _make_next
finished AS (
    UPDATE cyclone_runs r
       SET state = 'completed', finished_at = coalesce(%(now)s::timestamptz, now()),
           paused_at = NULL, output = jsonb_build_object(done.node, done.output)
      FROM done, run
     WHERE r.id = ANY (%(last_runs)s::uuid[])
       AND done.last AND r.id = done.run_id AND run.id = done.run_id
       -- The run's state as its lock read it: see step_complete_last.
       AND run.state IN ('running', 'paused')
), numbered AS (
    SELECT candidate.*, row_number() OVER () AS n FROM candidate
), leased AS (
    UPDATE cyclone_steps s
       SET state = 'running', attempt = s.attempt + 1, lease_token = gen_random_uuid(),
           lease_expires_at = coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => %(ttl)s),
           leased_by = w.name, started_at = coalesce(%(now)s::timestamptz, now()),
           slot = numbered.slot
      FROM numbered
      JOIN unnest(%(workers)s::text[]) WITH ORDINALITY AS w (name, n) ON w.n = numbered.n
     WHERE s.id = numbered.id
       AND CASE WHEN numbered.id IS NOT NULL THEN (SELECT count(*) FROM done) >= 0
                ELSE false END
 RETURNING w.n AS worker, s.id, numbered.available_at, numbered.priority, numbered.pass,
           s.run_id, s.workflow, s.node, s.node_limit, s.slot,
           s.kind, s.item_index, s.item, s.attempt, s.max_attempts, s.lease_token,
           numbered.input, numbered.deadline_at, numbered.graph_hash, numbered.parent_run_id,
           extract(epoch FROM least(s.timeout, numbered.deadline_at
                                               - coalesce(%(now)s::timestamptz, now())))::float8
               AS kill_after,
           extract(epoch FROM numbered.deadline_at
                              - coalesce(%(now)s::timestamptz, now()))::float8 AS deadline_left
)
SELECT json_build_object(
           'completed', (SELECT coalesce(json_agg(done.id), '[]') FROM done),
           'leases', (SELECT coalesce(json_agg(leased), '[]') FROM leased))::text AS result;

-- name: step_fail
-- An attempt failed: retry after a backoff with jitter while attempts remain, else dead-letter.
-- The attempt's error is kept in cyclone_step_attempts: the row's own error is overwritten by
-- the next failure and cleared by a completion or a DLQ retry.
WITH run AS (
    SELECT id FROM cyclone_runs WHERE id = (SELECT run_id FROM cyclone_steps
                                             WHERE id = %(step_id)s)
       FOR NO KEY UPDATE
), failed AS (
    UPDATE cyclone_steps s
       SET state = CASE WHEN %(retry)s AND s.attempt < s.max_attempts THEN 'available'
                        ELSE 'dead' END,
           available_at = coalesce(%(now)s::timestamptz, now()) + make_interval(
               secs => least(%(backoff_cap)s,
                             %(backoff_base)s * power(2, greatest(s.attempt - 1, 0)))
                       * (0.5 + random() * 0.5)),
           completed_at = CASE WHEN %(retry)s AND s.attempt < s.max_attempts THEN NULL
                               ELSE coalesce(%(now)s::timestamptz, now()) END,
           error = %(error)s, error_kind = %(kind)s, lease_token = NULL, lease_expires_at = NULL,
           gated_at = coalesce(%(now)s::timestamptz, now())
      FROM run
     WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
       AND s.run_id = run.id
    RETURNING s.id, s.run_id, s.node, s.state, s.attempt, s.leased_by, s.started_at
), kept AS (
    INSERT INTO cyclone_step_attempts
           (step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at)
    SELECT id, run_id, attempt, %(kind)s, %(error)s, leased_by, started_at,
           coalesce(%(now)s::timestamptz, now())
      FROM failed
)
SELECT run_id, node, state FROM failed;

-- name: step_release_items
-- A map's fan-out row becomes its first item, ready to lease.
WITH run AS (
    SELECT id FROM cyclone_runs WHERE id = %(run_id)s FOR NO KEY UPDATE
)
UPDATE cyclone_steps s
   SET state = 'available', item_index = 0, item = %(item)s::jsonb, attempt = 0,
       lease_token = NULL, lease_expires_at = NULL, started_at = NULL,
       available_at = coalesce(%(now)s::timestamptz, now())
  FROM run
 WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
   AND s.run_id = run.id
RETURNING s.id;

-- name: step_park_child
-- A child node waits for the child run it started (and for its max_wait, if any).
WITH run AS (
    SELECT id FROM cyclone_runs WHERE id = %(run_id)s FOR NO KEY UPDATE
)
UPDATE cyclone_steps s
   SET state = 'waiting', child_run_id = %(child_run_id)s, lease_token = NULL,
       lease_expires_at = NULL, gated_at = coalesce(%(now)s::timestamptz, now()),
       due_at = coalesce(%(now)s::timestamptz, now()) + make_interval(secs => %(max_wait)s)
  FROM run
 WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
   AND s.run_id = run.id
RETURNING s.id;

-- name: step_settle_waiting
-- A parked step ends: a signal arrived, a sleep is over, or its child run completed.
UPDATE cyclone_steps
   SET state = 'completed', output = %(output)s::jsonb, due_at = NULL,
       completed_at = coalesce(%(now)s::timestamptz, now())
 WHERE id = %(step_id)s AND state = 'waiting'
RETURNING id, node, run_id;

-- name: step_kill_waiting
-- A parked step dies: its child run failed or was cancelled.
UPDATE cyclone_steps
   SET state = 'dead', error_kind = %(kind)s, error = %(error)s,
       completed_at = coalesce(%(now)s::timestamptz, now())
 WHERE id = %(step_id)s AND state = 'waiting'
RETURNING id, node, run_id;

-- name: step_waiting_for_signal
SELECT id, node FROM cyclone_steps
 WHERE run_id = %(run_id)s AND kind = 'wait' AND signal = %(name)s AND state = 'waiting'
 ORDER BY id LIMIT 1;

-- name: step_nodes_done
-- Which of these nodes are complete: every one of their steps completed.
SELECT node FROM cyclone_steps
 WHERE run_id = %(run_id)s AND node = ANY(%(nodes)s::text[])
 GROUP BY node HAVING bool_and(state = 'completed');

-- name: map_item_pending
-- Whether an item of a map node is still to complete, asked at every item's completion: it
-- must not read the node's items (a 1,000-item map would read half a million rows). Items are
-- made in index order and leased oldest first, so the last are the likeliest still to run,
-- and a walk from the end finds one at once until the node is all but done.
SELECT item_index FROM cyclone_steps
 WHERE run_id = %(run_id)s AND node = %(node)s AND state <> 'completed'
 ORDER BY item_index DESC
 LIMIT 1;

-- name: step_revoked
-- Of the leases a supervisor's workers hold, those no longer valid, with why.
-- A token is set only while its step runs (a CHECK says so), so the token alone decides.
-- A lease also ends when its holder records the step, a moment before the holder's `done`
-- line reaches the supervisor: `finished` says so. Only revocations leave a step discarded
-- (cancel, run failed elsewhere), gone (retention), or with one of the kinds below; whatever
-- else the holder wrote (completed, a failure to retry, parked, released) is its own doing.
SELECT h.step_id,
       CASE WHEN s.state IN ('completed', 'waiting')
                 OR (s.state IN ('available', 'running', 'dead')
                     AND s.error_kind IS DISTINCT FROM 'cancelled'
                     AND s.error_kind IS DISTINCT FROM 'deadline'
                     AND s.error_kind IS DISTINCT FROM 'lease_expired')
            THEN 'finished' ELSE s.error_kind::text END AS reason
  FROM unnest(%(step_ids)s::bigint[], %(tokens)s::uuid[]) AS h (step_id, token)
  LEFT JOIN cyclone_steps s ON s.id = h.step_id
 WHERE s.id IS NULL OR s.lease_token IS DISTINCT FROM h.token;

-- name: steps_release
-- Give back leases the supervisor took ahead and no worker took in time (see
-- cyclone/supervisor/dispatch.py), as step_release gives one back: runs locked first, in id
-- order, then each step fenced by its token. No handler started: a rate-limited step keeps its
-- token while its bucket counts it as pending (cyclone_token_kept, migration 31). One row, one
-- column: how many went back, as text (the supervisor reads it as it reads steps_dispatch's).
WITH run AS (
    SELECT r.id FROM cyclone_runs r
     WHERE r.id IN (SELECT s.run_id FROM cyclone_steps s
                     WHERE s.id = ANY (%(step_ids)s::bigint[]))
     ORDER BY r.id
       FOR NO KEY UPDATE
), released AS (
    UPDATE cyclone_steps s
       SET state = 'available', attempt = greatest(s.attempt - 1, 0),
           available_at = coalesce(%(now)s::timestamptz, now()), lease_token = NULL,
           lease_expires_at = NULL, gated_at = coalesce(%(now)s::timestamptz, now())
      FROM run, unnest(%(step_ids)s::bigint[], %(tokens)s::uuid[]) AS l (step_id, token)
     WHERE s.id = ANY (%(step_ids)s::bigint[])
       AND s.id = l.step_id AND s.lease_token = l.token AND s.run_id = run.id
 RETURNING s.id
)
SELECT count(*)::text AS result FROM released;

-- name: step_release
-- Give a step back without spending an attempt: its worker was stopped by a shutdown, not by
-- anything the step did. Fenced like every write of a lease holder. Its handler started: a
-- rate-limited step spent its token, and is held for a new one (migration 31).
WITH run AS (
    SELECT id FROM cyclone_runs WHERE id = (SELECT run_id FROM cyclone_steps
                                             WHERE id = %(step_id)s)
       FOR NO KEY UPDATE
)
UPDATE cyclone_steps s
   SET state = 'available', attempt = greatest(s.attempt - 1, 0),
       held = s.rate_limit IS NOT NULL,
       available_at = coalesce(%(now)s::timestamptz, now()), lease_token = NULL,
       lease_expires_at = NULL, gated_at = coalesce(%(now)s::timestamptz, now())
  FROM run
 WHERE s.id = %(step_id)s AND s.lease_token = %(token)s
   AND s.run_id = run.id
RETURNING s.id;

-- name: steps_settle_late
-- Second pass after runs were ended: steps that a lock-free chain completion inserted while
-- the first pass ran (its snapshot could not see them) get the same fate as their siblings.
-- Runs in this statement's new snapshot include every such insert: the first pass waited on
-- the completing step's row lock, so the insert had committed before this statement began.
UPDATE cyclone_steps
   SET state = %(state)s, error_kind = %(kind)s, error = %(error)s,
       completed_at = coalesce(%(now)s::timestamptz, now()), due_at = NULL
 WHERE run_id = ANY(%(run_ids)s::uuid[]) AND state IN ('available', 'waiting');

-- name: step_get
-- A step, hot or in history.
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index
  FROM cyclone_steps s WHERE s.id = %(step_id)s
 UNION ALL
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index
  FROM cyclone_history_steps s WHERE s.id = %(step_id)s
 LIMIT 1;

-- name: dlq_list
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index
  FROM cyclone_steps s
 WHERE s.state = 'dead'
   AND (%(reason)s::text IS NULL OR s.error_kind = %(reason)s)
   AND (%(workflow)s::text IS NULL OR s.workflow = %(workflow)s)
   AND (%(since)s::timestamptz IS NULL OR s.completed_at >= %(since)s)
 ORDER BY s.completed_at DESC, s.id DESC
 LIMIT %(limit)s;
