-- The scanner's sweeps, one block `sweep_<name>` each, named as in cyclone/engine/sweeps.py's
-- SWEEPS. Each takes a batch of due rows, locks their runs with SKIP LOCKED (so any number of
-- scanners can run at once, and a run busy elsewhere is simply taken next time), then changes
-- the steps under a state guard. Runs are locked before steps, as everywhere.

-- name: sweep_deadlines
-- docs/run-deadlines.md, as SQL: running runs past deadline_at fail, and every available,
-- running or waiting step is dead-lettered with kind deadline. Paused runs are not running: their
-- deadline does not elapse.
WITH due AS (
    SELECT id FROM cyclone_runs
     WHERE state = 'running' AND deadline_at IS NOT NULL
       AND deadline_at <= coalesce(%(now)s::timestamptz, now())
     ORDER BY deadline_at
     LIMIT %(batch_size)s
       FOR NO KEY UPDATE SKIP LOCKED
), failed AS (
    UPDATE cyclone_runs r
       SET state = 'failed', finished_at = coalesce(%(now)s::timestamptz, now())
      FROM due
     WHERE r.id = due.id
 RETURNING r.id
), dead AS (
    UPDATE cyclone_steps s
       SET state = 'dead', error_kind = 'deadline', error = 'run deadline exceeded',
           completed_at = coalesce(%(now)s::timestamptz, now()),
           lease_token = NULL, lease_expires_at = NULL
      FROM failed
     WHERE s.run_id = failed.id AND s.state IN ('available', 'running', 'waiting')
 RETURNING s.id, s.run_id, s.child_run_id, s.attempt, s.leased_by, s.started_at
), kept AS (
    -- Kept in the history too: a DLQ retry clears the step's own error.
    INSERT INTO cyclone_step_attempts
           (step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at)
    SELECT id, run_id, attempt, 'deadline', 'run deadline exceeded', leased_by, started_at,
           coalesce(%(now)s::timestamptz, now())
      FROM dead
)
SELECT (SELECT coalesce(array_agg(id), '{}') FROM failed) AS run_ids,
       (SELECT coalesce(array_agg(child_run_id), '{}') FROM dead
         WHERE child_run_id IS NOT NULL) AS child_run_ids,
       (SELECT count(*) FROM dead) AS steps;

-- name: sweep_expired_leases
-- Leases nobody renewed: the holder's host is gone. Retried as lease_expired, or dead-lettered
-- when it was the last attempt. Keyed on lease expiry only, never on how long a step has run.
-- It reads every running step (cyclone_steps_running_idx): one per worker at most.
-- A lease that lapsed before the server had been up for `outage_grace` seconds (the lease's
-- ttl) lapsed because the database itself was down: no holder could renew it, and its
-- supervisor killed its worker before it lapsed. It goes back with its attempt not spent, as
-- a planned stop's (issue 22, item 9). NULL `outage_grace`: no such rule (the test harness).
WITH due AS (
    SELECT id, run_id,
           coalesce(lease_expires_at <= pg_postmaster_start_time()
                                        + make_interval(secs => %(outage_grace)s), false)
               AS outage
      FROM cyclone_steps
     WHERE state = 'running' AND lease_expires_at < coalesce(%(now)s::timestamptz, now())
     ORDER BY lease_expires_at
     LIMIT %(batch_size)s
), locked AS (
    SELECT id FROM cyclone_runs WHERE id IN (SELECT run_id FROM due)
       FOR NO KEY UPDATE SKIP LOCKED
), reclaimed AS (
    UPDATE cyclone_steps s
       SET state = CASE WHEN s.attempt < s.max_attempts OR due.outage THEN 'available'
                        ELSE 'dead' END,
           attempt = CASE WHEN due.outage THEN greatest(s.attempt - 1, 0) ELSE s.attempt END,
           -- (Its handler ran: a rate-limited step takes a new token, attempt spent or not.)
           held = due.outage AND s.rate_limit IS NOT NULL,
           available_at = coalesce(%(now)s::timestamptz, now()),
           completed_at = CASE WHEN s.attempt < s.max_attempts OR due.outage THEN NULL
                               ELSE coalesce(%(now)s::timestamptz, now()) END,
           error_kind = 'lease_expired',
           error = 'lease expired on attempt ' || s.attempt || ' (held by ' || coalesce(s.leased_by, '?') || ')'
                   || CASE WHEN due.outage THEN ' while the database restarted: attempt not spent'
                           ELSE '' END,
           lease_token = NULL, lease_expires_at = NULL
      FROM due JOIN locked ON locked.id = due.run_id
     WHERE s.id = due.id AND s.state = 'running'
       AND s.lease_expires_at < coalesce(%(now)s::timestamptz, now())
    RETURNING s.id, s.run_id, s.state, s.attempt + due.outage::int AS attempt, s.error,
              s.leased_by, s.started_at
), kept AS (
    INSERT INTO cyclone_step_attempts
           (step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at)
    SELECT id, run_id, attempt, 'lease_expired', error, leased_by, started_at,
           coalesce(%(now)s::timestamptz, now())
      FROM reclaimed
)
SELECT id, run_id, state FROM reclaimed;

