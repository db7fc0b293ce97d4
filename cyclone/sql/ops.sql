-- Operations: where the supervisors publish who runs what (read by `cyclone status` and
-- `cyclone workers` from any host) and the gauges `/metrics` reads from the database. The
-- sweep that forgets supervisors that died without saying goodbye is in sweeps.sql.

-- name: presence_publish
-- One round trip a publish: the supervisor's row, its workers' rows (one per slot, from
-- parallel arrays), and the removal of slots it no longer has. busy_for and uptime are
-- durations measured on the supervisor's monotonic clock; the timestamps come from this
-- database's clock, like every other time Cyclone stores.
-- The graphs it serves (migration 16) are marked served at most once a minute (SERVED_EVERY).
WITH sup AS (
    INSERT INTO cyclone_supervisors AS s (id, host, pid, state, workers_target, started_at, seen_at,
                                          workflows, graphs)
    VALUES (%(id)s, %(host)s, %(pid)s, %(state)s, %(target)s,
            now() - make_interval(secs => %(uptime)s), now(), %(served)s::text[],
            %(graphs)s::text[])
    ON CONFLICT (id) DO UPDATE
       SET state = EXCLUDED.state, workers_target = EXCLUDED.workers_target, seen_at = now(),
           workflows = EXCLUDED.workflows, graphs = EXCLUDED.graphs
    RETURNING s.id
), served AS (
    UPDATE cyclone_graphs g SET served_at = now()
     WHERE g.hash = ANY (%(graphs)s::text[])
       AND (g.served_at IS NULL OR g.served_at < now() - interval '60 seconds')
), gone AS (
    DELETE FROM cyclone_workers
     WHERE supervisor_id = %(id)s AND slot <> ALL (%(slots)s::integer[])
), w AS (
    SELECT * FROM unnest(%(slots)s::integer[], %(pids)s::integer[], %(step_ids)s::bigint[],
                         %(run_ids)s::uuid[], %(workflows)s::text[], %(nodes)s::text[],
                         %(attempts)s::integer[], %(busy_for)s::float8[])
               AS w (slot, pid, step_id, run_id, workflow, node, attempt, busy_for)
)
INSERT INTO cyclone_workers AS cw
       (supervisor_id, slot, pid, state, step_id, run_id, workflow, node, attempt, busy_since,
        seen_at)
SELECT sup.id, w.slot, w.pid,
       CASE WHEN w.step_id IS NULL THEN 'idle' ELSE 'busy' END,
       w.step_id, w.run_id, w.workflow, w.node, w.attempt,
       CASE WHEN w.step_id IS NULL THEN NULL
            ELSE now() - make_interval(secs => w.busy_for) END,
       now()
  FROM w CROSS JOIN sup
ON CONFLICT (supervisor_id, slot) DO UPDATE
   SET pid = EXCLUDED.pid, state = EXCLUDED.state, step_id = EXCLUDED.step_id,
       run_id = EXCLUDED.run_id, workflow = EXCLUDED.workflow, node = EXCLUDED.node,
       attempt = EXCLUDED.attempt,
       -- The same attempt as before keeps its first busy_since: it does not drift per
       -- publish. Another attempt of the step (a retry, a hand-over to a new worker in the
       -- slot) is busy from its own lease.
       busy_since = CASE WHEN cw.step_id IS NOT DISTINCT FROM EXCLUDED.step_id
                              AND cw.attempt IS NOT DISTINCT FROM EXCLUDED.attempt
                              AND cw.pid = EXCLUDED.pid AND cw.busy_since IS NOT NULL
                         THEN cw.busy_since ELSE EXCLUDED.busy_since END,
       seen_at = now();

-- name: presence_claim
-- Run once on each new presence connection: a session lock named by the supervisor's id,
-- held for as long as that connection lives, which sweep_stale_supervisors (sweeps.sql) reads
-- as "alive". (Behind a transaction-mode pooler the lock stays with the server connection it
-- landed on, so a dead supervisor's rows may outlive it until the pooler closes that
-- connection.)
SELECT pg_advisory_lock(hashtext(current_schema() || '.cyclone_supervisors'), hashtext(%(id)s));

