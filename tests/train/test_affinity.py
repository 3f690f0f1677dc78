"""deepwell.pin_cores: each local rank gets its own run of whole physical cores (hyperthread
siblings stay together), on made-up topologies; and pinning this process really changes its
affinity (restored afterwards)."""

from __future__ import annotations

import os
import threading

import pytest

import deepwell
from deepwell.train.affinity import cores_for, physical_cores

# 4 cores x 2 hyperthreads, Linux's usual numbering: CPU c and c + 4 share core c.
HT = {c: (0, c % 4) for c in range(8)}


def test_siblings_stay_together_and_ranks_split_the_cores():
    assert physical_cores(range(8), HT.get) == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert cores_for(0, 2, range(8), HT.get) == [0, 1, 4, 5]
    assert cores_for(1, 2, range(8), HT.get) == [2, 3, 6, 7]
    shares = [set(cores_for(r, 4, range(8), HT.get)) for r in range(4)]
    assert shares == [{0, 4}, {1, 5}, {2, 6}, {3, 7}]


def test_uneven_splits_unknown_topology_and_more_ranks_than_cores():
    # 3 cores over 2 ranks: the first rank takes the extra core.
    cores = {0: (0, 0), 1: (0, 1), 2: (0, 2)}
    assert cores_for(0, 2, [0, 1, 2], cores.get) == [0, 1]
    assert cores_for(1, 2, [0, 1, 2], cores.get) == [2]
    # No topology: each CPU is a core; two packages keep their own core ids apart.
    assert cores_for(1, 2, [4, 5, 6, 7], lambda c: None) == [6, 7]
    assert physical_cores([0, 1], {0: (0, 0), 1: (1, 0)}.get) == [[0], [1]]
    # More ranks than cores: round-robin, every rank gets one.
    assert [cores_for(r, 3, [0, 1], lambda c: None) for r in range(3)] == [[0], [1], [0]]


def test_bad_rank_is_named():
    with pytest.raises(ValueError, match=r"deepwell.pin_cores: local_rank must be in \[0, 2\), got 2"):
        cores_for(2, 2, range(8), HT.get)


def test_pinning_moves_this_process_and_its_new_threads():
    own = os.sched_getaffinity(0)
    if len(physical_cores(own)) < 2:
        pytest.skip("needs two physical cores to pin to a part of them")
    try:
        mine = deepwell.pin_cores(local_rank=0, local_world=2)
        assert set(mine) == set(cores_for(0, 2)) and set(mine) < own
        assert os.sched_getaffinity(0) == set(mine)
        seen = {}
        t = threading.Thread(target=lambda: seen.setdefault("cpus", os.sched_getaffinity(0)))
        t.start()
        t.join()
        assert seen["cpus"] == set(mine)
    finally:
        for task in os.listdir("/proc/self/task"):
            try:
                os.sched_setaffinity(int(task), own)
            except OSError:
                pass
