"""What both sides of the fork share: the supervisor imports it, and so do its children.

channel.py     the channel protocol (a socket pair: reports up, `given` answers down) and the
               exit codes a child leaves with
process.py     a child's set-up after the fork (init_process), its signal self-pipe (Wakeup),
               ChildExit, and the check that its supervisor is still there
proctitle.py   process titles
lease.py       lease_trust (how long a lease is acted on, by the keeper and the arbiter alike),
               and the RenewalBoard where the supervisor tells its workers of each renewal
session.py     connect_briefly: a connection with a statement_timeout, checked once a process
reaper.py      child subreapers: what a step started (daemons too) ends with it
limits.py      a worker's own limits after the fork ([worker] max_memory)
environ.py     a worker's environment without the database's secrets, before handlers run

Imports run one way: cyclone.supervisor -> cyclone.worker, cyclone.scanner -> cyclone.child ->
the engine and the core modules (tests/unit/test_import_direction.py holds them to it).
"""
