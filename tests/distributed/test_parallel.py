"""Scale-out: the Rust parallel planner through autoplan, the FSDP2 sharding deepwell.compile
applies, dryrun per rank, and a 2-process gloo run on the CPU (tests/distributed/_fsdp_worker.py) whose losses
match one process's."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch

import deepwell
from _util import trains_alike
from deepwell import _native
from deepwell.compiler.backend import _from_fixed_plan
from deepwell.plan.options import Fallback
from deepwell.core.policy import LayerDecision
from deepwell.models import Llama
from deepwell.plan.sites import Plan, Site

WORKER = os.path.join(os.path.dirname(__file__), "_fsdp_worker.py")


def _ir():
    torch.manual_seed(0)
    model = Llama(256, 256, 2, 4, 512, max_seq=64)
    return deepwell.capture(model, (torch.randint(0, 256, (2, 64)),))


def test_one_process_is_not_sharded():
    plan = deepwell.autoplan(_ir())
    assert plan.parallelism == {"data": 1, "tensor": 1, "pipeline": 1, "expert": 1}
    assert not plan.sharding["fsdp"] and "torchrun" in plan.sharding["reason"]


def test_two_processes_plan_fsdp_and_compile_needs_them():
    ir = _ir()
    plan = deepwell.autoplan(ir, world_size=2)
    assert (plan.parallelism["data"], plan.parallelism["tensor"]) == (2, 1)
    assert plan.sharding["fsdp"] and "FSDP over 2 data ranks" in plan.sharding["reason"]
    assert "parallel: data 2 x tensor 1" in plan.table()
    with pytest.raises(RuntimeError, match="the plan is for 2 processes .* torch.distributed is not initialised"):
        deepwell.compile(ir, plan=plan)


def test_planner_decides_tensor_parallel_from_memory():
    """The Rust rules seen through the C API: what does not fit in data parallel gets TP (peer
    links only), and the plan says so."""
    gib = 1 << 30
    model = {"weight_bytes": 2 * gib, "gradient_bytes": 2 * gib, "optimizer_bytes": 4 * gib,
             "activation_bytes": 100 * gib, "largest_unit_bytes": gib // 8}
    cluster = {"world_size": 2, "devices_per_node": 2, "memory_bytes": 80 * gib, "peer_access": True}
    p = _native.call("parallel_plan", {"cluster": cluster, "model": model})
    assert (p["data"], p["tensor"]) == (1, 2) and "tensor parallel 2" in p["reason"]
    p = _native.call("parallel_plan", {"cluster": {**cluster, "peer_access": False}, "model": model})
    assert (p["data"], p["tensor"]) == (2, 1) and "does not fit" in p["reason"]
    with pytest.raises(ValueError, match="missing field 'peer_access'"):
        _native.call("parallel_plan", {"cluster": {"world_size": 2, "devices_per_node": 1, "memory_bytes": 0}, "model": model})


def test_fsdp_on_gpus_leaves_sms_to_the_collectives():
    """GPU processes with data parallelism over NCCL plan an SM carveout for FSDP's overlapped
    collectives (Rust's COMM_SMS); one node's GPUs with peer access move them on the copy engines
    and leave none; CPU processes and tensor parallelism alone do not. Applying it sets torch's
    process-wide carveout on CUDA only, and never overrides one the user set."""
    from deepwell.distributed.shard import leave_sms_to_collectives

    gib = 1 << 30
    model = {"weight_bytes": 2 * gib, "gradient_bytes": 2 * gib, "optimizer_bytes": 4 * gib,
             "activation_bytes": 10 * gib, "largest_unit_bytes": gib // 8}
    cluster = {"world_size": 2, "devices_per_node": 2, "memory_bytes": 80 * gib, "peer_access": True}
    p = _native.call("parallel_plan", {"cluster": cluster, "model": model})
    assert (p["data"], p["collectives"], p["sm_carveout"]) == (2, "copy_engine", 0) and "copy engines" in p["reason"]
    cluster = {**cluster, "peer_access": False}
    p = _native.call("parallel_plan", {"cluster": cluster, "model": model})
    assert p["data"] == 2 and p["collectives"] == "process_group"
    assert p["sm_carveout"] > 0 and f"leave {p['sm_carveout']} SMs" in p["reason"]
    assert _native.call("parallel_plan", {"cluster": {**cluster, "memory_bytes": 0}, "model": model})["sm_carveout"] == 0
    tp = _native.call("parallel_plan", {"cluster": {**cluster, "peer_access": True},
                                        "model": {**model, "activation_bytes": 100 * gib}})
    assert (tp["tensor"], tp["sm_carveout"]) == (2, 0)
    assert deepwell.autoplan(_ir(), world_size=2).sharding["sm_carveout"] == 0  # the CPU: memory unknown
    # Weights kept gathered: FSDP units of 1, 2, 4, ... blocks (Rust's unit_blocks); the caller's
    # block count is optional (none: no block units) and must be a count.
    assert p["unit_blocks"] == [] and not p["reshard_after_forward"]
    kept = _native.call("parallel_plan", {"cluster": cluster, "model": {**model, "blocks": 16}})
    assert kept["unit_blocks"] == [1, 2, 4, 8, 1] and "FSDP units of [1, 2, 4, 8, 1] blocks" in kept["reason"]
    assert kept["ends_join_blocks"] and "the embedding joins the first unit" in kept["reason"]
    assert not p["ends_join_blocks"]  # no blocks: no block units to join
    with pytest.raises(ValueError, match="field 'blocks'"):
        _native.call("parallel_plan", {"cluster": cluster, "model": {**model, "blocks": -1}})

    before = torch._C._get_sm_carveout_experimental()
    try:
        torch._C._set_sm_carveout_experimental(None)
        # torch's carveout (cuBLASLt's GEMMs) and deepwell's own persistent GEMMs' move together.
        assert leave_sms_to_collectives(torch.device("cpu"), 16) == 0
        assert torch._C._get_sm_carveout_experimental() is None and _native.call("sm_carveout") == 0
        assert leave_sms_to_collectives(torch.device("cuda", 0), 0) == 0
        assert torch._C._get_sm_carveout_experimental() is None and _native.call("sm_carveout") == 0
        assert leave_sms_to_collectives(torch.device("cuda", 0), 16) == 16
        assert torch._C._get_sm_carveout_experimental() == 16 and _native.call("sm_carveout") == 16
        torch._C._set_sm_carveout_experimental(4)  # the user's own
        assert leave_sms_to_collectives(torch.device("cuda", 0), 16) == 4
        assert torch._C._get_sm_carveout_experimental() == 4 and _native.call("sm_carveout") == 4
        for bad in (-1, 2000, "8", 1.5):
            with pytest.raises(ValueError, match="sm_carveout: 'sms' must be an integer from 0 to 1024"):
                _native.call("sm_carveout", {"sms": bad})
    finally:
        torch._C._set_sm_carveout_experimental(before)
        _native.call("sm_carveout", {"sms": 0})


def test_a_forced_tensor_degree_is_planned_in_rust():
    """autoplan's tensor_parallel= goes to Rust's planner ("tensor"), which plans the carveout,
    units, prefetch and per-rank bytes for the forced degrees (forcing data parallelism where the
    planner chose tensor parallelism gets FSDP's collectives, here on the copy engines); a bad
    degree is an error naming the field."""
    gib = 1 << 30
    model = {"weight_bytes": 2 * gib, "gradient_bytes": 2 * gib, "optimizer_bytes": 4 * gib,
             "activation_bytes": 100 * gib, "largest_unit_bytes": gib // 8}
    cluster = {"world_size": 2, "devices_per_node": 2, "memory_bytes": 80 * gib, "peer_access": True}
    own = _native.call("parallel_plan", {"cluster": cluster, "model": model})
    forced = _native.call("parallel_plan", {"cluster": cluster, "model": model, "tensor": 1})
    assert (own["data"], own["tensor"], own["sm_carveout"]) == (1, 2, 0)
    assert (forced["data"], forced["tensor"], forced["forward_prefetch"]) == (2, 1, 1) and forced["collectives"] == "copy_engine"
    assert forced["per_rank_bytes"] > 0 and "forced by tensor_parallel=1" in forced["reason"]
    with pytest.raises(ValueError, match="field 'tensor' must be a positive divisor of world_size 2, got 3"):
        _native.call("parallel_plan", {"cluster": cluster, "model": model, "tensor": 3})


def test_nccl_runs_on_as_many_ctas_as_the_sms_left_to_it():
    """The data ranks' NCCL group is built with max_ctas = the collectives' SMs (the mesh's
    backend_override), so a collective fits beside a GEMM that leaves that many; nothing is
    overridden off the GPU or without a carveout."""
    from deepwell.distributed.shard import nccl_ctas

    assert nccl_ctas(torch.device("cpu"), 8) == {}
    assert nccl_ctas(torch.device("cuda", 0), 0) == {}
    if not torch.distributed.is_nccl_available():
        pytest.skip("this torch has no NCCL")
    (name, (backend, options)), = nccl_ctas(torch.device("cuda", 0), 8)["backend_override"].items()
    assert (name, backend, options.config.max_ctas) == ("data", "nccl", 8)


def _site(name: str) -> Site:
    return Site(name, "Linear", "attention", 256, 256, 128, device="cpu", dtype="torch.float32")


def _decided(name: str, recipe: str) -> Site:
    s = _site(name)
    s.decision = LayerDecision(recipe, False, f"planned {recipe}", "Precision")
    return s


def test_a_block_graph_takes_its_layers_shared_decision():
    """Under FSDP2 each block is its own graph with names relative to it, reused for every layer."""
    fixed = Plan("cpu", deepwell.PrecisionPolicy(), [_decided("layers.0.wq", "fp8_block"), _decided("layers.1.wq", "fp8_block")])
    gemm = type("G", (), {"site": _site("wq")})
    (site,) = _from_fixed_plan([gemm], fixed, Fallback.ERROR).sites
    assert site.decision.recipe == "fp8_block" and "one graph for 2 blocks" in site.decision.reason
    # Layers planned differently: the shared graph never runs with less precision than planned.
    fixed.sites[0] = _decided("layers.0.wq", "bf16")
    gemm = type("G", (), {"site": _site("wq")})
    (site,) = _from_fixed_plan([gemm], fixed, Fallback.ERROR).sites
    assert site.decision.recipe == "bf16" and "layers.0.wq bf16" in site.decision.reason
    # Other shapes or names do not match.
    gemm = type("G", (), {"site": _site("wk")})
    with pytest.raises(RuntimeError, match="'wk' is not in the plan"):
        _from_fixed_plan([gemm], fixed, Fallback.ERROR)


def _run(tmp_path, world: int, mode: str = "loop", tag: str = "", **env_extra) -> dict:
    out, store = tmp_path / f"{mode}{world}{tag}.json", tmp_path / f"{mode}-store{world}{tag}"
    env = {**os.environ, "DEEPWELL_TEST_RECIPE": "fp8_block", "DEEPWELL_TEST_MODE": mode, "DEEPWELL_TEST_CKPT_TAG": tag, **env_extra}
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(r), str(world), str(store), str(out)], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} of {world} exited with {p.returncode}:\n{log[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.distributed
def test_fsdp2_on_two_processes_matches_one(tmp_path):
    """Same model, same global batches, AdamW: 2 gloo ranks, each with half of every batch and
    FSDP2-sharded weights, give one process's losses (fp8_block on every block GEMM in both)."""
    one, two = _run(tmp_path, 1), _run(tmp_path, 2)
    assert two["parallelism"]["data"] == 2 and two["sharding"]["fsdp"] and two["sharded"].startswith("FSDP")
    assert two["fsdp_sharded"] and not one["fsdp_sharded"]
    assert set(two["ran"]) == {"fp8_block"} and one["ran"].count("fp8_block") == 2 * len(two["ran"])
    assert trains_alike(one["losses"], two["losses"]), (one["losses"], two["losses"])
    assert two["predicted_peak_bytes"] < one["predicted_peak_bytes"]


@pytest.mark.distributed
def test_fsdp2_units_follow_the_plan_and_train_like_one_process(tmp_path):
    """FSDP's units are the embedding, groups of the plan's unit_blocks blocks, and the final norm
    with the LM head (plan/parallel.py fsdp_units), each forward prefetching the next unit: 2 gloo
    ranks give one process's losses with units of one block (the CPU's plan: memory unknown,
    resharded), of two blocks kept gathered, and of one block each kept gathered with the ends
    joining them (a GPU's plan with room: `ends_join_blocks`)."""
    one = _run(tmp_path, 1)
    two = _run(tmp_path, 2)
    assert two["sharding"]["forward_prefetch"] == 1 and two["sharding"]["unit_blocks"] == [1, 1]
    assert two["sharding"]["ends_join_blocks"] is False  # resharded: the plan counted one block a unit
    assert two["units"] == [["tok_embeddings"], ["layers.0"], ["layers.1"], ["norm", "output"]], two["units"]
    grouped = _run(tmp_path, 2, tag="-units2", DEEPWELL_TEST_UNITS="2")
    assert grouped["units"] == [["tok_embeddings"], ["layers.0", "layers.1"], ["norm", "output"]], grouped["units"]
    joined = _run(tmp_path, 2, tag="-ends", DEEPWELL_TEST_UNITS="1,1", DEEPWELL_TEST_ENDS="1")
    assert joined["units"] == [["tok_embeddings", "layers.0"], ["layers.1", "norm", "output"]], joined["units"]
    for run in (two, grouped, joined):
        assert trains_alike(one["losses"], run["losses"]), (one["losses"], run["losses"])


@pytest.mark.distributed
def test_trainer_on_two_processes_matches_one_and_resumes_across_world_sizes(tmp_path):
    """deepwell.Trainer under 2 processes: each rank takes its rows of every global batch, and the
    logged loss and gradient norm (means over the ranks) equal one process's. Its checkpoints are
    sharded (each rank writes its FSDP2 shards through torch.distributed.checkpoint, no rank
    gathers the whole state: the worker makes distributed.py's gathers raise) and resume a fresh
    sharded model bit for bit, and one process (torch.distributed not initialised: DCP's no_dist
    load) from the same step with one process's losses. A damaged shard is a CheckpointError
    naming it on both ranks. checkpoint_format="full" (rank 0 gathers and writes the one-process
    format) resumes the same ways, and a one-process checkpoint resumes under 2 processes."""
    two = _run(tmp_path, 2, "trainer", DEEPWELL_TEST_NO_GATHER="1", DEEPWELL_TEST_CORRUPT="1")
    full = _run(tmp_path, 2, "trainer", "-full", DEEPWELL_TEST_CKPT_FORMAT="full")
    crosses = [tmp_path / "ckpt-world2" / "step_00000001", tmp_path / "ckpt-world2-full" / "step_00000001"]
    one = _run(tmp_path, 1, "trainer", CROSS_RESUME=os.pathsep.join(map(str, crosses)))
    assert two["checkpoint_format"] == "sharded" and full["checkpoint_format"] == "full" and one["checkpoint_format"] == "full"
    assert len(one["losses"]) == len(two["losses"]) == 3
    assert trains_alike(one["losses"] + one["grad_norms"], two["losses"] + two["grad_norms"]), (one, two)
    assert two["resumed"] == two["losses"] and full["resumed"] == full["losses"] == two["losses"] and one["resumed"] == one["losses"]
    assert len(one["crossed"]) == 2 and all(trains_alike(one["losses"], c) for c in one["crossed"]), (one["losses"], one["crossed"])

    files = json.loads((crosses[0] / "manifest.json").read_text())["files"]
    want = {"dcp/.metadata", "dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng-rank0.safetensors", "rng-rank1.safetensors"}
    assert want <= set(files) and "model.safetensors" not in files, sorted(files)
    assert "model.safetensors" in json.loads((crosses[1] / "manifest.json").read_text())["files"]
    assert len(two["errors"]) == 2 and all(
        re.search(r"step_00000003/dcp/__1_0\.distcp is corrupted .*the previous checkpoint \S*step_00000002 is intact", e) for e in two["errors"]
    ), two["errors"]

    # One process's (full-format) checkpoint under 2 processes, which then write sharded ones.
    back = _run(tmp_path, 2, "trainer", "-from1", CROSS_RESUME=str(tmp_path / "ckpt-world1" / "step_00000001"))
    assert back["checkpoint_format"] == "sharded" and back["resumed"] == back["losses"] == two["losses"]
    assert trains_alike(one["losses"], back["crossed"][0]), (one["losses"], back["crossed"])


def _main_job_under_torchrun(tmp_path, *options: str) -> str:
    """`torchrun --nproc-per-node 2 -m deepwell` on the CPU, 4 quick steps; its stdout."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "deepwell", "--device", "cpu",
           "--quick", "--steps", "4", "--parity-steps", "0", *options, "--out", str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done.stdout


@pytest.mark.distributed
def test_main_job_under_torchrun(tmp_path):
    """`torchrun --nproc-per-node 2 -m deepwell`: FSDP planned over the two processes, training on
    the stdlib corpus, and the resume from the middle checkpoint bit for bit (rank 0 prints)."""
    out = _main_job_under_torchrun(tmp_path)
    assert "(2 processes under torchrun)" in out and "parallel: data 2 x tensor 1" in out
    assert "steps 3..4 bit-identical to the first run" in out
    assert out.count("main job:") == 1  # the other rank is silent
    assert (tmp_path / "run" / "run-1" / "checkpoints" / "step_00000004").is_dir()  # each run its own run-N


@pytest.mark.distributed
def test_main_job_under_torchrun_with_tensor_parallelism(tmp_path):
    """`torchrun --nproc-per-node 2 -m deepwell --tensor-parallel 2`: the blocks split over both
    processes (DTensor), training, and the resume from the middle checkpoint bit for bit."""
    out = _main_job_under_torchrun(tmp_path, "--tensor-parallel", "2")
    assert "parallel: data 1 x tensor 2" in out and "forced by tensor_parallel=2" in out
    assert "steps 3..4 bit-identical to the first run" in out
    assert out.count("main job:") == 1


@pytest.mark.distributed
def test_main_job_under_torchrun_with_sequence_parallelism(tmp_path):
    """`... --tensor-parallel 2 --sequence-parallel`: the residual stream split along the sequence,
    the vocabulary-parallel embedding and LM head, training, and the bit-for-bit resume."""
    out = _main_job_under_torchrun(tmp_path, "--tensor-parallel", "2", "--sequence-parallel")
    assert "sequence parallel over the tensor ranks" in out
    assert "steps 3..4 bit-identical to the first run" in out


@pytest.mark.distributed
def test_main_job_under_torchrun_with_fp8_all_gather(tmp_path):
    """`torchrun --nproc-per-node 2 -m deepwell --precision fp8_block --fp8-all-gather`: FSDP2 gathers
    the fp8_block weights as FP8 codes (the plan says which and why not the others; bit-identity to
    the high-precision gather: tests/distributed/test_fp8_all_gather.py), training, and the bit-for-bit resume."""
    out = _main_job_under_torchrun(tmp_path, "--precision", "fp8_block", "--fp8-all-gather")
    assert "FP8 all-gather (fp8_block codes + tile scales) for 24 weights" in out
    assert "layers.0.attention.wq (recipe bf16)" in out  # the first site, bf16 by the policy
    assert "steps 3..4 bit-identical to the first run" in out


def test_fsdp_units_are_the_ends_and_groups_of_blocks_in_forward_order():
    """parallel.fsdp_units: the modules before the blocks, the blocks in groups, those after, along
    the path to the blocks (Hugging Face nests them in `model`); tied ends stay with the root."""
    from deepwell.models import Llama
    from deepwell.distributed.units import fsdp_units

    def names(model, units):
        of = {id(m): n for n, m in model.named_modules()}
        return [[of[id(m)] for m in unit] for unit in units]

    llama = Llama(64, 32, 5, 2, 64, max_seq=16)
    assert names(llama, fsdp_units(llama, 2)) == [
        ["tok_embeddings"], ["layers.0", "layers.1"], ["layers.2", "layers.3"], ["layers.4"], ["norm", "output"]]
    assert names(llama, fsdp_units(llama, [1, 2, 2])) == [  # the planner's growing units
        ["tok_embeddings"], ["layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"], ["norm", "output"]]
    assert names(llama, fsdp_units(llama, [1, 2, 2], ends_join_blocks=True)) == [  # the plan's ends_join_blocks
        ["tok_embeddings", "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4", "norm", "output"]]
    assert names(llama, fsdp_units(llama, [5], ends_join_blocks=True)) == [  # one group takes both ends
        ["tok_embeddings", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "norm", "output"]]
    for wrong in ([1, 2], [1, 2, 4], [0, 5]):
        with pytest.raises(RuntimeError, match=r"deepwell.compile: the plan's FSDP units of .* do not cover this model's 5 blocks"):
            fsdp_units(llama, wrong)
    tied = Llama(64, 32, 2, 2, 64, max_seq=16, tied=True)
    assert names(tied, fsdp_units(tied)) == [["layers.0"], ["layers.1"]]
    assert names(tied, fsdp_units(tied, 1, ends_join_blocks=True)) == [["layers.0"], ["layers.1"]]

    class Inner(torch.nn.Module):  # Hugging Face's layout: model.embed_tokens, model.layers, model.norm
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(64, 32)
            self.layers = torch.nn.ModuleList(torch.nn.Linear(32, 32) for _ in range(3))
            self.rotary = torch.nn.Identity()  # no parameters: no unit
            self.norm = torch.nn.LayerNorm(32)

    class CausalLM(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = Inner()
            self.lm_head = torch.nn.Linear(32, 64)

    hf = CausalLM()
    assert names(hf, fsdp_units(hf, 1)) == [
        ["model.embed_tokens"], ["model.layers.0"], ["model.layers.1"], ["model.layers.2"], ["model.norm", "lm_head"]]