-- name: sweep_max_wait
-- Waits and child nodes parked longer than their max_wait are dead-lettered.
WITH due AS (
    -- Paused runs are filtered before the LIMIT, so their overdue gates never fill a batch.
    SELECT s.id, s.run_id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'waiting' AND s.kind IN ('wait', 'child') AND r.state = 'running'
       AND s.due_at <= coalesce(%(now)s::timestamptz, now())
     ORDER BY s.due_at
     LIMIT %(batch_size)s
), locked AS (
    SELECT id FROM cyclone_runs
     WHERE id IN (SELECT run_id FROM due) AND state = 'running'
       FOR NO KEY UPDATE SKIP LOCKED
), expired AS (
    UPDATE cyclone_steps s
       SET state = 'dead', error_kind = 'max_wait',
           error = CASE s.kind WHEN 'wait' THEN 'no signal ' || quote_literal(s.signal)
                                                || ' within max_wait'
                           ELSE 'child run ' || s.child_run_id
                                || ' did not finish within max_wait'
                   END,
           completed_at = coalesce(%(now)s::timestamptz, now())
      FROM due JOIN locked ON locked.id = due.run_id
     WHERE s.id = due.id AND s.state = 'waiting'
    RETURNING s.id, s.run_id, s.child_run_id, s.attempt, s.error
), kept AS (
    INSERT INTO cyclone_step_attempts (step_id, run_id, attempt, error_kind, error, ended_at)
    SELECT id, run_id, attempt, 'max_wait', error, coalesce(%(now)s::timestamptz, now())
      FROM expired
)
SELECT id, run_id, child_run_id FROM expired;

-- name: sweep_sleeps
-- Sleeps that are over complete; the caller then advances their runs.
WITH due AS (
    -- Paused runs are filtered before the LIMIT, so their overdue gates never fill a batch.
    SELECT s.id, s.run_id FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'waiting' AND s.kind = 'sleep' AND r.state = 'running'
       AND s.due_at <= coalesce(%(now)s::timestamptz, now())
     ORDER BY s.due_at
     LIMIT %(batch_size)s
), locked AS (
    SELECT id FROM cyclone_runs
     WHERE id IN (SELECT run_id FROM due) AND state = 'running'
       FOR NO KEY UPDATE SKIP LOCKED
)
UPDATE cyclone_steps s
   SET state = 'completed', due_at = NULL, completed_at = coalesce(%(now)s::timestamptz, now())
  FROM due JOIN locked ON locked.id = due.run_id
 WHERE s.id = due.id AND s.state = 'waiting'
RETURNING s.id, s.run_id, s.node;

-- name: sweep_retention
-- Retention: finished top-level runs older than the retention go, with their child runs,
-- signals and steps. The function (migration 9) runs with the migrating role's rights, so the
-- runtime role deletes history only this way. Returns the number of top-level runs deleted.
SELECT cyclone_delete_finished(%(retention)s, %(batch_size)s, %(now)s::timestamptz) AS deleted;

-- name: sweep_history
-- History (migration 18): one batch of finished runs moved out of the hot tables. The function
-- runs with the migrating role's rights (it makes partitions); see its comments in schema.sql.
SELECT cyclone_history_move(%(tail)s, %(retention)s, %(batch_size)s, %(now)s::timestamptz)
       AS moved;

-- name: history_ahead
-- The partitions for the next two spans, made ahead of the moves that will fill them.
SELECT cyclone_history_ensure(%(retention)s, coalesce(%(now)s::timestamptz, now()),
                              coalesce(%(now)s::timestamptz, now())
                              + make_interval(secs => 2 * cyclone_history_span(%(retention)s)))
       AS made;

