"""One process of tests/train/test_optim.py (gloo on the CPU): RANK of WORLD steps deepwell.train.AdamW and
torch.optim.AdamW side by side on two copies of the same FSDP2-sharded model, under each optimizer
setting in CASES, and writes to OUT, per case, whether every parameter and state shard stayed
equal bit for bit and how often the update ran on local shards; then the same for gradient-norm
clipping (train/clip.py through train/distributed.py) against torch.nn.utils.clip_grad_norm_. DEEPWELL_TEST_DEVICE=cuda runs it
on one GPU per rank over NCCL instead (torch's CUDA kernels: fused, foreach, per tensor).

    python tests/train/_optim_worker.py RANK WORLD STORE OUT
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Replicate
from torch.optim.optimizer import register_optimizer_step_post_hook

import deepwell.train.clip as clip
import deepwell.train.optim as optim
from deepwell.train import distributed
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: _util
from _util import finish_rank  # noqa: E402

# Each case: AdamW's keyword arguments, and whether the run splits the parameters into two groups
# (the second at 3x the learning rate, without weight decay) and changes the learning rate mid-run.
CASES = {
    "fused": {"fused": True},
    "foreach": {"foreach": True},
    "per_tensor": {"foreach": False},
    "fused_amsgrad_maximize": {"fused": True, "amsgrad": True, "maximize": True, "weight_decay": 0.0},
    "foreach_amsgrad": {"foreach": True, "amsgrad": True},
    "fused_tensor_lr": {"fused": True, "lr": torch.tensor(2e-3)},
    "fused_groups_schedule": {"fused": True, "groups": True},
}
STEPS = 5
DEVICE = os.environ.get("DEEPWELL_TEST_DEVICE", "cpu")

LOCAL_CALLS: list[bool] = []  # what shard_local answered, each time the optimizer asked


def _count_local() -> None:
    decide = optim.shard_local

    def counted(*lists):
        LOCAL_CALLS.append(decide(*lists))
        return LOCAL_CALLS[-1]

    optim.shard_local = counted


def _model(mesh) -> torch.nn.Module:
    """Odd sizes: 2 ranks hold unequal shards, and the (1, 5) head weight leaves rank 1 an empty one."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.GELU(), torch.nn.Linear(7, 5, bias=False),
                                torch.nn.LayerNorm(5), torch.nn.Linear(5, 1)).to(DEVICE)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _groups(model, settings: dict) -> list[dict]:
    params = list(model.parameters())
    if not settings.get("groups"):
        return [{"params": params}]
    return [{"params": params[:3]}, {"params": params[3:], "lr": 3e-3, "weight_decay": 0.0}]


def _make(kind, model, settings: dict):
    kwargs = {k: v for k, v in settings.items() if k != "groups"}
    kwargs.setdefault("lr", 1e-3)
    opt = kind(_groups(model, settings), **kwargs)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if settings.get("groups") else None
    return opt, sched


def _shards(model, opt) -> list[torch.Tensor]:
    out = [p._local_tensor for p in model.parameters()]
    for state in opt.state.values():
        out += [v._local_tensor if isinstance(v, DTensor) else v for v in state.values()]
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


def _backward(model, step: int, rank: int) -> None:
    g = torch.Generator().manual_seed(100 * step + rank)  # each rank its own rows
    x = torch.randn(4, 6, generator=g).to(DEVICE)
    model(x).square().mean().backward()


def _run_case(mesh, rank: int, settings: dict) -> dict:
    ref_model, model = _model(mesh), _model(mesh)
    ref, ref_sched = _make(torch.optim.AdamW, ref_model, settings)
    opt, sched = _make(optim.AdamW, model, settings)
    before = len(LOCAL_CALLS)
    equal = True
    for step in range(STEPS):
        for m in (ref_model, model):
            _backward(m, step, rank)
        if step == 1:  # a parameter without a gradient this step: skipped, its state untouched
            ref_model[3].weight.grad = model[3].weight.grad = None
        for o, s in ((ref, ref_sched), (opt, sched)):
            o.step()
            o.zero_grad(set_to_none=True)
            if s is not None:
                s.step()
        equal &= _equal(_shards(ref_model, ref), _shards(model, opt))
    return {"equal": equal, "local": LOCAL_CALLS[before:]}


