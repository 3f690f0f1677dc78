"""deepwell.expert_parallel (torch_ops/deepwell/nn/moe_ep.py) on 2 gloo processes
(tests/distributed/_moe_ep_worker.py): each rank holds half the routed experts and sends each token to its
experts' rank and back, and the block computes what the unsharded block computes on the whole
batch: outputs, input gradients, the experts' weight gradients (complete on their rank) and the
replicated parameters' gradients (summed over the ranks). Also when every token goes to one
rank's experts, so the other computes no row."""

from __future__ import annotations

import pytest
import torch

import deepwell
from _util import FP8_TRAINING_REL, spawn, trains_alike

# bf16 on the CPU computes in fp32: each output row is the reference's bit for bit (measured 0.0);
# the gradients summed over rows or ranks differ by summation order (measured up to 8e-6).
# fp8_block (emulated on the CPU) groups wgrad's 128-row blocks by source rank under expert
# parallelism, but its power-of-two block scales (docs/NUMERICS.md "FP8 block") make each value's
# code independent of its block's other rows except near the subnormals: measured up to 6e-7.
TOL = {"y": 1e-6, "x_grad": 1e-5, "expert_grads": 1e-5, "replicated_grads": 5e-5}


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_expert_parallel_block_computes_the_unsharded_block(tmp_path, recipe):
    ranks = spawn(tmp_path, "distributed/_moe_ep_worker.py", 2, recipe, DEEPWELL_TEST_RECIPE=recipe)["ranks"]
    for rank, cases in enumerate(ranks):
        for case, r in cases.items():
            assert r["local_experts"] == 2
            for what, tol in TOL.items():
                assert r[what] <= tol, f"rank {rank}, {case}: {what} off by {r[what]:.2e} (tolerance {tol})"
    assert ranks[0]["one_rank"]["rows"] > 0 and ranks[1]["spread"]["rows"] > 0
    if recipe == "bf16":  # groups aligned to 1 row: no padding, so rank 1's experts get no row at all
        assert ranks[1]["one_rank"]["rows"] == 0


@pytest.mark.distributed
@pytest.mark.parametrize("recipe", ["bf16", "fp8_block"])
def test_expert_parallel_model_trains_like_one_process(tmp_path, recipe):
    """A 2-block MoE language model, eager, SGD: 2 processes with expert parallelism and
    deepwell.reduce_gradients against 1 process on the whole batch (tests/distributed/_moe_ep_train_worker.py)."""
    one = spawn(tmp_path, "distributed/_moe_ep_train_worker.py", 1, "one", DEEPWELL_TEST_RECIPE=recipe)
    two = spawn(tmp_path, "distributed/_moe_ep_train_worker.py", 2, "two", DEEPWELL_TEST_RECIPE=recipe,
                DEEPWELL_TEST_REFERENCE=str(tmp_path / "one.json"))
    # fp8_block: the later losses drift as the weights do (below), by the floor FP8_TRAINING_REL
    # documents for 2 processes against 1 (1.1e-5 at the third step on one 2-core Xeon).
    rel = 1e-5 if recipe == "bf16" else FP8_TRAINING_REL
    assert trains_alike(one["losses"], two["losses"], rel=rel), (one["losses"], two["losses"])
    assert one["losses"][-1] < one["losses"][0]
    # bf16: the reference's weights up to summation order. fp8_block: a weight that differs in its
    # last fp32 bits can round to another FP8 code in the next step's 128x128 tiles, so the runs
    # drift apart (measured 1e-4 after 3 steps). Both far below how far training moved the experts
    # (measured 5e-3), which a wrongly scaled expert gradient would get wrong by its own size.
    tol = 1e-5 if recipe == "bf16" else 4e-4
    assert one["expert_update"] > 10 * tol, one["expert_update"]
    assert max(two["expert_weight_errors"]) < tol, two["expert_weight_errors"]


def test_expert_parallel_refuses_what_it_cannot_shard():
    with pytest.raises(RuntimeError, match="deepwell.expert_parallel: torch.distributed is not initialized"):
        deepwell.expert_parallel(deepwell.DeepwellMoE(16, 16, 4, 2))


def test_compile_sharding_refuses_an_expert_parallel_block():
    """FSDP2 would gather different ranks' local experts into one wrong tensor: refused by name."""
    from deepwell.distributed.shard import shard

    model = torch.nn.Sequential(deepwell.DeepwellMoE(16, 16, 4, 2, name="layers.0.moe"))
    model[0].ep_size = 2  # as deepwell.expert_parallel leaves it on 2 processes
    with pytest.raises(ValueError, match=r"deepwell.compile: 0 is expert-parallel \(deepwell.expert_parallel\)"):
        shard(model, {"data": 2, "tensor": 1}, {"reshard_after_forward": True})
    assert shard(model, {"data": 1, "tensor": 1}, {}) is model  # one process: nothing to shard