-- name: history_droppable
-- The partitions of history whose every run ended before the retention, oldest first (the
-- bookkeeping table holds a row per partition: a few dozen at most).
SELECT lo, hi FROM cyclone_history_partitions
 WHERE hi <= coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(retention)s)
 ORDER BY lo;

-- name: history_archive
-- A partition of history as JSON lines (cyclone/engine/archive.py): a line per run, its steps
-- nested in it and their attempts in them. CSV with a quote and a delimiter that JSON never
-- holds raw (it escapes control characters), so each line is the JSON text as it is (COPY's
-- text format would double its backslashes).
COPY (
    SELECT jsonb_build_object(
               'run', to_jsonb(r) - 'run_ended_at',
               'steps', (SELECT coalesce(jsonb_agg(
                                    (to_jsonb(s) - 'run_ended_at')
                                    || jsonb_build_object('attempts', (
                                        SELECT coalesce(jsonb_agg(to_jsonb(a) - 'run_ended_at'
                                                                  ORDER BY a.id), '[]')
                                          FROM cyclone_history_attempts a
                                         WHERE a.step_id = s.id
                                           AND a.run_ended_at = s.run_ended_at))
                                    ORDER BY s.id), '[]')
                           FROM cyclone_history_steps s
                          WHERE s.run_id = r.id AND s.run_ended_at = r.run_ended_at))::text
      FROM cyclone_history_runs r
     WHERE r.run_ended_at >= %(lo)s AND r.run_ended_at < %(hi)s
     ORDER BY r.run_ended_at, r.id
) TO STDOUT WITH (FORMAT csv, QUOTE E'\x01', DELIMITER E'\x02');

-- name: sweep_history_drop
-- One of them dropped (all three tables), if it is still there and past the retention.
SELECT cyclone_history_drop(%(retention)s, %(now)s::timestamptz, %(lo)s) AS dropped;

-- name: sweep_stale_supervisors
-- Supervisors not seen for `stale_after` seconds died (SIGKILL, host lost): forget them and,
-- by cascade, their workers. The table holds one row per supervisor, so no index is needed.
-- One whose presence connection still holds its lock (presence_claim) is alive, however long
-- its loop went without publishing: it stays.
WITH due AS (
    SELECT id FROM cyclone_supervisors
     WHERE seen_at < coalesce(%(now)s::timestamptz, now()) - make_interval(secs => %(stale_after)s)
       AND NOT EXISTS (
           SELECT 1 FROM pg_locks l
            WHERE l.locktype = 'advisory' AND l.objsubid = 2 AND l.granted
              AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
              AND l.classid = hashtext(current_schema() || '.cyclone_supervisors')::oid
              AND l.objid = hashtext(cyclone_supervisors.id)::oid)
     ORDER BY seen_at
     LIMIT %(batch_size)s
       FOR UPDATE SKIP LOCKED
)
DELETE FROM cyclone_supervisors s USING due WHERE s.id = due.id
RETURNING s.id;

-- name: next_time_gate
-- The earliest moment something becomes due (for the test harness's clock).
SELECT min(t) AS at FROM (
    SELECT min(s.available_at) AS t FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'available' AND r.state = 'running'
    UNION ALL
    SELECT min(s.due_at) FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'waiting' AND r.state = 'running'
    UNION ALL
    SELECT min(lease_expires_at) FROM cyclone_steps WHERE state = 'running'
    UNION ALL
    SELECT min(deadline_at) FROM cyclone_runs WHERE state = 'running'
) AS gates;

-- name: sweep_fair_clock
-- Each queue's fair clock moves up to the largest pass among its steps in service (schema.sql,
-- cyclone_runs.pass): a run of a group with nothing queued starts there, in front of the
-- backlogs of other groups, behind what is already being served. Running steps are at most one
-- per worker of the fleet, walked through cyclone_steps_running_idx; a clock never goes back.
UPDATE cyclone_queues q
   SET pass = m.pass
  FROM (SELECT r.queue, max(s.pass) AS pass
          FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
         WHERE s.state = 'running'
         GROUP BY r.queue) AS m
 WHERE q.name = m.queue AND m.pass > q.pass
RETURNING q.name;

