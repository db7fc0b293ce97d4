-- Waiting for runs to end (Client.wait, AsyncClient.wait): the run-end notifications that
-- migration 10's trigger sends, and the batched check that wakes waiters when they do not come.

-- name: run_end_listen
LISTEN cyclone_run_ended;

-- name: run_wait_register
-- A waiter marks its run as waited for, so that its end is notified (migration 10). The
-- UPDATE waits for a transaction that is ending the run (it holds the row's lock) and then
-- finds it ended and changes nothing; one that ends the run later waits for this one and
-- sees `waited`. No row back: the run ended, was marked already, or does not exist, and
-- run_exists, a statement later (so on a snapshot taken after this one), tells which.
UPDATE cyclone_runs SET waited = true
 WHERE id = %(run_id)s AND NOT waited AND state IN ('running', 'paused')
RETURNING state;

-- name: run_end_unlisten
UNLISTEN cyclone_run_ended;

-- name: run_end_probe
-- Sent from another session once a listener is up: behind PgBouncer in transaction mode LISTEN
-- succeeds but nothing is ever delivered, and only a notification that arrives tells.
SELECT pg_notify('cyclone_run_ended', %(token)s);

-- name: runs_get_ended
-- Of the runs waited for, those that ended, as run_get reads them: one statement for every
-- waiter woken at once (by notifications, or by a poll).
-- include: _run_status
  FROM cyclone_runs r
 WHERE id = ANY(%(run_ids)s::uuid[]) AND state IN ('completed', 'failed', 'cancelled')
 UNION ALL
-- include: _history_run_status
  FROM cyclone_history_runs r
 WHERE id = ANY(%(run_ids)s::uuid[]);

-- name: run_pending_signals
-- The signals a run keeps that no wait consumed yet, by name (`cyclone run` names those that
-- no wait node of its graph listens for).
SELECT s.name, count(*) AS n, r.graph_hash
  FROM cyclone_signals s JOIN cyclone_runs r ON r.id = s.run_id
 WHERE s.run_id = %(run_id)s::uuid AND s.consumed_by IS NULL
 GROUP BY s.name, r.graph_hash
 ORDER BY s.name;
