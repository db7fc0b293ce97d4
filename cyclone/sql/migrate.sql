-- name: migration_lock
-- One migrator at a time per schema; the others wait, then find nothing left to do. Held to
-- the end of the transaction, not the session: behind a transaction-mode pooler the session's
-- next statement may run on another server connection, which could not unlock it.
SELECT pg_advisory_xact_lock(hashtext(current_schema() || '.cyclone_migrations'));

-- name: migration_lock_timeout
-- How long the lock above may be waited for, in this transaction only (0: forever). Returns
-- the session's own value, to be set back once the lock is held: the migrations' DDL waits
-- for its table locks as it always did.
SELECT current_setting('lock_timeout') AS previous, current_schema() AS schema,
       set_config('lock_timeout', %(timeout)s, true) AS timeout;

-- name: migration_lock_timeout_restore
SELECT set_config('lock_timeout', %(previous)s, true) AS timeout;

-- name: migration_table_create
CREATE TABLE IF NOT EXISTS cyclone_migrations (
    version    integer PRIMARY KEY,
    name       text NOT NULL,
    applied_at timestamptz NOT NULL DEFAULT now()
);

-- name: migration_table_present
-- Whether the migrations table exists: a role without DDL rights (the runtime role) can then
-- find the schema current without trying to create it.
SELECT to_regclass('cyclone_migrations') IS NOT NULL AS present;

-- name: migration_applied
SELECT version FROM cyclone_migrations ORDER BY version;

-- name: migration_record
INSERT INTO cyclone_migrations (version, name) VALUES (%(version)s, %(name)s);

-- name: migration_record_all
-- A schema made from schema.sql: every migration it stands for, recorded at once.
INSERT INTO cyclone_migrations (version, name)
SELECT * FROM unnest(%(versions)s::integer[], %(names)s::text[]);

-- name: schema_create
-- The test harness's private schema, named by a quoted identifier.
CREATE SCHEMA {};

-- name: schema_drop
DROP SCHEMA IF EXISTS {} CASCADE;
