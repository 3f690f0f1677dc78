"""One process of tests/distributed/test_parallel.py's FSDP2 run (gloo on the CPU): RANK of WORLD trains a small
LLaMA with deepwell.compile on its share of the same global batches and writes the averaged losses
to OUT. With WORLD=1 it is the single-process reference. DEEPWELL_TEST_MODE=trainer runs the
steps through deepwell.Trainer (which shards the global batches itself) instead of a plain loop.
DEEPWELL_TEST_TENSOR=T forces tensor parallelism of degree T (autoplan's tensor_parallel=): the T
adjacent ranks of each data rank take the same rows; DEEPWELL_TEST_SP=1 adds sequence parallelism
(autoplan's sequence_parallel=True).

FP8 all-gather (tests/distributed/test_fp8_all_gather.py): DEEPWELL_TEST_FP8_ALL_GATHER=1 plans with
autoplan's fp8_all_gather=True; DEEPWELL_TEST_MODE=eager runs the loop without torch.compile, the
planned sites' nn.Linear forwards calling deepwell.scaled_linear; DEEPWELL_TEST_GRADS=1 saves each
rank's loss and gradient shards of every step to OUT.rank<r>.pt; DEEPWELL_TEST_DTYPE=bfloat16 trains
a bf16 model; DEEPWELL_TEST_DIM sets the model width (256). DEEPWELL_TEST_UNITS=N gathers N blocks
per FSDP unit and keeps them gathered for the backward (the plan a GPU with room gets).

Checkpoints of the trainer mode: DEEPWELL_TEST_CKPT_FORMAT (full | sharded; unset: the Trainer's
default) into ckpt-world<WORLD><DEEPWELL_TEST_CKPT_TAG> beside OUT. CROSS_RESUME: checkpoints
(separated by os.pathsep) to resume fresh Trainers from, each one's losses a list of "crossed".
DEEPWELL_TEST_NO_GATHER=1 makes distributed.py's gathers of the whole state raise (what the sharded
format must never call); DEEPWELL_TEST_CORRUPT=1 then flips a byte of the last rank's DCP shard
of the last step and records each rank's CheckpointError on loading it.

    python tests/distributed/_fsdp_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import deepwell
import deepwell.compiler.backend
from deepwell.models import Llama
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import finish_rank  # noqa: E402

STEPS, BATCH, SEQ, VOCAB = 3, 4, 64, 256
RECIPE = os.environ.get("DEEPWELL_TEST_RECIPE", "fp8_block")
MODE = os.environ.get("DEEPWELL_TEST_MODE", "loop")
FP8_ALL_GATHER = os.environ.get("DEEPWELL_TEST_FP8_ALL_GATHER") == "1"
# DEEPWELL_TEST_CODES=0: deepwell.compile(..., fp8_block_codes=False), every fp8_block site on
# scaled_linear. FP8-gathered weights (tensor subclasses) always run there, so a run comparing the
# two all-gathers bit for bit needs its high-precision side there too.
COMPILE = {"fp8_block_codes": False} if os.environ.get("DEEPWELL_TEST_CODES") == "0" else {}
DIM = int(os.environ.get("DEEPWELL_TEST_DIM", "256"))
DTYPE = getattr(torch, os.environ.get("DEEPWELL_TEST_DTYPE", "float32"))
PRE_ALL_GATHERS = [0]  # calls of Fp8BlockShard.fsdp_pre_all_gather: the FP8 path ran
PLACEMENTS: set[str] = set()  # the placements of the saved gradients (DEEPWELL_TEST_GRADS)


def _count_fp8_gathers() -> None:
    from deepwell.distributed.fp8_weights import Fp8BlockShard

    pre = Fp8BlockShard.fsdp_pre_all_gather

    def counted(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads the signature
        PRE_ALL_GATHERS[0] += 1
        return pre(self, mesh, outer_size, outer_stride, module, mp_policy)

    Fp8BlockShard.fsdp_pre_all_gather = counted


def _eager(ir, plan):
    """The model sharded as `plan` says, its planned sites' nn.Linear forwards running
    deepwell.scaled_linear eagerly (no torch.compile)."""
    from deepwell.distributed.shard import shard

    recipe_of = {s.name: s.recipe for s in plan.sites}
    for name, module in ir.model.named_modules():
        if recipe_of.get(name, "bf16") != "bf16":
            module.forward = lambda x, m=module, r=recipe_of[name]: torch.ops.deepwell.scaled_linear(x, m.weight, m.bias, r, None)
    return shard(ir.model, plan.parallelism, plan.sharding, recipe_of)


def _units(model: torch.nn.Module) -> list[list[str]]:
    """The modules of each FSDP2 unit below the root (each a unit's state's modules), in the order
    the units' states are first met."""
    from torch.distributed.fsdp import FSDPModule

    names = {id(m): n for n, m in model.named_modules()}
    units, seen = [], set()
    for name, module in model.named_modules():
        if name and isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            if id(state) not in seen:
                seen.add(id(state))
                units.append([names[id(m)] for m in state._modules])
    return units


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    deepwell.compiler.backend.ensure_registered()  # (an installed deepwell registers it by entry point)
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    _count_fp8_gathers()
    torch.manual_seed(0)
    model = Llama(VOCAB, DIM, 2, 4, 2 * DIM, max_seq=SEQ).to(DTYPE)
    g = torch.Generator().manual_seed(1)
    data = torch.randint(0, VOCAB, (STEPS, BATCH, SEQ + 1), generator=g)
    tensor = int(os.environ.get("DEEPWELL_TEST_TENSOR", "1")) if world > 1 else 1
    local = BATCH // (world // tensor)  # this data rank's rows of every global batch
    rows = slice(rank // tensor * local, (rank // tensor + 1) * local)
    ir = deepwell.capture(model, (data[0, rows, :-1],))
    # Every block planned alike: FSDP2 compiles one graph per block (compiler/backend.py _shared_decision).
    policy = deepwell.PrecisionPolicy(precision=RECIPE, min_features=128, first_last_bf16=False)
    tp = tensor if tensor > 1 else None
    sequence_parallel = os.environ.get("DEEPWELL_TEST_SP") == "1"
    plan = deepwell.autoplan(ir, policy=policy, tensor_parallel=tp, fp8_all_gather=FP8_ALL_GATHER,
                             sequence_parallel=sequence_parallel)
    if os.environ.get("DEEPWELL_TEST_UNITS"):  # the GPU plan's FSDP layout, which the CPU's never picks
        units = [int(n) for n in os.environ["DEEPWELL_TEST_UNITS"].split(",")]
        plan.sharding.update(unit_blocks=units, reshard_after_forward=False,
                             ends_join_blocks=os.environ.get("DEEPWELL_TEST_ENDS") == "1")
    engine = _eager(ir, plan) if MODE == "eager" else deepwell.compile(ir, plan=plan, **COMPILE)
    estimate = deepwell.dryrun(engine) if MODE != "eager" else None
    saved = []  # per step: this rank's loss and gradient shards (DEEPWELL_TEST_GRADS)
    # Fused: the Trainer skips non-finite steps on the device. Its checkpoints resume below into
    # torch.optim.AdamW (without tensor parallelism).
    opt = deepwell.train.AdamW(model.parameters(), lr=1e-3, fused=True)
    losses, norms = [], []
    resumed, crossed = [], []
    errors = []
    if MODE == "trainer":
        ckpt = os.path.join(os.path.dirname(out), f"ckpt-world{world}{os.environ.get('DEEPWELL_TEST_CKPT_TAG', '')}")
        if os.environ.get("DEEPWELL_TEST_NO_GATHER") == "1":
            _refuse_gathers()
        batches = [data[step] for step in range(STEPS)]
        trainer = deepwell.Trainer.from_engine(engine, optimizer=opt, max_steps=STEPS, progress=False, plot=False,
                                               checkpoint_dir=ckpt, checkpoint_every=1, keep_checkpoints=None,
                                               checkpoint_format=os.environ.get("DEEPWELL_TEST_CKPT_FORMAT") or None)
        trainer.fit(batches)
        losses = [r["loss"] for r in trainer.history]
        norms = [r["grad_norm"] for r in trainer.history]
        # Fresh model, engine, optimizer and Trainer resumed from step 1: this run's checkpoint, and
        # (CROSS_RESUME) one written by a run with another number of processes.
        sources = [(os.path.join(ckpt, "step_00000001"), resumed)]
        for source in filter(None, os.environ.get("CROSS_RESUME", "").split(os.pathsep)):
            crossed.append([])
            sources.append((source, crossed[-1]))
        for source, into in sources:
            torch.manual_seed(123)  # other initial weights: the checkpoint must bring them back
            fresh = Llama(VOCAB, DIM, 2, 4, 2 * DIM, max_seq=SEQ).to(DTYPE)
            fir = deepwell.capture(fresh, (data[0, rows, :-1],))
            # The run's own plan (sequence parallelism included: without it the resumed model
            # reduces in another order, and torch 2.11 gave losses 1e-4 apart).
            fplan = deepwell.autoplan(fir, policy=policy, tensor_parallel=tp, fp8_all_gather=FP8_ALL_GATHER,
                                      sequence_parallel=sequence_parallel)
            feng = deepwell.compile(fir, plan=fplan, **COMPILE)
            # torch.optim.AdamW, where it can: the checkpoint's param groups say fused=True, and
            # torch's fused AdamW refuses the plain parameters tensor parallelism leaves beside
            # DTensors (deepwell's takes them, train/optim.py).
            kind = deepwell.train.AdamW if tp else torch.optim.AdamW
            t = deepwell.Trainer.from_engine(feng, optimizer=kind(fresh.parameters(), lr=1e-3),
                                             max_steps=STEPS, progress=False, plot=False)
            t.fit(batches, resume=source)
            into.extend(r["loss"] for r in t.history)
        if os.environ.get("DEEPWELL_TEST_CORRUPT") == "1":
            errors = _corrupt_and_load(trainer, os.path.join(ckpt, f"step_{STEPS:08d}"), rank, world)
    for step in range(STEPS if MODE in ("loop", "eager") else 0):
        tokens, targets = data[step, rows, :-1], data[step, rows, 1:]
        loss = torch.nn.functional.cross_entropy(engine(tokens).flatten(0, 1), targets.flatten())
        loss.backward()
        if os.environ.get("DEEPWELL_TEST_GRADS") == "1":
            saved.append({"loss": loss.detach().clone(), **{n: _local(p.grad).clone() for n, p in model.named_parameters()}})
        opt.step()
        opt.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        if world > 1:  # the mean over the data ranks (a data rank's tensor ranks hold equal losses)
            dist.all_reduce(mean)
            mean /= world
        losses.append(mean.item())
    result = {
        "losses": losses,
        "grad_norms": norms,
        "resumed": resumed,
        "crossed": crossed,
        "errors": errors,
        "checkpoint_format": trainer.checkpoint_format if MODE == "trainer" else None,
        "parallelism": plan.parallelism,
        "sharding": {k: v for k, v in plan.sharding.items() if k != "saved"},
        "recipes": sorted({s.recipe for s in plan.sites}),
        # What the compiled graphs run, site by site (per block under FSDP2).
        "ran": sorted(s.runs_in for p in deepwell.compiler.backend.PLANS for s in p.sites),
        "predicted_peak_bytes": estimate.peak_bytes if estimate else None,
        "fp8_all_gather": plan.sharding.get("fp8_all_gather"),
        "fp8_gathered": plan.sharding.get("fp8_gathered"),
        "fp8_pre_all_gathers": PRE_ALL_GATHERS[0],
        "predicted_gathered_bytes": estimate.gathered if estimate else None,
        # What FSDP2 shards hold and what the model's state dict (checkpoints) shows of them.
        "local_types": {n: type(getattr(p, "_local_tensor", p)).__name__ for n, p in model.named_parameters()},
        "state_dict_types": {n: type(getattr(t, "_local_tensor", t)).__name__ for n, t in model.state_dict().items()},
        "sharded": type(model).__name__,
        # What the Trainer asks before opening deepwell.microbatches() (Trainer._reuses_weights).
        "fsdp_sharded": deepwell.train.distributed.fsdp_sharded(model),
        # FSDP2's units below the root, as the names of the modules of each (forward order).
        "units": _units(model),
        "heads": [layer.attention.heads for layer in model.layers],
        "wq_placements": [repr(p) for p in getattr(model.layers[0].attention.wq.weight, "placements", ())],
        "embedding_placements": [repr(p) for p in getattr(model.tok_embeddings.weight, "placements", ())],
        "sequence_parallel": plan.sharding.get("sequence_parallel"),
        "grad_placements": sorted(PLACEMENTS),
    }
    if saved:
        torch.save(saved, f"{out}.rank{rank}.pt")
    finish_rank(result, rank, world, out)


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's part of a gradient: a DTensor's local shard, its pending sums (Partial: a
    replicated parameter's gradient under sequence parallelism, reduced when the optimizer reads it)
    reduced first."""
    if not hasattr(grad, "to_local"):
        return grad
    from torch.distributed.tensor import Replicate

    PLACEMENTS.update(repr(p) for p in grad.placements)
    whole = [Replicate() if p.is_partial() else p for p in grad.placements]
    return grad.redistribute(grad.device_mesh, whole).to_local()


def _refuse_gathers() -> None:
    """Under the sharded format no rank may gather the whole model or optimizer state."""
    from deepwell.train import distributed

    def refuse(*args, **kwargs):
        raise AssertionError("a rank gathered the whole state (distributed.py's full_state_dict path)")

    for name in ("model_tensors", "optimizer_state", "load_model_tensors", "load_optimizer_state", "_options"):
        setattr(distributed, name, refuse)


def _corrupt_and_load(trainer, step_dir: str, rank: int, world: int) -> list[str]:
    """Every rank's CheckpointError message for `step_dir` with its last rank's DCP shard damaged."""
    from deepwell.train import CheckpointError

    shard = os.path.join(step_dir, "dcp", f"__{world - 1}_0.distcp")
    if rank == 0:
        with open(shard, "r+b") as f:
            f.seek(os.path.getsize(shard) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0xFF]))
    if world > 1:
        dist.barrier()
    try:
        trainer.load_checkpoint(step_dir)
        message = "loaded"
    except CheckpointError as e:
        message = str(e)
    messages = [None] * world
    if world > 1:
        dist.all_gather_object(messages, message)
    else:
        messages = [message]
    return messages


if __name__ == "__main__":
    main()
