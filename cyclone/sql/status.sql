-- Operator reads: `cyclone runs`, `cyclone workers` and `cyclone status`. Read-only, on the
-- database clock, each bounded by a LIMIT and backed by an index, so their cost follows what
-- is live or recent, not the history the tables hold. The CLI runs them under a
-- statement_timeout.

-- name: run_list
-- Newest runs first, hot and in history (migration 18): each side's newest %(limit)s, then
-- the newest of both; a failed run shows the error kind of its dead step (cyclone_v_runs has
-- none, as docs/sql.md says), looked up for the listed runs only. The optional filters make
-- a generic plan blind to which apply, so callers run it unprepared (a custom plan each time).
SELECT r.id, r.workflow, r.state, f.error_kind, r.parent_run_id, r.created_at, r.deadline_at,
       r.paused_at, r.finished_at,
       CASE r.state
            WHEN 'running' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - r.paused_at)
       END::float8 AS deadline_left
  FROM ((SELECT id, workflow, state, parent_run_id, created_at, deadline_at, paused_at,
                finished_at, false AS moved
           FROM cyclone_runs
          WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
            AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
          ORDER BY created_at DESC, id DESC
          LIMIT %(limit)s)
        UNION ALL
        (SELECT id, workflow, state, parent_run_id, created_at, deadline_at, paused_at,
                finished_at, true AS moved
           FROM cyclone_history_runs
          WHERE (%(state)s::text IS NULL OR state = %(state)s::text)
            AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
          ORDER BY created_at DESC, id DESC
          LIMIT %(limit)s)
         ORDER BY created_at DESC, id DESC
         LIMIT %(limit)s) AS r
  LEFT JOIN LATERAL (SELECT d.error_kind
                       FROM (SELECT s.error_kind, s.completed_at, s.id FROM cyclone_steps s
                              WHERE s.run_id = r.id AND s.state = 'dead'
                             UNION ALL
                             SELECT s.error_kind, s.completed_at, s.id
                               FROM cyclone_history_steps s
                              WHERE r.moved AND s.run_id = r.id AND s.state = 'dead') AS d
                      ORDER BY d.completed_at, d.id LIMIT 1) AS f ON r.state = 'failed'
 ORDER BY r.created_at DESC, r.id DESC;