# dcp.load(no_dist=True) still warns that it assumes a single process, which is the point here.
@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_checkpoint_holds_every_rank_s_experts(tmp_path):
    """dcp.save of an expert-parallel model's state dict (tests/distributed/_moe_ep_ckpt_worker.py) writes the
    whole experts: it loads back into 2 expert-parallel processes and into one unsharded process
    bit for bit. Without the state-dict hooks DCP would take the ranks' local experts (same key,
    same shape) for one replicated tensor and keep rank 0's: the unsharded load below would fail."""
    import torch.distributed.checkpoint as dcp

    from _moe_ep_ckpt_worker import DIM, EXPERTS, build

    ckpt = tmp_path / "ckpt"
    ranks = spawn(tmp_path, "distributed/_moe_ep_ckpt_worker.py", 2, "ckpt", DEEPWELL_TEST_CASE="checkpoint",
                  DEEPWELL_TEST_CHECKPOINT=str(ckpt))["ranks"]
    for rank, r in enumerate(ranks):
        assert r["experts_state"] == ["DTensor", [EXPERTS, 2 * DIM, DIM]], r["experts_state"]  # whole gate_up_proj
        assert r["fresh_differs"] > 0
        assert r["reloaded_differ"] == [], f"rank {rank}: {r['reloaded_differ']}"
        assert r["from_unsharded_differ"] == [], f"rank {rank}: {r['from_unsharded_differ']}"
        whole = (EXPERTS, 2 * DIM, DIM)
        assert f"must be a DTensor of shape {whole} sharded on dim 0" in r["plain_refused"], r["plain_refused"]

    # One process, no process group: DCP gathers the two ranks' halves into whole experts.
    model = build(3)
    sd = model.state_dict()
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    model.load_state_dict(sd)
    reference = torch.load(f"{ckpt}.reference.pt")
    got = model.state_dict()
    assert sorted(got) == sorted(reference)
    assert [k for k, v in reference.items() if not torch.equal(got[k], v)] == []


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_optimizer_state_holds_every_rank_s_experts(tmp_path):
    """deepwell.expert_optimizer_state_dict presents AdamW's moments of the local experts as
    Shard(0) DTensors of the whole shape (tests/distributed/_moe_ep_ckpt_worker.py): saved by DCP with the
    model, they load back into 2 expert-parallel processes bit for bit, and one unsharded process
    reads them with torch's own get/set_optimizer_state_dict. Without it each rank's moments,
    plain tensors under one name, would be taken for one replicated tensor: the one-process load
    below would find one rank's moments in place of the other's."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict, set_optimizer_state_dict

    from _moe_ep_ckpt_worker import DIM, EXPERTS, build

    ckpt = tmp_path / "ckpt"
    ranks = spawn(tmp_path, "distributed/_moe_ep_ckpt_worker.py", 2, "optim", DEEPWELL_TEST_CASE="optimizer",
                  DEEPWELL_TEST_CHECKPOINT=str(ckpt))["ranks"]
    for rank, r in enumerate(ranks):
        assert r["moment_state"] == ["DTensor", [EXPERTS, 2 * DIM, DIM]], r["moment_state"]
        assert r["state_differ"] == [] and r["moments_differ"] == [], f"rank {rank}: {r}"

    model = build(3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sd = {"model": model.state_dict(), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=ckpt, no_dist=True)
    model.load_state_dict(sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    moments = torch.load(f"{ckpt}.moments.pt")
    params = dict(model.named_parameters())
    for key, want in moments.items():
        name, k = key.split(" ")
        assert torch.equal(opt.state[params[name]][k], want), key


@pytest.mark.distributed
def test_expert_parallel_to_hf_gathers_the_experts(tmp_path):
    """DeepwellMoE.to_hf on an expert-parallel block (2 processes) all-gathers the experts and gives
    what the unsharded block's to_hf gives, bit for bit."""
    pytest.importorskip("transformers")
    ranks = spawn(tmp_path, "distributed/_moe_ep_ckpt_worker.py", 2, "hf", DEEPWELL_TEST_CASE="to_hf")["ranks"]
    for rank, r in enumerate(ranks):
        assert r["keys"] > 0 and r["same_keys"]
        assert r["differ"] == [], f"rank {rank}: {r['differ']}"


def test_the_trainer_refuses_an_expert_parallel_model():
    """deepwell.Trainer neither reduces an expert-parallel model's gradients nor checkpoints its
    sharded experts: refused at construction, naming the block and the way out. The guard reads
    only ep_size, set here as deepwell.expert_parallel leaves it on 2 processes."""
    from _training import EagerEngine

    model = torch.nn.Sequential(deepwell.DeepwellMoE(16, 16, 4, 2))
    model[0].ep_size = 2
    with pytest.raises(RuntimeError, match=r"deepwell.Trainer: 0 is expert-parallel .*deepwell.reduce_gradients\(model\)"
                                           r".*torch.distributed.checkpoint on model.state_dict\(\)"):
        deepwell.Trainer.from_engine(EagerEngine(model))
