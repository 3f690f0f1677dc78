"""deepwell.expert_parallel (torch_ops/deepwell/nn/moe_ep.py) on 2 gloo processes
(tests/_moe_ep_worker.py): each rank holds half the routed experts and sends each token to its
experts' rank and back, and the block computes what the unsharded block computes on the whole
batch: outputs, input gradients, the experts' weight gradients (complete on their rank) and the
replicated parameters' gradients (summed over the ranks). Also when every token goes to one
rank's experts, so the other computes no row."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import spawn

# bf16 on the CPU computes in fp32: each output row is the reference's bit for bit (measured 0.0);
# the gradients summed over rows or ranks differ by summation order (measured up to 8e-6).
# fp8_block (emulated on the CPU) groups wgrad's 128-row blocks by source rank under expert
# parallelism, but its power-of-two block scales (docs/NUMERICS.md "FP8 block") make each value's
# code independent of its block's other rows except near the subnormals: measured up to 6e-7.
TOL = {"y": 1e-6, "x_grad": 1e-5, "expert_grads": 1e-5, "replicated_grads": 5e-5}


@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_expert_parallel_block_computes_the_unsharded_block(tmp_path, recipe):
    ranks = spawn(tmp_path, "_moe_ep_worker.py", 2, recipe, DEEPWELL_TEST_RECIPE=recipe)["ranks"]
    for rank, cases in enumerate(ranks):
        for case, r in cases.items():
            assert r["local_experts"] == 2
            for what, tol in TOL.items():
                assert r[what] <= tol, f"rank {rank}, {case}: {what} off by {r[what]:.2e} (tolerance {tol})"
    assert ranks[0]["one_rank"]["rows"] > 0 and ranks[1]["spread"]["rows"] > 0
    if recipe == "bf16":  # groups aligned to 1 row: no padding, so rank 1's experts get no row at all
        assert ranks[1]["one_rank"]["rows"] == 0


def test_expert_parallel_refuses_what_it_cannot_shard():
    with pytest.raises(RuntimeError, match="deepwell.expert_parallel: torch.distributed is not initialized"):
        deepwell.expert_parallel(deepwell.DeepwellMoE(16, 16, 4, 2))
