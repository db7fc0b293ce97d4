-- Version 11: what a node kind implies, written once: the state a step of that kind starts in
-- (and comes back to when the DLQ re-drives it). Waits and sleeps start waiting, for their
-- signal or their time; tasks, maps and child nodes start available, for a worker. Every
-- statement that makes or remakes steps calls this (steps.sql, runs.sql, dlq.sql), and
-- cyclone/states.py's NodeKind.first_state says the same for Python (a test holds them equal).
--
-- A LANGUAGE sql function of one expression, IMMUTABLE and not STRICT: the planner inlines it
-- into the calling statement, whose plan is then the one of the CASE written out in place
-- (tests/test_plans.py).

CREATE FUNCTION cyclone_kind_first_state(kind text) RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN kind IN ('wait', 'sleep') THEN 'waiting' ELSE 'available' END
$$;
