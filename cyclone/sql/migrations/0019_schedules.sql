-- Version 19: schedules (issue 24). A schedule is a row; the scanner's `schedules` sweep
-- starts one run per tick, by an idempotency key naming the schedule and the tick.

CREATE TABLE cyclone_schedules (
    name           text PRIMARY KEY CHECK (length(name) BETWEEN 1 AND 100),
    workflow       text NOT NULL REFERENCES cyclone_workflows (name),
    -- Exactly one of: a cron expression (5 fields) read in `timezone`, or seconds between ticks.
    cron           text,
    every          float8 CHECK (every >= 1),
    timezone       text NOT NULL DEFAULT 'UTC',
    input          jsonb NOT NULL DEFAULT 'null',
    -- The runs' concurrency key, computed once from the fixed input (NULL: none).
    concurrency_key text,
    run_deadline   float8 NOT NULL DEFAULT 0 CHECK (run_deadline >= 0),
    jitter         float8 NOT NULL DEFAULT 0 CHECK (jitter >= 0),
    overlap        text NOT NULL DEFAULT 'skip'
                   CHECK (overlap IN ('skip', 'buffer_one', 'buffer_all', 'cancel_other',
                                      'allow_all')),
    catchup_window float8 NOT NULL DEFAULT 3600 CHECK (catchup_window >= 0),
    paused         boolean NOT NULL DEFAULT false,
    -- Declared in code (Workflow.schedule), upserted by supervisors: one that disappears from
    -- the code is reported by them, not deleted.
    declared       boolean NOT NULL DEFAULT false,
    next_tick_at   timestamptz NOT NULL,
    -- When the sweep looks next: the next tick plus its jitter, or at once while buffered
    -- ticks wait for the active run to end.
    due_at         timestamptz NOT NULL,
    buffered       timestamptz[] NOT NULL DEFAULT '{}',
    last_tick_at   timestamptz,
    last_run_id    uuid,
    -- How late the latest tick's run started (seconds after the tick, jitter included).
    last_lag       float8,
    started        bigint NOT NULL DEFAULT 0,
    skipped        bigint NOT NULL DEFAULT 0,
    missed         bigint NOT NULL DEFAULT 0,
    created_at     timestamptz NOT NULL DEFAULT now(),
    updated_at     timestamptz NOT NULL DEFAULT now(),
    CHECK ((cron IS NULL) <> (every IS NULL))
);

CREATE INDEX cyclone_schedules_due ON cyclone_schedules (due_at) WHERE NOT paused;
