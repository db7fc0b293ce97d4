-- Cyclone's schema as it stands after the last migration: read this file to learn the tables.
--
-- It is also how `migrate` makes a schema that was never migrated (no cyclone_migrations
-- table): a fresh install, and every TestEnv, run this script in one transaction under the
-- migration lock and record every migration as applied (cyclone/migrate.py). A database that
-- was migrated before is changed only by the numbered files in migrations/. So this file must
-- say exactly what the migrations make: tests/db/test_schema_file.py holds it to a database
-- migrated file by file, object by object (columns with their order, types, defaults and
-- nullability; constraints; indexes; functions with their ACLs; triggers; views; partitioning;
-- sequences and where they stand) and row by row (the rows a migration inserts, such as the
-- default queue). A migration that changes the schema, or writes a row or sets a sequence,
-- must change this file too. The loader of named statements (cyclone/sql/__init__.py) skips it.
--
-- Every statement Cyclone runs against these tables is a named block in the other files of
-- this folder; the views at the end are the public, read-only face (docs/sql.md). The
-- bookkeeping table cyclone_migrations is made by migrate.sql's migration_table_create.
--
-- Times are timestamptz and come from the database's clock. Ids of runs are uuids made by the
-- client; ids of steps, signals and attempts are identities.

------------------------------------------------------------------------------------------------
-- Value lists
--
-- The states and kinds are text checked against a domain's list: a session keeps a domain's
-- check compiled, where a table's CHECK is rebuilt from its stored text on every write
-- (migration 3). cyclone/states.py mirrors these lists (a test holds them equal).
------------------------------------------------------------------------------------------------

CREATE DOMAIN cyclone_run_state AS text
    CHECK (VALUE IN ('queued', 'running', 'paused', 'completed', 'failed', 'cancelled'));
CREATE DOMAIN cyclone_step_state AS text
    CHECK (VALUE IN ('available', 'running', 'waiting', 'completed', 'dead', 'discarded'));
CREATE DOMAIN cyclone_node_kind AS text
    CHECK (VALUE IN ('task', 'map', 'wait', 'sleep', 'child'));
-- Why a step attempt failed or a step was dead-lettered.
CREATE DOMAIN cyclone_error_kind AS text
    CHECK (VALUE IN ('error', 'timeout', 'crashed', 'lease_expired', 'deadline', 'max_wait',
                     'child_failed', 'cancelled', 'too_many_items'));

-- What a node kind implies: the state its step starts in (and comes back to when the DLQ
-- re-drives it), for every statement that makes or remakes steps. Waits and sleeps wait for
-- their signal or their time; tasks, maps and child nodes are available to a worker. One
-- expression, IMMUTABLE, not STRICT: the planner inlines it, so the callers' plans are those
-- of the CASE written out in place. NodeKind.first_state (cyclone/states.py) says the same.
CREATE FUNCTION cyclone_kind_first_state(kind text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN kind IN ('wait', 'sleep') THEN 'waiting' ELSE 'available' END
$$;

------------------------------------------------------------------------------------------------
-- Workflows and their graphs
------------------------------------------------------------------------------------------------

-- One row per distinct graph a workflow has had, keyed by the hash of its JSON. A run points
-- at the graph it started with, so a deploy that changes a workflow never changes the shape of
-- runs already in flight.
CREATE TABLE cyclone_graphs (
    hash        text PRIMARY KEY,
    workflow    text NOT NULL,
    graph       jsonb NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    -- When a live supervisor last said it serves this graph (`cyclone workflows`), written at
    -- most once a minute by each (migration 16).
    served_at   timestamptz
);

-- The graph new runs of each workflow start with (the last one registered).
CREATE TABLE cyclone_workflows (
    name        text PRIMARY KEY,
    graph_hash  text NOT NULL REFERENCES cyclone_graphs (hash),
    updated_at  timestamptz NOT NULL DEFAULT now(),
    -- Flow control (migration 14): the queue its runs go to, and their default priority.
    queue       text NOT NULL DEFAULT 'default',
    priority    smallint NOT NULL DEFAULT 3,
    -- Runs per key: the input field that gives a run's key (NULL: computed in code, or no
    -- limit), and how many runs of one key may be active at once (NULL: no limit).
    concurrency_field text,
    concurrency_limit integer
);

