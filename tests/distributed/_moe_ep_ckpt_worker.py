"""One process of tests/distributed/test_moe_ep.py's checkpoint and Hugging Face tests (gloo on the CPU).

DEEPWELL_TEST_CASE=checkpoint: RANK of WORLD builds the small MoE language model of
tests/distributed/_moe_lm.py (seed 0, the same on every rank), shards it with deepwell.expert_parallel and
saves `model.state_dict()` with torch.distributed.checkpoint to DEEPWELL_TEST_CHECKPOINT; rank 0
also saves the unsharded model's state dict beside it (torch.save, `<dir>.reference.pt`) for the
test to load the checkpoint into one unsharded process and compare. Then, in these processes, a
model of other weights, sharded alike, loads the checkpoint (dcp.load + load_state_dict) and
another loads the unsharded model's state dict: each rank reports the tensors that differ from the
saved model's (none expected), and the refusal of a plain local tensor.

DEEPWELL_TEST_CASE=optimizer: the same model after one AdamW step on each rank's own tokens; its
optimizer state through deepwell.expert_optimizer_state_dict saved with the model by DCP, loaded
back into a model and optimizer that took another step (deepwell.load_expert_optimizer_state_dict);
each rank reports the states that differ. Rank 0 saves the whole experts' moments, all-gathered
(`<dir>.moments.pt`), for the test's one-process load.

DEEPWELL_TEST_CASE=to_hf: a DeepSeek-V3 MoE block of transformers (8 experts, shared experts,
score-correction bias) converted to DeepwellMoE, sharded, and converted back with `to_hf` (which
all-gathers the experts): each rank reports the HF tensors that differ from the unsharded
block's `to_hf`.

    python tests/distributed/_moe_ep_ckpt_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import copy
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import deepwell
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _moe_lm import MoELM  # noqa: E402
from _util import finish_rank  # noqa: E402

VOCAB, DIM, LAYERS, EXPERTS, TOP_K = 64, 32, 2, 4, 2


def build(seed: int) -> MoELM:
    """The model every rank (and the test's own process) builds; `seed` sets every weight, the
    expert biases and token counts included (else zeros, which any load would get right)."""
    torch.manual_seed(seed)
    model = MoELM(VOCAB, DIM, LAYERS, EXPERTS, TOP_K, num_shared_experts=1, expert_bias=True)
    for layer in model.layers:
        layer.moe.expert_bias.normal_()
        layer.moe.tokens_per_expert.uniform_(0, 100)
    return model


def tensors(model) -> dict[str, torch.Tensor]:
    """Parameters and buffers as the model holds them (plain tensors, local experts)."""
    return {**dict(model.named_parameters()), **dict(model.named_buffers())}


def differing(model, want) -> list[str]:
    mine, theirs = tensors(model), tensors(want)
    return [n for n, t in theirs.items() if not torch.equal(mine[n], t)]


def checkpoint(rank: int) -> dict:
    ckpt = os.environ["DEEPWELL_TEST_CHECKPOINT"]
    reference = build(0)
    if rank == 0:
        torch.save(reference.state_dict(), ckpt + ".reference.pt")
    model = copy.deepcopy(reference)
    deepwell.expert_parallel(model)
    sd = model.state_dict()
    w = sd["layers.0.moe.experts.gate_up_proj"]
    result = {"experts_state": [type(w).__name__, list(w.shape)]}
    dcp.save(sd, checkpoint_id=ckpt)

    fresh = build(1)
    deepwell.expert_parallel(fresh)
    result["fresh_differs"] = len(differing(fresh, model))  # else the load below proves nothing
    sd = fresh.state_dict()
    dcp.load(sd, checkpoint_id=ckpt)
    fresh.load_state_dict(sd)
    result["reloaded_differ"] = differing(fresh, model)

    # An unsharded model's state dict: each rank keeps its slice of the whole experts.
    other = build(2)
    deepwell.expert_parallel(other)
    other.load_state_dict(reference.state_dict())
    result["from_unsharded_differ"] = differing(other, model)

    # A plain (E / world, ...) tensor could be any rank's experts: refused.
    plain = {k: v.to_local() if isinstance(v, DTensor) else v for k, v in model.state_dict().items()}
    try:
        other.load_state_dict(plain)
        result["plain_refused"] = None
    except RuntimeError as e:
        result["plain_refused"] = str(e)
    return result


def _adamw_step(model, seed: int) -> torch.optim.Optimizer:
    """An AdamW of `model` after one step on tokens drawn from `seed`, gradients reduced over the
    processes: the optimizer has moments for every parameter."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().square().mean().backward()
    deepwell.reduce_gradients(model)
    opt.step()
    return opt


def _expert_moments(model, opt) -> dict[str, torch.Tensor]:
    """AdamW's moments of every block's whole experts, all-gathered (a collective)."""
    out = {}
    for path, m in model.named_modules():
        if isinstance(m, deepwell.DeepwellMoE):
            for name in ("gate_up_proj", "down_proj"):
                state = opt.state[getattr(m.experts, name)]
                for k in ("exp_avg", "exp_avg_sq"):
                    parts = [torch.empty_like(state[k]) for _ in range(dist.get_world_size())]
                    dist.all_gather(parts, state[k])
                    out[f"{path}.experts.{name} {k}"] = torch.cat(parts)
    return out


def optimizer(rank: int) -> dict:
    """The optimizer's state through deepwell.expert_optimizer_state_dict: saved with the model by
    DCP, loaded back into 2 expert-parallel processes whose optimizer took another step; rank 0
    saves the gathered whole moments (`<dir>.moments.pt`) for the test's one-process load."""
    ckpt = os.environ["DEEPWELL_TEST_CHECKPOINT"]
    model = build(0)
    deepwell.expert_parallel(model)
    opt = _adamw_step(model, seed=rank)  # each rank its own tokens: the moments differ per rank
    moments = _expert_moments(model, opt)
    if rank == 0:
        torch.save(moments, ckpt + ".moments.pt")
    osd = deepwell.expert_optimizer_state_dict(model, opt)
    state = osd["state"]["layers.0.moe.experts.gate_up_proj"]["exp_avg"]
    result = {"moment_state": [type(state).__name__, list(state.shape)]}
    dcp.save({"model": model.state_dict(), "optim": osd}, checkpoint_id=ckpt)

    fresh = build(1)
    deepwell.expert_parallel(fresh)
    fresh_opt = _adamw_step(fresh, seed=10 + rank)
    msd, fosd = fresh.state_dict(), deepwell.expert_optimizer_state_dict(fresh, fresh_opt)
    dcp.load({"model": msd, "optim": fosd}, checkpoint_id=ckpt)
    fresh.load_state_dict(msd)
    deepwell.load_expert_optimizer_state_dict(fresh, fresh_opt, fosd)
    names = {p: n for n, p in model.named_parameters()}
    result["state_differ"] = [
        f"{names[p]} {k}" for p, q in zip(model.parameters(), fresh.parameters())
        for k, v in opt.state[p].items() if not torch.equal(v, fresh_opt.state[q][k])
    ]
    result["moments_differ"] = [k for k, v in _expert_moments(fresh, fresh_opt).items() if not torch.equal(v, moments[k])]
    return result


def to_hf() -> dict:
    import transformers

    from deepwell.nn.moe_hf import _hf_class

    # tests/nn/test_moe_hf.py's tiny DeepSeek-V3, its 8 experts split 4 + 4.
    config = transformers.DeepseekV3Config(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
        intermediate_size=48, max_position_embeddings=64, n_routed_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, n_shared_experts=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
        norm_topk_prob=True, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
        qk_nope_head_dim=8, v_head_dim=16)
    torch.manual_seed(0)
    hf = _hf_class(config)(config)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
        hf.gate.e_score_correction_bias.normal_(0, 0.05)
    full = deepwell.DeepwellMoE.from_hf(hf)
    block = deepwell.DeepwellMoE.from_hf(hf)
    deepwell.expert_parallel(block)
    got, want = block.to_hf(config).state_dict(), full.to_hf(config).state_dict()
    return {"keys": len(want), "same_keys": sorted(got) == sorted(want),
            "differ": [k for k, v in want.items() if not torch.equal(got[k], v)]}


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    case = os.environ["DEEPWELL_TEST_CASE"]
    result = checkpoint(rank) if case == "checkpoint" else optimizer(rank) if case == "optimizer" else to_hf()
    every = [None] * world
    dist.all_gather_object(every, result)
    finish_rank({"ranks": every}, rank, world, out)


if __name__ == "__main__":
    main()
