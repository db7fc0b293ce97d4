-- Version 14: flow control, part one: queues, priorities, fair leasing, and runs per key.
--
-- A workflow names its queue and its default priority (cyclone_workflows, at registration); a
-- run takes both at submit (a submit may give its own priority), and its steps carry the
-- priority and a fairness pass. Steps are leased in (priority, pass, id) order: priority 1
-- first; among one priority, by pass. A run's pass is its place in a start-time fair queue
-- (docs/flow-control.md): the queue's clock (cyclone_queues.pass, the largest pass in service,
-- kept by the fair_clock sweep) or, when its group (workflow and concurrency key) already has
-- live runs, one past the group's last, whichever is later. A backlog of one group therefore
-- holds passes far ahead of the clock, and a run of another group submitted meanwhile lands
-- near the head of the line instead of behind the backlog. A map's items take their fan-out's
-- pass plus their index: a big fan-out spreads over passes and interleaves with other runs.

ALTER TABLE cyclone_workflows
    ADD COLUMN queue text NOT NULL DEFAULT 'default',
    ADD COLUMN priority smallint NOT NULL DEFAULT 3,
    ADD COLUMN concurrency_field text,
    ADD COLUMN concurrency_limit integer;

ALTER TABLE cyclone_runs
    ADD COLUMN queue text NOT NULL DEFAULT 'default',
    ADD COLUMN priority smallint NOT NULL DEFAULT 3,
    ADD COLUMN pass bigint NOT NULL DEFAULT 0,
    ADD COLUMN concurrency_key text,
    ADD COLUMN concurrency_limit integer,
    ADD COLUMN queued boolean NOT NULL DEFAULT false;

ALTER TABLE cyclone_steps
    ADD COLUMN priority smallint NOT NULL DEFAULT 3,
    ADD COLUMN pass bigint NOT NULL DEFAULT 0,
    ADD COLUMN node_limit integer,
    ADD COLUMN rate_limit text,
    ADD COLUMN held boolean NOT NULL DEFAULT false;

-- One row per queue a registered workflow names; `pass` is the queue's fair clock.
CREATE TABLE cyclone_queues (
    name       text PRIMARY KEY,
    pass       bigint NOT NULL DEFAULT 0,
    created_at timestamptz NOT NULL DEFAULT now()
);
INSERT INTO cyclone_queues (name) VALUES ('default');

-- The lease order. available_at is the last key column so that steps not yet due (a retry in
-- its backoff) are passed over inside the index, without a visit to the table.
CREATE INDEX cyclone_steps_ready_idx ON cyclone_steps (priority, pass, id, available_at)
    WHERE state = 'available';

-- A group's last pass among its live runs, at submit.
CREATE INDEX cyclone_runs_fair_idx
    ON cyclone_runs (workflow, (coalesce(concurrency_key, '')), queued, pass)
    WHERE pass > 0;

DROP FUNCTION cyclone_lease_candidate(boolean, uuid, timestamptz, text[], timestamptz, bigint);
DROP FUNCTION cyclone_lease_candidates(integer, uuid[], timestamptz, text[], timestamptz, bigint);

