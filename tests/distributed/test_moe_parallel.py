"""deepwell.DeepwellMoE under data parallelism (2 gloo processes on the CPU, tests/distributed/_moe_dp_worker.py):
the step API shards an MoE language model with FSDP2 (the experts' stacked weights included) and it
trains like one process, and aux-loss-free balancing moves every rank's expert bias alike, from
all ranks' token counts."""

from __future__ import annotations

import pytest

from _util import spawn, trains_alike

pytestmark = pytest.mark.distributed


def test_moe_model_under_fsdp_trains_like_one_process_with_one_expert_bias(tmp_path):
    one = spawn(tmp_path, "distributed/_moe_dp_worker.py", 1, "one")
    two = spawn(tmp_path, "distributed/_moe_dp_worker.py", 2, "two")
    assert two["parallelism"]["data"] == 2 and two["sharded"].startswith("FSDP")
    assert two["experts_sharded"] == "DTensor"  # the experts' (E, 2F, D) weights are FSDP shards
    assert trains_alike(one["losses"], two["losses"]), (one["losses"], two["losses"])
    # update_expert_bias sums the counts over the ranks: the ranks' biases are equal (from their own
    # counts alone they drift apart after the first step) and are what one process's tokens give.
    (solo,), (rank0, rank1) = one["biases"], two["biases"]
    assert rank0 == rank1, (rank0, rank1)
    assert any(b != 0 for layer in rank0 for b in layer), "the biases moved"
    assert rank0 == solo, (rank0, solo)
    for run in (one, two):
        assert run["skipped_update"] == {"kept": True, "same": True, "moved": True}, run["skipped_update"]
