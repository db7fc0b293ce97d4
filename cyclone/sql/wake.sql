-- Waking on ready steps and on timers (migration 22): the flag a waiting supervisor sets, and
-- the scanner's look ahead.

-- name: wake_arm
-- A supervisor waits for ready steps: the next writer of one notifies cyclone_ready (and
-- clears the flag). One row, always (the dispatcher's session reads a result).
WITH armed AS (
    UPDATE cyclone_wake SET wanted = true WHERE NOT wanted RETURNING 1
)
SELECT count(*)::text AS armed FROM armed;

-- name: wake_ready
-- A retry's backoff or a token given ahead came due: wake a waiting supervisor, if any.
SELECT cyclone_wake_ready();

-- name: wake_timer
-- The scanner is about to sleep: until the next time due within %(horizon)s seconds (which it
-- writes, so that a timer set earlier meanwhile notifies it); returns how long that is.
UPDATE cyclone_wake SET timer_at = cyclone_next_due(%(horizon)s)
RETURNING greatest(extract(epoch FROM timer_at - now()), 0)::float8 AS wait;
