-- Version 31: a rate-limited step given back keeps its token only while its bucket has not
-- counted it as started.
--
-- A step given back with its attempt not spent (a lease taken ahead that no worker started in
-- time, a handler stopped by a planned stop, a lease lapsed while the database restarted) went
-- back available on the token it had. But a bucket counts a leased step as started 0.3 s after
-- its lease and then forgets it: a lease given back later started again on a token already
-- counted, uncounted itself; and a handler stopped after it started went again on the token it
-- had spent. bench/chaos.py (CI, seed 61468) found three starts within 8 ms from a bucket of
-- burst 2, after worker freezes and kills and a PostgreSQL restart.
--
-- Now such a step keeps its token only while its id is still among its bucket's pending steps
-- (cyclone_token_kept, which waits for an admission writing the bucket); otherwise it is held
-- again for a new one. A handler that started spent its token whatever the bucket says: the
-- planned stop's release and the outage's reclaim set `held` to say so.

CREATE FUNCTION cyclone_token_kept(limiter text, step bigint) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    PERFORM 1 FROM cyclone_rate_buckets b
      WHERE b.name = limiter AND step = ANY (b.pending)
        FOR SHARE;
    RETURN FOUND;
END
$$;

CREATE OR REPLACE FUNCTION cyclone_steps_keep_rules() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- PL/pgSQL compiles a test the first time a transaction reaches it, and the cost grows
    -- with its size: so each step starts with a small test that the hot path fails (a lease and
    -- a completion make no step available or waiting), and the larger ones sit behind it.
    IF NEW.state = 'available' OR NEW.state = 'waiting' THEN
        -- A step of a limited node made available waits, held, until admitted: a new one, and
        -- one made available again other than by a planned stop giving it back (a retry of a
        -- rate-limited step takes a token per attempt; a DLQ retry takes a slot anew). A retry
        -- of a node limited by concurrency only keeps its slot. A rate-limited step given back
        -- (its attempt not spent) keeps its token only while its bucket still counts it as not
        -- started (migration 31): a handler that started spent it (the statement that stops
        -- one sets `held`), and so did a lease the bucket already counted as started.
        IF NEW.node_limit IS NOT NULL OR NEW.rate_limit IS NOT NULL THEN
            IF NEW.state = 'available'
               AND (TG_OP = 'INSERT'
                    OR (OLD.state <> 'available' AND NOT OLD.held
                        AND (OLD.state <> 'running'
                             OR (NEW.rate_limit IS NOT NULL
                                 AND (NEW.attempt >= OLD.attempt OR NEW.held
                                      OR NOT cyclone_token_kept(NEW.rate_limit, NEW.id))))))
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
