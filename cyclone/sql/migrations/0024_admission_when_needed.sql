-- Version 24: admitting the held steps of a node limited by concurrency waits while enough of
-- its steps are available for workers, and the triggers pass the node's limit along.
--
-- Every step of a node with `concurrency=N` that ended freed a slot, and its trigger admitted
-- the next held step at once: three walks of partial indexes (the node's limit from a held
-- step, its steps in use, its held steps in order), each over the entries that admitted and
-- ended steps leave behind until VACUUM. With limits declared and not binding, that made a
-- step cost 2.2 times the server instructions of one without (bench/instructions.py
-- --declared). Now a slot freed while 16 or more of the node's steps are available admits
-- nothing: the workers have work, and the slots are filled in one admission once fewer wait
-- (up to 200 steps a call, as before). A node whose limit binds (fewer available than 16,
-- and so whenever N is at most 16) admits at every freed slot, as before. The triggers know
-- the limit from the row that fired them, which spares the first walk.

DROP FUNCTION cyclone_admit_steps(text, text, timestamptz);

CREATE FUNCTION cyclone_admit_steps(wf text, nd text, at timestamptz, lim_hint integer DEFAULT NULL)
RETURNS integer
LANGUAGE plpgsql VOLATILE AS $$
DECLARE
    horizon CONSTANT float8 := 2.0;  -- RATE_HORIZON: how far ahead a token may be given
    batch CONSTANT integer := 200;   -- most steps one call admits
    enough CONSTANT integer := 16;   -- available steps of the node that make admitting wait
    lim integer := lim_hint;
    free integer;
    ready integer;
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
    IF lim IS NULL THEN
        SELECT s.node_limit INTO lim FROM cyclone_steps s
         WHERE s.held AND s.workflow = wf AND s.node = nd LIMIT 1;
    END IF;
    free := batch;
    IF lim IS NOT NULL THEN
        SELECT lim - count(*), count(*) FILTER (WHERE s.state = 'available')
          INTO free, ready
          FROM cyclone_steps s
         WHERE s.workflow = wf AND s.node = nd AND s.node_limit IS NOT NULL
           AND s.state IN ('available', 'running');
        -- Enough of the node's steps wait for a worker: a slot left free now costs no
        -- throughput, and is filled with the others in one admission once they run low,
        -- instead of one admission (and its walks of the held and limited indexes) a step.
        IF ready >= enough THEN
            RETURN 0;
        END IF;
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

CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM cyclone_admit_steps(NEW.workflow, NEW.node, now(), NEW.node_limit);
    RETURN NULL;
END
$$;

-- A step that held a slot let it go (ended, parked, or held again for a token).
CREATE OR REPLACE FUNCTION cyclone_steps_free_slot() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF OLD.state IN ('available', 'running') AND NEW.state NOT IN ('available', 'running') THEN
        PERFORM cyclone_admit_steps(NEW.workflow, NEW.node, now(), OLD.node_limit);
    END IF;
    RETURN NULL;
END
$$;