-- The queues registered workflows name. `pass` is the queue's fair clock: the largest pass
-- of its steps in service, kept by the fair_clock sweep; a run submitted to a group with no
-- live run starts there (see cyclone_runs.pass).
CREATE TABLE cyclone_queues (
    name       text PRIMARY KEY,
    pass       bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO cyclone_queues (name) VALUES ('default');

------------------------------------------------------------------------------------------------
-- Runs
------------------------------------------------------------------------------------------------

CREATE TABLE cyclone_runs (
    id              uuid PRIMARY KEY,
    workflow        text NOT NULL,
    graph_hash      text NOT NULL REFERENCES cyclone_graphs (hash),
    state           cyclone_run_state NOT NULL,
    input           jsonb NOT NULL,
    -- The output of the run's last node, once the run completed.
    output          jsonb,
    -- A second submit with the same key returns the first run instead of making one.
    idempotency_key text,
    -- A child run (a `child` node of another run): its parent run and the step waiting for it.
    -- Deleting a parent deletes its children.
    parent_run_id   uuid REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    parent_step_id  bigint,
    created_at      timestamptz NOT NULL,
    -- When the deadline sweep fails the run (NULL: no deadline). A child run has none of its
    -- own: it is bounded by its parent's deadline and its node's max_wait.
    deadline_at     timestamptz,
    paused_at       timestamptz,
    finished_at     timestamptz,
    -- A client waits for this run: its end is notified on channel cyclone_run_ended (the
    -- trigger cyclone_runs_ended below).
    waited          boolean NOT NULL DEFAULT false,
    -- Flow control (migration 14). The workflow's queue and the run's priority (1 is leased
    -- first), copied to its steps.
    queue           text NOT NULL DEFAULT 'default',
    priority        smallint NOT NULL DEFAULT 3,
    -- Its place in its queue's start-time fair queue: the later of the queue's clock and one
    -- past the last pass of its group's live runs (a group: the workflow and concurrency key).
    -- Its steps take this pass (a map's items add their index).
    pass            bigint NOT NULL DEFAULT 0,
    -- The key its workflow's concurrency is counted by, computed at submit (NULL: none), and
    -- the limit it was submitted under (NULL: none).
    concurrency_key text,
    concurrency_limit integer,
    -- Waiting for a slot of its key: state `queued` (or `paused` while it waited). It has no
    -- steps until cyclone_admit admits it.
    queued          boolean NOT NULL DEFAULT false,
    -- ctx.patched()'s answers by change id (migration 16): given once, read by every retry.
    patches         jsonb,
    -- The W3C traceparent current at submit (migration 20; a child run takes its parent's):
    -- each attempt's span is its child when the supervisor traces (SPEC section 16).
    trace_parent    text
);

-- Children of a run (cancel and fail go down the tree).
CREATE INDEX cyclone_runs_parent_idx ON cyclone_runs (parent_run_id)
    WHERE parent_run_id IS NOT NULL;
-- Retention and listings of finished runs.
CREATE INDEX cyclone_runs_finished_idx ON cyclone_runs (finished_at)
    WHERE finished_at IS NOT NULL;
-- `cyclone runs` lists the newest runs first.
CREATE INDEX cyclone_runs_created_idx ON cyclone_runs (created_at, id);
-- Most runs have no key: only those with one are indexed.
CREATE UNIQUE INDEX cyclone_runs_idempotency_idx ON cyclone_runs (idempotency_key)
    WHERE idempotency_key IS NOT NULL;
-- The deadline sweep and the counts of live runs share this one index. The sweep's conditions
-- are its leading columns and its order is the sweep's order, so any plan through it reads
-- only the runs due (with a second index on state alone, statistics taken while few runs were
-- live led the planner to read every live run).
CREATE INDEX cyclone_runs_live_idx ON cyclone_runs (state, deadline_at)
    WHERE state IN ('running', 'paused');
-- A group's last pass among its live runs, read at submit, and its active runs, counted under
-- a concurrency limit: `pass > 0` is a live run submitted since migration 14 (an ended run's
-- pass is negative: cyclone_runs_pass_sign).
CREATE INDEX cyclone_runs_fair_idx
    ON cyclone_runs (workflow, (coalesce(concurrency_key, '')), queued, pass)
    WHERE pass > 0;
-- Queued runs of a key, in the order they are admitted; and their deadlines, for the sweep.
CREATE INDEX cyclone_runs_queued_idx
    ON cyclone_runs (workflow, concurrency_key, priority, created_at, pass, id)
    WHERE state = 'queued';
-- (Not by state: the admission's index would answer that too, and a planner that took it
-- sorted every queued run by deadline for each sweep. A queued run that is not paused.)
CREATE INDEX cyclone_runs_queued_deadline_idx ON cyclone_runs (deadline_at)
    WHERE queued AND paused_at IS NULL AND deadline_at IS NOT NULL;

------------------------------------------------------------------------------------------------
-- Steps: one row per node instance of a run (a map node has one row per item, and one for the
-- fan-out itself)
------------------------------------------------------------------------------------------------

-- No foreign key to cyclone_runs: its check locked the run's row for every step inserted.
-- Steps are only made by statements that hold their run, and the one place runs are deleted
-- (cyclone_delete_finished, below) deletes their steps itself.
CREATE TABLE cyclone_steps (
    id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id           uuid NOT NULL,
    workflow         text NOT NULL,
    node             text NOT NULL,
    kind             cyclone_node_kind NOT NULL,
    -- Map items carry their index; a map row without one is the fan-out itself, waiting for a
    -- worker (which has the code) to evaluate the items.
    item_index       integer,
    item             jsonb,
    state            cyclone_step_state NOT NULL,
    -- Attempts made so far; a failed attempt below max_attempts becomes available again.
    attempt          integer NOT NULL DEFAULT 0,
    max_attempts     integer NOT NULL,
    -- A task's time limit per attempt (NULL: none).
    timeout          interval,
    -- The signal name a wait node waits for.
    signal           text,
    -- When the step may be leased (retry backoff moves it forward).
    available_at     timestamptz NOT NULL,
    -- Sleep wake-up, or the max_wait expiry of a wait or child node.
    due_at           timestamptz,
    -- The lease of a running step: whoever holds the token may finish it until it expires;
    -- heartbeats push lease_expires_at forward.
    lease_token      uuid,
    lease_expires_at timestamptz,
    leased_by        text,
    -- The run a child node started.
    child_run_id     uuid,
    output           jsonb,
    -- The latest error; every failed attempt's is kept in cyclone_step_attempts.
    error            text,
    error_kind       cyclone_error_kind,
    created_at       timestamptz NOT NULL,
    started_at       timestamptz,
    completed_at     timestamptz,
    -- When the step's current gate (retry available_at, or due_at) was set: a gate set during
    -- a pause starts counting at resume, so resume gives back only the paused part of a gate.
    gated_at         timestamptz,
    -- Its run's priority and its fair pass (migration 14): the lease order.
    priority         smallint NOT NULL DEFAULT 3,
    pass             bigint NOT NULL DEFAULT 0,
    -- Its node's limits: at most node_limit of its steps hold a lease at once (a slot each:
    -- cyclone_node_slots, migration 33), and a token of limiter rate_limit per attempt; `held`
    -- while it waits for a token (state `waiting`: see cyclone_admit_steps).
    node_limit       integer,
    rate_limit       text,
    held             boolean NOT NULL DEFAULT false,
    -- Parked by the `unserved` sweep (state `waiting`): its run's graph is served by no live
    -- supervisor, and it waits out of the lease index until one serves it (migration 16).
    parked           boolean NOT NULL DEFAULT false,
    -- The slot of its node its lease holds (cyclone_node_slots, migration 33), while running.
    slot             integer
);

-- One step per node instance: advancing a run twice cannot create a node twice. Its leading
-- column also serves every lookup of a run's steps.
CREATE UNIQUE INDEX cyclone_steps_node_idx
    ON cyclone_steps (run_id, node, item_index) NULLS NOT DISTINCT;
-- Due steps in the order they became due: the oldest due step and the due count (status,
-- metrics).
CREATE INDEX cyclone_steps_available_idx ON cyclone_steps (available_at, id)
    WHERE state = 'available';
-- Lease candidates, in the order they are leased (see cyclone_lease_candidate). available_at
-- is the last key column so that steps not yet due (a retry in its backoff) are passed over
-- inside the index, without a visit to the table. Steps of a node limited by concurrency wait
-- in an index of their own (cyclone_steps_limited_ready_idx, migration 33).
CREATE INDEX cyclone_steps_ready_idx ON cyclone_steps (priority, pass, id, available_at)
    WHERE state = 'available' AND node_limit IS NULL;
-- Parked steps, by run (the `unserved` sweep makes them available again).
CREATE INDEX cyclone_steps_parked_idx ON cyclone_steps (run_id) WHERE parked AND state = 'waiting';
-- Sleep wake-ups and max_wait expiry.
CREATE INDEX cyclone_steps_due_idx ON cyclone_steps (due_at)
    WHERE state = 'waiting' AND due_at IS NOT NULL;
-- The dead-letter queue.
CREATE INDEX cyclone_steps_dead_idx ON cyclone_steps (completed_at)
    WHERE state = 'dead';
-- The DLQ by reason (migration 21): its counts by reason without a visit to each dead step's
-- row, and a reason's dead steps newest first (the console's DLQ page, `dlq list --reason`).
CREATE INDEX cyclone_steps_dead_kind_idx ON cyclone_steps (error_kind, completed_at, id)
    WHERE state = 'dead';
-- Running steps, for the expired-lease sweep: at most one per worker of the fleet. By id, not
-- lease expiry, so a heartbeat changes no indexed column and is applied in place (HOT), and
-- leases do not all insert at one edge of the index.
CREATE INDEX cyclone_steps_running_idx ON cyclone_steps (id) WHERE state = 'running';

-- Every failed, killed or dead-lettered attempt of a step, written by the statement that
-- records the failure (a step row keeps only its latest error). No foreign key, as for steps:
-- retention deletes these rows with their steps.
CREATE TABLE cyclone_step_attempts (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    step_id     bigint NOT NULL,
    run_id      uuid NOT NULL,
    attempt     integer NOT NULL,
    error_kind  cyclone_error_kind NOT NULL,
    error       text,
    worker      text,
    started_at  timestamptz,
    ended_at    timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX cyclone_step_attempts_step_idx ON cyclone_step_attempts (step_id, id);

------------------------------------------------------------------------------------------------
-- Signals: kept until their wait node is reached (consumed_by is then the step)
------------------------------------------------------------------------------------------------

CREATE TABLE cyclone_signals (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run_id      uuid NOT NULL REFERENCES cyclone_runs (id) ON DELETE CASCADE,
    name        text NOT NULL,
    payload     jsonb,
    created_at  timestamptz NOT NULL,
    consumed_by bigint
);
CREATE INDEX cyclone_signals_pending_idx ON cyclone_signals (run_id, name, id)
    WHERE consumed_by IS NULL;

------------------------------------------------------------------------------------------------
-- Presence: who is running where (`cyclone status`, `cyclone workers`, from any host)
------------------------------------------------------------------------------------------------

-- One row per live supervisor, refreshed every few seconds; rows not seen for a while are
-- supervisors that died (status shows them as lost; the scanner's stale_supervisors sweep
-- removes them).
CREATE TABLE cyclone_supervisors (
    id             text PRIMARY KEY,
    host           text NOT NULL,
    pid            integer NOT NULL,
    state          text NOT NULL DEFAULT 'running' CHECK (state IN ('running', 'draining')),
    workers_target integer NOT NULL DEFAULT 0,
    started_at     timestamptz NOT NULL DEFAULT now(),
    seen_at        timestamptz NOT NULL DEFAULT now(),
    -- The workflows its workers lease for (NULL: a supervisor older than migration 8, taken to
    -- serve every workflow). Runs of a workflow no live supervisor serves are reported.
    workflows      text[],
    -- The graph hashes its workers lease for (migration 16; NULL: every graph of `workflows`).
    graphs         text[]
);

-- When code containing each ctx.patched() change first registered (migration 16).
CREATE TABLE cyclone_patches (
    workflow      text NOT NULL,
    patch         text NOT NULL,
    registered_at timestamptz NOT NULL,
    PRIMARY KEY (workflow, patch)
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

------------------------------------------------------------------------------------------------
-- The row rules of steps and runs
--
-- Kept by a BEFORE trigger on each table rather than CHECK constraints, which PostgreSQL reads
-- back from their stored text on every write (migrations 5 and 6). A broken rule still fails
-- the statement with SQLSTATE 23514 (check_violation) naming cyclone_steps_rules or
-- cyclone_runs_rules as the constraint, and the detail lists the rules broken. A rule on a
-- NULL is not broken (as a CHECK passes on NULL), so a NULL in a NOT NULL column reaches that
-- constraint, which names the column. Each rule is written twice, as a condition in the
-- fast test and as the text naming it: tests/db/test_schema.py holds both to one model. Like every
-- trigger, these do not fire while session_replication_role is `replica`.
--
-- The same functions do what other row triggers did with a WHEN clause (migration 23): a WHEN
-- clause is read back from its text and compiled for every statement that may fire it, rows
-- or not, where a test in a function that runs anyway costs a few thousand instructions.
-- Before the rules: a step of a limited node is held, a run's pass takes its sign, a
-- finished_at in the past is refused. After them: the end of a run a client waits for is
-- notified (channel cyclone_run_ended, payload the run's id; only runs with `waited` set,
-- since a transaction that sent a NOTIFY serialises its commit with every other such commit),
-- and a waiting supervisor or the scanner is woken (cyclone_wake_ready, cyclone_wake_timer).
-- Notifications are delivered at commit, never on rollback. Runs end and steps become ready
-- in a dozen places; a trigger cannot be forgotten by the next one.
------------------------------------------------------------------------------------------------

-- Whether a step's token is still promised to it: its id is among the pending steps of one of
-- its limiter's buckets (those given a token and not yet counted as started). The row is
-- locked in share mode, so that an admission writing the bucket is waited for and its new
-- list read: a step that admission counted as started is no longer pending.
CREATE FUNCTION cyclone_token_kept(limiter text, step bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM cyclone_rate_buckets b
      WHERE b.name = limiter AND (step = ANY (b.pending) OR step = ANY (b.fresh))
        FOR SHARE;
    RETURN FOUND;
END
$$;

CREATE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- PL/pgSQL compiles a test the first time a transaction reaches it, and the cost grows
    -- with its size: so each step starts with a small test that the hot path fails (a lease and
    -- a completion make no step available or waiting), and the larger ones sit behind it.
    IF NEW.state = 'available' OR NEW.state = 'waiting' THEN
        -- A rate-limited step made available waits, held, until admitted with a token: a new
        -- one, and one made available again other than by a planned stop giving it back (a
        -- retry takes a token per attempt). A step given back (its attempt not spent) keeps
        -- its token only while its bucket still counts it as not started (migration 31): a
        -- handler that started spent it (the statement that stops one sets `held`), and so did
        -- a lease the bucket already counted as started. (A node's `concurrency` holds no
        -- step back: its steps wait for a slot as available ones, migration 33.)
        IF NEW.rate_limit IS NOT NULL THEN
            IF NEW.state = 'available'
               AND (TG_OP = 'INSERT'
                    OR (OLD.state <> 'available' AND NOT OLD.held
                        AND (OLD.state <> 'running' OR NEW.attempt >= OLD.attempt OR NEW.held
                             OR NOT cyclone_token_kept(NEW.rate_limit, NEW.id))))
            THEN
                NEW.state := 'waiting';
                NEW.held := true;
            ELSIF NEW.state = 'waiting' AND NOT NEW.held AND OLD.held THEN
                -- Admitted: cyclone_admit_steps clears `held` alone and the step becomes
                -- available here, so that the trigger on UPDATE OF state (which looks for a slot
                -- let go) does not fire for each step admitted.
                NEW.state := 'available';
            END IF;
        END IF;
        -- Wake whoever waits for this step: a supervisor whose workers found nothing (the flag
        -- is set only while one waits), or the scanner asleep past the step's time. (Should a
        -- rule below fail the row, the transaction rolls back its notification with it.) The
        -- flag or time is read once the transaction has its id (pg_current_xact_id): whoever
        -- sets one then waits for the transactions in progress (cyclone_wake_settle), which
        -- counts only those with an id, and a BEFORE trigger runs before the row's write
        -- gives the first write of a transaction its id.
        IF NEW.state = 'available' THEN
            IF NEW.available_at <= now() THEN
                IF (TG_OP = 'INSERT' OR OLD.state <> 'available')
                   AND pg_current_xact_id() IS NOT NULL
                   AND pg_sequence_last_value('cyclone_wake_ready') = 1 THEN
                    PERFORM cyclone_wake_ready();
                END IF;
            ELSIF (TG_OP = 'INSERT' OR OLD.state <> 'available'
                   OR OLD.available_at <> NEW.available_at)
                  AND pg_current_xact_id() IS NOT NULL
                  AND cyclone_epoch_ms(NEW.available_at)
                      < pg_sequence_last_value('cyclone_wake_timer') THEN
                PERFORM cyclone_wake_timer(NEW.available_at);
            END IF;
        ELSIF NEW.due_at < now() + interval '1 minute' THEN
            IF (TG_OP = 'INSERT' OR OLD.state <> 'waiting'
                OR OLD.due_at IS DISTINCT FROM NEW.due_at)
               AND pg_current_xact_id() IS NOT NULL
               AND cyclone_epoch_ms(NEW.due_at) < pg_sequence_last_value('cyclone_wake_timer')
            THEN
                PERFORM cyclone_wake_timer(NEW.due_at);
            END IF;
        END IF;
    ELSIF NEW.state = 'running' THEN
        -- A lease of a step of a limited node claims a free slot of the node (migration 33),
        -- skipping those another transaction holds, or is not taken: the row is left as it
        -- was, and the leasing statement's RETURNING leaves it out.
        -- The walk starts at the step's own place among the slots (its id, modulo the limit),
        -- and wraps: steps are leased about in id order and freed about in the order leased,
        -- so it finds one free at once, where a walk from the first slot passed every slot in use.
        -- (steps_dispatch's leases come with the slots cyclone_lease_pick claimed for them.)
        IF NEW.node_limit IS NOT NULL AND OLD.state <> 'running' AND NEW.slot IS NULL THEN
            UPDATE cyclone_node_slots sl SET step_id = NEW.id
             WHERE (sl.workflow, sl.node, sl.slot)
                   = (SELECT f.workflow, f.node, f.slot FROM cyclone_node_slots f
                       WHERE f.workflow = NEW.workflow AND f.node = NEW.node
                         AND f.step_id IS NULL AND f.slot <= NEW.node_limit
                         AND f.slot > NEW.id % NEW.node_limit
                       ORDER BY f.slot LIMIT 1
                         FOR UPDATE SKIP LOCKED)
            RETURNING sl.slot INTO NEW.slot;
            IF NOT FOUND THEN
                UPDATE cyclone_node_slots sl SET step_id = NEW.id
                 WHERE (sl.workflow, sl.node, sl.slot)
                       = (SELECT f.workflow, f.node, f.slot FROM cyclone_node_slots f
                           WHERE f.workflow = NEW.workflow AND f.node = NEW.node
                             AND f.step_id IS NULL AND f.slot <= NEW.id % NEW.node_limit
                           ORDER BY f.slot LIMIT 1
                             FOR UPDATE SKIP LOCKED)
                RETURNING sl.slot INTO NEW.slot;
                IF NOT FOUND THEN
                    RETURN NULL;
                END IF;
            END IF;
        END IF;
    ELSIF NEW.held THEN
        -- A held step that ends unadmitted (its run cancelled or failed, a deadline) waits for
        -- nothing any more: admission would make it available again, ended, and a DLQ retry
        -- would skip the hold.
        NEW.held := false;
    END IF;
    -- A lease that ends (the step completed, failed, expired, given back, cancelled) lets its
    -- slot go in the same statement.
    IF NEW.slot IS NOT NULL AND NEW.state <> 'running' THEN
        UPDATE cyclone_node_slots SET step_id = NULL
         WHERE workflow = OLD.workflow AND node = OLD.node AND slot = OLD.slot
           AND step_id = OLD.id;
        NEW.slot := NULL;
    END IF;
    IF ((NEW.lease_token IS NOT NULL) <> (NEW.state = 'running')
        OR (NEW.lease_expires_at IS NOT NULL) <> (NEW.state = 'running')
        OR (NEW.completed_at IS NOT NULL) <> (NEW.state IN ('completed', 'dead', 'discarded'))
        OR (NEW.error_kind IS NULL AND NEW.state = 'dead')
        OR (NEW.output IS NOT NULL AND NEW.state <> 'completed')
        OR NOT (NEW.attempt >= 0 AND NEW.max_attempts >= 1)
        OR NEW.item_index < 0) IS NOT TRUE THEN
        RETURN NEW;
    END IF;
    -- A running step holds a lease; a step that ended has completed_at; a dead step says
    -- why; only a completed step has output.
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_steps_rules', TABLE = 'cyclone_steps',
        MESSAGE = format('step %s (state %s) breaks a rule of cyclone_steps', NEW.id, NEW.state),
        DETAIL = concat_ws('; ',
            CASE WHEN (NEW.lease_token IS NOT NULL) <> (NEW.state = 'running')
                 THEN 'lease_token is set exactly while the step is running' END,
            CASE WHEN (NEW.lease_expires_at IS NOT NULL) <> (NEW.state = 'running')
                 THEN 'lease_expires_at is set exactly while the step is running' END,
            CASE WHEN (NEW.completed_at IS NOT NULL)
                      <> (NEW.state IN ('completed', 'dead', 'discarded'))
                 THEN 'completed_at is set exactly once the step ended' END,
            CASE WHEN NEW.error_kind IS NULL AND NEW.state = 'dead'
                 THEN 'a dead step has an error_kind' END,
            CASE WHEN NEW.output IS NOT NULL AND NEW.state <> 'completed'
                 THEN 'only a completed step has output' END,
            CASE WHEN NOT (NEW.attempt >= 0 AND NEW.max_attempts >= 1)
                 THEN 'attempt >= 0 and max_attempts >= 1' END,
            CASE WHEN NEW.item_index < 0 THEN 'item_index >= 0' END);
END
$$;

CREATE FUNCTION cyclone_runs_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- (On an INSERT, OLD is NULL: the state differs from it and was never an end.)
    IF NEW.state IS DISTINCT FROM OLD.state THEN
        -- A run's pass is negative once it ended (positive again if the DLQ re-drives it),
        -- and a client waiting for its end (`waited`: run_wait_register in waits.sql) hears
        -- of it at commit.
        IF NEW.state IN ('completed', 'failed', 'cancelled') THEN
            NEW.pass := -abs(NEW.pass);
            IF NEW.waited AND TG_OP = 'UPDATE' THEN
                PERFORM pg_notify('cyclone_run_ended', NEW.id::text);
            END IF;
        ELSIF OLD.state IN ('completed', 'failed', 'cancelled') THEN
            NEW.pass := abs(NEW.pass);
        END IF;
    END IF;
    -- A finished_at earlier than the transaction's clock, set by a role that does not own the
    -- table: retention would take the run before its time. (Qualified names: this runs with
    -- the caller's search_path.)
    IF NEW.finished_at < pg_catalog.now() THEN
        IF TG_OP = 'UPDATE' AND NEW.finished_at IS DISTINCT FROM OLD.finished_at
           AND NOT pg_catalog.pg_has_role(current_user,
                                          (SELECT c.relowner FROM pg_catalog.pg_class c
                                            WHERE c.oid = TG_RELID), 'MEMBER') THEN
            RAISE insufficient_privilege USING
                MESSAGE = pg_catalog.format('run %s: finished_at %s is before now (%s); role %s'
                                            ' may only end a run at the current time', NEW.id,
                                            NEW.finished_at, pg_catalog.now(), current_user);
        END IF;
    END IF;
    -- A deadline earlier than the scanner sleeps.
    IF NEW.deadline_at < now() + interval '1 minute' THEN
        IF NEW.state IN ('running', 'queued')
           AND pg_current_xact_id() IS NOT NULL
           AND cyclone_epoch_ms(NEW.deadline_at) < pg_sequence_last_value('cyclone_wake_timer')
        THEN
            PERFORM cyclone_wake_timer(NEW.deadline_at);
        END IF;
    END IF;
    IF ((NEW.finished_at IS NOT NULL) <> (NEW.state IN ('completed', 'failed', 'cancelled'))
        OR (NEW.paused_at IS NOT NULL) <> (NEW.state = 'paused')
        OR (NEW.output IS NOT NULL AND NEW.state <> 'completed')
        OR (NEW.parent_run_id IS NOT NULL AND NEW.deadline_at IS NOT NULL)) IS NOT TRUE THEN
        RETURN NEW;
    END IF;
    RAISE check_violation USING
        CONSTRAINT = 'cyclone_runs_rules', TABLE = 'cyclone_runs',
        MESSAGE = format('run %s (state %s) breaks a rule of cyclone_runs', NEW.id, NEW.state),
        DETAIL = concat_ws('; ',
            CASE WHEN (NEW.finished_at IS NOT NULL)
                      <> (NEW.state IN ('completed', 'failed', 'cancelled'))
                 THEN 'finished_at is set exactly once the run ended' END,
            CASE WHEN (NEW.paused_at IS NOT NULL) <> (NEW.state = 'paused')
                 THEN 'paused_at is set exactly while the run is paused' END,
            CASE WHEN NEW.output IS NOT NULL AND NEW.state <> 'completed'
                 THEN 'only a completed run has output' END,
            -- A child run is bounded by its parent's deadline and its node's max_wait only.
            CASE WHEN NEW.parent_run_id IS NOT NULL AND NEW.deadline_at IS NOT NULL
                 THEN 'a child run has no deadline of its own' END);
END
$$;

CREATE TRIGGER cyclone_steps_rules BEFORE INSERT OR UPDATE ON cyclone_steps
    FOR EACH ROW EXECUTE FUNCTION cyclone_steps_keep_rules();
CREATE TRIGGER cyclone_runs_rules BEFORE INSERT OR UPDATE ON cyclone_runs
    FOR EACH ROW EXECUTE FUNCTION cyclone_runs_keep_rules();

------------------------------------------------------------------------------------------------
-- Runs per key: at most `concurrency_limit` runs of a workflow with the same concurrency key
-- are active (running, or paused after they started); the others wait as `queued`, with no
-- steps, and are admitted oldest first within priority as active ones end. Every admission
-- happens under the key's advisory lock (cyclone_slot_lock), taken by a statement before the
-- one that counts (a submit: concurrency_lock, then run_submit), or inside cyclone_admit,
-- whose statements each see what committed before the lock was granted: so the count of
-- active runs is exact and nothing is kept that could drift from the runs themselves.
------------------------------------------------------------------------------------------------

-- The lock of a workflow's key (a transaction lock: released at commit or rollback).
CREATE FUNCTION cyclone_slot_lock(workflow text, ckey text) RETURNS void
LANGUAGE sql VOLATILE AS $$
    SELECT pg_advisory_xact_lock(hashtextextended(
        'cyclone_slot:' || current_schema() || chr(31) || workflow || chr(31) || ckey, 0))
$$;

-- A graph's root nodes, as the statements that make steps take them (node_rows in Python).
CREATE FUNCTION cyclone_graph_roots(graph_hash text)
RETURNS TABLE (node text, kind text, max_attempts integer, timeout float8, signal text,
               due float8, node_limit integer, rate_limit text)
LANGUAGE sql STABLE AS $$
    SELECT n->>'name', n->>'kind', coalesce((n->>'max_attempts')::integer, 1),
           (n->>'timeout')::float8, n->>'signal',
           CASE WHEN n->>'kind' = 'sleep' THEN (n->>'duration')::float8
                ELSE (n->>'max_wait')::float8 END,
           (n->>'concurrency')::integer, n->>'rate_limit'
      FROM cyclone_graphs g, jsonb_array_elements(g.graph->'nodes') AS n
     WHERE g.hash = graph_hash AND jsonb_array_length(coalesce(n->'after', '[]')) = 0
$$;

-- Admit the queued runs of a key that fit under its limit: each becomes running, takes a fair
-- pass no earlier than its queue's clock (it waited; it does not jump the line it rejoins),
-- and gets its root steps. Returns how many were admitted.
CREATE FUNCTION cyclone_admit(wf text, ckey text, lim integer, at timestamptz)
RETURNS integer LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    active integer;
    admitted integer;
BEGIN
    PERFORM cyclone_slot_lock(wf, ckey);
    -- Under the lock, a submit that queued a run has committed: with none queued, nothing to
    -- count (the common case of a limit that does not bind).
    IF NOT EXISTS (SELECT 1 FROM cyclone_runs r
                    WHERE r.workflow = wf AND r.concurrency_key = ckey AND r.state = 'queued')
    THEN
        RETURN 0;
    END IF;
    SELECT count(*) INTO active FROM cyclone_runs r
     WHERE r.workflow = wf AND coalesce(r.concurrency_key, '') = ckey
       AND r.queued = false AND r.pass > 0;
    IF active >= lim THEN
        RETURN 0;
    END IF;
    WITH next AS (
        SELECT r.id FROM cyclone_runs r
         WHERE r.workflow = wf AND r.concurrency_key = ckey AND r.state = 'queued'
         ORDER BY r.priority, r.created_at, r.pass, r.id  -- pass: the order in a submit_many
         LIMIT lim - active
           FOR NO KEY UPDATE SKIP LOCKED
    ), runs AS (
        UPDATE cyclone_runs r
           SET state = 'running', queued = false,
               pass = greatest(r.pass, coalesce((SELECT q.pass + 1 FROM cyclone_queues q
                                                  WHERE q.name = r.queue), 0))
          FROM next WHERE r.id = next.id
        RETURNING r.id, r.workflow, r.graph_hash, r.priority, r.pass
    ), roots AS (
        INSERT INTO cyclone_steps (run_id, workflow, node, kind, state, max_attempts, timeout,
                                   signal, available_at, due_at, created_at, priority, pass,
                                   node_limit, rate_limit)
        SELECT runs.id, runs.workflow, n.node, n.kind, cyclone_kind_first_state(n.kind),
               n.max_attempts, make_interval(secs => n.timeout), n.signal, at,
               at + make_interval(secs => n.due), at, runs.priority, runs.pass,
               n.node_limit, n.rate_limit
          FROM runs, cyclone_graph_roots(runs.graph_hash) AS n
    )
    SELECT count(*) INTO admitted FROM runs;
    RETURN admitted;
END
$$;

-- A run that held a slot ended: admit what now fits. (A queued run that ends held none.)
CREATE FUNCTION cyclone_runs_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
BEGIN
    IF OLD.state IN ('running', 'paused') AND NOT OLD.queued
       AND NEW.state IN ('completed', 'failed', 'cancelled') THEN
        -- An assignment, not PERFORM: a call alone is evaluated as a simple expression, where
        -- PERFORM runs a query (a plan's executor started and ended) for every row.
        admitted := cyclone_admit(NEW.workflow, NEW.concurrency_key, NEW.concurrency_limit, now());
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_slot_freed AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW WHEN (NEW.concurrency_limit IS NOT NULL)
    EXECUTE FUNCTION cyclone_runs_free_slot();

------------------------------------------------------------------------------------------------
-- Steps of limited nodes: `concurrency=N` on a node (at most N of its steps hold a lease at
-- once, across every VM) and `rate_limit` (one token of a bucket per attempt).
--
-- Concurrency (migration 33) is held by slots: a node has N slot rows, a lease of one of its
-- steps claims a free one (the rules' trigger, in the statement that leases: a step that finds
-- none is not leased) and the end of that lease lets it go, in the statement that ends it. Its
-- steps wait for a slot as available ones, in an index of their own
-- (cyclone_steps_limited_ready_idx), out of the one the other leases walk, and the lease reads
-- a node only while the node has a free slot (cyclone_lease_pick): a full node's backlog is
-- walked by nobody, and a node whose limit never binds costs its steps a slot's claim and
-- release, nothing more. A claim takes a free slot with SKIP LOCKED and never waits. A release
-- may wait for a statement that locked its slot while reading it as free (its snapshot older
-- than the claim), which never waits for the releaser in turn: that statement began before the
-- step was leased, so it is not the one that ends the lease.
--
-- Rate: a step is made `waiting` with `held` set, out of the lease indexes, so that no lease
-- walks over it; cyclone_admit_steps makes it available when a token is free. A token not yet
-- refilled is given ahead of time: the step becomes available at the moment its token refills
-- (available_at), at most RATE_HORIZON ahead, and the held_steps sweep gives the next ones. A
-- bucket promises tokens to at most `burst` steps not yet started, and counts each token taken
-- when its step started (migration 29): steps held back by a stall of the leases cannot all
-- start at once when they resume. Admission runs when a step is made and in that sweep; it
-- takes the node's advisory lock without waiting (a transaction that holds it admits; one that
-- does not leaves the rest to the sweep), and bucket rows with SKIP LOCKED, so no admission
-- ever waits for another: nothing here can deadlock the statements that fire it.
------------------------------------------------------------------------------------------------

-- A limiter: `rate` tokens every `per` seconds, at most `burst` saved up (client.set_rate_limit).
CREATE TABLE cyclone_rate_limits (
    name       text PRIMARY KEY,
    rate       float8 NOT NULL,
    per        float8 NOT NULL,
    burst      float8 NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- A limiter's buckets: one, or one per key (`RateLimit(name, key=FIELD)`). `tokens` is the
-- level at updated_at, counting the tokens of the `pending` steps (given one, not yet started)
-- as not yet taken (migration 29); `next_at`: when the held_steps sweep should look again.
-- `fresh`: pending steps given their token since the last look at `pending` (migration 32),
-- kept apart so that the admissions in between do not write the long list again.
CREATE TABLE cyclone_rate_buckets (
    name       text NOT NULL,
    key        text NOT NULL,
    tokens     float8 NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (name, key),
    pending    bigint[] NOT NULL DEFAULT '{}',
    next_at    timestamptz,
    fresh      bigint[] NOT NULL DEFAULT '{}'
);

CREATE INDEX cyclone_rate_buckets_next_idx ON cyclone_rate_buckets (next_at)
    WHERE next_at IS NOT NULL;

-- Available steps of nodes limited by concurrency, by node in lease order (migration 33): what
-- cyclone_lease_limited walks for a node with a free slot. And held steps in the order admitted.
CREATE INDEX cyclone_steps_limited_ready_idx
    ON cyclone_steps (workflow, node, priority, pass, id, available_at)
    WHERE state = 'available' AND node_limit IS NOT NULL;
CREATE INDEX cyclone_steps_held_idx ON cyclone_steps (workflow, node, priority, pass, id)
    WHERE held;

-- The input field a rate-limited node's bucket key is read from (NULL: one bucket).
CREATE FUNCTION cyclone_node_rate_key(graph_hash text, node text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT n->>'rate_key'
      FROM cyclone_graphs g, jsonb_array_elements(g.graph->'nodes') AS n
     WHERE g.hash = graph_hash AND n->>'name' = node
$$;

CREATE FUNCTION cyclone_admit_steps(wf text, nd text, at timestamptz)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    horizon CONSTANT float8 := 2.0;  -- RATE_HORIZON: how far ahead a token may be given
    batch CONSTANT integer := 200;   -- most held steps one call reads, and admits
    -- The longest from a lease to its handler's start: a lease taken ahead starts within
    -- READY_FOR (0.25 s, cyclone/supervisor/dispatch.py) of its statement, or goes back.
    slack CONSTANT interval := interval '300 milliseconds';
    -- How often a bucket's pending steps are walked while it has tokens to spare, and how many
    -- may be given meanwhile (migration 32): `fresh` stays short enough to be kept in its row.
    relook CONSTANT interval := interval '100 milliseconds';
    fresh_most CONSTANT integer := 200;
    admitted integer;
    st record;
    ev record;
    rows_read integer := 0;
    -- (Set when the walk starts: a default is evaluated at every call, and a call that finds
    -- the node's lock taken ends before.)
    ids bigint[];
    waits float8[];
    -- The buckets this call met, by `name || chr(31) || key`: the level at b_at (tokens, the
    -- pending steps' not yet taken), how many steps are pending (still waiting to start, and
    -- given a token by this call: their ids in p_id, their bucket in p_bucket), the burst,
    -- seconds a token (NULL: it gives nothing this call: its limiter is undeclared, or another
    -- admission holds its row), and `open` false once it can give no more this call.
    b_id text[];
    b_name text[];
    b_key text[];
    b_level float8[];
    b_pend integer[];
    b_burst float8[];
    b_secs float8[];
    b_open boolean[];
    b_at timestamptz[];
    b_walked boolean[];
    p_id bigint[];
    p_bucket integer[];
    b integer;
    t timestamptz;
    next timestamptz;
    seen integer;
    bkey text;
    keyfield text;
    keyed_graph text;
    wait float8;
    lim_row cyclone_rate_limits%ROWTYPE;
    bucket cyclone_rate_buckets%ROWTYPE;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended(
               'cyclone_node:' || current_schema() || chr(31) || wf || chr(31) || nd, 0)) THEN
        RETURN 0;
    END IF;
    ids := '{}';
    waits := '{}';
    b_id := '{}';
    b_name := '{}';
    b_key := '{}';
    b_level := '{}';
    b_pend := '{}';
    b_burst := '{}';
    b_secs := '{}';
    b_open := '{}';
    b_at := '{}';
    b_walked := '{}';
    p_id := '{}';
    p_bucket := '{}';
    -- Pick the steps in lease order, skipping those another transaction holds; a bucket's row
    -- is read and locked once, when its first step is met, and written once, after the walk:
    -- one statement per bucket, not three a step. The run is read only for a rate-limited step
    -- (its bucket key).
    FOR st IN
        SELECT s.id, s.rate_limit, s.available_at, r.graph_hash, r.input
          FROM cyclone_steps s
          LEFT JOIN LATERAL (SELECT r.graph_hash, r.input FROM cyclone_runs r
                              WHERE r.id = s.run_id AND s.rate_limit IS NOT NULL
                             OFFSET 0) AS r ON true  -- OFFSET 0: no lookup without a limiter
         WHERE s.held AND s.workflow = wf AND s.node = nd
         ORDER BY s.priority, s.pass, s.id
         LIMIT batch
           FOR UPDATE OF s SKIP LOCKED
    LOOP
        rows_read := rows_read + 1;
        wait := 0;
        IF st.rate_limit IS NOT NULL THEN
            IF st.graph_hash IS DISTINCT FROM keyed_graph THEN  -- one graph read per graph
                keyfield := cyclone_node_rate_key(st.graph_hash, nd);
                keyed_graph := st.graph_hash;
            END IF;
            bkey := CASE WHEN keyfield IS NULL THEN '' ELSE coalesce(st.input->>keyfield, '') END;
            b := array_position(b_id, st.rate_limit || chr(31) || bkey);
            IF b IS NULL THEN
                b := cardinality(b_id) + 1;
                b_id[b] := st.rate_limit || chr(31) || bkey;
                b_name[b] := st.rate_limit;
                b_key[b] := bkey;
                b_secs[b] := NULL;
                b_open[b] := true;
                -- An undeclared limiter holds its steps until client.set_rate_limit names it.
                SELECT * INTO lim_row FROM cyclone_rate_limits WHERE name = st.rate_limit;
                IF FOUND THEN
                    SELECT * INTO bucket FROM cyclone_rate_buckets
                     WHERE name = st.rate_limit AND key = bkey FOR UPDATE SKIP LOCKED;
                    IF NOT FOUND THEN
                        -- A bucket's first token (or one another admission holds: next time).
                        INSERT INTO cyclone_rate_buckets (name, key, tokens, updated_at)
                        VALUES (st.rate_limit, bkey, lim_row.burst, at)
                        ON CONFLICT (name, key) DO NOTHING;
                        SELECT * INTO bucket FROM cyclone_rate_buckets
                         WHERE name = st.rate_limit AND key = bkey FOR UPDATE SKIP LOCKED;
                    END IF;
                    IF FOUND THEN
                        -- Refilled to now, or to the bucket's own time when that is later: a
                        -- transaction that began before another admission wrote the bucket
                        -- reads it after (`at` is the transaction's start), and a bucket set
                        -- back to that earlier time would refill the same seconds twice.
                        b_at[b] := greatest(at, bucket.updated_at);
                        b_burst[b] := lim_row.burst;
                        b_secs[b] := lim_row.per / lim_row.rate;
                        -- A bucket walked less than `relook` ago that has tokens for its pending
                        -- steps and a whole batch more, even were none of them started, is not
                        -- walked again (migration 32): every step it meets gets a token now
                        -- whatever the walk would find, its pending steps stay pending, its
                        -- level and time as they were, for the next walk to count, and the steps
                        -- given a token join `fresh`. Walked at each admission, a busy bucket read
                        -- and wrote every step leased in the last `slack` (1,500 at 5,000 steps
                        -- a second) for each 20 or so steps a node limit admits.
                        b_level[b] := least(b_burst[b], bucket.tokens
                            + extract(epoch FROM b_at[b] - bucket.updated_at) / b_secs[b]);
                        b_pend[b] := cardinality(bucket.pending) + cardinality(bucket.fresh);
                        b_walked[b] := b_at[b] - bucket.updated_at >= relook
                                       OR cardinality(bucket.fresh) >= fresh_most
                                       OR b_pend[b] + batch > b_level[b];
                        IF b_walked[b] THEN
                            -- The level, refilled to b_at through the starts of the steps pending
                            -- (in either list), in the order they started. A leased step's
                            -- handler starts up to `slack` after its lease (a lease taken ahead
                            -- waits in its worker's queue: READY_FOR), so a step counts as started
                            -- then, and until then keeps its token, as one still waiting does. One
                            -- whose start is not on record (ended unstarted, gone to the history)
                            -- took it at b_at, the latest it could have.
                            b_level[b] := bucket.tokens;
                            b_pend[b] := 0;
                            t := bucket.updated_at;
                            -- (One scan of the primary key for the ids, in order: neighbours
                            -- share its pages, where a lookup per id descended it each time.)
                            seen := 0;
                            FOR ev IN
                                SELECT s.id,
                                       (s.state = 'available' AND NOT s.held)
                                       OR (s.state = 'running' AND s.started_at + slack > b_at[b])
                                           AS waiting,
                                       least(greatest(coalesce(s.started_at + slack, b_at[b]),
                                                      bucket.updated_at), b_at[b]) AS started
                                  FROM cyclone_steps s
                                 WHERE s.id = ANY (bucket.pending || bucket.fresh)
                                 ORDER BY 3, 1
                            LOOP
                                seen := seen + 1;
                                IF ev.waiting THEN
                                    b_pend[b] := b_pend[b] + 1;
                                    p_id := p_id || ev.id;
                                    p_bucket := p_bucket || b;
                                ELSE
                                    b_level[b] := least(b_burst[b], b_level[b]
                                        + extract(epoch FROM ev.started - t) / b_secs[b]) - 1;
                                    t := ev.started;
                                END IF;
                            END LOOP;
                            -- Those gone (to the history) took theirs at b_at.
                            b_level[b] := least(b_burst[b], b_level[b]
                                                + extract(epoch FROM b_at[b] - t) / b_secs[b])
                                          - (cardinality(bucket.pending)
                                             + cardinality(bucket.fresh) - seen);
                        END IF;
                    END IF;
                END IF;
            END IF;
            -- A node of one bucket (no key) that gives nothing more has no step to admit: the
            -- rest of the walk would only lock rows (migration 33; until then a node limit
            -- stopped it at the free slots).
            EXIT WHEN keyfield IS NULL AND (b_secs[b] IS NULL OR NOT b_open[b]);
            CONTINUE WHEN b_secs[b] IS NULL OR NOT b_open[b];
            -- One token, while the bucket's pending steps with this one are at most `burst`:
            -- at the time the level has refilled for them all (now if it has), so that they
            -- may start at any time after, all at once, and each find a token.
            wait := greatest(b_pend[b] + 1 - b_level[b], 0) * b_secs[b];
            IF b_pend[b] + 1 > b_burst[b] OR wait > horizon THEN
                b_open[b] := false;
                CONTINUE;
            END IF;
            b_pend[b] := b_pend[b] + 1;
            p_id := p_id || st.id;
            p_bucket := p_bucket || b;
            wait := wait + extract(epoch FROM b_at[b] - at);  -- from the bucket's time
        END IF;
        ids := ids || st.id;
        waits := waits || wait;
    END LOOP;
    -- A bucket that held steps back (or that this call stopped reading at its batch) looks
    -- again once some of its pending steps could have started: a token's time, at least 50 ms,
    -- and a quarter of a burst (at most 1 s) for a large one, which sets how many pending
    -- steps each look reads.
    FOR b IN 1 .. cardinality(b_id) LOOP
        IF b_secs[b] IS NOT NULL THEN
            next := NULL;
            IF NOT b_open[b] OR rows_read >= batch THEN
                next := b_at[b] + make_interval(secs => greatest(
                    b_secs[b], 0.05, least(b_burst[b] * b_secs[b] / 4, 1.0)));
            END IF;
            UPDATE cyclone_rate_buckets
               SET tokens = CASE WHEN b_walked[b] THEN b_level[b] ELSE tokens END,
                   updated_at = CASE WHEN b_walked[b] THEN b_at[b] ELSE updated_at END,
                   next_at = coalesce(next, next_at),
                   pending = CASE WHEN b_walked[b] THEN ARRAY(
                                  SELECT p_id[i] FROM generate_subscripts(p_id, 1) AS i
                                   WHERE p_bucket[i] = b) ELSE pending END,
                   fresh = CASE WHEN b_walked[b] THEN '{}' ELSE fresh || ARRAY(
                                SELECT p_id[i] FROM generate_subscripts(p_id, 1) AS i
                                 WHERE p_bucket[i] = b) END
             WHERE name = b_name[b] AND key = b_key[b];
            IF cyclone_epoch_ms(next) < pg_sequence_last_value('cyclone_wake_timer') THEN
                PERFORM cyclone_wake_timer(next);  -- the scanner sleeps past it
            END IF;
        END IF;
    END LOOP;
    IF cardinality(ids) = 0 THEN
        RETURN 0;
    END IF;
    -- The steps picked (locked by the walk), in one statement.
    UPDATE cyclone_steps s
       SET held = false,  -- and so available (the rules' trigger): see cyclone_steps_keep_rules
           available_at = greatest(s.available_at, at + make_interval(secs => a.wait))
      FROM unnest(ids, waits) AS a (id, wait)
     WHERE s.id = ANY (ids) AND s.id = a.id;
    GET DIAGNOSTICS admitted = ROW_COUNT;
    RETURN admitted;
END
$$;

-- A held step inserted admits its node's held steps, once per statement and node (migrations
-- 28, 29): the rows an INSERT makes are all there when its row triggers fire, so the first call
-- saw the others. The mark `cyclone.admitted`, local to the transaction, holds the session's
-- last step id (currval) at that call and the nodes admitted since; a later insert takes a new
-- id and so starts a new mark. A call that filled its batch is not marked: the next row calls
-- again. What the calls left held is admitted by the held_steps sweep, woken at the bucket's
-- next_at.
CREATE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
    mark text;
    upto text;
    here text;
BEGIN
    upto := currval('cyclone_steps_id_seq')::text || chr(30);
    here := NEW.workflow || chr(31) || NEW.node || chr(30);
    mark := current_setting('cyclone.admitted', true);
    IF mark IS NOT NULL AND starts_with(mark, upto) THEN
        IF strpos(mark, chr(30) || here) > 0 THEN
            RETURN NULL;  -- this statement's rows of the node were admitted together
        END IF;
        mark := mark || here;
    ELSE
        mark := upto || here;
    END IF;
    admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now());  -- not PERFORM: see cyclone_runs_free_slot
    IF admitted < 200 THEN  -- a call that filled its batch (200) may leave more to give
        mark := set_config('cyclone.admitted', mark, true);
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_steps_held AFTER INSERT ON cyclone_steps
    FOR EACH ROW WHEN (NEW.held)
    EXECUTE FUNCTION cyclone_steps_admit();

-- The nodes limited by concurrency (migration 33), each with its slots: 1 to node_limit, the
-- highest limit a graph of the node gave it. A slot holds the step whose lease claimed it
-- (step_id), or nothing. A lower limit leaves the higher slots unused: a lease claims a slot at
-- most its step's own limit.
CREATE TABLE cyclone_limited_nodes (
    workflow   text NOT NULL,
    node       text NOT NULL,
    node_limit integer NOT NULL,
    PRIMARY KEY (workflow, node)
);

-- A slot changes with every lease and every end of one: its row is read through the primary
-- key alone (a claim walks the node's slots in order for free ones; the end of a lease finds
-- its own by the step's `slot`), so that no index names step_id and each change is a HOT
-- update, in room the fill factor keeps on the row's page. (An index of free slots made every
-- claim and release write an entry in each index, and walk the versions left behind.)
CREATE TABLE cyclone_node_slots (
    workflow text NOT NULL,
    node     text NOT NULL,
    slot     integer NOT NULL,
    step_id  bigint,
    PRIMARY KEY (workflow, node, slot)
) WITH (fillfactor = 10);

CREATE FUNCTION cyclone_node_slots_make(wf text, nd text, lim integer) RETURNS void
LANGUAGE sql VOLATILE AS $$
    INSERT INTO cyclone_limited_nodes (workflow, node, node_limit) VALUES (wf, nd, lim)
    ON CONFLICT (workflow, node) DO UPDATE SET node_limit = excluded.node_limit
     WHERE cyclone_limited_nodes.node_limit < excluded.node_limit;
    INSERT INTO cyclone_node_slots (workflow, node, slot)
    SELECT wf, nd, g FROM generate_series(1, lim) AS g
    ON CONFLICT DO NOTHING;
$$;

-- A graph registered makes the slots of its nodes limited by concurrency.
CREATE FUNCTION cyclone_graphs_make_slots() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM cyclone_node_slots_make(NEW.workflow, n->>'name', (n->>'concurrency')::integer)
       FROM jsonb_array_elements(NEW.graph->'nodes') AS n
      WHERE n->>'concurrency' IS NOT NULL;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_graphs_slots AFTER INSERT ON cyclone_graphs
    FOR EACH ROW EXECUTE FUNCTION cyclone_graphs_make_slots();

-- Steps held back by a node's limits, counted up to `cap` (the metrics'
-- cyclone_steps_throttled): held steps by node, by a walk of cyclone_steps_held_idx in its
-- order, grouped without a sort whatever the statistics say; and the available steps of each
-- node with no free slot (migration 33).
CREATE FUNCTION cyclone_held_counts(cap integer)
RETURNS TABLE (workflow text, node text, rate_limit text, held bigint)
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
    SELECT h.workflow, h.node, max(h.rate_limit), count(*)
      FROM (SELECT s.workflow, s.node, s.rate_limit FROM cyclone_steps s WHERE s.held
             ORDER BY s.workflow, s.node LIMIT greatest(cap, 0)) AS h
     GROUP BY h.workflow, h.node
    UNION ALL
    SELECT n.workflow, n.node, NULL, w.n
      FROM cyclone_limited_nodes n,
           LATERAL (SELECT count(*) AS n
                      FROM (SELECT 1 FROM cyclone_steps s
                             WHERE s.workflow = n.workflow AND s.node = n.node
                               AND s.state = 'available' AND s.node_limit IS NOT NULL
                             LIMIT greatest(cap, 0)) AS a) AS w
     WHERE w.n > 0
       AND NOT EXISTS (SELECT 1 FROM cyclone_node_slots f
                        WHERE f.workflow = n.workflow AND f.node = n.node
                          AND f.step_id IS NULL)
$$;

------------------------------------------------------------------------------------------------
-- The lease's candidate scan, and how far behind the workers are
--
-- Functions so that the planner settings they carry apply to them alone (a function's SET
-- lasts for its call: nothing leaks into the session or through a pooler). With no sort, only
-- cyclone_steps_ready_idx gives the order; with no hash join, no plan builds a table of
-- every run. What is left walks the index and looks each candidate's run up by its primary
-- key, whatever the statistics say (on a table never analyzed, or analyzed while the queue was
-- empty, the planner otherwise sorted the whole backlog for every lease). A forced generic
-- plan keeps the plan made once per session. Each setting has a cost on every call, so only
-- these are set; see bench/README.md for the figures.
------------------------------------------------------------------------------------------------

-- `after_priority, after_pass, after_id`: where this caller's last lease was in the index
-- (NULL: from the start). Leased steps leave dead entries behind until VACUUM, and a scan from
-- the start walks them all; starting after the last lease skips them. A step that becomes
-- available behind that point (a run of a group that had nothing queued, a chain's next step,
-- a retry whose backoff ended) is found by a scan from the start, which callers make when a
-- lease from their point finds nothing, and every FULL_SCAN_EVERY (cyclone/engine/steps.py).
-- `go` false returns nothing (a lease that must not look); `other_than` skips one run.
-- `graphs`: the graph hashes the caller's code can run (NULL: any), tested on the run the
-- scan reads by primary key anyway (migration 16, docs/deploys.md).
CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 1
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, s.priority, s.pass, r.input, r.deadline_at, r.graph_hash,
           r.parent_run_id
      FROM cyclone_steps s
      -- By primary key, always: OFFSET 0 keeps the lookup a subquery of its own, whose one
      -- condition is the id, so the run's state below cannot lead the planner to walk
      -- cyclone_runs_live_idx for each step (it did, on statistics of a drained history).
      JOIN LATERAL (SELECT r.input, r.deadline_at, r.graph_hash, r.parent_run_id, r.state
                      FROM cyclone_runs r WHERE r.id = s.run_id OFFSET 0) AS r ON true
     WHERE go AND s.state = 'available' AND s.node_limit IS NULL
       AND s.run_id IS DISTINCT FROM other_than
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))
     ORDER BY s.priority, s.pass, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

-- The same, for up to `want` steps at once (the supervisor leasing for its idle workers:
-- steps_dispatch); `other_than` skips the runs whose steps the same statement completes.
CREATE FUNCTION cyclone_lease_candidates(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE sql VOLATILE ROWS 8
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, s.priority, s.pass, r.input, r.deadline_at, r.graph_hash,
           r.parent_run_id
      FROM cyclone_steps s
      JOIN LATERAL (SELECT r.input, r.deadline_at, r.graph_hash, r.parent_run_id, r.state
                      FROM cyclone_runs r WHERE r.id = s.run_id OFFSET 0) AS r ON true
     WHERE want > 0 AND s.state = 'available' AND s.node_limit IS NULL
       AND NOT (s.run_id = ANY (coalesce(other_than, '{}')))
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))
     ORDER BY s.priority, s.pass, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;

-- The steps of one node limited by concurrency a lease may take (migration 33): as
-- cyclone_lease_candidates, from cyclone_steps_limited_ready_idx, at most `want` of them.
CREATE FUNCTION cyclone_lease_limited(
    wf text, nd text, want integer, other_than uuid[], at timestamptz, after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid,
                node_limit integer)
LANGUAGE sql VOLATILE ROWS 8
SET enable_sort = off
SET enable_hashjoin = off
SET plan_cache_mode = force_generic_plan
AS $$
    SELECT s.id, s.available_at, s.priority, s.pass, r.input, r.deadline_at, r.graph_hash,
           r.parent_run_id, s.node_limit
      FROM cyclone_steps s
      JOIN LATERAL (SELECT r.input, r.deadline_at, r.graph_hash, r.parent_run_id, r.state
                      FROM cyclone_runs r WHERE r.id = s.run_id OFFSET 0) AS r ON true
     WHERE want > 0 AND s.workflow = wf AND s.node = nd
       AND s.state = 'available' AND s.node_limit IS NOT NULL
       AND NOT (s.run_id = ANY (coalesce(other_than, '{}')))
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
       AND (graphs IS NULL OR r.graph_hash = ANY(graphs))
     ORDER BY s.priority, s.pass, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;

-- What a lease takes, in lease order (steps_dispatch, and _lease_next through
-- cyclone_lease_pick_one): the steps of no node limit from cyclone_lease_candidates, and those
-- of each node limited by concurrency that has a free slot, at most as many as it has free
-- (migration 33). With `claim` (steps_dispatch, which leases every step this returns), the
-- slots of the limited ones are claimed here, two statements for each node, and `slot` says
-- which: a step whose node's slots were taken meanwhile is left out. Without it, the lease
-- claims each one's slot in the rules' trigger, a statement for each step, or leaves the step
-- (one claim there cost about three times one here). With no limited node among `workflows`
-- that has a step available and a free slot, cyclone_lease_candidates alone.
CREATE FUNCTION cyclone_lease_pick(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[], claim boolean
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid,
                slot integer)
LANGUAGE plpgsql VOLATILE ROWS 8
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
DECLARE
    wfs text[];
    nds text[];
    frees integer[];
    c_id bigint[];
    c_at timestamptz[];
    c_priority smallint[];
    c_pass bigint[];
    c_input jsonb[];
    c_deadline timestamptz[];
    c_graph text[];
    c_parent uuid[];
    c_wf text[];
    c_nd text[];
    c_lim integer[];
    mine bigint[];
    got integer[];
    claimed_ids bigint[] := '{}';
    claimed_slots integer[] := '{}';
BEGIN
    -- The limited nodes of `workflows` with a step available after the caller's last lease
    -- (past the entries leased steps left behind: see cyclone_lease_candidate) and a free
    -- slot: a descent of each index for each node declared (LATERAL ... LIMIT: a probe per
    -- node, where a join read every available step of the node, for statistics that knew none).
    SELECT array_agg(n.workflow), array_agg(n.node), array_agg(f.free)
      INTO wfs, nds, frees
      FROM cyclone_limited_nodes n,
           LATERAL (SELECT s.id FROM cyclone_steps s
                     WHERE s.workflow = n.workflow AND s.node = n.node
                       AND s.state = 'available' AND s.node_limit IS NOT NULL
                       AND (s.priority, s.pass, s.id)
                           > (coalesce(after_priority, 0), coalesce(after_pass, -1),
                              coalesce(after_id, 0))
                     LIMIT 1) AS a,
           LATERAL (SELECT count(*)::integer AS free
                      FROM (SELECT 1 FROM cyclone_node_slots f
                             WHERE f.workflow = n.workflow AND f.node = n.node
                               AND f.step_id IS NULL AND f.slot <= n.node_limit
                             LIMIT greatest(want, 0)) AS f) AS f
     WHERE (workflows IS NULL OR n.workflow = ANY (workflows)) AND f.free > 0;
    IF wfs IS NULL THEN
        RETURN QUERY SELECT c.*, NULL::integer
                       FROM cyclone_lease_candidates(want, other_than, at, workflows,
                                                     after_priority, after_pass, after_id,
                                                     graphs) AS c;
        RETURN;
    END IF;
    -- Both kinds, in lease order, the first `want` (each column an array, in that order).
    SELECT array_agg(c.id ORDER BY c.o), array_agg(c.available_at ORDER BY c.o),
           array_agg(c.priority ORDER BY c.o), array_agg(c.pass ORDER BY c.o),
           array_agg(c.input ORDER BY c.o), array_agg(c.deadline_at ORDER BY c.o),
           array_agg(c.graph_hash ORDER BY c.o), array_agg(c.parent_run_id ORDER BY c.o),
           array_agg(c.wf ORDER BY c.o), array_agg(c.nd ORDER BY c.o),
           array_agg(c.lim ORDER BY c.o)
      INTO c_id, c_at, c_priority, c_pass, c_input, c_deadline, c_graph, c_parent, c_wf,
           c_nd, c_lim
      FROM (SELECT u.*, row_number() OVER (ORDER BY u.priority, u.pass, u.id) AS o
              FROM (SELECT l.*, NULL::text AS wf, NULL::text AS nd, NULL::integer AS lim
                      FROM cyclone_lease_candidates(want, other_than, at, workflows,
                                                    after_priority, after_pass, after_id,
                                                    graphs) AS l
                    UNION ALL
                    SELECT l.id, l.available_at, l.priority, l.pass, l.input, l.deadline_at,
                           l.graph_hash, l.parent_run_id, n.workflow, n.node, l.node_limit
                      FROM unnest(wfs, nds, frees) AS n (workflow, node, free),
                           LATERAL cyclone_lease_limited(n.workflow, n.node, n.free,
                                                         other_than, at, after_priority,
                                                         after_pass, after_id, graphs) AS l
                     ORDER BY 3, 4, 1
                     LIMIT greatest(want, 0)) AS u) AS c;
    IF claim THEN
        FOR i IN 1 .. cardinality(wfs) LOOP
            mine := ARRAY(SELECT c_id[j] FROM generate_subscripts(c_id, 1) AS j
                           WHERE c_wf[j] = wfs[i] AND c_nd[j] = nds[i] ORDER BY j);
            CONTINUE WHEN cardinality(mine) = 0;
            got := ARRAY(SELECT f.slot FROM cyclone_node_slots f
                          WHERE f.workflow = wfs[i] AND f.node = nds[i] AND f.step_id IS NULL
                            AND f.slot <= (SELECT min(c_lim[j]) FROM generate_subscripts(c_id, 1) AS j
                                            WHERE c_wf[j] = wfs[i] AND c_nd[j] = nds[i])
                          ORDER BY f.slot LIMIT cardinality(mine)
                            FOR UPDATE SKIP LOCKED);
            CONTINUE WHEN cardinality(got) = 0;
            mine := mine[1:cardinality(got)];
            UPDATE cyclone_node_slots sl SET step_id = x.id
              FROM unnest(mine, got) AS x (id, slot)
             WHERE sl.workflow = wfs[i] AND sl.node = nds[i] AND sl.slot = x.slot;
            claimed_ids := claimed_ids || mine;
            claimed_slots := claimed_slots || got;
        END LOOP;
    END IF;
    RETURN QUERY
    SELECT u.id, u.available_at, u.priority, u.pass, u.input, u.deadline_at, u.graph_hash,
           u.parent_run_id, k.slot
      FROM unnest(c_id, c_at, c_priority, c_pass, c_input, c_deadline, c_graph, c_parent, c_wf)
               WITH ORDINALITY AS u (id, available_at, priority, pass, input, deadline_at,
                                     graph_hash, parent_run_id, wf, o)
      LEFT JOIN unnest(claimed_ids, claimed_slots) AS k (id, slot) ON k.id = u.id
     WHERE u.wf IS NULL OR NOT claim OR k.slot IS NOT NULL
     ORDER BY u.o;
END
$$;

-- One step, as cyclone_lease_candidate takes it (its arguments), from both kinds.
CREATE FUNCTION cyclone_lease_pick_one(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE plpgsql VOLATILE ROWS 1
SET plan_cache_mode = force_generic_plan
AS $$
#variable_conflict use_column
BEGIN
    IF NOT EXISTS (SELECT 1 FROM cyclone_limited_nodes n
                    WHERE workflows IS NULL OR n.workflow = ANY (workflows)) THEN
        RETURN QUERY SELECT * FROM cyclone_lease_candidate(go, other_than, at, workflows,
                                   after_priority, after_pass, after_id, graphs);
        RETURN;
    END IF;
    RETURN QUERY SELECT p.id, p.available_at, p.priority, p.pass, p.input, p.deadline_at,
                        p.graph_hash, p.parent_run_id
                   FROM cyclone_lease_pick(
                        CASE WHEN go THEN 1 ELSE 0 END,
                        CASE WHEN other_than IS NULL THEN NULL ELSE ARRAY[other_than] END, at,
                        workflows, after_priority, after_pass, after_id, graphs, false) AS p;
END
$$;

-- The oldest step due of a running run (`cyclone status`, the metrics), by the same walk of
-- the candidate index, without locking anything.
CREATE FUNCTION cyclone_oldest_due(at timestamptz) RETURNS timestamptz
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_hashjoin = off
AS $$
    SELECT s.available_at
      FROM cyclone_steps s
      JOIN cyclone_runs r ON r.id = s.run_id
     WHERE s.state = 'available' AND s.available_at <= at AND r.state = 'running'
     ORDER BY s.available_at, s.id
     LIMIT 1
$$;

-- The steps due, counted up to `cap` (`cyclone status`, the metrics' queue gauge), by the same
-- walk of the candidate index, which stops at the cap.
CREATE FUNCTION cyclone_due_count(cap integer, at timestamptz) RETURNS bigint
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
    SELECT count(*) FROM (SELECT 1 FROM cyclone_steps
                           WHERE state = 'available' AND available_at <= at
                           ORDER BY available_at, id
                           LIMIT greatest(cap, 0)) AS due
$$;

------------------------------------------------------------------------------------------------
-- Retention
--
-- The runtime role may not delete history (`cyclone migrate --print-grants`), so the scanner's
-- retention calls this function, which runs with its owner's rights (the role that migrated)
-- and deletes nothing else. It deletes finished top-level runs older than `retention` seconds,
-- at most batch_size of them, with their child runs and signals (ON DELETE CASCADE), the steps
-- of all of them and those steps' attempts, and returns the number of top-level runs deleted.
--
-- Written by an EXECUTE because it names its schema (migration 15): its search_path is that
-- schema then pg_temp, searched last, and every table it reads is qualified, so no temporary
-- object of the caller's runs with the owner's rights. A caller that is not a member of the
-- owner (the runtime role) gets a cut-off of at most the server's clock less at least a day;
-- the owner passes any `at` and retention (TestEnv's clock moves forward). Rows are found by
-- their ids (`= ANY (array)`, a lookup each; migration 27): a join to the doomed runs let a
-- plan made while the tables were empty walk a whole index for them.
------------------------------------------------------------------------------------------------

DO $migration$
BEGIN
EXECUTE format($fn$
CREATE OR REPLACE FUNCTION %1$I.cyclone_delete_finished(
    retention float8, batch_size integer, at timestamptz
) RETURNS bigint LANGUAGE sql SECURITY DEFINER
SET search_path = %1$I, pg_temp
AS $$
    WITH RECURSIVE trusted AS (
        -- Inside the function current_user is its owner; session_user is who logged in.
        SELECT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') AS owner
    ), cutoff AS (
        SELECT CASE WHEN trusted.owner
                    THEN coalesce(at, pg_catalog.now())
                         - pg_catalog.make_interval(secs => retention)
                    ELSE least(coalesce(at, pg_catalog.now()), pg_catalog.now())
                         - pg_catalog.make_interval(secs => greatest(
                               coalesce(retention, 0), 86400))  -- the floor: one day
               END AS before
          FROM trusted
    ), doomed AS (
        SELECT id FROM (SELECT r.id FROM %1$I.cyclone_runs r, cutoff
                         WHERE r.finished_at < cutoff.before
                           AND r.parent_run_id IS NULL
                         ORDER BY r.finished_at
                         LIMIT batch_size) AS top
        UNION ALL
        SELECT c.id FROM doomed d,
               LATERAL (SELECT r.id FROM %1$I.cyclone_runs r
                         WHERE r.parent_run_id = d.id OFFSET 0) AS c
    ), steps AS (
        DELETE FROM %1$I.cyclone_steps
         WHERE run_id = ANY (ARRAY(SELECT id FROM doomed)) RETURNING id
    ), attempts AS (
        DELETE FROM %1$I.cyclone_step_attempts
         WHERE step_id = ANY (ARRAY(SELECT id FROM steps))
    ), runs AS (
        DELETE FROM %1$I.cyclone_runs
         WHERE id = ANY (ARRAY(SELECT id FROM doomed)) AND parent_run_id IS NULL
        RETURNING 1
    )
    SELECT count(*) FROM runs;
$$
$fn$, current_schema());
END
$migration$;

REVOKE ALL ON FUNCTION cyclone_delete_finished(float8, integer, timestamptz) FROM PUBLIC;

-- Schedules (migration 19): cron or an interval, each tick starting one run of `workflow`.
-- The scanner's `schedules` sweep takes the rows due (due_at <= now, not paused) through
-- cyclone_schedules_due, so a pass costs O(due schedules) whatever the table holds; it starts
-- a tick's run with an idempotency key naming the schedule and the tick (two scanners never
-- start it twice) and moves next_tick_at. docs/schedules.md has the semantics.
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

------------------------------------------------------------------------------------------------
-- History (migration 18): finished runs moved out of the hot tables by the scanner's history
-- sweep (`scanner.history_after`), kept in partitions by time that retention drops whole.
-- Failed runs and runs with an idempotency key stay hot until retention deletes them.
------------------------------------------------------------------------------------------------

-- The partition key of all three tables is `run_ended_at`: when the run's top-level run ended,
-- so that a tree of runs, its steps and its attempts live and die in one partition.
CREATE TABLE cyclone_history_runs (
    id              uuid NOT NULL,
    workflow        text NOT NULL,
    graph_hash      text NOT NULL,
    state           cyclone_run_state NOT NULL,
    input           jsonb NOT NULL,
    output          jsonb,
    idempotency_key text,
    parent_run_id   uuid,
    parent_step_id  bigint,
    created_at      timestamptz NOT NULL,
    deadline_at     timestamptz,
    paused_at       timestamptz,
    finished_at     timestamptz,
    queue           text NOT NULL,
    priority        smallint NOT NULL,
    pass            bigint NOT NULL,
    concurrency_key text,
    concurrency_limit integer,
    run_ended_at    timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_runs_id_idx ON cyclone_history_runs (id);
CREATE INDEX cyclone_history_runs_created_idx ON cyclone_history_runs (created_at, id);

CREATE TABLE cyclone_history_steps (
    id               bigint NOT NULL,
    run_id           uuid NOT NULL,
    workflow         text NOT NULL,
    node             text NOT NULL,
    kind             cyclone_node_kind NOT NULL,
    item_index       integer,
    item             jsonb,
    state            cyclone_step_state NOT NULL,
    attempt          integer NOT NULL,
    max_attempts     integer NOT NULL,
    timeout          interval,
    signal           text,
    available_at     timestamptz NOT NULL,
    due_at           timestamptz,
    leased_by        text,
    child_run_id     uuid,
    output           jsonb,
    error            text,
    error_kind       cyclone_error_kind,
    created_at       timestamptz NOT NULL,
    started_at       timestamptz,
    completed_at     timestamptz,
    priority         smallint NOT NULL,
    pass             bigint NOT NULL,
    node_limit       integer,
    rate_limit       text,
    run_ended_at     timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_steps_run_idx ON cyclone_history_steps (run_id, id);
CREATE INDEX cyclone_history_steps_id_idx ON cyclone_history_steps (id);

CREATE TABLE cyclone_history_attempts (
    id           bigint NOT NULL,
    step_id      bigint NOT NULL,
    run_id       uuid NOT NULL,
    attempt      integer NOT NULL,
    error_kind   cyclone_error_kind NOT NULL,
    error        text,
    worker       text,
    started_at   timestamptz,
    ended_at     timestamptz NOT NULL,
    run_ended_at timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_attempts_step_idx ON cyclone_history_attempts (step_id, id);

-- One row per partition (the same range in all three tables), so that the sweep finds what to
-- create and what to drop without parsing the catalog's partition bounds.
CREATE TABLE cyclone_history_partitions (
    lo         timestamptz PRIMARY KEY,
    hi         timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (hi > lo)
);

-- How far the moves got: the latest end moved. The next batch looks from a little before it,
-- so it does not walk again past the failed and keyed runs that stay behind.
CREATE TABLE cyclone_history_mark (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    moved_to timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO cyclone_history_mark DEFAULT VALUES;

-- The width of a partition for a retention: an eighth of it, between ten seconds and a day, so
-- that history holds at most a ninth more than the retention, in about nine partitions, and
-- retention drops one at a time. 0 (keep forever): a day.
CREATE FUNCTION cyclone_history_span(retention float8) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN coalesce(retention, 0) <= 0 THEN 86400
                ELSE least(greatest(retention / 8, 10), 86400) END
$$;

DO $migration$
BEGIN
EXECUTE format($fn$
-- Make the partitions that hold ends from `from_at` to `to_at` (aligned on the span from the
-- epoch), around any that exist (a retention changed since). Returns how many it made. The
-- history_drop sweep makes the next ones ahead, in a transaction of their own, so that a move
-- seldom makes one (making one locks history's tables, readers included, to its commit). A
-- caller that is not the owner makes none past two spans from now, nor before the retention.
CREATE FUNCTION %1$I.cyclone_history_ensure(retention float8, from_at timestamptz,
                                            to_at timestamptz)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    span float8 := %1$I.cyclone_history_span(retention);
    slot float8;
    a timestamptz;
    b timestamptz;
    made integer := 0;
    suffix text;
    t text;
BEGIN
    IF NOT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        to_at := least(to_at, pg_catalog.now() + pg_catalog.make_interval(secs => 2 * span));
        IF coalesce(retention, 0) > 0 THEN
            from_at := greatest(from_at, pg_catalog.now() - pg_catalog.make_interval(
                secs => greatest(retention, 86400) + span));
        END IF;
    END IF;
    slot := pg_catalog.floor(extract(epoch FROM from_at) / span) * span;
    WHILE pg_catalog.to_timestamp(slot) <= to_at LOOP
        a := pg_catalog.to_timestamp(slot);
        b := pg_catalog.to_timestamp(slot + span);
        SELECT coalesce(max(p.hi), a) INTO a FROM %1$I.cyclone_history_partitions p
         WHERE p.lo <= a AND p.hi > a;
        SELECT coalesce(min(p.lo), b) INTO b FROM %1$I.cyclone_history_partitions p
         WHERE p.lo > a AND p.lo < b;
        IF a < b THEN
            suffix := pg_catalog.to_char(a AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
            FOREACH t IN ARRAY ARRAY['runs', 'steps', 'attempts'] LOOP
                EXECUTE pg_catalog.format(
                    'CREATE TABLE %%I.%%I PARTITION OF %%I.%%I FOR VALUES FROM (%%L) TO (%%L)',
                    '%1$s', pg_catalog.concat_ws('_', 'cyclone', 'history', t, suffix),
                    '%1$s', pg_catalog.concat_ws('_', 'cyclone', 'history', t), a, b);
            END LOOP;
            INSERT INTO %1$I.cyclone_history_partitions (lo, hi) VALUES (a, b);
            made := made + 1;
        END IF;
        slot := slot + span;
    END LOOP;
    RETURN made;
END
$$;

-- Move up to batch_size finished top-level runs that ended more than `tail` seconds before `at`
-- (and, with a retention, less than the retention ago: older ones are retention's), with their
-- child runs, steps and attempts, into history; one statement, so a reader sees a run either
-- here or there. Returns the number of top-level runs moved.
CREATE FUNCTION %1$I.cyclone_history_move(tail float8, retention float8, batch_size integer,
                                          at timestamptz)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    now_at timestamptz := coalesce(at, pg_catalog.now());
    mark timestamptz;
    from_at timestamptz;
    ids uuid[];
    ends timestamptz[];
    first_end timestamptz;
    last_end timestamptz;
BEGIN
    -- Who is not the owner moves only what ended before the server's clock says.
    IF NOT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        now_at := least(now_at, pg_catalog.now());
    END IF;
    -- One mover at a time: a second scanner waits here for one batch, then moves the next.
    SELECT m.moved_to INTO mark FROM %1$I.cyclone_history_mark m FOR UPDATE;
    -- Five minutes before the mark: a run whose end committed later than that stays hot until
    -- retention deletes it (it is only not moved).
    from_at := greatest(mark - interval '5 minutes',
                        CASE WHEN coalesce(retention, 0) > 0
                             THEN now_at - pg_catalog.make_interval(secs => retention)
                             ELSE '-infinity' END);
    SELECT pg_catalog.array_agg(d.id ORDER BY d.finished_at),
           pg_catalog.array_agg(d.finished_at ORDER BY d.finished_at),
           min(d.finished_at), max(d.finished_at)
      INTO ids, ends, first_end, last_end
      FROM (SELECT r.id, r.finished_at FROM %1$I.cyclone_runs r
             WHERE r.finished_at >= from_at
               AND r.finished_at < now_at - pg_catalog.make_interval(secs => tail)
               AND r.parent_run_id IS NULL AND r.idempotency_key IS NULL
               AND r.state IN ('completed', 'cancelled')
             ORDER BY r.finished_at
             LIMIT batch_size
               FOR UPDATE SKIP LOCKED) AS d;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM %1$I.cyclone_history_ensure(retention, first_end, last_end);
    WITH RECURSIVE tree AS (
        SELECT t.id, t.ended FROM ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(ends)) AS t (id, ended)
        UNION ALL
        SELECT r.id, tree.ended FROM %1$I.cyclone_runs r JOIN tree ON r.parent_run_id = tree.id
    ), runs_out AS (
        DELETE FROM %1$I.cyclone_runs r USING tree WHERE r.id = tree.id
        RETURNING r.*, tree.ended
    ), runs_in AS (
        INSERT INTO %1$I.cyclone_history_runs
               (id, workflow, graph_hash, state, input, output, idempotency_key, parent_run_id,
                parent_step_id, created_at, deadline_at, paused_at, finished_at, queue,
                priority, pass, concurrency_key, concurrency_limit, run_ended_at)
        SELECT id, workflow, graph_hash, state, input, output, idempotency_key, parent_run_id,
               parent_step_id, created_at, deadline_at, paused_at, finished_at, queue,
               priority, pass, concurrency_key, concurrency_limit, ended
          FROM runs_out
    ), steps_out AS (
        DELETE FROM %1$I.cyclone_steps s USING tree WHERE s.run_id = tree.id
        RETURNING s.*, tree.ended
    ), steps_in AS (
        INSERT INTO %1$I.cyclone_history_steps
               (id, run_id, workflow, node, kind, item_index, item, state, attempt,
                max_attempts, timeout, signal, available_at, due_at, leased_by, child_run_id,
                output, error, error_kind, created_at, started_at, completed_at, priority, pass,
                node_limit, rate_limit, run_ended_at)
        SELECT id, run_id, workflow, node, kind, item_index, item, state, attempt,
               max_attempts, timeout, signal, available_at, due_at, leased_by, child_run_id,
               output, error, error_kind, created_at, started_at, completed_at, priority, pass,
               node_limit, rate_limit, ended
          FROM steps_out
    ), attempts_out AS (
        DELETE FROM %1$I.cyclone_step_attempts a USING steps_out s WHERE a.step_id = s.id
        RETURNING a.*, s.ended
    )
    INSERT INTO %1$I.cyclone_history_attempts
           (id, step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at,
            run_ended_at)
    SELECT id, step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at, ended
      FROM attempts_out;
    UPDATE %1$I.cyclone_history_mark SET moved_to = greatest(moved_to, last_end);
    RETURN pg_catalog.cardinality(ids);
END
$$;

-- Drop the partition that starts at `lo` if all of it is past the retention (for a caller that
-- is not the owner: past a day at least, on the server's clock, as for
-- cyclone_delete_finished). Returns whether it dropped it. It waits at most 100 ms for the
-- readers of history (while it waits, new readers queue behind it), then gives up until the
-- next pass.
CREATE FUNCTION %1$I.cyclone_history_drop(retention float8, at timestamptz, part_lo timestamptz)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    cutoff timestamptz;
    part record;
    suffix text;
    t text;
BEGIN
    IF coalesce(retention, 0) <= 0 THEN
        RETURN false;
    END IF;
    IF pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        cutoff := coalesce(at, pg_catalog.now()) - pg_catalog.make_interval(secs => retention);
    ELSE
        cutoff := least(coalesce(at, pg_catalog.now()), pg_catalog.now())
                  - pg_catalog.make_interval(secs => greatest(retention, 86400));
    END IF;
    SELECT p.lo, p.hi INTO part FROM %1$I.cyclone_history_partitions p
     WHERE p.lo = part_lo AND p.hi <= cutoff FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    suffix := pg_catalog.to_char(part.lo AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
    FOREACH t IN ARRAY ARRAY['attempts', 'steps', 'runs'] LOOP
        EXECUTE pg_catalog.format('DROP TABLE IF EXISTS %%I.%%I', '%1$s',
                                  pg_catalog.concat_ws('_', 'cyclone', 'history', t, suffix));
    END LOOP;
    DELETE FROM %1$I.cyclone_history_partitions p WHERE p.lo = part.lo;
    RETURN true;
END
$$;
$fn$, current_schema());
END
$migration$;

REVOKE ALL ON FUNCTION cyclone_history_ensure(float8, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION cyclone_history_move(float8, float8, integer, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION cyclone_history_drop(float8, timestamptz, timestamptz) FROM PUBLIC;
-- Waking (migration 22): a step made ready notifies cyclone_ready while a supervisor waits for
-- work (cyclone_wake_ready at 1, cleared by the first writer that finds it set); a time that
-- comes due within a minute, earlier than the scanner means to wake (cyclone_wake_timer, epoch
-- milliseconds), notifies cyclone_timer.
------------------------------------------------------------------------------------------------

CREATE SEQUENCE cyclone_wake_ready MINVALUE 0 MAXVALUE 1 START 0 NO CYCLE;
SELECT setval('cyclone_wake_ready', 0, true);
CREATE SEQUENCE cyclone_wake_timer MINVALUE 0 START 0 NO CYCLE;
SELECT setval('cyclone_wake_timer', 0, true);

-- A time as the triggers compare it with cyclone_wake_timer.
CREATE FUNCTION cyclone_epoch_ms(at timestamptz) RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT (extract(epoch FROM at) * 1000)::bigint
$$;

-- Wait until every transaction in progress now has ended, at most `most` seconds: one that
-- read the flag (or the scanner's time) before it was set commits first. Returns whether all did.
CREATE FUNCTION cyclone_wake_settle(most float8) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
    busy xid8[] := ARRAY(SELECT pg_snapshot_xip(pg_current_snapshot()));
    until timestamptz := clock_timestamp() + make_interval(secs => most);
BEGIN
    LOOP
        busy := ARRAY(SELECT x FROM unnest(busy) AS x
                       WHERE x <> pg_current_xact_id_if_assigned()
                         AND pg_xact_status(x) = 'in progress');
        IF cardinality(busy) = 0 THEN
            RETURN true;
        END IF;
        IF clock_timestamp() >= until THEN
            RETURN false;
        END IF;
        PERFORM pg_sleep(0.0005);
    END LOOP;
END
$$;

-- A supervisor waits for ready steps; returns once a step made ready before is committed, so
-- that its next look finds it (settled within `most` seconds).
CREATE FUNCTION cyclone_wake_arm(most float8) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
    PERFORM setval('cyclone_wake_ready', 1, true);
    RETURN cyclone_wake_settle(most);
END
$$;

-- Wake a waiting supervisor, if one waits (the scanner calls it too, as a retry comes due).
CREATE FUNCTION cyclone_wake_ready() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF pg_sequence_last_value('cyclone_wake_ready') = 1 THEN
        PERFORM setval('cyclone_wake_ready', 0, true);
        PERFORM pg_notify('cyclone_ready', '');
    END IF;
END
$$;

-- The scanner sleeps until the next time due (cyclone_next_due): it writes it, waits for the
-- transactions in progress (one may have set an earlier time and found the old one), looks
-- again; returns how long from now, in seconds.
CREATE FUNCTION cyclone_wake_timer_set(horizon float8, since timestamptz, most float8)
RETURNS float8 LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz := cyclone_next_due(horizon, since);
BEGIN
    PERFORM setval('cyclone_wake_timer', cyclone_epoch_ms(at), true);
    PERFORM cyclone_wake_settle(most);
    at := least(at, cyclone_next_due(horizon, since));
    PERFORM setval('cyclone_wake_timer', cyclone_epoch_ms(at), true);
    RETURN greatest(extract(epoch FROM at - now()), 0)::float8;
END
$$;

-- Wake the scanner for `at` (the triggers call it only when it sleeps past it).
CREATE FUNCTION cyclone_wake_timer(at timestamptz) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    PERFORM setval('cyclone_wake_timer', cyclone_epoch_ms(at), true);
    PERFORM pg_notify('cyclone_timer', '');
END
$$;

-- The earliest time after `since`, within `horizon` seconds of now, at which something comes
-- due that the scanner or a lease acts on: a step's retry or token, a sleep or max_wait, a live
-- run's deadline, a schedule's tick. Each is the first entry of an index past `since` (NULL:
-- nothing that soon). `since` is when the scanner's last pass began: what came due before was
-- that pass's to handle, and what it left (a paused run's sleep, a row another scanner held)
-- must not have the scanner wake again at once; what came due during the pass is due now.
CREATE FUNCTION cyclone_next_due(horizon float8, since timestamptz) RETURNS timestamptz
LANGUAGE plpgsql STABLE AS $$
DECLARE
    after timestamptz := coalesce(since, now());
BEGIN
    -- PL/pgSQL, not SQL: the scanner calls it at every sleep, and its plans are kept for
    -- the session instead of made anew at each call.
    RETURN least(
        -- In cyclone_steps_available_idx's order: a generic plan of min() walked the whole
        -- cyclone_steps_ready_idx instead (its last column is available_at too).
        (SELECT available_at FROM cyclone_steps
          WHERE state = 'available' AND available_at > after ORDER BY available_at, id LIMIT 1),
        (SELECT min(due_at) FROM cyclone_steps
          WHERE state = 'waiting' AND due_at IS NOT NULL AND due_at > after),
        (SELECT min(deadline_at) FROM cyclone_runs
          WHERE state = 'running' AND deadline_at > after),
        (SELECT min(deadline_at) FROM cyclone_runs
          WHERE queued AND paused_at IS NULL AND deadline_at IS NOT NULL AND deadline_at > after),
        (SELECT min(due_at) FROM cyclone_schedules WHERE NOT paused AND due_at > after),
        (SELECT min(next_at) FROM cyclone_rate_buckets WHERE next_at > after),
        now() + make_interval(secs => horizon));
END
$$;

------------------------------------------------------------------------------------------------
-- Views: the read-only face for dashboards and ad-hoc queries (docs/sql.md)
------------------------------------------------------------------------------------------------

-- Steps, without payloads (item, output, lease token), with every failed attempt, oldest
-- first; hot and in history (a run is in exactly one of the two).
CREATE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, s.lease_expires_at, s.leased_by, s.child_run_id,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt', a.attempt, 'error_kind', a.error_kind, 'error', a.error,
                   'worker', a.worker, 'started_at', a.started_at, 'ended_at', a.ended_at)
                   ORDER BY a.id), '[]'::jsonb)
          FROM cyclone_step_attempts a WHERE a.step_id = s.id) AS attempts
  FROM cyclone_steps s
UNION ALL
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, NULL::timestamptz, s.leased_by, s.child_run_id,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt', a.attempt, 'error_kind', a.error_kind, 'error', a.error,
                   'worker', a.worker, 'started_at', a.started_at, 'ended_at', a.ended_at)
                   ORDER BY a.id), '[]'::jsonb)
          FROM cyclone_history_attempts a WHERE a.step_id = s.id)
  FROM cyclone_history_steps s;

CREATE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_steps s WHERE s.run_id = r.id) AS steps_total,
       (SELECT count(*) FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state = 'completed') AS steps_completed
  FROM cyclone_runs r
UNION ALL
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_history_steps s WHERE s.run_id = r.id),
       (SELECT count(*) FROM cyclone_history_steps s
         WHERE s.run_id = r.id AND s.state = 'completed')
  FROM cyclone_history_runs r;