-- name: sweep_queued_deadlines
-- Queued runs (waiting for a slot of their key) past their deadline fail like any other run:
-- their root steps, which admission would have made, are made dead-lettered with kind
-- deadline, so the run reports why it failed as a running run would.
WITH due AS (
    SELECT id, state FROM cyclone_runs
     WHERE queued AND paused_at IS NULL AND deadline_at IS NOT NULL
       AND deadline_at <= coalesce(%(now)s::timestamptz, now())
     ORDER BY deadline_at
     LIMIT %(batch_size)s
       FOR NO KEY UPDATE SKIP LOCKED
), failed AS (
    UPDATE cyclone_runs r
       SET state = 'failed', queued = false,
           finished_at = coalesce(%(now)s::timestamptz, now())
      FROM due
     WHERE r.id = due.id AND due.state = 'queued'  -- as its lock read it
 RETURNING r.id, r.workflow, r.graph_hash, r.priority, r.pass
), dead AS (
    INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, timeout,
                               signal, available_at, created_at, completed_at, error_kind,
                               error, priority, pass)
    SELECT f.id, f.workflow, n.node, n.kind, 'dead', n.max_attempts,
           make_interval(secs => n.timeout), n.signal, coalesce(%(now)s::timestamptz, now()),
           coalesce(%(now)s::timestamptz, now()), coalesce(%(now)s::timestamptz, now()),
           'deadline', 'run deadline exceeded', f.priority, f.pass
      FROM failed f, cyclone_graph_roots(f.graph_hash) AS n
    RETURNING id
)
SELECT count(*) AS failed, (SELECT count(*) FROM dead) AS steps FROM failed;

-- name: sweep_held_steps
-- Admit the held steps of rate-limited nodes (cyclone_admit_steps): tokens that refilled
-- since, and those an admission that could not take a node's lock left. Each node with held
-- steps once, found by a skip scan of cyclone_steps_held_idx (a walk per node, not per step).
-- And let go a slot still claimed by a step that holds no lease (migration 33: every end of a
-- lease lets its slot go in its own statement, so this finds one only if a step's row changed
-- by some other way); by the step id read, so that a slot claimed again meanwhile is kept.
WITH RECURSIVE stale AS (
    SELECT sl.workflow, sl.node, sl.slot, sl.step_id FROM cyclone_node_slots sl
     WHERE sl.step_id IS NOT NULL
       AND NOT EXISTS (SELECT 1 FROM cyclone_steps s
                        WHERE s.id = sl.step_id AND s.state = 'running' AND s.slot = sl.slot)
), freed AS (
    UPDATE cyclone_node_slots sl SET step_id = NULL
      FROM stale
     WHERE sl.workflow = stale.workflow AND sl.node = stale.node AND sl.slot = stale.slot
       AND sl.step_id = stale.step_id
), nodes AS (
    (SELECT workflow, node FROM cyclone_steps WHERE held ORDER BY workflow, node LIMIT 1)
    UNION ALL
    SELECT n.workflow, n.node
      FROM nodes,
           LATERAL (SELECT s.workflow, s.node FROM cyclone_steps s
                     WHERE s.held AND (s.workflow, s.node) > (nodes.workflow, nodes.node)
                     ORDER BY s.workflow, s.node LIMIT 1) AS n
)
SELECT coalesce(sum(cyclone_admit_steps(workflow, node, coalesce(%(now)s::timestamptz, now()))),
                0)::integer AS admitted
  FROM (SELECT * FROM nodes LIMIT %(batch_size)s) AS due;

-- name: sweep_schedules
-- Due schedules, locked: ticks to start, or buffered ticks waiting for a run to end. Through
-- cyclone_schedules_due (ordered by due_at, partial on NOT paused): O(due rows).
-- include: _schedule_columns
  FROM cyclone_schedules
 WHERE NOT paused AND due_at <= coalesce(%(now)s::timestamptz, now())
 ORDER BY due_at
 LIMIT %(batch_size)s
   FOR UPDATE SKIP LOCKED;

