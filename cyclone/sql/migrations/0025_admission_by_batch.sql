-- Version 25: admitting held steps costs a statement per bucket and one per call instead of
-- four a step, a freed slot looks at most at 16 index entries, and a held step that ends
-- unadmitted stops being held.
--
-- With limits declared and none binding (a node limit of 64, a rate limit far above the
-- drain, a per-key run limit no key reaches: bench/instructions.py --declared), a step cost
-- 1,862k server instructions against 1,174k without limits. By function (--keep), 340k of the
-- 690k were the admission loop (for each admitted step: the limiter's row, its bucket's row
-- locked, the bucket written, the step written, each a statement) and 130k the count of the
-- node's slots in use at every freed slot, a walk of every available and running step of the
-- node (up to its limit, 64) with a visit to each row. Now:
--
--   * a freed slot first counts the node's available steps up to 16, through the slot index
--     keyed by state (rebuilt below), before taking the node's lock; only with fewer does it
--     count the slots in use and admit;
--   * admission walks the held steps in lease order (skipping rows another transaction
--     holds), takes each bucket's tokens in memory (its row read, locked and written once a
--     call), and admits the steps it picked in one statement, which clears `held` alone: the
--     rules' trigger makes such a step available, so the trigger on UPDATE OF state, which
--     looks for a slot let go, no longer fires for each step admitted;
--   * the run's row is read for a rate-limited step only (its bucket key);
--   * the admission triggers call their function in an assignment, which PL/pgSQL evaluates
--     as a simple expression, where PERFORM ran a query for every row.
--
-- A held step whose run was cancelled or failed (or whose deadline passed) kept `held`: the
-- next admission of its node picked it and made it available with its completed_at set, which
-- the rules refuse, so every later end of a step of that node failed; and a DLQ retry of it
-- skipped the hold. The rules now clear `held` when a step leaves `waiting`, and the rows
-- already in that state are mended here.

UPDATE cyclone_steps SET held = false WHERE held AND state <> 'waiting';

DROP INDEX cyclone_steps_limited_idx;
CREATE INDEX cyclone_steps_limited_idx ON cyclone_steps (workflow, node, state, pass)
    WHERE node_limit IS NOT NULL AND state IN ('available', 'running');

CREATE OR REPLACE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- PL/pgSQL compiles a test the first time a transaction reaches it, and the cost grows
    -- with its size: so each step starts with a small test that the hot path fails (a lease and
    -- a completion make no step available or waiting), and the larger ones sit behind it.
    IF NEW.state = 'available' OR NEW.state = 'waiting' THEN
        -- A step of a limited node made available waits, held, until admitted: a new one, and
        -- one made available again other than by a planned stop giving it back (a retry of a
        -- rate-limited step takes a token per attempt; a DLQ retry takes a slot anew). A retry
        -- of a node limited by concurrency only keeps its slot.
        IF NEW.node_limit IS NOT NULL OR NEW.rate_limit IS NOT NULL THEN
            IF NEW.state = 'available'
               AND (TG_OP = 'INSERT'
                    OR (OLD.state <> 'available' AND NOT OLD.held
                        AND (OLD.state <> 'running'
                             OR (NEW.attempt >= OLD.attempt AND NEW.rate_limit IS NOT NULL))))
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
    ELSIF NEW.held THEN
        -- A held step that ends unadmitted (its run cancelled or failed, a deadline) waits for
        -- nothing any more: admission would make it available again, ended, and a DLQ retry
        -- would skip the hold.
        NEW.held := false;
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

