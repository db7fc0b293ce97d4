-- The roles of a real deployment (`cyclone migrate --print-grants`). {schema}, {migrator},
-- {runtime} and {readonly} are identifiers, filled in by psycopg.sql.

-- name: grants_print
-- Run as the schema's owner or a superuser, once `cyclone migrate` ran as the migrating
-- role (which then owns every Cyclone object), and again after an upgrade that adds tables.
-- The migrating role: DDL. Only `cyclone migrate` runs as it.
GRANT USAGE, CREATE ON SCHEMA {schema} TO {migrator};
-- Supervisors, workers, scanners and the CLI's writes (cancel, pause, retry): read and write
-- the work, never DDL, never delete history (retention goes through cyclone_delete_finished,
-- migration 9). Presence rows are theirs to delete.
GRANT USAGE ON SCHEMA {schema} TO {runtime};
GRANT SELECT, INSERT, UPDATE ON {schema}.cyclone_steps,
      {schema}.cyclone_signals, {schema}.cyclone_graphs, {schema}.cyclone_workflows TO {runtime};
-- Flow control (migration 14): queues' fair clocks, rate limits and their buckets.
GRANT SELECT, INSERT, UPDATE ON {schema}.cyclone_queues, {schema}.cyclone_rate_limits,
      {schema}.cyclone_rate_buckets TO {runtime};
-- Nodes' concurrency slots (migration 33): made as graphs register, claimed and let go by leases.
GRANT SELECT, INSERT, UPDATE ON {schema}.cyclone_limited_nodes, {schema}.cyclone_node_slots
      TO {runtime};
-- Schedules (migration 19): the sweep ticks them, clients and the CLI manage them.
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.cyclone_schedules TO {runtime};
-- Waking (migration 22): supervisors set the flag, writers of ready steps clear it (setval).
GRANT UPDATE ON SEQUENCE {schema}.cyclone_wake_ready, {schema}.cyclone_wake_timer TO {runtime};
-- Runs: only the columns its statements change (migration 15). Not created_at, input, parent
-- or key, which say what the run was; finished_at only at the current time (a trigger). The
-- REVOKE takes back the whole-table UPDATE that grants printed before version 15 gave.
REVOKE UPDATE ON {schema}.cyclone_runs FROM {runtime};
GRANT SELECT, INSERT ON {schema}.cyclone_runs TO {runtime};
GRANT UPDATE (state, output, deadline_at, paused_at, finished_at, waited, queued, pass)
      ON {schema}.cyclone_runs TO {runtime};
-- Deploys (migration 16): ctx.patched()'s answers, kept on the run once given, and when code
-- containing each change first registered.
GRANT UPDATE (patches) ON {schema}.cyclone_runs TO {runtime};
GRANT SELECT, INSERT, UPDATE ON {schema}.cyclone_patches TO {runtime};
-- Failed attempts are written, never changed: their history is what operators read.
GRANT SELECT, INSERT ON {schema}.cyclone_step_attempts TO {runtime};
GRANT SELECT, INSERT, UPDATE, DELETE ON {schema}.cyclone_supervisors, {schema}.cyclone_workers
      TO {runtime};
GRANT SELECT ON {schema}.cyclone_migrations, {schema}.cyclone_v_runs, {schema}.cyclone_v_steps
      TO {runtime};
GRANT USAGE, SELECT ON ALL SEQUENCES IN SCHEMA {schema} TO {runtime};
GRANT EXECUTE ON FUNCTION {schema}.cyclone_delete_finished(float8, integer, timestamptz)
      TO {runtime};
-- History (migration 18): read by the run and step lookups; moved and dropped only through
-- its functions, which run as their owner.
GRANT SELECT ON {schema}.cyclone_history_runs, {schema}.cyclone_history_steps,
      {schema}.cyclone_history_attempts, {schema}.cyclone_history_partitions TO {runtime};
GRANT EXECUTE ON FUNCTION {schema}.cyclone_history_move(float8, float8, integer, timestamptz),
      {schema}.cyclone_history_drop(float8, timestamptz, timestamptz),
      {schema}.cyclone_history_ensure(float8, timestamptz, timestamptz) TO {runtime};
-- Listings, `cyclone status`, metrics: read only, tables added later included.
GRANT USAGE ON SCHEMA {schema} TO {readonly};
GRANT SELECT ON ALL TABLES IN SCHEMA {schema} TO {readonly};
ALTER DEFAULT PRIVILEGES FOR ROLE {migrator} IN SCHEMA {schema} GRANT SELECT ON TABLES
      TO {readonly};

-- name: schema_current
-- The schema a session's unqualified names go to: the one the GRANTs are printed for.
SELECT current_schema() AS schema;
