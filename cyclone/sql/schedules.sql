-- Schedules (cyclone/engine/schedules.py; docs/schedules.md).

-- name: _schedule_columns
SELECT name, workflow, cron, every, timezone, input, concurrency_key, run_deadline, jitter,
       overlap, catchup_window, paused, declared, next_tick_at, due_at, buffered, last_tick_at,
       last_run_id, last_lag, started, skipped, missed, created_at, updated_at

-- name: schedule_upsert
-- Create a schedule, or change it. A change that keeps the timing (cron or interval, and the
-- zone) keeps next_tick_at, so that every supervisor upserting the declared schedules at start
-- leaves the ticks where they were; a new timing takes the next tick computed by the caller.
-- Paused stays as an operator left it. Returns whether the row was new.
INSERT INTO cyclone_schedules AS s
       (name, workflow, cron, every, timezone, input, concurrency_key, run_deadline, jitter,
        overlap, catchup_window, declared, next_tick_at, due_at, created_at, updated_at)
VALUES (%(name)s, %(workflow)s, %(cron)s, %(every)s, %(timezone)s, %(input)s::jsonb,
        %(concurrency_key)s, %(run_deadline)s, %(jitter)s, %(overlap)s, %(catchup_window)s,
        %(declared)s, %(next_tick_at)s, %(due_at)s, coalesce(%(now)s::timestamptz, now()),
        coalesce(%(now)s::timestamptz, now()))
ON CONFLICT (name) DO UPDATE
   SET workflow = EXCLUDED.workflow, cron = EXCLUDED.cron, every = EXCLUDED.every,
       timezone = EXCLUDED.timezone, input = EXCLUDED.input,
       concurrency_key = EXCLUDED.concurrency_key, run_deadline = EXCLUDED.run_deadline,
       jitter = EXCLUDED.jitter, overlap = EXCLUDED.overlap,
       catchup_window = EXCLUDED.catchup_window, declared = EXCLUDED.declared,
       next_tick_at = CASE WHEN (s.cron, s.every, s.timezone)
                                IS NOT DISTINCT FROM (EXCLUDED.cron, EXCLUDED.every,
                                                      EXCLUDED.timezone)
                           THEN s.next_tick_at ELSE EXCLUDED.next_tick_at END,
       due_at = CASE WHEN (s.cron, s.every, s.timezone, s.jitter)
                          IS NOT DISTINCT FROM (EXCLUDED.cron, EXCLUDED.every,
                                                EXCLUDED.timezone, EXCLUDED.jitter)
                     THEN s.due_at ELSE EXCLUDED.due_at END,
       updated_at = EXCLUDED.updated_at
RETURNING (xmax = 0) AS created, next_tick_at;

-- name: schedule_lock
-- The schedule, locked for a change (trigger, backfill, pause, resume): the sweep skips it
-- meanwhile, and this waits for a sweep that holds it.
-- include: _schedule_columns
  FROM cyclone_schedules WHERE name = %(name)s
   FOR UPDATE;

-- name: schedule_get
-- include: _schedule_columns
  FROM cyclone_schedules WHERE name = %(name)s;

-- name: schedules_list
-- Every schedule, by name (a deployment has tens, not millions: bounded all the same).
-- include: _schedule_columns
  FROM cyclone_schedules ORDER BY name LIMIT %(limit)s;

-- name: schedules_declared
-- The declared schedules of these workflows, to report those the code no longer declares.
SELECT name, workflow FROM cyclone_schedules
 WHERE declared AND workflow = ANY(%(workflows)s::text[]) ORDER BY name;

-- name: schedule_delete
DELETE FROM cyclone_schedules WHERE name = %(name)s RETURNING name;

-- name: schedule_pause
UPDATE cyclone_schedules
   SET paused = true, updated_at = coalesce(%(now)s::timestamptz, now())
 WHERE name = %(name)s RETURNING name;

-- name: schedule_save
-- What a tick, a trigger, a resume or a backfill changed, written back to the locked row.
UPDATE cyclone_schedules
   SET paused = %(paused)s, next_tick_at = %(next_tick_at)s, due_at = %(due_at)s,
       buffered = %(buffered)s::timestamptz[], last_tick_at = %(last_tick_at)s,
       last_run_id = %(last_run_id)s, last_lag = %(last_lag)s,
       started = started + %(started)s, skipped = skipped + %(skipped)s,
       missed = missed + %(missed)s, updated_at = coalesce(%(now)s::timestamptz, now())
 WHERE name = %(name)s;

-- name: schedule_run_active
-- Whether a schedule's latest run is still active (queued runs included: they hold a place).
SELECT EXISTS (SELECT 1 FROM cyclone_runs
                WHERE id = %(run_id)s AND state IN ('running', 'paused', 'queued')) AS active;