CREATE FUNCTION cyclone_lease_candidate(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint
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
     WHERE go AND s.state = 'available'
       AND s.run_id IS DISTINCT FROM other_than
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.priority, s.pass, s.id
     LIMIT 1
       FOR UPDATE OF s SKIP LOCKED
$$;

CREATE FUNCTION cyclone_lease_candidates(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint
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
     WHERE want > 0 AND s.state = 'available'
       AND NOT (s.run_id = ANY (coalesce(other_than, '{}')))
       AND s.available_at <= at
       AND (s.priority, s.pass, s.id)
           > (coalesce(after_priority, 0), coalesce(after_pass, -1), coalesce(after_id, 0))
       AND (workflows IS NULL OR s.workflow = ANY(workflows))
       AND r.state = 'running'
       AND (r.deadline_at IS NULL OR r.deadline_at > at)
     ORDER BY s.priority, s.pass, s.id
     LIMIT greatest(want, 0)
       FOR UPDATE OF s SKIP LOCKED
$$;

-- Runs per key (cyclone_admit below).
ALTER DOMAIN cyclone_run_state DROP CONSTRAINT cyclone_run_state_check;
ALTER DOMAIN cyclone_run_state ADD CONSTRAINT cyclone_run_state_check
    CHECK (VALUE IN ('queued', 'running', 'paused', 'completed', 'failed', 'cancelled'));

-- Queued runs of a key, in the order they are admitted; and their deadlines, for the sweep.
CREATE INDEX cyclone_runs_queued_idx
    ON cyclone_runs (workflow, concurrency_key, priority, created_at, pass, id)
    WHERE state = 'queued';
-- (Not by state: the admission's index would answer that too, and a planner that took it
-- sorted every queued run by deadline for each sweep. A queued run that is not paused.)
CREATE INDEX cyclone_runs_queued_deadline_idx ON cyclone_runs (deadline_at)
    WHERE queued AND paused_at IS NULL AND deadline_at IS NOT NULL;

-- A map whose items exceed its max_items fails its step with a kind of its own.
ALTER DOMAIN cyclone_error_kind DROP CONSTRAINT cyclone_error_kind_check;
ALTER DOMAIN cyclone_error_kind ADD CONSTRAINT cyclone_error_kind_check
    CHECK (VALUE IN ('error', 'timeout', 'crashed', 'lease_expired', 'deadline', 'max_wait',
                     'child_failed', 'cancelled', 'too_many_items'));



-- A run's pass is negative once it ended (and positive again if the DLQ re-drives it): the
-- lookups of a group's live runs at submit and admission test `pass > 0` alone, which no index
-- of run states can answer, so the planner cannot walk cyclone_runs_live_idx for them (it did,
-- on statistics of a drained history, reading every live run for each submit).
CREATE FUNCTION cyclone_runs_pass_sign() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    NEW.pass := CASE WHEN NEW.state IN ('completed', 'failed', 'cancelled') THEN -abs(NEW.pass)
                     ELSE abs(NEW.pass) END;
    RETURN NEW;
END
$$;

CREATE TRIGGER cyclone_runs_pass_sign BEFORE UPDATE OF state ON cyclone_runs
    FOR EACH ROW
    WHEN ((OLD.state IN ('completed', 'failed', 'cancelled'))
          IS DISTINCT FROM (NEW.state IN ('completed', 'failed', 'cancelled')))
    EXECUTE FUNCTION cyclone_runs_pass_sign();

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
    SELECT pg_advisory_xact_lock(hashtextextended('cyclone_slot:' || workflow || chr(31) || ckey, 0))
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
BEGIN
    PERFORM cyclone_admit(NEW.workflow, NEW.concurrency_key, NEW.concurrency_limit, now());
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_slot_freed AFTER UPDATE OF state ON cyclone_runs
    FOR EACH ROW
    WHEN (OLD.state IN ('running', 'paused') AND NOT OLD.queued
          AND NEW.state IN ('completed', 'failed', 'cancelled')
          AND NEW.concurrency_limit IS NOT NULL)
    EXECUTE FUNCTION cyclone_runs_free_slot();

------------------------------------------------------------------------------------------------
-- Steps of limited nodes: `concurrency=N` on a node (at most N of its steps available or
-- running at once, across every VM) and `rate_limit` (one token of a bucket per attempt). Such
-- a step is made `waiting` with `held` set, out of the lease index, so that no lease walks
-- over it; cyclone_admit_steps makes it available when a slot and a token are free. A token
-- not yet refilled is given ahead of time: the step becomes available at the moment its token
-- refills (available_at), at most RATE_HORIZON ahead, and the held_steps sweep gives the next
-- ones. Admission runs when a step is made, when a limited step stops holding its slot, and in
-- that sweep; it takes the node's advisory lock without waiting (a transaction that holds it
-- admits; one that does not leaves the rest to the sweep), and bucket rows with SKIP LOCKED,
-- so no admission ever waits for another: nothing here can deadlock the statements that fire it.
------------------------------------------------------------------------------------------------

-- A limiter: `rate` tokens every `per` seconds, at most `burst` saved up (client.set_rate_limit).
CREATE TABLE cyclone_rate_limits (
    name       text PRIMARY KEY,
    rate       float8 NOT NULL,
    per        float8 NOT NULL,
    burst      float8 NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);

-- A limiter's buckets: one, or one per key (`RateLimit(name, key=FIELD)`). Tokens below zero
-- are tokens given ahead of their refill.
CREATE TABLE cyclone_rate_buckets (
    name       text NOT NULL,
    key        text NOT NULL,
    tokens     float8 NOT NULL,
    updated_at timestamptz NOT NULL,
    PRIMARY KEY (name, key)
);

-- Steps of a limited node that hold a slot (counted), and held steps in the order admitted.
CREATE INDEX cyclone_steps_limited_idx ON cyclone_steps (workflow, node)
    WHERE node_limit IS NOT NULL AND state IN ('available', 'running');
CREATE INDEX cyclone_steps_held_idx ON cyclone_steps (workflow, node, priority, pass, id)
    WHERE held;

-- The input field a rate-limited node's bucket key is read from (NULL: one bucket).
CREATE FUNCTION cyclone_node_rate_key(graph_hash text, node text) RETURNS text
LANGUAGE sql STABLE AS $$
    SELECT n->>'rate_key'
      FROM cyclone_graphs g, jsonb_array_elements(g.graph->'nodes') AS n
     WHERE g.hash = graph_hash AND n->>'name' = node
$$;

CREATE FUNCTION cyclone_admit_steps(wf text, nd text, at timestamptz) RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    horizon CONSTANT float8 := 2.0;  -- RATE_HORIZON: how far ahead a token may be given
    batch CONSTANT integer := 200;   -- most steps one call admits
    lim integer;
    free integer;
    admitted integer := 0;
    st record;
    lim_row cyclone_rate_limits%ROWTYPE;
    bucket cyclone_rate_buckets%ROWTYPE;
    bkey text;
    keyfield text;
    keyed_graph text;
    wait float8;
    full_keys text[] := '{}';
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtextextended('cyclone_node:' || wf || chr(31) || nd, 0))
    THEN
        RETURN 0;
    END IF;
    SELECT s.node_limit INTO lim FROM cyclone_steps s
     WHERE s.held AND s.workflow = wf AND s.node = nd LIMIT 1;
    free := batch;
    IF lim IS NOT NULL THEN
        SELECT lim - count(*) INTO free FROM cyclone_steps s
         WHERE s.workflow = wf AND s.node = nd AND s.node_limit IS NOT NULL
           AND s.state IN ('available', 'running');
        free := least(free, batch);
    END IF;
    IF free <= 0 THEN
        RETURN 0;
    END IF;
    FOR st IN
        SELECT s.id, s.rate_limit, s.available_at, s.run_id, r.graph_hash, r.input
          FROM cyclone_steps s JOIN cyclone_runs r ON r.id = s.run_id
         WHERE s.held AND s.workflow = wf AND s.node = nd
         ORDER BY s.priority, s.pass, s.id
         LIMIT batch
           FOR UPDATE OF s SKIP LOCKED
    LOOP
        EXIT WHEN free <= 0;
        wait := 0;
        IF st.rate_limit IS NOT NULL THEN
            IF st.graph_hash IS DISTINCT FROM keyed_graph THEN  -- one graph read per graph
                keyfield := cyclone_node_rate_key(st.graph_hash, nd);
                keyed_graph := st.graph_hash;
            END IF;
            bkey := CASE WHEN keyfield IS NULL THEN '' ELSE coalesce(st.input->>keyfield, '') END;
            CONTINUE WHEN bkey = ANY (full_keys);
            SELECT * INTO lim_row FROM cyclone_rate_limits WHERE name = st.rate_limit;
            IF NOT FOUND THEN
                -- An undeclared limiter holds its steps until client.set_rate_limit names it.
                full_keys := full_keys || bkey;
                CONTINUE;
            END IF;
            SELECT * INTO bucket FROM cyclone_rate_buckets
             WHERE name = st.rate_limit AND key = bkey FOR UPDATE SKIP LOCKED;
            IF NOT FOUND THEN
                -- A bucket's first token (or one another admission holds: then, next time).
                INSERT INTO cyclone_rate_buckets (name, key, tokens, updated_at)
                VALUES (st.rate_limit, bkey, lim_row.burst, at)
                ON CONFLICT (name, key) DO NOTHING;
                SELECT * INTO bucket FROM cyclone_rate_buckets
                 WHERE name = st.rate_limit AND key = bkey FOR UPDATE SKIP LOCKED;
            END IF;
            IF NOT FOUND THEN
                full_keys := full_keys || bkey;
                CONTINUE;
            END IF;
            -- Refill, then take one token: now if there is one, else when it refills.
            bucket.tokens := least(lim_row.burst, bucket.tokens
                + greatest(extract(epoch FROM at - bucket.updated_at), 0)
                  * lim_row.rate / lim_row.per);
            wait := greatest(1 - bucket.tokens, 0) * lim_row.per / lim_row.rate;
            IF wait > horizon THEN
                UPDATE cyclone_rate_buckets SET tokens = bucket.tokens, updated_at = at
                 WHERE name = st.rate_limit AND key = bkey;
                full_keys := full_keys || bkey;
                CONTINUE;
            END IF;
            UPDATE cyclone_rate_buckets SET tokens = bucket.tokens - 1, updated_at = at
             WHERE name = st.rate_limit AND key = bkey;
        END IF;
        UPDATE cyclone_steps
           SET state = 'available', held = false,
               available_at = greatest(st.available_at, at + make_interval(secs => wait))
         WHERE id = st.id;
        free := free - 1;
        admitted := admitted + 1;
    END LOOP;
    RETURN admitted;
