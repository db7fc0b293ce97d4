-- Waking on ready steps and on timers (migration 22): the flag a waiting supervisor sets, and
-- the scanner's look ahead.

-- name: wake_arm
-- A supervisor waits for ready steps: the next writer of one notifies cyclone_ready (and
-- clears the flag). Returns once the transactions in progress have ended (at most %(most)s
-- seconds): the supervisor's next look finds what they made ready.
SELECT cyclone_wake_arm(%(most)s) AS settled;

-- name: wake_ready
-- A retry's backoff or a token given ahead came due: wake a waiting supervisor, if any. The
-- time is when the scanner's pass that follows began (see cyclone_next_due).
SELECT cyclone_wake_ready(), now() AS now;

-- name: wake_timer
-- The scanner is about to sleep: until the next time due after %(since)s, when its last pass
-- began, within %(horizon)s seconds (which it writes, so that a timer set earlier meanwhile
-- notifies it); returns how long that is (0: due already).
SELECT cyclone_wake_timer_set(%(horizon)s, %(since)s, %(most)s) AS wait;