CREATE OR REPLACE FUNCTION cyclone_admit_steps(wf text, nd text, at timestamptz, lim_hint integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    horizon CONSTANT float8 := 2.0;  -- RATE_HORIZON: how far ahead a token may be given
    batch CONSTANT integer := 200;   -- most held steps one call reads, and admits
    enough CONSTANT integer := 16;   -- available steps of the node that make admitting wait
    lim integer := lim_hint;
    free integer := batch;
    admitted integer;
    st record;
    -- (Set when the walk starts: a default is evaluated at every call, and most calls, for a
    -- freed slot, end at the first test.)
    ids bigint[];
    waits float8[];
    -- The buckets this call met, by `name || chr(31) || key`: tokens left after its takes and
    -- seconds a token (NULL: it gives nothing this call: its limiter is undeclared, or another
    -- admission holds its row), and `open` false once its next token is past the horizon.
    b_id text[];
    b_name text[];
    b_key text[];
    b_tokens float8[];
    b_secs float8[];
    b_open boolean[];
    b integer;
    bkey text;
    keyfield text;
    keyed_graph text;
    wait float8;
    lim_row cyclone_rate_limits%ROWTYPE;
    bucket cyclone_rate_buckets%ROWTYPE;
BEGIN
    IF lim IS NULL THEN
        SELECT s.node_limit INTO lim FROM cyclone_steps s
         WHERE s.held AND s.workflow = wf AND s.node = nd LIMIT 1;
    END IF;
    -- While `enough` of the node's steps are available, the workers have work the limit does
    -- not hold back: a freed slot waits, and is filled with the others in one admission once
    -- fewer are available. A walk of at most `enough` entries, before the lock, ends most calls
    -- for a freed slot. (With a limit of `enough` or less, that many available leave no slot.)
    -- In pass order, which cyclone_steps_limited_idx alone gives: with a bare LIMIT, statistics
    -- that promised many such steps led the planner to scan the table, or the primary key,
    -- hoping to stop early, and it read every step when fewer than `enough` were there. From
    -- the last pass: the entries leased steps leave until VACUUM are at the first passes
    -- (steps are admitted and leased in pass order), and a walk from there read them all.
    IF lim > enough THEN
        IF (SELECT count(*) FROM (SELECT 1 FROM cyclone_steps s
                                   WHERE s.workflow = wf AND s.node = nd
                                     AND s.node_limit IS NOT NULL AND s.state = 'available'
                                   ORDER BY s.pass DESC
                                   LIMIT enough) AS ready) >= enough THEN
            RETURN 0;
        END IF;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended('cyclone_node:' || wf || chr(31) || nd, 0))
    THEN
        RETURN 0;
    END IF;
    IF lim IS NOT NULL THEN
        SELECT lim - count(*) INTO free FROM cyclone_steps s
         WHERE s.workflow = wf AND s.node = nd AND s.node_limit IS NOT NULL
           AND s.state IN ('available', 'running');
        IF free <= 0 THEN
            RETURN 0;
        END IF;
        free := least(free, batch);
    END IF;
    ids := '{}';
    waits := '{}';
    b_id := '{}';
    b_name := '{}';
    b_key := '{}';
    b_tokens := '{}';
    b_secs := '{}';
    b_open := '{}';
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
                    IF FOUND THEN  -- refilled to now
                        b_tokens[b] := least(lim_row.burst, bucket.tokens
                            + greatest(extract(epoch FROM at - bucket.updated_at), 0)
                              * lim_row.rate / lim_row.per);
                        b_secs[b] := lim_row.per / lim_row.rate;
                    END IF;
                END IF;
            END IF;
            CONTINUE WHEN b_secs[b] IS NULL OR NOT b_open[b];
            -- One token: now if there is one, else when it refills.
            wait := greatest(1 - b_tokens[b], 0) * b_secs[b];
            IF wait > horizon THEN
                b_open[b] := false;
                CONTINUE;
            END IF;
            b_tokens[b] := b_tokens[b] - 1;
        END IF;
        ids := ids || st.id;
        waits := waits || wait;
        EXIT WHEN cardinality(ids) >= free;
    END LOOP;
    FOR b IN 1 .. cardinality(b_id) LOOP
        IF b_secs[b] IS NOT NULL THEN
            UPDATE cyclone_rate_buckets SET tokens = b_tokens[b], updated_at = at
             WHERE name = b_name[b] AND key = b_key[b];
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

CREATE OR REPLACE FUNCTION cyclone_runs_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
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

CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
BEGIN
    admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now(), NEW.node_limit);  -- not PERFORM: see cyclone_runs_free_slot
    RETURN NULL;
END
$$;

CREATE OR REPLACE FUNCTION cyclone_steps_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
BEGIN
    IF OLD.state IN ('available', 'running') AND NEW.state NOT IN ('available', 'running') THEN
        admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now(), OLD.node_limit);
    END IF;
    RETURN NULL;
END
$$;
