-- Version 22: wake on ready, and timers on time (issue 23).
--
-- A step that becomes ready wakes a supervisor that waits for work, at once: NOTIFY on channel
-- cyclone_ready. Not for every step: a transaction that notified holds a database-wide lock from
-- the start of its commit to its end (migration 10), so only while some supervisor said it
-- waits (`wanted`, set by the supervisor as its workers go idle), and the first transaction to
-- find it set clears it. Under load no supervisor waits, and a step made ready costs one read of
-- this one-row table. The flag is read without a lock; it is cleared under SKIP LOCKED, so that
-- no writer of steps ever waits for another on this row (a second notifier only notifies too,
-- which wakes nobody twice: a listener takes any number of notifications as one wake-up).
--
-- A step or run whose time comes within the next minute (a retry's backoff, a token given
-- ahead, a sleep's end, a max_wait, a deadline) notifies cyclone_timer when that time is
-- earlier than `timer_at`, when the scanner that wakes first means to wake (it writes it before
-- it sleeps, and never sleeps longer than a minute): that scanner then wakes for it instead of
-- at its next interval. Times further off are found by the scanner's next look, before they
-- come. The WHEN clauses are evaluated without calling the functions: a step that is neither
-- made ready nor timed, and a run whose deadline is over a minute away, pay nothing.
--
-- A supervisor that sets the flag then looks once more must see every step of a transaction
-- that read the flag unset; the scanner that writes `timer_at` likewise. So after setting it,
-- it waits for the transactions in progress then to end (cyclone_wake_settle), and only then
-- looks: one that read the old value before the flag was set has committed (or rolled back) by
-- then, and one that reads it later sees it set. The triggers themselves take no lock and read
-- one row: that is all a ready step costs while no supervisor waits.

CREATE TABLE cyclone_wake (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    wanted   boolean NOT NULL DEFAULT false,
    timer_at timestamptz
);
INSERT INTO cyclone_wake DEFAULT VALUES;

-- A supervisor waits for ready steps (then it calls cyclone_wake_settle, and looks once more).
CREATE FUNCTION cyclone_wake_arm() RETURNS text LANGUAGE sql AS $$
    UPDATE cyclone_wake SET wanted = true WHERE NOT wanted;
    SELECT 'armed';
$$;

-- Wait until every transaction in progress now has ended, at most `most` seconds: one that
-- read the flag (or `timer_at`) before it was set commits first. Returns whether all did.
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

-- The scanner sleeps until the next time due (cyclone_next_due), which it writes; returns how
-- long that is from now, in seconds. (It settles, then calls this again before it sleeps.)
CREATE FUNCTION cyclone_wake_timer_set(horizon float8, since timestamptz) RETURNS float8
LANGUAGE plpgsql AS $$
DECLARE
    at timestamptz;
BEGIN
    UPDATE cyclone_wake SET timer_at = cyclone_next_due(horizon, since) RETURNING timer_at INTO at;
    RETURN greatest(extract(epoch FROM at - now()), 0)::float8;
END
$$;

-- Wake a waiting supervisor, if one waits (the scanner calls it too, as a retry comes due).
CREATE FUNCTION cyclone_wake_ready() RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF (SELECT wanted FROM cyclone_wake) THEN
        UPDATE cyclone_wake SET wanted = false
         WHERE one IN (SELECT one FROM cyclone_wake WHERE wanted FOR UPDATE SKIP LOCKED);
        PERFORM pg_notify('cyclone_ready', '');
    END IF;
END
$$;

-- Wake the scanner for `at`, if it sleeps past it.
CREATE FUNCTION cyclone_wake_timer(at timestamptz) RETURNS void LANGUAGE plpgsql AS $$
BEGIN
    IF at < (SELECT timer_at FROM cyclone_wake) THEN
        UPDATE cyclone_wake SET timer_at = at
         WHERE one IN (SELECT one FROM cyclone_wake WHERE timer_at > at
                        FOR UPDATE SKIP LOCKED);
        PERFORM pg_notify('cyclone_timer', '');
    END IF;
END
$$;

CREATE FUNCTION cyclone_steps_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.state = 'waiting' THEN
        PERFORM cyclone_wake_timer(NEW.due_at);
    ELSIF NEW.available_at > now() THEN
        PERFORM cyclone_wake_timer(NEW.available_at);
    ELSIF (SELECT wanted FROM cyclone_wake) THEN
        PERFORM cyclone_wake_ready();  -- read there again: another may have cleared it
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_steps_wake AFTER INSERT ON cyclone_steps
    FOR EACH ROW
    WHEN (NEW.state = 'available'
          OR (NEW.state = 'waiting' AND NEW.due_at < now() + interval '1 minute'))
    EXECUTE FUNCTION cyclone_steps_wake();

CREATE TRIGGER cyclone_steps_wake_again AFTER UPDATE OF state, available_at, due_at
    ON cyclone_steps FOR EACH ROW
    WHEN ((NEW.state = 'available'
           AND (OLD.state <> 'available' OR OLD.available_at <> NEW.available_at))
          OR (NEW.state = 'waiting' AND NEW.due_at < now() + interval '1 minute'
              AND (OLD.state <> 'waiting' OR OLD.due_at IS DISTINCT FROM NEW.due_at)))
    EXECUTE FUNCTION cyclone_steps_wake();

CREATE FUNCTION cyclone_runs_wake() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM cyclone_wake_timer(NEW.deadline_at);
    RETURN NULL;
END
$$;

CREATE TRIGGER cyclone_runs_wake AFTER INSERT OR UPDATE OF deadline_at
    ON cyclone_runs FOR EACH ROW
    WHEN (NEW.deadline_at < now() + interval '1 minute')
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
