-- Version 21: the DLQ by reason (the web console's DLQ page, `cyclone dlq list --reason`, the
-- DLQ depth that `cyclone status` and the metrics count by reason). With only
-- cyclone_steps_dead_idx (by completed_at), a count by reason visited every dead step's heap
-- row (103,355 pages, 0.8 s, for a DLQ of 103,073 steps in a 10M-run history), and a listing of
-- one reason walked the whole DLQ for it. Dead steps only: a step is written here once, when
-- it is dead-lettered, so the engine's hot path pays nothing.
CREATE INDEX cyclone_steps_dead_kind_idx ON cyclone_steps (error_kind, completed_at, id)
    WHERE state = 'dead';
