-- Waiting for runs to end (Client.wait, AsyncClient.wait): the run-end notifications that
-- migration 10's trigger sends, and the batched check that wakes waiters when they do not come.

-- name: run_end_listen
LISTEN cyclone_run_ended;

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
 WHERE id = ANY(%(run_ids)s::uuid[]) AND state IN ('completed', 'failed', 'cancelled');
