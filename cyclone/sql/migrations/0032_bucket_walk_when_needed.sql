-- Version 32: a bucket with tokens to spare reads its pending steps at most every 100 ms, and
-- the steps it gives tokens to in between are kept in a short list of their own.
--
-- Each admission read every step its bucket had promised a token and not yet counted as
-- started, and wrote the list again: a leased step counts as started 300 ms after its lease,
-- so a bucket of 5,000 steps a second read and wrote about 1,500 ids at every admission. Under
-- a node limit of 64, an admission gives about 20 steps, and that list cost more than the rest
-- of their admission (bench/runtime.py --only flow --flows declared,node: all three limits
-- declared ran at 0.64-0.72 of the drain with none, the node limit alone at 0.78-0.82).
--
-- Now a bucket read less than 100 ms ago, with fewer than 200 steps given tokens since, that
-- has tokens for its pending steps and for a whole batch more, were none of them started yet,
-- is not read: the steps it gives tokens to join `fresh`, and its level, time and pending list
-- stay as they were for the next read to count. Those steps get the same tokens a read would
-- give them (each one at once), and nothing is counted early or lost: a pending step, in either
-- list, stays pending until a read counts it started. A lease given back keeps its token while
-- its id is in either list.

ALTER TABLE cyclone_rate_buckets ADD COLUMN fresh bigint[] NOT NULL DEFAULT '{}';

CREATE OR REPLACE FUNCTION cyclone_token_kept(limiter text, step bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM cyclone_rate_buckets b
      WHERE b.name = limiter AND (step = ANY (b.pending) OR step = ANY (b.fresh))
        FOR SHARE;
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION cyclone_admit_steps(wf text, nd text, at timestamptz,
                                               lim_hint integer DEFAULT NULL,
                                               marked boolean DEFAULT false)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    horizon CONSTANT float8 := 2.0;  -- RATE_HORIZON: how far ahead a token may be given
    batch CONSTANT integer := 200;   -- most held steps one call reads, and admits
    enough CONSTANT integer := 16;   -- available steps of the node that make admitting wait
    -- The longest from a lease to its handler's start: a lease taken ahead starts within
    -- READY_FOR (0.25 s, cyclone/supervisor/dispatch.py) of its statement, or goes back.
    slack CONSTANT interval := interval '300 milliseconds';
    -- How often a bucket's pending steps are walked while it has tokens to spare, and how many
    -- may be given meanwhile (migration 32): `fresh` stays short enough to be kept in its row.
    relook CONSTANT interval := interval '100 milliseconds';
    fresh_most CONSTANT integer := 200;
    lim integer := lim_hint;
    free integer := batch;
    ready integer := 0;
    admitted integer;
    st record;
    ev record;
    rows_read integer := 0;
    -- (Set when the walk starts: a default is evaluated at every call, and most calls, for a
    -- freed slot, end at the first test.)
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
    -- A marked step's call (migration 30) skips it: it comes when the walk would not return.
    IF lim > enough AND NOT marked THEN
        IF (SELECT count(*) FROM (SELECT 1 FROM cyclone_steps s
                                   WHERE s.workflow = wf AND s.node = nd
                                     AND s.node_limit IS NOT NULL AND s.state = 'available'
                                   ORDER BY s.pass DESC
                                   LIMIT enough) AS ready) >= enough THEN
            RETURN 0;
        END IF;
    END IF;
    IF NOT pg_try_advisory_xact_lock(hashtextextended(
               'cyclone_node:' || current_schema() || chr(31) || wf || chr(31) || nd, 0)) THEN
        RETURN 0;
    END IF;
    IF lim IS NOT NULL THEN
        SELECT lim - count(*), count(*) FILTER (WHERE s.state = 'available') INTO free, ready
          FROM cyclone_steps s
         WHERE s.workflow = wf AND s.node = nd AND s.node_limit IS NOT NULL
           AND s.state IN ('available', 'running');
        IF free <= 0 THEN
            -- Every slot held, found by a marked step: each holder admits when it lets its
            -- slot go, so that the first slot freed is filled (the step whose lease called,
            -- too; those another transaction holds now are ending, or being marked by it).
            -- An unmarked call (an insert's, the sweep's) leaves that to the sweep's next pass.
            IF lim > enough AND marked THEN
                UPDATE cyclone_steps s SET refill = 2
                 WHERE s.id IN (SELECT h.id FROM cyclone_steps h
                                 WHERE h.workflow = wf AND h.node = nd
                                   AND h.node_limit IS NOT NULL
                                   AND h.state IN ('available', 'running') AND h.refill <> 2
                                   FOR UPDATE SKIP LOCKED);
            END IF;
            RETURN 0;
        END IF;
        free := least(free, batch);
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
        EXIT WHEN cardinality(ids) >= free;
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
    -- The steps picked (locked by the walk), in one statement, marked (migration 30) for the
    -- call that admits the next ones, where a node's limit is above `enough` (at or under it,
    -- every slot let go admits): with `enough` or more available after this call, the step
    -- leased when fewer than `enough` are left behind it, in lease order (1: its lease
    -- admits); with fewer (the slots are held by running steps), every step admitted (2: the
    -- end of each admits).
    UPDATE cyclone_steps s
       SET held = false,  -- and so available (the rules' trigger): see cyclone_steps_keep_rules
           available_at = greatest(s.available_at, at + make_interval(secs => a.wait)),
           refill = CASE WHEN lim IS NULL OR lim <= enough THEN 0
                         WHEN ready + cardinality(ids) < enough THEN 2
                         WHEN a.n = greatest(cardinality(ids) - enough + 1, 1) THEN 1
                         ELSE 0 END
      FROM unnest(ids, waits) WITH ORDINALITY AS a (id, wait, n)
     WHERE s.id = ANY (ids) AND s.id = a.id;
    GET DIAGNOSTICS admitted = ROW_COUNT;
    RETURN admitted;
END
$$;
