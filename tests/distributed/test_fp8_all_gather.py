"""FSDP2's FP8 weight all-gather (`deepwell.autoplan(..., fp8_all_gather=True)`; distributed/fp8_all_gather.py
chooses the weights, distributed/fp8_weights.py gathers them): which weights take it and why the others do
not, the gathered weight running scaled_linear from its codes bit for bit, and, on 2 gloo processes
on the CPU (tests/distributed/_fsdp_worker.py), training steps whose losses and gradients are bit-identical to
the high-precision all-gather's, compiled and eager, with checkpoints that save and resume."""

from __future__ import annotations

import os

import pytest
import torch

import deepwell
from _util import same_bits, spawn, trains_alike
from deepwell.distributed import fp8_all_gather
from deepwell.distributed.fp8_weights import Fp8BlockGathered
from deepwell.models import Llama

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch built without distributed")

ops = torch.ops.deepwell
LINEARS = ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w3", "feed_forward.w2")


def _plan(dim: int = 256, recipe: str = "fp8_block", tied: bool = False, overrides=None, **kw):
    torch.manual_seed(0)
    model = Llama(256, dim, 2, 4, 2 * dim, max_seq=64, tied=tied)
    ir = deepwell.capture(model, (torch.randint(0, 256, (2, 64)),))
    policy = deepwell.PrecisionPolicy(precision=recipe, min_features=128, first_last_bf16=False,
                                      name_overrides=overrides or {})
    return deepwell.autoplan(ir, policy=policy, **{"world_size": 2, **kw})


def _weights(*linears: str, layers=(0, 1)) -> list[str]:
    return [f"layers.{i}.{name}.weight" for i in layers for name in linears]


def test_off_by_default():
    plan = _plan()
    assert plan.sharding["fp8_all_gather"] is False and plan.sharding["fp8_gathered"] == []
    assert "FP8" not in plan.sharding["reason"]


def test_fp8_block_weights_of_whole_tiles_are_gathered_as_codes():
    plan = _plan(fp8_all_gather=True)
    assert plan.sharding["fp8_all_gather"] and sorted(plan.sharding["fp8_gathered"]) == sorted(_weights(*LINEARS))
    assert "FP8 all-gather (fp8_block codes + tile scales) for 14 weights" in plan.sharding["reason"]
    assert "output (recipe bf16)" in plan.sharding["reason"]  # the LM head stays bf16, gathered as before


def test_other_recipes_and_partial_tiles_fall_back():
    """Weights whose site is not fp8_block, or whose shard is not whole 128-row tiles, keep FSDP2's
    high-precision all-gather, and the reason names them."""
    plan = _plan(recipe="mxfp8", fp8_all_gather=True)
    assert plan.sharding["fp8_gathered"] == [] and "layers.0.attention.wq (recipe mxfp8)" in plan.sharding["reason"]
    # d=128: q/k/v/o (128 x 128) and w2 (128 x 256) hold 64 rows per rank; w1/w3 (256 x 128) 128.
    plan = _plan(dim=128, fp8_all_gather=True)
    assert sorted(plan.sharding["fp8_gathered"]) == sorted(_weights("feed_forward.w1", "feed_forward.w3"))
    assert "128x128 does not split into whole 128-row tiles over 2 ranks" in plan.sharding["reason"]


def test_graph_mates_tied_weights_tensor_parallelism_and_one_process():
    # One compiled graph serves wq of every block: wq planned bf16 in one block keeps them all off.
    plan = _plan(fp8_all_gather=True, overrides={"layers.0.attention.wq": "bf16"})
    assert sorted(plan.sharding["fp8_gathered"]) == sorted(_weights(*LINEARS[1:]))
    assert "layers.1.attention.wq (its block graph is shared with a site planned otherwise)" in plan.sharding["reason"]
    # A tied LM head's GEMM reads the embedding's weight (the site's name), which F.embedding reads too.
    plan = _plan(tied=True, fp8_all_gather=True, overrides={"tok_embeddings": "fp8_block"})
    assert len(plan.sharding["fp8_gathered"]) == 14 and "tok_embeddings (not the weight of an nn.Linear)" in plan.sharding["reason"]
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False), torch.nn.Linear(256, 256, bias=False))
    model[1].weight = model[0].weight
    assert fp8_all_gather.choose(model, {"0": "fp8_block"}, 2, 1) == ([], "FP8 all-gather (fp8_block codes + tile scales) "
                                                                    "for 0 weights; high-precision gather for 0 (the weight is shared (tied))")
    plan = _plan(fp8_all_gather=True, tensor_parallel=2, world_size=4)
    assert plan.sharding["fp8_gathered"] == [] and "not with tensor parallelism" in plan.sharding["reason"]
    plan = _plan(fp8_all_gather=True, world_size=1)
    assert plan.sharding["fp8_all_gather"] and plan.sharding["fp8_gathered"] == []


