-- Version 28: a statement that inserts held steps admits each node once; a rate bucket's
-- clock never runs backwards.
--
-- Every held step inserted called cyclone_admit_steps, whose first test walks up to 16 of the
-- node's available steps (a heap visit each: the entries are too new to be all-visible): a
-- submit_many of 1,000 runs of a node limited to 64 made 1,000 calls, the first admitting 64
-- and the 999 others finding that nothing more fitted. The rows a statement inserts are all
-- there when its AFTER ROW triggers fire, so the first call of a node saw them all and the
-- others can only repeat it; for a node limited by concurrency they are skipped now (a mark
-- local to the transaction: the session's last step id, and the nodes admitted at it):
-- whatever the first call left, the ends of the steps it admitted admit. A node limited by
-- rate only still calls for each row: no end of its steps admits, and a call gives at most
-- `batch` tokens.
--
-- An admission refilled a bucket from its updated_at to `at`, the start of its transaction,
-- and set updated_at to `at`. A transaction that began before another admission wrote the
-- bucket, and reached it after, set the bucket's time back, and the next admission refilled
-- those seconds a second time: a token given early by as long as that transaction had run
-- (a quarter of a token for a transaction of 60 ms at 4 tokens a second; bench/chaos.py's rate
-- check, which allows a twentieth, reported a start that found no token once). The bucket now
-- keeps the later of the two times, and the steps it gives tokens to count their wait from it.

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
    b_at timestamptz[];
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
    b_at := '{}';
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
                    IF FOUND THEN
                        -- Refilled to now, or to the bucket's own time when that is later: a
                        -- transaction that began before another admission wrote the bucket
                        -- reads it after (`at` is the transaction's start), and a bucket set
                        -- back to that earlier time would refill the same seconds twice.
                        b_at[b] := greatest(at, bucket.updated_at);
                        b_tokens[b] := least(lim_row.burst, bucket.tokens
                            + extract(epoch FROM b_at[b] - bucket.updated_at)
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
            wait := wait + extract(epoch FROM b_at[b] - at);  -- from the bucket's time
        END IF;
        ids := ids || st.id;
        waits := waits || wait;
        EXIT WHEN cardinality(ids) >= free;
    END LOOP;
    FOR b IN 1 .. cardinality(b_id) LOOP
        IF b_secs[b] IS NOT NULL THEN
            UPDATE cyclone_rate_buckets SET tokens = b_tokens[b], updated_at = b_at[b]
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

CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
    mark text;
    upto text;
    here text;
BEGIN
    IF NEW.node_limit IS NOT NULL THEN
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
    END IF;
    admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now(), NEW.node_limit);  -- not PERFORM: see cyclone_runs_free_slot
    IF NEW.node_limit IS NOT NULL THEN
        mark := set_config('cyclone.admitted', mark, true);
    END IF;
    RETURN NULL;
END
$$;
