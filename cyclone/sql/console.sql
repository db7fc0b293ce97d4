-- The web console's reads (cyclone/console/, docs/console.md). Read-only, on the database
-- clock, each bounded by a LIMIT and an index, so a page costs what it shows, not the history
-- the tables hold. The console runs them in read-only transactions under a statement_timeout;
-- its actions go through the engine (retry_dead_step, cancel_run), never through SQL of its own.
-- It also reads statements of status.sql (workers, limits, DLQ depth) and runs.sql.

-- name: console_walk
-- In the transaction of every console read of this file: plans that walk an index in its
-- order and stop when the page is full, whatever the statistics say. Without them, a planner
-- that sized a listing's window by its LIMIT (%(scan)s rows, not the page's) or by statistics
-- of another day read the whole range through a bitmap and sorted it (30,000 runs for a page
-- of 50, on a table never analyzed), and one that took cyclone_step_attempts for a table of
-- 30 rows read all of it for each step. `local`: for the transaction only (the console),
-- else for the session.
SELECT set_config(s.name, s.value, %(local)s)
  FROM unnest(ARRAY['enable_sort', 'enable_bitmapscan', 'enable_hashjoin', 'enable_seqscan'],
              ARRAY['off', 'off', 'off', 'off']) AS s (name, value);

-- name: _runs_window
-- A fragment: runs w after the keyset cursor (%(before_at)s, %(before_id)s) and inside
-- [%(since)s, %(until)s), newest first, in cyclone_runs_created_idx's order.
 WHERE (w.created_at, w.id) < (coalesce(%(before_at)s::timestamptz, 'infinity'),
                               coalesce(%(before_id)s::uuid,
                                        'ffffffff-ffff-ffff-ffff-ffffffffffff'))
   AND w.created_at >= coalesce(%(since)s::timestamptz, '-infinity')
   AND w.created_at < coalesce(%(until)s::timestamptz, 'infinity')
 ORDER BY w.created_at DESC, w.id DESC

-- name: _dead_window
-- A fragment: dead steps s after the keyset cursor (%(before_at)s, %(before_id)s), dead since
-- %(since)s, of %(reason)s when given, newest first: in cyclone_steps_dead_idx's order, or
-- with a reason in cyclone_steps_dead_kind_idx's (a seek to the reason, not a filter).
 WHERE s.state = 'dead'
   AND (%(reason)s::text IS NULL OR s.error_kind = %(reason)s::text)
   AND (s.completed_at, s.id) < (coalesce(%(before_at)s::timestamptz, 'infinity'),
                                 coalesce(%(before_id)s::bigint, 9223372036854775807))
   AND s.completed_at >= coalesce(%(since)s::timestamptz, '-infinity')
 ORDER BY s.completed_at DESC, s.id DESC

-- name: console_runs
-- A run's dead steps are read through its run_id alone (`state || ''` is no condition an
-- index of dead steps can take): with `state = 'dead'` the planner ANDed the run's entries
-- with cyclone_steps_dead_idx, reading the whole DLQ for each run.
--
-- A page of runs, newest first, after the keyset cursor (%(before_at)s, %(before_id)s) and
-- inside [%(since)s, %(until)s). The filters apply to a window of at most %(scan)s runs walked
-- in cyclone_runs_created_idx's order, so no filter can make a page read the whole history:
-- without a filter a page reads the rows it shows; with a selective one, at most %(scan)s
-- (the caller then reads console_runs_boundary and offers to search on from there). A failed
-- run shows its first dead step's kind and error, looked up for the runs the filters keep.
-- The optional filters make a generic plan blind to which apply: run unprepared.
SELECT r.id, r.workflow, r.state, r.queue, r.priority, r.concurrency_key, r.parent_run_id,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at, f.error_kind, f.error,
       CASE r.state
            WHEN 'running' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'queued' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - r.paused_at)
       END::float8 AS deadline_left
  FROM (SELECT w.id, w.workflow, w.state, w.queue, w.priority, w.concurrency_key,
               w.parent_run_id, w.created_at, w.deadline_at, w.paused_at, w.finished_at
          FROM cyclone_runs w
-- include: _runs_window
         LIMIT %(scan)s) AS r
  LEFT JOIN LATERAL (SELECT s.error_kind, s.error FROM cyclone_steps s
                      WHERE s.run_id = r.id AND r.state = 'failed'
                        AND s.state || '' = 'dead'
                      ORDER BY s.completed_at, s.id LIMIT 1) AS f ON true
 WHERE (%(state)s::text IS NULL OR r.state = %(state)s::text)
   AND (%(workflow)s::text IS NULL OR r.workflow = %(workflow)s::text)
   AND (%(queue)s::text IS NULL OR r.queue = %(queue)s::text)
   AND (%(ckey)s::text IS NULL OR r.concurrency_key = %(ckey)s::text)
   -- Text in the error of any dead step of the run (a map's items each have one), as typed:
   -- strpos, not LIKE, so % and _ are plain characters.
   AND (%(error)s::text IS NULL
        OR (r.state = 'failed'
            AND EXISTS (SELECT 1 FROM cyclone_steps d
                         WHERE d.run_id = r.id AND d.state || '' = 'dead'
                           AND strpos(lower(d.error), lower(%(error)s::text)) > 0)))
 ORDER BY r.created_at DESC, r.id DESC
 LIMIT %(limit)s;

-- name: console_runs_boundary
-- Where a window of console_runs ended: its %(scan)s-th run (none: the window reached the
-- start of the range, so there is nothing older to search).
SELECT w.created_at, w.id
  FROM cyclone_runs w
-- include: _runs_window
OFFSET %(scan)s - 1
 LIMIT 1;

-- name: console_run
-- One run, with what its page shows beside RunStatus: its flow-control place, its deadline
-- left, its graph, and the W3C traceparent stored at submit where tracing is on (read from the
-- row as JSON, so that the statement runs on a schema without that column: NULL there).
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.parent_step_id,
       r.idempotency_key, r.created_at, r.deadline_at, r.paused_at, r.finished_at, r.queue,
       r.priority, r.concurrency_key, r.concurrency_limit, r.graph_hash, g.graph,
       to_jsonb(r) ->> 'trace_parent' AS trace_parent,
       -- Why it failed: its first dead step (as RunStatus says), wherever it is in the run.
       (SELECT jsonb_build_object('id', s.id, 'node', s.node, 'item_index', s.item_index,
                                  'attempt', s.attempt, 'error_kind', s.error_kind,
                                  'error', s.error)
          FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state || '' = 'dead'
         ORDER BY s.completed_at, s.id LIMIT 1) AS failure,
       CASE r.state
            WHEN 'running' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'queued' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - r.paused_at)
       END::float8 AS deadline_left,
       now() AS now
  FROM cyclone_runs r
  LEFT JOIN cyclone_graphs g ON g.hash = r.graph_hash
 WHERE r.id = %(run_id)s;