-- name: run_steps_summary
-- `cyclone steps`: a run's steps counted by node and state, through the index that leads with
-- run_id (hot, or history's); cheap however many items a map has, and the total tells whether
-- to list them.
SELECT node, kind, state, count(*) AS steps, min(id) AS first_id
  FROM (SELECT node, kind, state, id FROM cyclone_steps WHERE run_id = %(run_id)s
        UNION ALL
        SELECT node, kind, state, id FROM cyclone_history_steps WHERE run_id = %(run_id)s)
       AS s
 GROUP BY node, kind, state
 ORDER BY first_id;

-- name: run_steps_page
-- `cyclone steps`: a run's steps in creation order, those in %(state)s only when given, at
-- most %(limit)s of them. `s.id + 0` keeps the planner from walking the primary key in id
-- order and filtering on run_id: for a big run it does so, and on a big table that walk may
-- pass millions of other runs' steps (all of them when no step matches the state). Read
-- through the run_id index, the cost is a top-N sort over this run's steps only. A run's
-- steps are all hot or all in history.
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error, s.error_kind,
       s.created_at, s.started_at, s.completed_at, s.item_index, s.child_run_id
  FROM (SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error,
               s.error_kind, s.created_at, s.started_at, s.completed_at, s.item_index,
               s.child_run_id
          FROM cyclone_steps s
         WHERE s.run_id = %(run_id)s
           AND (%(state)s::text IS NULL OR s.state = %(state)s::text)
        UNION ALL
        SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.error,
               s.error_kind, s.created_at, s.started_at, s.completed_at, s.item_index,
               s.child_run_id
          FROM cyclone_history_steps s
         WHERE s.run_id = %(run_id)s
           AND (%(state)s::text IS NULL OR s.state = %(state)s::text)) AS s
 ORDER BY s.id + 0
 LIMIT %(limit)s;

-- name: status_supervisors
-- Every supervisor that published itself; `seen_ago` tells live ones from lost ones.
-- `queues`: those of the workflows it serves (NULL: every queue, as a supervisor older than
-- migration 8 publishes no workflows).
SELECT id, host, pid, state, workers_target, started_at, seen_at,
       extract(epoch FROM now() - started_at)::float8 AS up_for,
       extract(epoch FROM now() - seen_at)::float8 AS seen_ago,
       CASE WHEN sup.workflows IS NOT NULL THEN
           (SELECT coalesce(array_agg(DISTINCT w.queue ORDER BY w.queue), '{}')
              FROM cyclone_workflows w WHERE w.name = ANY (sup.workflows))
       END AS queues
  FROM cyclone_supervisors sup
 ORDER BY host, pid, id
 LIMIT %(limit)s;

-- name: status_workers
-- What each worker holds, joined by primary key to its step and run: the lease and the
-- deadline are read live, not from what the supervisor last published. A paused run's
-- deadline is frozen at what it had left when paused.
SELECT w.supervisor_id, w.slot, w.pid, w.state, w.step_id, w.run_id, w.workflow, w.node,
       w.attempt, s.item_index, s.state AS step_state, r.state AS run_state, w.busy_since,
       extract(epoch FROM now() - w.busy_since)::float8 AS elapsed,
       CASE WHEN s.state = 'running'
            THEN extract(epoch FROM s.lease_expires_at - now()) END::float8 AS lease_left,
       CASE r.state
            WHEN 'running' THEN extract(epoch FROM r.deadline_at - now())
            WHEN 'paused' THEN extract(epoch FROM r.deadline_at - r.paused_at)
       END::float8 AS deadline_left,
       extract(epoch FROM now() - w.seen_at)::float8 AS seen_ago
  FROM cyclone_workers w
  LEFT JOIN cyclone_steps s ON s.id = w.step_id
  LEFT JOIN cyclone_runs r ON r.id = s.run_id
 ORDER BY w.supervisor_id, w.slot
 LIMIT %(limit)s;

-- name: status_runs_by_state
-- Live runs through the partial index on live states; finished runs of the last %(window)s
-- seconds through the finished_at index.
SELECT state, count(*) AS runs, false AS recent
  FROM cyclone_runs WHERE state IN ('running', 'paused')
 GROUP BY state
UNION ALL
-- Runs waiting for a slot of their key, through the index of queued runs.
SELECT 'queued', count(*), false FROM cyclone_runs WHERE state = 'queued' HAVING count(*) > 0
UNION ALL
SELECT state, count(*), true
  FROM cyclone_runs WHERE finished_at >= now() - make_interval(secs => %(window)s)
 GROUP BY state;

-- name: _due_counts
-- A fragment: the steps a worker could lease now, counted up to %(cap)s (a backlog bigger
-- than that is reported as "more than", so a large backlog costs no more than a small one),
-- and the oldest one's age: how far behind the workers are. A paused run's steps wait for its
-- resume, not for workers, so they are not due. Counted as all due steps (cyclone_due_count,
-- migration 13: a walk of the index that stops at the cap) less those of paused runs (few
-- runs, each run's steps read by its run_id alone: with the state in the WHERE, the planner
-- could read the whole index of available steps for each paused run): joining every due step
-- to its run cost 60 times more on 100,000 runs. The oldest comes from cyclone_oldest_due (migration 7), whose plan walks the
-- candidate index in order whatever the statistics say.
SELECT greatest(a.n - p.n, 0) AS due, a.n >= %(cap)s AS due_capped,
       extract(epoch FROM now() - cyclone_oldest_due(now()))::float8 AS oldest_due_age
  FROM (SELECT cyclone_due_count(%(cap)s, now()) AS n) AS a,
       (SELECT coalesce(sum(held.n), 0)::bigint AS n
          FROM (SELECT (SELECT count(*) FILTER (WHERE s.state = 'available'
                                                  AND s.available_at <= now())
                          FROM cyclone_steps s WHERE s.run_id = r.id) AS n
                  FROM cyclone_runs r WHERE r.state = 'paused'
                 LIMIT %(cap)s) AS held) AS p

-- name: status_queue
-- The queue (see _due_counts), and the steps leased right now.
SELECT q.*, (SELECT count(*) FROM cyclone_steps WHERE state = 'running') AS running
  FROM (
-- include: _due_counts
) AS q;

-- name: _unserved_runs
-- A fragment: running runs, by workflow and graph version, that no live supervisor's workers
-- lease: their steps wait with workers idle (a workflow added to a module a SIGHUP could not
-- re-import, or a version whose VMs were all retired: docs/deploys.md). A supervisor serves the
-- names it publishes (NULL, from before migration 8: every name) and, of those, the graph
-- hashes it publishes (NULL, from before migration 16: every graph); %(served)s and
-- %(graphs)s are what the asking supervisor serves (its row skipped by %(self_id)s; %(graphs)s
-- NULL: every graph of %(served)s). With no live supervisor at all, nothing is reported: that
-- is another alarm.
SELECT r.workflow, r.graph_hash, count(*) AS runs
  FROM cyclone_runs r
 WHERE r.state = 'running'
   AND NOT (r.workflow = ANY (%(served)s::text[])
            AND (%(graphs)s::text[] IS NULL OR r.graph_hash = ANY (%(graphs)s::text[])))
   AND NOT EXISTS (SELECT 1 FROM cyclone_supervisors s
                    WHERE s.seen_at > now() - make_interval(secs => %(lost_after)s)
                      AND s.id IS DISTINCT FROM %(self_id)s::text
                      AND (s.workflows IS NULL OR r.workflow = ANY (s.workflows))
                      AND (s.graphs IS NULL OR r.graph_hash = ANY (s.graphs)))
   AND (cardinality(%(served)s::text[]) > 0
        OR EXISTS (SELECT 1 FROM cyclone_supervisors s
                    WHERE s.seen_at > now() - make_interval(secs => %(lost_after)s)))
 GROUP BY r.workflow, r.graph_hash

-- name: status_unserved
-- Running runs of graph versions no live supervisor serves, most runs first.
SELECT workflow, graph_hash, runs FROM (
-- include: _unserved_runs
) AS unserved
 ORDER BY runs DESC, workflow, graph_hash
 LIMIT %(limit)s;

-- name: status_dlq_depth
-- The DLQ by reason, through the partial index on dead steps.
SELECT error_kind AS reason, count(*) AS steps, max(completed_at) AS newest
  FROM cyclone_steps WHERE state = 'dead'
 GROUP BY error_kind
 ORDER BY steps DESC, reason;

-- name: status_deadline_failures
-- Runs most recently failed by their deadline, from the newest deadline-killed steps.
SELECT run_id, workflow, count(*) AS steps, max(completed_at) AS failed_at,
       extract(epoch FROM now() - max(completed_at))::float8 AS ago
  FROM (SELECT run_id, workflow, completed_at FROM cyclone_steps
         WHERE state = 'dead' AND error_kind = 'deadline'
         ORDER BY completed_at DESC LIMIT 500) AS recent
 GROUP BY run_id, workflow
 ORDER BY failed_at DESC
 LIMIT %(limit)s;

-- name: status_paused_runs
-- Paused runs, longest paused first, with the deadline time frozen at the pause.
SELECT id, workflow, paused_at, deadline_at,
       extract(epoch FROM now() - paused_at)::float8 AS paused_for,
       extract(epoch FROM deadline_at - paused_at)::float8 AS frozen_left,
       count(*) OVER () AS total
  FROM cyclone_runs WHERE state = 'paused'
 ORDER BY paused_at
 LIMIT %(limit)s;

-- name: replica_lag
-- On a streaming standby ([database] read_url): how many seconds of the primary's commits it
-- has yet to show, 0 once it replayed all it received. NULL on a primary. (The time since the
-- last replayed commit alone grows while the primary is idle, behind on nothing.)
SELECT CASE WHEN NOT pg_is_in_recovery() THEN NULL
            WHEN pg_last_wal_receive_lsn() IS NOT DISTINCT FROM pg_last_wal_replay_lsn() THEN 0
            ELSE greatest(extract(epoch FROM now() - pg_last_xact_replay_timestamp()), 0)
       END::float8 AS lag;

-- name: status_begin
-- The first statement of a snapshot's transaction: every section sees the same moment.
SET TRANSACTION ISOLATION LEVEL REPEATABLE READ READ ONLY;

-- name: limits_keys
-- `cyclone limits`: runs per key of workflows with a concurrency limit, the busiest keys first:
-- active (running, or paused after it started) and queued. Live runs only (pass > 0, the
-- index of each group's live runs), at most %(limit)s keys.
SELECT workflow, concurrency_key AS key, max(concurrency_limit) AS "limit",
       count(*) FILTER (WHERE NOT queued) AS active, count(*) FILTER (WHERE queued) AS queued
  FROM cyclone_runs
 WHERE pass > 0 AND concurrency_limit IS NOT NULL
 GROUP BY workflow, concurrency_key
 ORDER BY count(*) FILTER (WHERE queued) DESC, workflow, concurrency_key
 LIMIT %(limit)s;

-- name: limits_nodes
-- `cyclone limits`: nodes with a concurrency limit that have steps in play: the slots in use
-- (held by a lease: cyclone_node_slots, migration 33) and the steps waiting for one (available)
-- or for a token (held), through the partial indexes.
SELECT n.workflow, n.node, n.node_limit AS "limit", u.in_use, w.available + w.held AS held
  FROM cyclone_limited_nodes n,
       LATERAL (SELECT count(*) AS in_use FROM cyclone_node_slots sl
                 WHERE sl.workflow = n.workflow AND sl.node = n.node
                   AND sl.step_id IS NOT NULL) AS u,
       LATERAL (SELECT (SELECT count(*) FROM cyclone_steps s
                         WHERE s.workflow = n.workflow AND s.node = n.node
                           AND s.state = 'available' AND s.node_limit IS NOT NULL) AS available,
                       (SELECT count(*) FROM cyclone_steps s
                         WHERE s.held AND s.workflow = n.workflow AND s.node = n.node)
                           AS held) AS w
 WHERE u.in_use > 0 OR w.available + w.held > 0
 ORDER BY n.workflow, n.node
 LIMIT %(limit)s;

-- name: limits_rates
-- `cyclone limits`: each limiter, its buckets' tokens now (refilled to this moment, less those
-- promised to steps not yet started; below 0: given ahead of their refill) and the steps held
-- for a token.
SELECT l.name, l.rate, l.per, l.burst, b.key,
       CASE WHEN b.key IS NOT NULL THEN least(l.burst, b.tokens + greatest(
            extract(epoch FROM now() - b.updated_at), 0) * l.rate / l.per)
            - cardinality(b.pending) - cardinality(b.fresh) END AS tokens,
       (SELECT count(*) FROM cyclone_steps s WHERE s.held AND s.rate_limit = l.name) AS held
  FROM cyclone_rate_limits l
  LEFT JOIN cyclone_rate_buckets b ON b.name = l.name
 ORDER BY l.name, b.key
 LIMIT %(limit)s;

-- name: status_schedules
-- The next ticks of unpaused schedules, soonest first (through cyclone_schedules_due), and
-- how many ticks each missed so far.
SELECT name, workflow, next_tick_at, due_at, missed,
       extract(epoch FROM due_at - now())::float8 AS due_in
  FROM cyclone_schedules
 WHERE NOT paused
 ORDER BY due_at
 LIMIT %(limit)s;

-- name: workflow_versions
-- `cyclone workflows`: each workflow's stored graph versions (newest first), whether new runs
-- start with it (`current`), its live runs (running, paused or queued: counted once over the
-- live runs, through their indexes), the live supervisors that serve it, when it was first
-- registered and when a supervisor last said it served it (NULL: never). Read-only.
WITH live AS (
    SELECT graph_hash, count(*) AS n FROM (
        SELECT r.graph_hash FROM cyclone_runs r WHERE r.state IN ('running', 'paused')
        UNION ALL
        SELECT r.graph_hash FROM cyclone_runs r WHERE r.state = 'queued'
    ) AS runs GROUP BY graph_hash
), sups AS (
    SELECT s.id, s.workflows, s.graphs FROM cyclone_supervisors s
     WHERE s.seen_at > now() - make_interval(secs => %(lost_after)s)
)
SELECT g.workflow, g.hash AS graph_hash, coalesce(w.graph_hash = g.hash, false) AS current,
       coalesce(live.n, 0) AS live_runs,
       ARRAY(SELECT sups.id FROM sups
              WHERE (sups.workflows IS NULL OR g.workflow = ANY (sups.workflows))
                AND (sups.graphs IS NULL OR g.hash = ANY (sups.graphs))
              ORDER BY sups.id) AS served_by,
       g.created_at AS first_seen, g.served_at AS last_served
  FROM cyclone_graphs g
  LEFT JOIN cyclone_workflows w ON w.name = g.workflow
  LEFT JOIN live ON live.graph_hash = g.hash
 WHERE %(workflow)s::text IS NULL OR g.workflow = %(workflow)s
 ORDER BY g.workflow, g.created_at DESC, g.hash
 LIMIT %(limit)s;
