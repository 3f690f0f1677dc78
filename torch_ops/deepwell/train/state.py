"""Training state as (tensors, JSON) pairs for a checkpoint, and back: the model's weights, the
optimizer's state, every random generator, and the quantization state of each deepwell.Linear.

What is not state, and why nothing is stored for it: deepwell's scales are current scaling
(recomputed from each tensor's amax at every call; no amax history as in delayed scaling), and the
weight cache lives only inside one optimizer step's `microbatches()` scope. The stochastic-rounding
seed sequence of NVFP4 (`deepwell.manual_seed`, Rust state with no getter) is restarted by the
Trainer at every step from (seed, step), so the step number is its state.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from .checkpoint_files import CheckpointError, require


# ---------------------------------------------------------------------------------------------
# Model


def model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """The state dict with tied tensors stored once: (tensors, {alias: stored name})."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in model.state_dict().items():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if t.numel() and key in seen:
            aliases[name] = seen[key]
        else:
            seen[key] = name
            tensors[name] = t
    return tensors, aliases


def load_model_tensors(model: torch.nn.Module, tensors: dict[str, torch.Tensor], aliases: dict[str, str]) -> None:
    """Copies the stored weights into the model's own tensors (their identity stays, so an optimizer
    built on them keeps working); a missing or unexpected name is an error."""
    full = dict(tensors)
    full.update({alias: tensors[name] for alias, name in aliases.items()})
    missing, unexpected = model.load_state_dict(full, strict=False)
    if missing or unexpected:
        raise RuntimeError(f"checkpoint does not fit the model: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


# ---------------------------------------------------------------------------------------------
# Optimizer


def optimizer_state(opt: torch.optim.Optimizer, sd: dict | None = None) -> tuple[dict[str, torch.Tensor], dict]:
    """torch's optimizer state dict (`sd`, default `opt.state_dict()`: states keyed by the index of
    the parameter in the flattened param groups) split into tensors ("<param index>.<name>") and JSON."""
    sd = opt.state_dict() if sd is None else sd
    tensors, scalars = {}, {}
    for idx, entry in sd["state"].items():
        for k, v in entry.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{idx}.{k}"] = v
            else:
                scalars.setdefault(str(idx), {})[k] = v
    return tensors, {"type": type(opt).__name__, "param_groups": sd["param_groups"], "scalars": scalars}


def load_optimizer_state(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> None:
    opt.load_state_dict(optimizer_state_dict(opt, tensors, meta))


def optimizer_state_dict(opt: torch.optim.Optimizer, tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The torch optimizer state dict `optimizer_state` split, for `opt`."""
    if meta["type"] != type(opt).__name__:
        raise RuntimeError(f"checkpoint holds {meta['type']} state, the optimizer is a {type(opt).__name__}")
    state: dict[int, dict] = {}
    for key, t in tensors.items():
        idx, name = key.split(".", 1)
        state.setdefault(int(idx), {})[name] = t
    for idx, entry in meta["scalars"].items():
        state.setdefault(int(idx), {}).update(entry)
    groups = []
    for mine, stored in zip(opt.param_groups, meta["param_groups"]):
        # JSON turned tuples (betas) into lists: give them their type back.
        groups.append({k: tuple(v) if isinstance(mine.get(k), tuple) and isinstance(v, list) else v for k, v in stored.items()})
    if len(groups) != len(meta["param_groups"]) or len(opt.param_groups) != len(groups):
        raise RuntimeError(f"checkpoint has {len(meta['param_groups'])} param groups, the optimizer {len(opt.param_groups)}")
    return {"state": state, "param_groups": groups}


# ---------------------------------------------------------------------------------------------
# Random generators


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """torch (CPU and every CUDA device), Python's `random` and numpy's global generators."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{i}"] = s
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
    version, internal, gauss_next = random.getstate()
    meta = {
        "python": [version, list(internal), gauss_next],
        "numpy": [kind, int(pos), int(has_gauss), float(gauss)],
        "cuda_devices": sum(k.startswith("torch_cuda_") for k in tensors),
    }
    return tensors, meta


def load_rng_state(tensors: dict[str, torch.Tensor], meta: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    n = meta["cuda_devices"]
    if n and torch.cuda.is_available():
        states = [tensors[f"torch_cuda_{i}"] for i in range(n)]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])
    version, internal, gauss_next = meta["python"]
    random.setstate((version, tuple(internal), gauss_next))
    kind, pos, has_gauss, gauss = meta["numpy"]
    np.random.set_state((kind, tensors["numpy_keys"].numpy().astype(np.uint32), pos, has_gauss, gauss))


# ---------------------------------------------------------------------------------------------
# Quantization state of guarded layers (deepwell.Linear)


def guarded_layers(model: torch.nn.Module) -> dict[str, object]:
    """Qualified name -> Guardrail of every deepwell.Linear with guardrails."""
    return {n: m.guardrail for n, m in model.named_modules() if getattr(m, "guardrail", None) is not None}


def guardrail_state(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict]:
    """Each guarded layer's planned and running recipe, fallback events, call count and the
    statistics still on their way to the host (read at the next statistics step)."""
    tensors, meta = {}, {}
    for name, g in guarded_layers(model).items():
        pending = None
        if g._pending is not None:
            call, host, event = g._pending
            if event is not None:
                event.synchronize()
            tensors[name] = host.detach().to("cpu", torch.float64)
            pending = call
        r = g.record
        meta[name] = {"recipe": r.recipe, "running": r.active_recipe, "events": list(r.events), "calls": g.calls, "pending_call": pending}
    return tensors, meta


_GUARDED = {"recipe": str, "running": str, "events": list, "calls": int, "pending_call": (int, type(None))}


def check_guardrail_state(model: torch.nn.Module, meta: dict, ckpt: Path | str) -> None:
    """Raises before anything is loaded when the checkpoint's guarded layers do not fit the model:
    another set of layers, or a layer the model builds in another recipe than the checkpoint
    trained it in. The model's configuration is what the user asked for now; running the
    checkpoint's recipe instead would change its numerics silently, and running the model's would
    continue a run under numerics it was not trained with, so neither is guessed. A layer whose
    guardrail fell back (running bf16) resumes in bf16, its planned recipe being the same."""
    where = f"checkpoint {ckpt}"
    layers = guarded_layers(model)
    if set(layers) != set(meta):
        raise RuntimeError(f"{where}: its guarded layers {sorted(meta)} differ from the model's {sorted(layers)}")
    for name, g in layers.items():
        require(meta, {name: _GUARDED}, where, "state.quantization.guarded_layers.")
        saved, mine = meta[name]["recipe"], g.record.recipe
        if saved != mine:
            raise ValueError(
                f"deepwell.Trainer: {where} trained deepwell.Linear {name!r} in {saved}, but the model builds it in {mine}: "
                f"build the layer with recipe={saved!r} to resume this run (or start a new run from its weights alone)"
            )
        if meta[name]["running"] not in (saved, "bf16"):
            raise CheckpointError(f"{where}: layer {name!r} planned {saved} cannot be running {meta[name]['running']!r} (only {saved} or its bf16 fallback): the manifest was edited")


def load_guardrail_state(model: torch.nn.Module, tensors: dict[str, torch.Tensor], meta: dict, ckpt: Path | str = "") -> None:
    check_guardrail_state(model, meta, ckpt)
    for name, g in guarded_layers(model).items():
        m = meta[name]
        if m["pending_call"] is not None and name not in tensors:
            raise CheckpointError(f"checkpoint {ckpt}: layer {name!r} has pending statistics but guardrails.safetensors holds none for it")
        g.calls = m["calls"]
        g.record.active_recipe, g.record.events = m["running"], list(m["events"])
        g._pending = None if m["pending_call"] is None else (m["pending_call"], tensors[name], None)


# ---------------------------------------------------------------------------------------------
# The manifest a Trainer reads back


#: The JSON state every Trainer checkpoint holds (Trainer._meta), for checkpoint_files.require.
COMMON = {
    "step": int, "batches_used": int, "tokens_seen": int, "history": list, "loader": (dict, type(None)),
    "scheduler": (dict, type(None)), "plan": (dict, type(None)), "quantization": {"guarded_layers": dict}, "rng": dict,
}
#: What the one-process ("full") format adds: its tensor files and their JSON halves.
FULL = {
    "model_aliases": dict, "optimizer": {"type": str, "param_groups": list, "scalars": dict},
    "rng": {"python": list, "numpy": list, "cuda_devices": int},
}
FULL_FILES = ("model.safetensors", "optimizer.safetensors", "rng.safetensors")


def check_manifest(manifest: dict, ckpt: Path) -> str:
    """The checkpoint's format ("full" or "sharded") once its state holds every key a Trainer reads
    back (the format's own keys for "full"; train/sharded.py checks its own); else CheckpointError
    naming the key."""
    where = f"checkpoint {ckpt}"
    meta = manifest["state"]
    require(meta, COMMON, where, "state.")
    fmt = meta.get("checkpoint_format", "full")
    if fmt not in ("full", "sharded"):
        raise CheckpointError(f"{where}: the manifest's state.checkpoint_format must be 'full' or 'sharded', got {fmt!r:.80}")
    if fmt == "full":
        require(meta, FULL, where, "state.")
        for name in FULL_FILES:
            if name not in manifest["files"]:
                raise CheckpointError(f"{where}: the manifest lists no {name}, which every checkpoint of the full format holds: the manifest was edited")
    return fmt