-- name: sweep_unserved
-- Steps of runs whose graph no live supervisor serves (engine/versions.py) leave the lease
-- index, parked (state `waiting`): a lease would otherwise walk over them every time, and a
-- retired version's runs can wait for days. Steps parked so whose graph a live supervisor serves
-- again become available. A supervisor serves a run when it names the run's workflow and graph
-- (NULL: every workflow, every graph of its workflows: one older than migration 16). With no
-- live supervisor at all nothing is parked: that is another alarm, and nothing leases anyway.
-- What it reads: the graphs ever registered (a few), each tested against the few live
-- supervisors; the live runs of the workflow of a graph that none serves, through
-- cyclone_runs_fair_idx (`pass > 0`: every run submitted since migration 14), none while every
-- version is served. It walked every running run instead, each pass: at a backlog of 300,000
-- the scanner spent most of a core on it. Then the steps of the unserved runs by run_id
-- (OFFSET 0 keeps that lookup on the run's index whatever the statistics say, as in
-- cyclone_lease_candidate); the parked steps
-- (cyclone_steps_parked_idx), none while every version is served. An unserved run with a step
-- to park is locked first (SKIP LOCKED), as every writer of a run's steps does. The steps are
-- written by `= ANY (array)` of their ids: a walk of the primary key, where a join to the CTE
-- let the planner walk every available step (cyclone_steps_ready_idx) for it.
WITH live AS MATERIALIZED (
    SELECT s.workflows, s.graphs FROM cyclone_supervisors s
     WHERE s.seen_at > now() - make_interval(secs => %(lost_after)s)
), gone AS MATERIALIZED (
    SELECT g.workflow, g.hash FROM cyclone_graphs g
     WHERE EXISTS (SELECT 1 FROM live)
       AND NOT EXISTS (SELECT 1 FROM live
                        WHERE (live.workflows IS NULL OR g.workflow = ANY (live.workflows))
                          AND (live.graphs IS NULL OR g.hash = ANY (live.graphs)))
), candidates AS MATERIALIZED (
    SELECT r.id FROM gone,
           LATERAL (SELECT r.id, r.state, r.graph_hash FROM cyclone_runs r
                     WHERE r.workflow = gone.workflow AND r.pass > 0 OFFSET 0) AS r
     WHERE r.graph_hash = gone.hash AND r.state = 'running'
       AND EXISTS (SELECT 1 FROM (SELECT st.state FROM cyclone_steps st
                                   WHERE st.run_id = r.id OFFSET 0) AS st
                    WHERE st.state = 'available')
     LIMIT %(batch_size)s
), unserved AS MATERIALIZED (
    -- Locked by id alone (a test of state here let the planner AND the whole running-runs
    -- index in): a run that ended meanwhile has no available step for `parked` to write.
    SELECT r.id FROM cyclone_runs r
     WHERE r.id = ANY (ARRAY(SELECT c.id FROM candidates c))
       FOR NO KEY UPDATE SKIP LOCKED
), due AS MATERIALIZED (
    SELECT st.id FROM unserved u,
           LATERAL (SELECT st.id, st.state FROM cyclone_steps st
                     WHERE st.run_id = u.id OFFSET 0) AS st
     WHERE st.state = 'available'
), parked AS (
    UPDATE cyclone_steps s SET state = 'waiting', parked = true
     WHERE s.id = ANY (ARRAY(SELECT due.id FROM due)) AND s.state = 'available'
    RETURNING s.id
), back AS MATERIALIZED (
    SELECT st.id
      FROM cyclone_steps st
      JOIN LATERAL (SELECT r.workflow, r.graph_hash FROM cyclone_runs r
                     WHERE r.id = st.run_id OFFSET 0) AS r ON true
     WHERE st.parked AND st.state = 'waiting'
       AND EXISTS (SELECT 1 FROM live
                    WHERE (live.workflows IS NULL OR r.workflow = ANY (live.workflows))
                      AND (live.graphs IS NULL OR r.graph_hash = ANY (live.graphs)))
     LIMIT %(batch_size)s
       FOR UPDATE OF st SKIP LOCKED
), unparked AS (
    UPDATE cyclone_steps s
       SET state = 'available', parked = false,
           available_at = greatest(s.available_at, coalesce(%(now)s::timestamptz, now()))
     WHERE s.id = ANY (ARRAY(SELECT back.id FROM back)) AND s.state = 'waiting' AND s.parked
    RETURNING s.id
)
SELECT (SELECT count(*) FROM parked)::integer AS parked,
       (SELECT count(*) FROM unparked)::integer AS unparked;

