"""`deepwell.export(engine, path)` and `deepwell.load(path)`: an inference artifact holding the plan,
the policy and the model's weights, each planned low-precision site's weight pre-quantized in its
recipe (train/quantized.py), written atomically like a checkpoint (a directory with
weights.safetensors and manifest.json, every file's SHA-256 checked on load).

What "the loaded model's logits match the trained model's" means (tests/test_export.py):
- On every device, `load(path)(tokens)` is bit-identical to `planned_eager(engine)(tokens)`: the
  trained weights run eagerly with every planned site through deepwell.scaled_linear in its recipe.
  Both quantize the weight with the same kernel (the artifact stores those codes), quantize the
  activations with the same kernel, and run the same GEMM, chosen by the same dispatch table
  (`deepwell.quantized_linear`: native block-scaled GEMMs on a GPU that has them), and epilogue.
- Against the compiled engine itself (`engine(tokens)`), the logits agree to within the rounding of
  Inductor's fused kernels (the norms, rotary and attention around the sites are fused and
  vectorised, so their last bits differ from eager): not bit for bit. The tests bound it.
- Before `quantized_linear`, a GPU ran the loaded sites as a bf16 GEMM of dequantized values
  while training ran the native FP8 GEMM: the main job on the H100 measured logits up to 1.9 apart
  (FP8 re-quantization of each layer's input amplifies one-ulp differences). The CPU tests prove
  the shared path; tests/test_quantized_linear.py's GPU test proves the op on the device.
"""

from __future__ import annotations

import copy
import importlib
import json
import os
from dataclasses import asdict
from pathlib import Path

import torch

from .. import _native
from . import checkpoint, state
from .quantized import QUANTIZED, QuantizedLinear, quantize_weight

FORMAT, VERSION = "deepwell-export", 1


def _planned_linears(engine) -> dict[str, tuple[torch.nn.Linear, str]]:
    """site name -> (its nn.Linear, recipe) for every low-precision site of the engine's plan."""
    modules = dict(engine.model.named_modules())
    found = {}
    for site in engine.plan.sites:
        if site.recipe not in QUANTIZED:
            continue
        module = modules.get(site.name)
        if not isinstance(module, torch.nn.Linear):
            got = type(module).__name__ if module is not None else "no module of that name"
            raise ValueError(f"deepwell.export: site {site.name!r} ({site.recipe}) must be an nn.Linear to pre-quantize its weight, got {got}")
        found[site.name] = (module, site.recipe)
    return found


def _json_config(model: torch.nn.Module):
    config = getattr(model, "config", None)
    try:
        return json.loads(json.dumps(config)) if isinstance(config, dict) else None
    except (TypeError, ValueError):
        return None


def _dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of the model's floating-point parameters (what it trained in)."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def export(engine, path: str | os.PathLike) -> Path:
    """Writes the inference artifact of `engine` (a deepwell.Engine) to directory `path`."""
    if not hasattr(engine, "plan") or not hasattr(engine, "model"):
        raise ValueError(f"deepwell.export: expected a deepwell.Engine (deepwell.compile's result), got {type(engine).__name__}")
    model = engine.model
    tensors, aliases = state.model_tensors(model)
    sites = {}
    for name, (linear, recipe) in _planned_linears(engine).items():
        key = f"{name}.weight" if name else "weight"
        if key in tensors and key not in aliases.values():
            del tensors[key]
        aliases.pop(key, None)
        for part, t in quantize_weight(linear.weight, recipe).items():
            tensors[f"{key}.{part}"] = t
        sites[name] = {"recipe": recipe, "in_features": linear.in_features, "out_features": linear.out_features}
    cls = type(model)
    body = {
        "format": FORMAT,
        "version": VERSION,
        "model": {"class": f"{cls.__module__}.{cls.__qualname__}", "config": _json_config(model), "dtype": str(_dtype(model)).removeprefix("torch.")},
        "plan": engine.plan.to_dict(),
        "policy": asdict(engine.plan.policy),
        "quantized_sites": sites,
        "aliases": aliases,
        "versions": {"torch": torch.__version__, "deepwell": _native.version()},
    }
    return checkpoint.write_atomic(Path(path), {"weights": tensors}, body)


