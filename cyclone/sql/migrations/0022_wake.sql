-- Version 22: wake on ready, and timers on time (issue 23).
--
-- A step that becomes ready wakes a supervisor that waits for work, at once: NOTIFY on channel
-- cyclone_ready. Not for every step: a transaction that notified holds a database-wide lock from
-- the start of its commit to its end (migration 10), so only while some supervisor said it
-- waits (the sequence cyclone_wake_ready at 1, set by a supervisor as its workers go idle); the
-- first transaction that finds it set clears it. A step or run whose time comes within the next
-- minute (a retry's backoff, a token given ahead, a sleep's end, a max_wait, a deadline) notifies
-- cyclone_timer when that time is earlier than the scanner means to wake (cyclone_wake_timer,
-- in epoch milliseconds, written before it sleeps; it never sleeps longer than a minute): that
-- scanner then wakes for it. Times further off are found by its next look, before they come.
--
-- Sequences, not a table: their value is read by a C function in the triggers' WHEN clauses,
-- with no query run and no function of ours called while nobody waits, which is what a ready
-- step costs under load (a PL/pgSQL trigger reading a one-row table cost 16% of the server's
-- instructions a step: bench/README.md). And setval is not transactional: a value set is seen
-- by every session at once, and rolled back by none.
--
-- A supervisor that sets the flag then looks once more must see every step of a transaction
-- that read it unset; the scanner that writes its time likewise. So after setting it, it waits
-- for the transactions in progress then to end (cyclone_wake_settle), and only then looks: one
-- that read the old value has committed (or rolled back) by then; one that reads later sees it.

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

CREATE FUNCTION cyclone_steps_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'waiting' THEN
        PERFORM cyclone_wake_timer(NEW.due_at);
    ELSIF NEW.available_at > now() THEN
        PERFORM cyclone_wake_timer(NEW.available_at);
    ELSE
        PERFORM cyclone_wake_ready();
    END IF;
    RETURN NULL;
END
$$;

-- Called only when its WHEN says someone is to be woken: a step made ready while a supervisor
-- waits, or a time earlier than the scanner's.
CREATE TRIGGER cyclone_steps_wake AFTER INSERT ON cyclone_steps
    FOR EACH ROW
    WHEN ((NEW.state = 'available' AND NEW.available_at <= now()
           AND pg_sequence_last_value('cyclone_wake_ready') = 1)
          OR (((NEW.state = 'available' AND NEW.available_at > now())
               OR (NEW.state = 'waiting' AND NEW.due_at < now() + interval '1 minute'))
              AND cyclone_epoch_ms(CASE NEW.state WHEN 'waiting' THEN NEW.due_at
                                                  ELSE NEW.available_at END)
                  < pg_sequence_last_value('cyclone_wake_timer')))
    EXECUTE FUNCTION cyclone_steps_wake();

-- Not UPDATE OF state: every write that makes a step available again sets its available_at
-- (a retry, a release, a token given, a DLQ retry, a parked step freed), and the lease and the
-- completion, which set state on every step, then never consider this trigger at all.
CREATE TRIGGER cyclone_steps_wake_again AFTER UPDATE OF available_at, due_at
    ON cyclone_steps FOR EACH ROW
    WHEN ((NEW.state = 'available' AND NEW.available_at <= now()
           AND OLD.state <> 'available'
           AND pg_sequence_last_value('cyclone_wake_ready') = 1)
          OR (((NEW.state = 'available'
                AND (OLD.state <> 'available' OR OLD.available_at <> NEW.available_at)
                AND NEW.available_at > now())
               OR (NEW.state = 'waiting' AND NEW.due_at < now() + interval '1 minute'
                   AND (OLD.state <> 'waiting' OR OLD.due_at IS DISTINCT FROM NEW.due_at)))
              AND cyclone_epoch_ms(CASE NEW.state WHEN 'waiting' THEN NEW.due_at
                                                  ELSE NEW.available_at END)
                  < pg_sequence_last_value('cyclone_wake_timer')))
    EXECUTE FUNCTION cyclone_steps_wake();

CREATE FUNCTION cyclone_runs_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM cyclone_wake_timer(NEW.deadline_at);
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_wake AFTER INSERT OR UPDATE OF deadline_at ON cyclone_runs
    FOR EACH ROW
    WHEN (NEW.deadline_at < now() + interval '1 minute'
          AND cyclone_epoch_ms(NEW.deadline_at) < pg_sequence_last_value('cyclone_wake_timer'))
    EXECUTE FUNCTION cyclone_runs_wake();

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
        now() + make_interval(secs => horizon));
END
$$;
