-- Version 28: a step made held behind another held step of its node does not look for a slot.
--
-- Every held step inserted ran cyclone_admit_steps, whose first test walks up to 16 of the
-- node's available steps (a heap visit each: the entries are too new to be all-visible). In
-- a drain with limits declared and not binding (bench/instructions.py --declared) that was a
-- quarter of the admission's cost: submit_many inserts a batch whose first step admits what
-- fits, and each of the others walked the 16 again to find that nothing more did.
--
-- A held step that leases before the new one (cyclone_steps_held_idx's order) means an
-- admission has already passed over it: the node had 16 steps available, or no free slot, or
-- another transaction held its lock. In the first two cases the steps available or running
-- will end or be leased, and each end admits again (cyclone_steps_free_slot), in lease order,
-- which reaches the new step; in the third, the held_steps sweep admits what that admission
-- could not see. So the new step's trigger looks at the first held step of its node, one
-- index entry, and admits only when that is the new step itself. A rate-limited step always
-- admits: its bucket may be keyed, and the step ahead may wait for another key's tokens.

CREATE OR REPLACE FUNCTION cyclone_steps_admit() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    admitted integer;
    first_held bigint;
BEGIN
    IF NEW.rate_limit IS NULL THEN
        first_held := (SELECT s.id FROM cyclone_steps s
                        WHERE s.held AND s.workflow = NEW.workflow AND s.node = NEW.node
                        ORDER BY s.priority, s.pass, s.id
                        LIMIT 1);
        IF first_held IS DISTINCT FROM NEW.id THEN
            RETURN NULL;  -- behind a held step (or admitted already, by an earlier row's call)
        END IF;
    END IF;
    admitted := cyclone_admit_steps(NEW.workflow, NEW.node, now(), NEW.node_limit);  -- not PERFORM: see cyclone_runs_free_slot
    RETURN NULL;
END
$$;