def _resume(mesh, rank: int) -> dict:
    """A distributed-checkpoint state dict of a deepwell AdamW (states as DTensors) loads into a
    fresh one on a fresh model, which then goes on as the uninterrupted torch.optim.AdamW."""
    settings = {"fused": True}
    ref_model, model = _model(mesh), _model(mesh)
    ref, _ = _make(torch.optim.AdamW, ref_model, settings)
    opt, _ = _make(optim.AdamW, model, settings)
    for step in range(2):
        for m, o in ((ref_model, ref), (model, opt)):
            _backward(m, step, rank)
            o.step()
            o.zero_grad()
    model_sd, opt_sd = get_state_dict(model, opt)
    states_are_dtensors = all(isinstance(v, DTensor) for s in opt_sd["state"].values() for k, v in s.items() if k != "step")
    fresh_model = _model(mesh)
    fresh, _ = _make(optim.AdamW, fresh_model, settings)
    set_state_dict(fresh_model, fresh, model_state_dict=model_sd, optim_state_dict=opt_sd)
    for step in range(2, 4):
        for m, o in ((ref_model, ref), (fresh_model, fresh)):
            _backward(m, step, rank)
            o.step()
            o.zero_grad()
    return {"equal": _equal(_shards(ref_model, ref), _shards(fresh_model, fresh)), "dtensor_states": states_are_dtensors}


def _fallback(mesh, rank: int) -> dict:
    """A gradient replicated where its parameter is sharded: the update needs the gradient's shard,
    so the group keeps DTensor's path, and the result is still torch's."""
    ref_model, model = _model(mesh), _model(mesh)
    ref, _ = _make(torch.optim.AdamW, ref_model, {"foreach": True})
    opt, _ = _make(optim.AdamW, model, {"foreach": True})
    before = len(LOCAL_CALLS)
    for m, o in ((ref_model, ref), (model, opt)):
        _backward(m, 0, rank)
        w = m[0].weight
        w.grad = w.grad.redistribute(w.device_mesh, [Replicate()])
        o.step()
    return {"equal": _equal(_shards(ref_model, ref), _shards(model, opt)), "local": LOCAL_CALLS[before:]}


def _mixed(mesh, rank: int) -> dict:
    """Plain tensors beside DTensors in one fused group (what tensor parallelism leaves): torch's
    fused AdamW needs one optimizer per kind; deepwell's takes both, with the same result."""
    ref_model, model = _model(mesh), _model(mesh)
    plain = [torch.nn.Parameter(torch.randn(3, generator=torch.Generator().manual_seed(7)).to(DEVICE)) for _ in range(2)]
    refs = [torch.optim.AdamW(list(ref_model.parameters()), lr=1e-3, fused=True),
            torch.optim.AdamW([plain[0]], lr=1e-3, fused=True)]
    opt = optim.AdamW(list(model.parameters()) + [plain[1]], lr=1e-3, fused=True)
    for step in range(3):
        for m in (ref_model, model):
            _backward(m, step, rank)
        for p in plain:
            p.grad = torch.full((3,), 0.5 + step, device=DEVICE)
        for o in refs + [opt]:
            o.step()
    torch_fused_refuses = False
    try:
        torch.optim.AdamW(list(ref_model.parameters()) + [plain[0]], lr=1e-3, fused=True).step()
    except RuntimeError:
        torch_fused_refuses = True
    same = _equal(_shards(ref_model, refs[0]), [p._local_tensor for p in model.parameters()] +
                  [v._local_tensor if isinstance(v, DTensor) else v
                   for p in model.parameters() for v in opt.state[p].values()])
    return {"equal": same and torch.equal(plain[0], plain[1]), "torch_fused_refuses": torch_fused_refuses}


