"""The process tree the reaper reads from /proc, and what it picks to kill (no process started:
the tree is given)."""

from __future__ import annotations

import os

from cyclone.child import reaper

#        1
#        |
#       100 (supervisor)
#     /   |    \
#   101  102   150 (a stray: a dead worker's daemon)
#    |          |
#   110        151
#    |
#   111
TREE = {100: 1, 101: 100, 102: 100, 110: 101, 111: 110, 150: 100, 151: 150, 7: 1}


def test_descendants_are_the_whole_subtree_but_what_is_spared() -> None:
    assert sorted(reaper.descendants(100, TREE)) == [101, 102, 110, 111, 150, 151]
    assert sorted(reaper.descendants(100, TREE, skip={101, 102})) == [150, 151]
    assert sorted(reaper.descendants(101, TREE)) == [110, 111]
    assert reaper.descendants(111, TREE) == []


def test_the_tree_is_read_from_proc_with_this_process_in_it() -> None:
    tree = reaper.parents()
    assert tree[os.getpid()] == os.getppid()
    # A command with ")" and spaces in it must not shift the fields (comm is "(...)").
    assert all(isinstance(pid, int) and isinstance(ppid, int) for pid, ppid in tree.items())


def test_a_command_with_spaces_and_parentheses_does_not_shift_the_fields() -> None:
    assert reaper.ppid_of(b"4242 (evil) 1 (x) S 77 4242 4242 0 -1") == 77  # comm "evil) 1 (x"
    assert reaper.ppid_of(b"4242 (sleep) S 77 4242 4242 0 -1 4194304") == 77
    assert reaper.ppid_of(b"4242 (a) b) R 9 1 1") == 9
    assert reaper.ppid_of(b"garbage") is None
