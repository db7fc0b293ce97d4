-- Version 18: history (issue 25). Finished runs leave the hot tables for tables partitioned by
-- time, which retention drops whole instead of deleting row by row.
--
-- The scanner's `history` sweep moves finished top-level runs (completed or cancelled, with no
-- idempotency key) that ended more than `scanner.history_after` ago, with their child runs,
-- steps and failed attempts, in batches of one transaction each (cyclone_history_move). The
-- hot tables then hold live runs and a short tail of ended ones, whatever the retention, so
-- their indexes stay in memory and their plans stay those of a small table. Retention drops a
-- partition once all of it is past `scanner.retention` (cyclone_history_drop), after an
-- optional archive (`scanner.archive`). Failed runs (the DLQ re-drives them) and runs with an
-- idempotency key (a repeat submit must find them) stay hot until retention deletes them, as
-- before; docs/scaling.md says what that costs.
--
-- Online: this migration only creates objects. It reads no row of the hot tables and takes no
-- lock on them stronger than a function's creation needs, so at any size it commits in
-- milliseconds; the runs already ended move later, batch by batch, like new ones.

-- The partition key of all three tables is `run_ended_at`: when the run's top-level run ended,
-- so that a tree of runs, its steps and its attempts live and die in one partition.
CREATE TABLE cyclone_history_runs (
    id              uuid NOT NULL,
    workflow        text NOT NULL,
    graph_hash      text NOT NULL,
    state           cyclone_run_state NOT NULL,
    input           jsonb NOT NULL,
    output          jsonb,
    idempotency_key text,
    parent_run_id   uuid,
    parent_step_id  bigint,
    created_at      timestamptz NOT NULL,
    deadline_at     timestamptz,
    paused_at       timestamptz,
    finished_at     timestamptz,
    queue           text NOT NULL,
    priority        smallint NOT NULL,
    pass            bigint NOT NULL,
    concurrency_key text,
    concurrency_limit integer,
    run_ended_at    timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_runs_id_idx ON cyclone_history_runs (id);
CREATE INDEX cyclone_history_runs_created_idx ON cyclone_history_runs (created_at, id);

CREATE TABLE cyclone_history_steps (
    id               bigint NOT NULL,
    run_id           uuid NOT NULL,
    workflow         text NOT NULL,
    node             text NOT NULL,
    kind             cyclone_node_kind NOT NULL,
    item_index       integer,
    item             jsonb,
    state            cyclone_step_state NOT NULL,
    attempt          integer NOT NULL,
    max_attempts     integer NOT NULL,
    timeout          interval,
    signal           text,
    available_at     timestamptz NOT NULL,
    due_at           timestamptz,
    leased_by        text,
    child_run_id     uuid,
    output           jsonb,
    error            text,
    error_kind       cyclone_error_kind,
    created_at       timestamptz NOT NULL,
    started_at       timestamptz,
    completed_at     timestamptz,
    priority         smallint NOT NULL,
    pass             bigint NOT NULL,
    node_limit       integer,
    rate_limit       text,
    run_ended_at     timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_steps_run_idx ON cyclone_history_steps (run_id, id);
CREATE INDEX cyclone_history_steps_id_idx ON cyclone_history_steps (id);

CREATE TABLE cyclone_history_attempts (
    id           bigint NOT NULL,
    step_id      bigint NOT NULL,
    run_id       uuid NOT NULL,
    attempt      integer NOT NULL,
    error_kind   cyclone_error_kind NOT NULL,
    error        text,
    worker       text,
    started_at   timestamptz,
    ended_at     timestamptz NOT NULL,
    run_ended_at timestamptz NOT NULL
) PARTITION BY RANGE (run_ended_at);
CREATE INDEX cyclone_history_attempts_step_idx ON cyclone_history_attempts (step_id, id);

-- One row per partition (the same range in all three tables), so that the sweep finds what to
-- create and what to drop without parsing the catalog's partition bounds.
CREATE TABLE cyclone_history_partitions (
    lo         timestamptz PRIMARY KEY,
    hi         timestamptz NOT NULL,
    created_at timestamptz NOT NULL DEFAULT now(),
    CHECK (hi > lo)
);

-- How far the moves got: the latest end moved. The next batch looks from a little before it,
-- so it does not walk again past the failed and keyed runs that stay behind.
CREATE TABLE cyclone_history_mark (
    one      boolean PRIMARY KEY DEFAULT true CHECK (one),
    moved_to timestamptz NOT NULL DEFAULT '-infinity'
);
INSERT INTO cyclone_history_mark DEFAULT VALUES;

-- The width of a partition for a retention: an eighth of it, between ten seconds and a day, so
-- that history holds at most a ninth more than the retention, in about nine partitions, and
-- retention drops one at a time. 0 (keep forever): a day.
CREATE FUNCTION cyclone_history_span(retention float8) RETURNS float8
LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE WHEN coalesce(retention, 0) <= 0 THEN 86400
                ELSE least(greatest(retention / 8, 10), 86400) END
$$;

DO $migration$
BEGIN
EXECUTE format($fn$
-- Make the partitions that hold ends from `from_at` to `to_at` (aligned on the span from the
-- epoch), around any that exist (a retention changed since). Returns how many it made. The
-- history_drop sweep makes the next ones ahead, in a transaction of their own, so that a move
-- seldom makes one (making one locks history's tables, readers included, to its commit). A
-- caller that is not the owner makes none past two spans from now, nor before the retention.
CREATE FUNCTION %1$I.cyclone_history_ensure(retention float8, from_at timestamptz,
                                            to_at timestamptz)
RETURNS integer LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    span float8 := %1$I.cyclone_history_span(retention);
    slot float8;
    a timestamptz;
    b timestamptz;
    made integer := 0;
    suffix text;
    t text;
BEGIN
    IF NOT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        to_at := least(to_at, pg_catalog.now() + pg_catalog.make_interval(secs => 2 * span));
        IF coalesce(retention, 0) > 0 THEN
            from_at := greatest(from_at, pg_catalog.now() - pg_catalog.make_interval(
                secs => greatest(retention, 86400) + span));
        END IF;
    END IF;
    slot := pg_catalog.floor(extract(epoch FROM from_at) / span) * span;
    WHILE pg_catalog.to_timestamp(slot) <= to_at LOOP
        a := pg_catalog.to_timestamp(slot);
        b := pg_catalog.to_timestamp(slot + span);
        SELECT coalesce(max(p.hi), a) INTO a FROM %1$I.cyclone_history_partitions p
         WHERE p.lo <= a AND p.hi > a;
        SELECT coalesce(min(p.lo), b) INTO b FROM %1$I.cyclone_history_partitions p
         WHERE p.lo > a AND p.lo < b;
        IF a < b THEN
            suffix := pg_catalog.to_char(a AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
            FOREACH t IN ARRAY ARRAY['runs', 'steps', 'attempts'] LOOP
                EXECUTE pg_catalog.format(
                    'CREATE TABLE %%I.%%I PARTITION OF %%I.%%I FOR VALUES FROM (%%L) TO (%%L)',
                    '%1$s', pg_catalog.concat_ws('_', 'cyclone', 'history', t, suffix),
                    '%1$s', pg_catalog.concat_ws('_', 'cyclone', 'history', t), a, b);
            END LOOP;
            INSERT INTO %1$I.cyclone_history_partitions (lo, hi) VALUES (a, b);
            made := made + 1;
        END IF;
        slot := slot + span;
    END LOOP;
    RETURN made;
END
$$;

-- Move up to batch_size finished top-level runs that ended more than `tail` seconds before `at`
-- (and, with a retention, less than the retention ago: older ones are retention's), with their
-- child runs, steps and attempts, into history; one statement, so a reader sees a run either
-- here or there. Returns the number of top-level runs moved.
CREATE FUNCTION %1$I.cyclone_history_move(tail float8, retention float8, batch_size integer,
                                          at timestamptz)
RETURNS bigint LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET enable_hashjoin = off
SET enable_mergejoin = off
AS $$
DECLARE
    now_at timestamptz := coalesce(at, pg_catalog.now());
    mark timestamptz;
    from_at timestamptz;
    ids uuid[];
    ends timestamptz[];
    first_end timestamptz;
    last_end timestamptz;
BEGIN
    -- Who is not the owner moves only what ended before the server's clock says.
    IF NOT pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        now_at := least(now_at, pg_catalog.now());
    END IF;
    -- One mover at a time: a second scanner waits here for one batch, then moves the next.
    SELECT m.moved_to INTO mark FROM %1$I.cyclone_history_mark m FOR UPDATE;
    -- Five minutes before the mark: a run whose end committed later than that stays hot until
    -- retention deletes it (it is only not moved).
    from_at := greatest(mark - interval '5 minutes',
                        CASE WHEN coalesce(retention, 0) > 0
                             THEN now_at - pg_catalog.make_interval(secs => retention)
                             ELSE '-infinity' END);
    SELECT pg_catalog.array_agg(d.id ORDER BY d.finished_at),
           pg_catalog.array_agg(d.finished_at ORDER BY d.finished_at),
           min(d.finished_at), max(d.finished_at)
      INTO ids, ends, first_end, last_end
      FROM (SELECT r.id, r.finished_at FROM %1$I.cyclone_runs r
             WHERE r.finished_at >= from_at
               AND r.finished_at < now_at - pg_catalog.make_interval(secs => tail)
               AND r.parent_run_id IS NULL AND r.idempotency_key IS NULL
               AND r.state IN ('completed', 'cancelled')
             ORDER BY r.finished_at
             LIMIT batch_size
               FOR UPDATE SKIP LOCKED) AS d;
    IF ids IS NULL THEN
        RETURN 0;
    END IF;
    PERFORM %1$I.cyclone_history_ensure(retention, first_end, last_end);
    WITH RECURSIVE tree AS (
        SELECT t.id, t.ended FROM ROWS FROM (pg_catalog.unnest(ids), pg_catalog.unnest(ends)) AS t (id, ended)
        UNION ALL
        SELECT r.id, tree.ended FROM %1$I.cyclone_runs r JOIN tree ON r.parent_run_id = tree.id
    ), runs_out AS (
        DELETE FROM %1$I.cyclone_runs r USING tree WHERE r.id = tree.id
        RETURNING r.*, tree.ended
    ), runs_in AS (
        INSERT INTO %1$I.cyclone_history_runs
               (id, workflow, graph_hash, state, input, output, idempotency_key, parent_run_id,
                parent_step_id, created_at, deadline_at, paused_at, finished_at, queue,
                priority, pass, concurrency_key, concurrency_limit, run_ended_at)
        SELECT id, workflow, graph_hash, state, input, output, idempotency_key, parent_run_id,
               parent_step_id, created_at, deadline_at, paused_at, finished_at, queue,
               priority, pass, concurrency_key, concurrency_limit, ended
          FROM runs_out
    ), steps_out AS (
        DELETE FROM %1$I.cyclone_steps s USING tree WHERE s.run_id = tree.id
        RETURNING s.*, tree.ended
    ), steps_in AS (
        INSERT INTO %1$I.cyclone_history_steps
               (id, run_id, workflow, node, kind, item_index, item, state, attempt,
                max_attempts, timeout, signal, available_at, due_at, leased_by, child_run_id,
                output, error, error_kind, created_at, started_at, completed_at, priority, pass,
                node_limit, rate_limit, run_ended_at)
        SELECT id, run_id, workflow, node, kind, item_index, item, state, attempt,
               max_attempts, timeout, signal, available_at, due_at, leased_by, child_run_id,
               output, error, error_kind, created_at, started_at, completed_at, priority, pass,
               node_limit, rate_limit, ended
          FROM steps_out
    ), attempts_out AS (
        DELETE FROM %1$I.cyclone_step_attempts a USING steps_out s WHERE a.step_id = s.id
        RETURNING a.*, s.ended
    )
    INSERT INTO %1$I.cyclone_history_attempts
           (id, step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at,
            run_ended_at)
    SELECT id, step_id, run_id, attempt, error_kind, error, worker, started_at, ended_at, ended
      FROM attempts_out;
    UPDATE %1$I.cyclone_history_mark SET moved_to = greatest(moved_to, last_end);
    RETURN pg_catalog.cardinality(ids);
END
$$;

-- Drop the partition that starts at `lo` if all of it is past the retention (for a caller that
-- is not the owner: past a day at least, on the server's clock, as for
-- cyclone_delete_finished). Returns whether it dropped it. It waits at most 100 ms for the
-- readers of history (while it waits, new readers queue behind it), then gives up until the
-- next pass.
CREATE FUNCTION %1$I.cyclone_history_drop(retention float8, at timestamptz, part_lo timestamptz)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER
SET search_path = %1$I, pg_temp
SET lock_timeout = '100ms'
AS $$
DECLARE
    cutoff timestamptz;
    part record;
    suffix text;
    t text;
BEGIN
    IF coalesce(retention, 0) <= 0 THEN
        RETURN false;
    END IF;
    IF pg_catalog.pg_has_role(session_user, current_user, 'MEMBER') THEN
        cutoff := coalesce(at, pg_catalog.now()) - pg_catalog.make_interval(secs => retention);
    ELSE
        cutoff := least(coalesce(at, pg_catalog.now()), pg_catalog.now())
                  - pg_catalog.make_interval(secs => greatest(retention, 86400));
    END IF;
    SELECT p.lo, p.hi INTO part FROM %1$I.cyclone_history_partitions p
     WHERE p.lo = part_lo AND p.hi <= cutoff FOR UPDATE SKIP LOCKED;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    suffix := pg_catalog.to_char(part.lo AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MISS');
    FOREACH t IN ARRAY ARRAY['attempts', 'steps', 'runs'] LOOP
        EXECUTE pg_catalog.format('DROP TABLE IF EXISTS %%I.%%I', '%1$s',
                                  pg_catalog.concat_ws('_', 'cyclone', 'history', t, suffix));
    END LOOP;
    DELETE FROM %1$I.cyclone_history_partitions p WHERE p.lo = part.lo;
    RETURN true;
END
$$;
$fn$, current_schema());
END
$migration$;

REVOKE ALL ON FUNCTION cyclone_history_ensure(float8, timestamptz, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION cyclone_history_move(float8, float8, integer, timestamptz) FROM PUBLIC;
REVOKE ALL ON FUNCTION cyclone_history_drop(float8, timestamptz, timestamptz) FROM PUBLIC;

-- The views read history too: a run is in exactly one of the two places.
CREATE OR REPLACE VIEW cyclone_v_steps AS
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, s.lease_expires_at, s.leased_by, s.child_run_id,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt', a.attempt, 'error_kind', a.error_kind, 'error', a.error,
                   'worker', a.worker, 'started_at', a.started_at, 'ended_at', a.ended_at)
                   ORDER BY a.id), '[]'::jsonb)
          FROM cyclone_step_attempts a WHERE a.step_id = s.id) AS attempts
  FROM cyclone_steps s
UNION ALL
SELECT s.id, s.run_id, s.workflow, s.node, s.kind, s.state, s.attempt, s.max_attempts,
       s.item_index, s.error, s.error_kind, s.created_at, s.started_at, s.completed_at,
       s.available_at, s.due_at, NULL::timestamptz, s.leased_by, s.child_run_id,
       (SELECT coalesce(jsonb_agg(jsonb_build_object(
                   'attempt', a.attempt, 'error_kind', a.error_kind, 'error', a.error,
                   'worker', a.worker, 'started_at', a.started_at, 'ended_at', a.ended_at)
                   ORDER BY a.id), '[]'::jsonb)
          FROM cyclone_history_attempts a WHERE a.step_id = s.id)
  FROM cyclone_history_steps s;

CREATE OR REPLACE VIEW cyclone_v_runs AS
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_steps s WHERE s.run_id = r.id) AS steps_total,
       (SELECT count(*) FROM cyclone_steps s
         WHERE s.run_id = r.id AND s.state = 'completed') AS steps_completed
  FROM cyclone_runs r
UNION ALL
SELECT r.id, r.workflow, r.state, r.input, r.output, r.parent_run_id, r.idempotency_key,
       r.created_at, r.deadline_at, r.paused_at, r.finished_at,
       (SELECT count(*) FROM cyclone_history_steps s WHERE s.run_id = r.id),
       (SELECT count(*) FROM cyclone_history_steps s
         WHERE s.run_id = r.id AND s.state = 'completed')
  FROM cyclone_history_runs r;
