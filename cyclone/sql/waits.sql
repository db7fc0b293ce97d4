-- Waiting for runs to end (Client.wait, AsyncClient.wait): the run-end notifications that
-- migration 10's trigger sends, and the batched check that wakes waiters when they do not come.

-- name: run_end_listen
LISTEN cyclone_run_ended;

-- name: run_wait_register
-- A waiter's first look at its run, registering it (with %(watcher)s, its client's watcher) so
-- that its end is notified (migration 10). The row lock FOR SHARE waits for a transaction that
-- is ending the run (any UPDATE of the row locks it) and makes one that comes later wait for
-- this one: either the end is seen here, or the end sees the registration. Only a run that
-- can still end is registered; NULL %(watcher)s registers nothing (the client polls).
WITH run AS (
    SELECT id, state FROM cyclone_runs WHERE id = %(run_id)s FOR SHARE
), registered AS (
    INSERT INTO cyclone_run_waiters (run_id, watcher)
    SELECT id, %(watcher)s::uuid FROM run
     WHERE %(watcher)s::uuid IS NOT NULL AND state IN ('running', 'paused')
    ON CONFLICT DO NOTHING
)
SELECT state FROM run;

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
