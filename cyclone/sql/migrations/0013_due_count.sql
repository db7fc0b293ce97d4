-- Version 13: the count of due steps (`cyclone status`, the metrics' queue gauge) by a walk of
-- the candidate index that stops at its cap. Counted with a plain LIMIT, on statistics that
-- saw no backlog, the planner read the whole index into a bitmap first (every due step, whatever
-- the cap), and with an ORDER BY it sorted them all.
CREATE FUNCTION cyclone_due_count(cap integer, at timestamptz) RETURNS bigint
LANGUAGE sql STABLE
SET enable_sort = off
SET enable_bitmapscan = off
SET enable_seqscan = off
AS $$
    SELECT count(*) FROM (SELECT 1 FROM cyclone_steps
                           WHERE state = 'available' AND available_at <= at
                           ORDER BY available_at, id
                           LIMIT greatest(cap, 0)) AS due
$$;
