-- Version 33: a node's `concurrency` counts the leases of its steps, held by slots claimed at
-- lease, and its steps wait for a slot as available ones (docs/flow-control.md).
--
-- Until now a node's limit counted its steps available or running, and its other steps waited
-- held, out of the lease index, for an admission to make them available as slots freed. Two
-- costs followed, both paid in the drain: every step was written twice (held, then admitted:
-- a whole row and its index entries), its admission ran under the node's lock in the
-- statement that leased or ended a step, and with it the rate admission of a node limited both
-- ways; and the steps made available, waiting in the index for a lease, held slots that no
-- handler used, so a supervisor that queues leases ahead for its workers found fewer steps to
-- lease than it asked for. bench/runtime.py --only flow, 10,000 one-step runs on 4 workers:
-- a node limit of 64 that four workers never reach ran at 0.65-0.73 of the same drain with no
-- limit, all three limits declared at 0.61-0.68, and a node limit of 1,000 still at 0.85.
--
-- Now each node limited by concurrency has N slot rows (cyclone_node_slots, made as a graph
-- registers), and a step holds one while it holds a lease (its `slot`). The supervisor's
-- statement claims the slots of the steps it leases, one statement for each node, and lets go
-- those of the steps it completes, one statement for all; every other lease claims its step's
-- slot in the rules' trigger, and every other end of a lease lets it go there. Claims skip the
-- slots another transaction holds and never wait; a step that finds none is not leased. A step
-- of such a node is inserted available, in an index of its own
-- (cyclone_steps_limited_ready_idx), and a lease reads a node there only while the node has a
-- free slot (cyclone_lease_pick): a full node's backlog is read by no lease. Only rate limits
-- hold steps now; `refill` (migration 30), which chose the steps whose lease or end admitted
-- the next ones, goes.
--
-- Steps that held a slot: those running claim one each here; those held for a slot alone are
-- made available.

ALTER TABLE cyclone_steps ADD COLUMN slot integer;

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

-- The slots of every graph's limited nodes, and of any node a step names beyond them.
SELECT cyclone_node_slots_make(g.workflow, n->>'name', max((n->>'concurrency')::integer))
  FROM cyclone_graphs g, jsonb_array_elements(g.graph->'nodes') AS n
 WHERE n->>'concurrency' IS NOT NULL
 GROUP BY g.workflow, n->>'name';
SELECT cyclone_node_slots_make(s.workflow, s.node, max(s.node_limit))
  FROM cyclone_steps s
 WHERE s.node_limit IS NOT NULL AND s.state IN ('available', 'running', 'waiting')
 GROUP BY s.workflow, s.node;

CREATE OR REPLACE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- Running steps claim their slots.
WITH r AS (
    SELECT s.id, s.workflow, s.node,
           row_number() OVER (PARTITION BY s.workflow, s.node ORDER BY s.id)::integer AS n
      FROM cyclone_steps s
     WHERE s.state = 'running' AND s.node_limit IS NOT NULL
), claimed AS (
    UPDATE cyclone_node_slots sl SET step_id = r.id
      FROM r
     WHERE sl.workflow = r.workflow AND sl.node = r.node AND sl.slot = r.n
    RETURNING sl.step_id, sl.slot
)
UPDATE cyclone_steps s SET slot = claimed.slot FROM claimed WHERE s.id = claimed.step_id;

DROP TRIGGER cyclone_steps_slot_freed ON cyclone_steps;
DROP FUNCTION cyclone_steps_free_slot();
DROP FUNCTION cyclone_admit_steps(text, text, timestamptz, integer, boolean);
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

CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
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

-- Held for a slot alone: available now, to wait for one in the new index.
UPDATE cyclone_steps SET held = false, state = 'available'
 WHERE held AND rate_limit IS NULL AND state = 'waiting';

DROP INDEX cyclone_steps_limited_idx;
CREATE INDEX cyclone_steps_limited_ready_idx
    ON cyclone_steps (workflow, node, priority, pass, id, available_at)
    WHERE state = 'available' AND node_limit IS NOT NULL;
DROP INDEX cyclone_steps_ready_idx;
CREATE INDEX cyclone_steps_ready_idx ON cyclone_steps (priority, pass, id, available_at)
    WHERE state = 'available' AND node_limit IS NULL;
ALTER TABLE cyclone_steps DROP COLUMN refill;

DROP FUNCTION cyclone_held_counts(integer);
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

CREATE OR REPLACE FUNCTION cyclone_lease_candidate(
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

CREATE OR REPLACE FUNCTION cyclone_lease_candidates(
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

CREATE FUNCTION cyclone_lease_pick(
    want integer, other_than uuid[], at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[], claim boolean
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid,
                slot integer)
LANGUAGE plpgsql VOLATILE ROWS 8 AS $$
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

CREATE FUNCTION cyclone_lease_pick_one(
    go boolean, other_than uuid, at timestamptz, workflows text[], after_priority smallint,
    after_pass bigint, after_id bigint, graphs text[]
) RETURNS TABLE (id bigint, available_at timestamptz, priority smallint, pass bigint,
                input jsonb, deadline_at timestamptz, graph_hash text, parent_run_id uuid)
LANGUAGE plpgsql VOLATILE ROWS 1 AS $$
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