def read_manifest(path: str | os.PathLike) -> dict:
    """The verified manifest of an artifact (plan, policy, quantized sites, model class)."""
    return checkpoint.verify(path, FORMAT, VERSION)


def _build(spec: dict) -> torch.nn.Module:
    module_name, _, qualname = spec["class"].rpartition(".")
    if spec.get("config") is None:
        raise ValueError(f"deepwell.load: the artifact's model {spec['class']} recorded no config; pass model=<an instance of it>")
    cls = getattr(importlib.import_module(module_name), qualname, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module)):
        raise ValueError(f"deepwell.load: the artifact names model class {spec['class']!r}, which is not an nn.Module here")
    # Built in the dtype it trained in: its buffers (rotary tables) too, as the trained model's were.
    return cls(**spec["config"]).to(getattr(torch, spec.get("dtype", "float32")))


def load(path: str | os.PathLike, model: torch.nn.Module | None = None, device: str | torch.device | None = None) -> torch.nn.Module:
    """The exported model, in eval mode, without gradients: its low-precision sites are
    QuantizedLinear modules on the stored codes, the rest as trained. `model`: an instance of the
    architecture to fill (default: built from the class and config the artifact names). The
    manifest is at `model.deepwell_artifact` (plan, policy, sites)."""
    parts, manifest, where = checkpoint.load(path, FORMAT)
    weights = dict(parts["weights"])
    model = model if model is not None else _build(manifest["model"])
    for name, site in manifest["quantized_sites"].items():
        key = f"{name}.weight"
        stored = {p: weights.pop(f"{key}.{p}") for p in ("data", "scale", "global_scale") if f"{key}.{p}" in weights}
        bias = weights.pop(f"{name}.bias", None)
        q = QuantizedLinear(site["recipe"], site["in_features"], site["out_features"], stored, bias)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), torch.nn.Linear):
            raise ValueError(f"deepwell.load: {where}: site {name!r} is not an nn.Linear of {type(model).__name__}")
        setattr(parent, child, q)
    full = dict(weights)
    full.update({alias: weights[name] for alias, name in manifest["aliases"].items() if name in weights})
    missing, unexpected = model.load_state_dict(full, strict=False)
    quantized_buffers = {f"{n}.{b}" for n in manifest["quantized_sites"] for b in ("weight_data", "weight_scale", "weight_global_scale", "bias")}
    missing = [k for k in missing if k not in quantized_buffers]
    if missing or unexpected:
        raise ValueError(f"deepwell.load: {where} does not fit {type(model).__name__}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if device is not None:
        model = model.to(device)
    model.eval().requires_grad_(False)
    model.deepwell_artifact = {k: manifest[k] for k in ("model", "plan", "policy", "quantized_sites", "versions")}
    return model


class _PlannedLinear(torch.nn.Module):
    """An nn.Linear run through deepwell.scaled_linear in its planned recipe, eagerly."""

    def __init__(self, linear: torch.nn.Linear, recipe: str):
        super().__init__()
        self.linear, self.recipe = linear, recipe

    def forward(self, x):
        return torch.ops.deepwell.scaled_linear(x, self.linear.weight, self.linear.bias, self.recipe, None)


def planned_eager(engine) -> torch.nn.Module:
    """A copy of the engine's model that runs its plan eagerly (every low-precision site through
    deepwell.scaled_linear, the rest as written): the trained model's logits without Inductor's
    fusions, the reference the loaded artifact is bit-identical to on the CPU."""
    model = copy.deepcopy(engine.model)
    for name, (_, recipe) in _planned_linears(engine).items():
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        setattr(parent, child, _PlannedLinear(getattr(parent, child), recipe))
    return model.eval()