-- name: sweep_reindex
-- The queue-shaped indexes (partial, over rows that come and go at the drain rate: a backlog
-- fills them, and when it drains VACUUM only marks their pages reusable, never gives them
-- back), each with what an entry takes in a fresh build, measured at 50,000 entries (key
-- columns, tuple header, line pointer, leaves 90% full; a workflow name of 13 characters, a
-- key and a node name of 11 or 12; live runs with distinct deadlines: without one, they share
-- a deduplicated key at 7 bytes an entry). Not the running steps' index (one entry per worker
-- at most): no backlog reaches it.
-- Returns, most bytes to win first, each such index that is bloated: its pages as of its last
-- VACUUM, ANALYZE or build (relpages, beside the entries counted then: reltuples; -1, never
-- counted) at least %(floor)s bytes and more than %(ratio)s times what those entries take;
-- and before them the leftovers of a rebuild that failed: invalid indexes named after one of
-- them with _ccnew or _ccold and a number. None of a table whose index is being built now
-- (another REINDEX or CREATE INDEX CONCURRENTLY would wait for it). `may`: whether this role
-- may do it: drop an index it owns; rebuild one of a table it owns, or (PostgreSQL 17) holds
-- MAINTAIN on. `pid`: the server process that ran this (behind a pooler, not the session's).
-- Reads the catalog through the two tables' indexes (pg_index by indrelid): a few dozen rows.
WITH queue (name, entry) AS (VALUES
    ('cyclone_steps_ready_idx', 50), ('cyclone_steps_available_idx', 32),
    ('cyclone_steps_held_idx', 68), ('cyclone_steps_limited_ready_idx', 76),
    ('cyclone_steps_parked_idx', 32),
    ('cyclone_steps_due_idx', 24), ('cyclone_runs_fair_idx', 48),
    ('cyclone_runs_live_idx', 32), ('cyclone_runs_queued_idx', 88),
    ('cyclone_runs_queued_deadline_idx', 24)
), found AS (
    SELECT n.nspname::text AS schema, i.relname::text AS index, t.relname::text AS "table",
           i.relname <> q.name AS leftover, x.indisvalid AS valid, q.entry,
           i.relpages::float8 * current_setting('block_size')::int AS counted_bytes,
           i.reltuples AS entries, pg_relation_size(i.oid) AS bytes,
           pg_relation_size(t.oid) AS table_bytes,
           CASE WHEN i.relname <> q.name THEN pg_has_role(i.relowner, 'USAGE')
                WHEN current_setting('server_version_num')::int >= 170000
                THEN has_table_privilege(t.oid, 'MAINTAIN')
                ELSE pg_has_role(t.relowner, 'USAGE') END AS may
      FROM pg_class t
      JOIN pg_namespace n ON n.oid = t.relnamespace
      JOIN pg_index x ON x.indrelid = t.oid
      JOIN pg_class i ON i.oid = x.indexrelid
      JOIN queue q ON i.relname = q.name
                   OR (left(i.relname, length(q.name)) = q.name
                       AND substr(i.relname, length(q.name) + 1) ~ '^_cc(new|old)[0-9]*$')
     WHERE t.oid IN (to_regclass('cyclone_steps'), to_regclass('cyclone_runs'))
       AND NOT EXISTS (SELECT 1 FROM pg_stat_progress_create_index p WHERE p.relid = t.oid)
)
SELECT schema, index, "table", leftover, bytes, entries::bigint AS entries, table_bytes, may,
       pg_backend_pid() AS pid, current_user::text AS "user"
  FROM found
 WHERE CASE WHEN leftover THEN NOT valid
            ELSE entries >= 0 AND counted_bytes >= %(floor)s
                 AND counted_bytes > %(ratio)s * entries * entry END
 ORDER BY leftover DESC, counted_bytes - greatest(entries, 0) * entry DESC;

-- name: reindex_lock
-- One rebuild at a time in a schema, whatever the number of scanners: a session lock, taken
-- without waiting, released by reindex_unlock once done (a lost session releases it too).
SELECT pg_try_advisory_lock(hashtext(current_schema() || '.cyclone_reindex'), 0) AS locked;

-- name: reindex_unlock
SELECT pg_advisory_unlock(hashtext(current_schema() || '.cyclone_reindex'), 0) AS unlocked;

-- name: reindex_index
-- {index}: the index, with its schema (psycopg.sql). Not in a transaction block: it commits
-- several times as it goes (build, validate, swap, drop the old one); writes go on meanwhile.
REINDEX INDEX CONCURRENTLY {index};

-- name: reindex_drop
-- {index}: a rebuild's leftover, with its schema. Not in a transaction block either.
DROP INDEX CONCURRENTLY IF EXISTS {index};

-- name: reindex_size
-- An index's bytes now (after its rebuild: the new one's).
SELECT pg_relation_size(c.oid) AS bytes
  FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
 WHERE n.nspname = %(schema)s AND c.relname = %(index)s;
