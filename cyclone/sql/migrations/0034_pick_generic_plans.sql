-- Version 34: cyclone_lease_pick and cyclone_lease_pick_one keep one plan for each of their
-- statements, as the SQL functions they call do.
--
-- A PL/pgSQL function's statements are planned through the plan cache like a prepared
-- statement's: each with the call's values while a custom plan looks cheaper than the generic
-- one. For the pick's probe of the limited nodes (a join of cyclone_limited_nodes with two
-- LATERAL lookups) it always did, so every call planned the probe anew: 0.6 ms of planning for
-- 0.07 ms of execution, on every statement the supervisor sent while any node had a limit.
-- A drain of steps of no limit paid it too (bench/README.md, "Migration 34"): the pick cost
-- about 190 us a call more than cyclone_lease_candidates alone, and 35 us with this.

ALTER FUNCTION cyclone_lease_pick(integer, uuid[], timestamptz, text[], smallint, bigint, bigint,
                                  text[], boolean)
    SET plan_cache_mode = force_generic_plan;

ALTER FUNCTION cyclone_lease_pick_one(boolean, uuid, timestamptz, text[], smallint, bigint,
                                      bigint, text[])
    SET plan_cache_mode = force_generic_plan;