def _sharded_grads(mesh, rank: int, mixed: bool, poison: bool) -> torch.nn.Module:
    """A model whose gradients are set, not computed: `mixed` makes one layer bf16, `poison` puts a
    NaN in rank 0's first gradient."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 7), torch.nn.GELU(), torch.nn.Linear(7, 5, bias=False),
                                torch.nn.LayerNorm(5), torch.nn.Linear(5, 1)).to(DEVICE)
    if mixed:
        model[2].to(torch.bfloat16)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    g = torch.Generator().manual_seed(10 + rank)
    for i, p in enumerate(model.parameters()):
        local = torch.randn(p._local_tensor.shape, generator=g).to(DEVICE, p.dtype)
        if poison and i == 0 and rank == 0:
            local.view(-1)[0] = float("nan")
        p.grad = DTensor.from_local(local, mesh, p.placements, shape=p.shape, stride=p.stride())
    return model


def _clip_cases(mesh, rank: int) -> dict:
    """deepwell's clip (train/distributed.py, local shards) against torch's clip_grad_norm_ on the
    DTensors: the returned norm and every clipped gradient shard bit for bit."""
    out = {}
    for name, (max_norm, mixed, poison) in {"clips": (1e-3, False, False), "does_not_clip": (1e9, False, False),
                                            "no_limit": (float("inf"), False, False), "bf16_layer": (0.5, True, False),
                                            "nan": (1.0, False, True)}.items():
        ref, mine = _sharded_grads(mesh, rank, mixed, poison), _sharded_grads(mesh, rank, mixed, poison)
        want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), max_norm).full_tensor()
        local = clip.sharded_over_one_mesh([p.grad for p in mine.parameters()])
        got = distributed.clip_grad_norm(list(mine.parameters()), max_norm)
        same_norm = bool(torch.equal(want, got) or (want.isnan() and got.isnan()))
        grads = [(a.grad._local_tensor, b.grad._local_tensor) for a, b in zip(ref.parameters(), mine.parameters())]
        same_grads = all(torch.equal(a, b) or (a.isnan().all() and b.isnan().all()) for a, b in grads)
        out[name] = {"local": local, "norm": same_norm, "grads": same_grads}
    # A replicated gradient beside sharded ones: torch's path, unchanged.
    ref, mine = _sharded_grads(mesh, rank, False, False), _sharded_grads(mesh, rank, False, False)
    for m in (ref, mine):
        w = m[0].weight
        w.grad = w.grad.redistribute(w.device_mesh, [Replicate()])
    want = torch.nn.utils.clip_grad_norm_(list(ref.parameters()), 1e-3).full_tensor()
    local = clip.sharded_over_one_mesh([p.grad for p in mine.parameters()])
    got = distributed.replicated(distributed.clip_grad_norm(list(mine.parameters()), 1e-3))
    out["replicated_grad"] = {"local": local, "norm": bool(torch.equal(want, got)),
                              "grads": all(torch.equal(a.grad.full_tensor(), b.grad.full_tensor()) for a, b in zip(ref.parameters(), mine.parameters()))}
    return out


def main() -> None:
    rank, world, store, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    if DEVICE == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if DEVICE == "cuda" else "gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh(DEVICE, (world,))
    _count_local()
    hooked = []
    handle = register_optimizer_step_post_hook(lambda o, args, kwargs: hooked.append(type(o).__module__))
    result = {name: _run_case(mesh, rank, settings) for name, settings in CASES.items()}
    handle.remove()
    result["hooks_fired"] = hooked.count("deepwell.train.optim")
    result["resume"] = _resume(mesh, rank)
    result["fallback"] = _fallback(mesh, rank)
    result["mixed"] = _mixed(mesh, rank)
    result["clip"] = _clip_cases(mesh, rank)
    finish_rank(result, rank, world, out)


if __name__ == "__main__":
    main()