-- name: console_run_children
-- A run's child runs, by the step that started each then oldest first, through the index of
-- children (an order no other index gives: by created_at alone, the planner walked
-- cyclone_runs_created_idx through every run, filtering on the parent).
SELECT id, workflow, state, parent_step_id, created_at, finished_at
  FROM cyclone_runs
 WHERE parent_run_id = %(run_id)s
 ORDER BY parent_step_id, created_at, id
 LIMIT %(limit)s;

-- name: console_run_steps
-- A run's steps in creation order, at most %(limit)s, with their lease and schedule (as
-- run_steps_page: through the run_id index, then a top-N sort of this run's steps only).
SELECT s.id, s.node, s.kind, s.state, s.attempt, s.max_attempts, s.item_index, s.error,
       s.error_kind, s.created_at, s.started_at, s.completed_at, s.available_at, s.due_at,
       s.leased_by, s.child_run_id, s.held,
       extract(epoch FROM s.lease_expires_at - now())::float8 AS lease_left
  FROM cyclone_steps s
 WHERE s.run_id = %(run_id)s
 ORDER BY s.id + 0
 LIMIT %(limit)s;

-- name: console_step_attempts
-- Every failed attempt of the steps shown (cyclone_step_attempts, by its step index), oldest
-- first within each step, at most %(limit)s.
SELECT a.step_id, a.attempt, a.error_kind, a.error, a.worker, a.started_at, a.ended_at
  FROM unnest(%(step_ids)s::bigint[]) AS shown (id)
  CROSS JOIN LATERAL (SELECT * FROM cyclone_step_attempts a
                       WHERE a.step_id = shown.id ORDER BY a.id LIMIT %(limit)s) AS a
 LIMIT %(limit)s;

-- name: console_dlq
-- A page of the DLQ (of one reason, or all), newest first after the keyset cursor; the
-- workflow and error filters apply to a window of at most %(scan)s dead steps (as
-- console_runs), with each step's run and its deadline.
SELECT d.id, d.run_id, d.workflow, d.node, d.kind, d.item_index, d.attempt, d.error_kind,
       d.error, d.completed_at, r.state AS run_state, r.parent_run_id, r.deadline_at
  FROM (SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.item_index, s.attempt,
               s.error_kind, s.error, s.completed_at
          FROM cyclone_steps s
-- include: _dead_window
         LIMIT %(scan)s) AS d
  JOIN LATERAL (SELECT r.state, r.parent_run_id, r.deadline_at FROM cyclone_runs r
                 WHERE r.id = d.run_id OFFSET 0) AS r ON true
 WHERE (%(workflow)s::text IS NULL OR d.workflow = %(workflow)s::text)
   AND (%(error)s::text IS NULL OR strpos(lower(d.error), lower(%(error)s::text)) > 0)
 ORDER BY d.completed_at DESC, d.id DESC
 LIMIT %(limit)s;

-- name: console_dlq_boundary
-- Where a window of console_dlq ended (as console_runs_boundary).
SELECT s.completed_at, s.id
  FROM cyclone_steps s
-- include: _dead_window
OFFSET %(scan)s - 1
 LIMIT 1;

-- name: console_workflows
-- The registered workflows (a deployment has tens): their queue, default priority and runs
-- per key, by queue.
SELECT w.name, w.queue, w.priority, w.concurrency_field, w.concurrency_limit, w.updated_at
  FROM cyclone_workflows w
 ORDER BY w.queue, w.name
 LIMIT %(limit)s;

-- name: console_queue_use
-- Live runs by queue, priority and state, counted up to %(cap)s (each through the index of
-- its states: cyclone_runs_live_idx, cyclone_runs_queued_idx), and the steps leased now.
SELECT live.queue, live.priority, live.state, count(*) AS runs
  FROM (SELECT r.queue, r.priority, r.state FROM cyclone_runs r
         WHERE r.state IN ('running', 'paused') LIMIT %(cap)s) AS live
 GROUP BY live.queue, live.priority, live.state
UNION ALL
SELECT q.queue, q.priority, 'queued', count(*)
  FROM (SELECT r.queue, r.priority FROM cyclone_runs r
         WHERE r.state = 'queued' LIMIT %(cap)s) AS q
 GROUP BY q.queue, q.priority
 ORDER BY 1, 2, 3;