-- name: presence_delete
-- A supervisor leaving cleanly; its workers' rows go with it (ON DELETE CASCADE).
DELETE FROM cyclone_supervisors WHERE id = %(id)s;

-- name: metrics_gauges
-- The gauges /metrics reads from the database, in one round trip. Every part uses a partial
-- index (cyclone_steps_dead_idx, cyclone_runs_live_idx, cyclone_steps_available_idx), so
-- the cost follows the DLQ, the live runs and the due steps (see _due_counts), not history.
-- Unserved runs: see _unserved_runs (status.sql).
WITH due AS (
-- include: _due_counts
), unserved AS (
-- include: _unserved_runs
)
SELECT 'dlq' AS metric, error_kind AS label, count(*)::float8 AS value
  FROM cyclone_steps WHERE state = 'dead' GROUP BY error_kind
UNION ALL
SELECT 'runs', state, count(*)
  FROM cyclone_runs WHERE state IN ('running', 'paused') GROUP BY state
UNION ALL
SELECT 'runs', 'queued', count(*) FROM cyclone_runs WHERE state = 'queued'
UNION ALL
-- Steps held back by a node's limits, by the limit that holds them (a rate limiter's name,
-- else the node; two nodes of one limiter give a row each, which the reader adds up), counted
-- up to the cap (cyclone_held_counts).
SELECT 'throttled',
       CASE WHEN h.rate_limit IS NOT NULL THEN 'rate:' || h.rate_limit
            ELSE 'concurrency:' || h.workflow || '/' || h.node END,
       h.held
  FROM cyclone_held_counts(%(cap)s) AS h
UNION ALL
SELECT 'due', 'steps', due FROM due
UNION ALL
SELECT 'due', 'oldest_age', coalesce(oldest_due_age, 0) FROM due
UNION ALL
-- Labelled `workflow graph_hash` (a hash has no space): the reader splits at the last space.
SELECT 'unserved', workflow || ' ' || graph_hash, runs FROM unserved
UNION ALL
-- Schedules (migration 19): each one's ticks started, skipped and missed (counters kept on
-- its row) and how late its latest tick's run started. By name, at most 1,000 (a deployment
-- has tens; the reader caps the series further, cyclone/supervisor/labels.py).
SELECT 'schedule_' || o.outcome, s.name, o.value
  FROM (SELECT name, started, skipped, missed, last_lag FROM cyclone_schedules
         ORDER BY name LIMIT 1000) AS s,
       LATERAL (VALUES ('started', s.started::float8), ('skipped', s.skipped::float8),
                       ('missed', s.missed::float8), ('lag', s.last_lag)) AS o (outcome, value)
 WHERE o.value IS NOT NULL;

-- name: session_statement_timeout
-- The statement_timeout this session got, in milliseconds: a pooler that ignores startup
-- options (PgBouncer's ignore_startup_parameters = options) drops the one a connection asked
-- for without a word.
SELECT setting::integer AS ms FROM pg_settings WHERE name = 'statement_timeout';

-- name: metrics_database_age
-- Two gauges of this database's health under sustained load, read from shared memory and one
-- catalog row (no table is scanned). How long the oldest open transaction of a client session
-- has run: it holds back VACUUM, so dead rows pile up while it lasts (0 when none is open).
-- Sessions of other roles show no xact_start unless the reader has pg_read_all_stats; the
-- supervisor's role sees its own workers'. And age(datfrozenxid): autovacuum's freeze starts
-- at 200 million, PostgreSQL stops writes at about 2 billion.
SELECT 'oldest_xact_age_seconds' AS metric,
       greatest(max(extract(epoch FROM now() - xact_start)), 0)::float8 AS value
  FROM pg_stat_activity
 WHERE datname = current_database() AND backend_type = 'client backend'
   AND xact_start IS NOT NULL AND pid <> pg_backend_pid()
UNION ALL
SELECT 'xid_age', age(datfrozenxid)::float8 FROM pg_database WHERE datname = current_database();
