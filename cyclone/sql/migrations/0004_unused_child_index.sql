-- Version 4: drop the index of steps by child run. No statement reads steps by child_run_id
-- (a child run names its parent step itself, in cyclone_runs.parent_step_id), but every
-- statement that writes cyclone_steps opened the index and readied its predicate.
DROP INDEX cyclone_steps_child_idx;