END
$$;

-- Held steps by node, counted up to `cap` (the metrics' cyclone_steps_throttled), by a walk of
-- cyclone_steps_held_idx in its order: grouped without a sort, whatever the statistics say.
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
$$;

-- A new step of a limited node is held until admitted; so is one made available again other
-- than by a planned stop giving it back: a retry of a rate-limited step (each attempt takes a
-- token) and a step re-driven from the DLQ. A step that keeps its slot (a retry of a node
-- limited by concurrency only) is not.
CREATE FUNCTION cyclone_steps_hold() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT'
       OR (OLD.state <> 'running' AND OLD.state <> 'available')
       OR (OLD.state = 'running' AND NEW.attempt >= OLD.attempt AND NEW.rate_limit IS NOT NULL)
    THEN
        NEW.state := 'waiting';
        NEW.held := true;
    END IF;
    RETURN NEW;
END
$$;

CREATE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM cyclone_admit_steps(NEW.workflow, NEW.node, now());
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_steps_hold BEFORE INSERT ON cyclone_steps
    FOR EACH ROW
    WHEN (NEW.state = 'available' AND (NEW.node_limit IS NOT NULL OR NEW.rate_limit IS NOT NULL))
    EXECUTE FUNCTION cyclone_steps_hold();
CREATE TRIGGER cyclone_steps_hold_again BEFORE UPDATE OF state ON cyclone_steps
    FOR EACH ROW
    WHEN (NEW.state = 'available' AND OLD.state <> 'available' AND NOT OLD.held
          AND (NEW.node_limit IS NOT NULL OR NEW.rate_limit IS NOT NULL))
    EXECUTE FUNCTION cyclone_steps_hold();
CREATE TRIGGER cyclone_steps_held AFTER INSERT ON cyclone_steps
    FOR EACH ROW WHEN (NEW.held)
    EXECUTE FUNCTION cyclone_steps_admit();
-- A step that held a slot let it go (ended, parked, or held again for a token).
CREATE TRIGGER cyclone_steps_slot_freed AFTER UPDATE OF state ON cyclone_steps
    FOR EACH ROW
    WHEN (OLD.node_limit IS NOT NULL AND OLD.state IN ('available', 'running')
          AND NEW.state NOT IN ('available', 'running'))
    EXECUTE FUNCTION cyclone_steps_admit();