def test_a_plan_for_another_world_size_is_refused():
    model = torch.nn.Sequential(torch.nn.Linear(256, 256, bias=False))
    with pytest.raises(RuntimeError, match=r"0.weight \(256x256\) is planned for the FP8 all-gather but does not split"):
        fp8_all_gather.apply(model, ["0.weight"], data=4)


def _gathered(w: torch.Tensor) -> torch.nn.Parameter:
    """What FSDP2 builds from a weight's gathered codes (every rank's tiles: the whole weight's)."""
    data, scale = ops.fp8_block_quantize(w.contiguous(), 128, 128, True)
    return torch.nn.Parameter(Fp8BlockGathered(data, scale, w.dtype))


@pytest.mark.parametrize("recipe", ["fp8_block", "fp8_block@sm_90"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gathered_weight_runs_scaled_linear_from_its_codes(recipe, dtype):
    """y, dx and dW of scaled_linear on the gathered weight (quantized_linear and
    quantized_linear_backward on its codes) equal those on the high-precision weight bit for bit;
    dW is a plain tensor of the weight's dtype (what FSDP2 reduce-scatters). n = 512 and k = 512
    make sm_90's dgrad and fprop run its native blockwise GEMMs (through their CPU model)."""
    g = torch.Generator().manual_seed(3)
    for shape_x, n in [((2, 8, 512), 512), ((16, 256), 128)]:
        x = torch.randn(shape_x, generator=g).to(dtype)
        w = (torch.randn(n, shape_x[-1], generator=g) / shape_x[-1] ** 0.5).to(dtype)
        dy = torch.randn(*shape_x[:-1], n, generator=g).to(dtype)
        results = []
        for weight in (w.clone().requires_grad_(), _gathered(w)):
            xi = x.clone().requires_grad_()
            y = ops.scaled_linear(xi, weight, None, recipe, None)
            y.backward(dy)
            results.append((y, xi.grad, weight.grad))
        (y0, dx0, dw0), (y1, dx1, dw1) = results
        assert type(dw1) is torch.Tensor and dw1.dtype == dtype
        assert same_bits(y0, y1) and same_bits(dx0, dx1) and same_bits(dw0, dw1), (recipe, shape_x)


def test_gathered_weight_refuses_other_readers():
    """Only scaled_linear in fp8_block reads the codes: anything else would have read the
    high-precision weight, so it is an error naming the op, eager or compiled (without the deepwell
    backend, which rewrites the site's F.linear into scaled_linear)."""
    w = _gathered(torch.randn(256, 256))
    x = torch.randn(4, 256)
    with pytest.raises(RuntimeError, match=r"aten.t.default reached a weight FSDP2 gathered as fp8_block codes"):
        torch.nn.functional.linear(x, w)
    with pytest.raises(RuntimeError, match=r"recipe 'mxfp8' reached a weight FSDP2 gathered as fp8_block codes"):
        ops.scaled_linear(x, w, None, "mxfp8", None)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"gathered as fp8_block codes"):
        torch.compile(torch.nn.functional.linear, backend="inductor")(x, w)


def test_shard_checkpoints_as_a_plain_tensor():
    """The state dict holds the plain shard (sharing its storage), and loading writes into it."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 128, bias=False))
    fp8_all_gather.apply(model, ["0.weight"], data=1)
    sd = model.state_dict()
    assert type(sd["0.weight"]) is torch.Tensor and fp8_all_gather.is_fp8_gathered(model[0].weight)
    assert sd["0.weight"].data_ptr() == model[0].weight._tensor.data_ptr()
    new = torch.randn(128, 256)
    model.load_state_dict({"0.weight": new})
    assert torch.equal(model[0].weight._tensor, new)


def _grads(tmp_path, tag: str, **env) -> tuple[dict, list]:
    """A 2-process run's result and each rank's per-step loss and gradient shards."""
    result = spawn(tmp_path, "distributed/_fsdp_worker.py", 2, tag, DEEPWELL_TEST_GRADS="1", **env)
    return result, [torch.load(tmp_path / f"{tag}.json.rank{r}.pt") for r in range(2)]


def _bit_identical(a: list, b: list) -> bool:
    return all(
        len(ra) == len(rb) and all(sa.keys() == sb.keys() and all(same_bits(sa[k], sb[k]) for k in sa) for sa, sb in zip(ra, rb))
        for ra, rb in zip(a, b)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("mode,dim,dtype", [("loop", 128, "bfloat16"), ("eager", 256, "float32")])
def test_training_is_bit_identical_to_the_high_precision_all_gather(tmp_path, mode, dim, dtype):
    """3 AdamW steps of a 2-block LLaMA on 2 ranks, fp8_block on every block GEMM: with the FP8
    all-gather every rank's loss and gradient shards equal those of the high-precision all-gather
    bit for bit, compiled by deepwell.compile (d=128 in bf16: q/k/v/o and w2 fall back, w1/w3 are
    gathered as codes, one FSDP2 all-gather mixing both) and eager (d=256 in fp32: all 14 weights).
    Every gathered weight goes through fsdp_pre_all_gather before each forward and backward."""
    # Both runs on scaled_linear (fp8_block_codes=False): FP8-gathered weights never take the
    # from-codes ops, so only there is the all-gather the one difference between the runs.
    env = {"DEEPWELL_TEST_MODE": mode, "DEEPWELL_TEST_DIM": str(dim), "DEEPWELL_TEST_DTYPE": dtype,
           "DEEPWELL_TEST_CODES": "0"}
    fp8, fp8_grads = _grads(tmp_path, "fp8", DEEPWELL_TEST_FP8_ALL_GATHER="1", **env)
    high, high_grads = _grads(tmp_path, "high", **env)
    gathered = fp8["fp8_gathered"]
    assert len(gathered) == (4 if dim == 128 else 14) and high["fp8_gathered"] == []
    assert fp8["fp8_pre_all_gathers"] == len(gathered) * 2 * 3  # forward + backward, 3 steps
    assert {n for n, t in fp8["local_types"].items() if t == "Fp8BlockShard"} == set(gathered)
    assert set(fp8["state_dict_types"].values()) == {"Tensor"}
    assert _bit_identical(fp8_grads, high_grads)
    assert fp8["losses"] == high["losses"]
    if mode == "loop":
        assert fp8["ran"] == high["ran"] and set(fp8["ran"]) == {"fp8_block"}
        assert fp8["predicted_gathered_bytes"] < high["predicted_gathered_bytes"]


@pytest.mark.distributed
def test_checkpoints_save_and_resume_with_the_fp8_all_gather(tmp_path):
    """deepwell.Trainer on 2 ranks with the FP8 all-gather: sharded checkpoints (DCP, plain
    tensors) resume a fresh sharded model bit for bit, a damaged shard is a CheckpointError, the
    full format resumes alike, and one process (no FSDP, no FP8 gather) resumes both with one
    process's losses."""
    env = {"DEEPWELL_TEST_MODE": "trainer", "DEEPWELL_TEST_RECIPE": "fp8_block", "DEEPWELL_TEST_FP8_ALL_GATHER": "1"}
    two = spawn(tmp_path, "distributed/_fsdp_worker.py", 2, "trainer", DEEPWELL_TEST_CORRUPT="1", DEEPWELL_TEST_NO_GATHER="1", **env)
    full = spawn(tmp_path, "distributed/_fsdp_worker.py", 2, "trainer-full", DEEPWELL_TEST_CKPT_TAG="-full",
                 DEEPWELL_TEST_CKPT_FORMAT="full", **env)
    crosses = [tmp_path / "ckpt-world2" / "step_00000001", tmp_path / "ckpt-world2-full" / "step_00000001"]
    one = spawn(tmp_path, "distributed/_fsdp_worker.py", 1, "trainer-one", DEEPWELL_TEST_MODE="trainer",
                CROSS_RESUME=os.pathsep.join(map(str, crosses)))
    assert two["fp8_pre_all_gathers"] > 0 and len(two["fp8_gathered"]) == 14
    assert two["resumed"] == two["losses"] and full["resumed"] == full["losses"] == two["losses"]
    assert len(two["errors"]) == 2 and all("__1_0.distcp is corrupted" in e for e in two["errors"])
    assert trains_alike(one["losses"], two["losses"]) and len(one["crossed"]) == 2
    assert all(trains_alike(one["losses"], c) for c in one["crossed"])

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = FileSystemReader(str(crosses[0] / "dcp")).read_metadata().state_dict_metadata
    wq = meta["model.layers.0.attention.wq.weight"]
    assert isinstance(wq, TensorStorageMetadata) and wq.size == torch.Size([256, 256])
