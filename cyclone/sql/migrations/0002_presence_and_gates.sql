-- Version 2: who is running where (for `cyclone status` and `cyclone workers`, from any host),
-- and when a step's time gate was set (so resume gives back only the paused part of a gate).

-- When the step's current gate (retry available_at, or due_at) was set: a gate set during a
-- pause starts counting at resume.
ALTER TABLE cyclone_steps ADD COLUMN gated_at timestamptz;

-- One row per live supervisor, refreshed every few seconds; rows not seen for a while are
-- supervisors that died (status shows them as lost; the scanner's retention removes them).
CREATE TABLE cyclone_supervisors (
    id             text PRIMARY KEY,
    host           text NOT NULL,
    pid            integer NOT NULL,
    state          text NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'draining')),
    workers_target integer NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    seen_at        timestamptz NOT NULL DEFAULT now()
);

-- One row per worker slot of a supervisor: what it holds right now.
CREATE TABLE cyclone_workers (
    supervisor_id text NOT NULL REFERENCES cyclone_supervisors (id) ON DELETE CASCADE,
    slot          integer NOT NULL,
    pid           integer NOT NULL,
    state         text NOT NULL CHECK (state IN ('idle', 'busy')),
    step_id       bigint,
    run_id        uuid,
    workflow      text,
    node          text,
    attempt       integer,
    busy_since    timestamptz,
    seen_at       timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (supervisor_id, slot),
    CHECK ((state = 'busy') = (step_id IS NOT NULL))
);

-- `cyclone runs` lists the newest runs first.
CREATE INDEX cyclone_runs_created_idx ON cyclone_runs (created_at, id);
