"""`deepwell.export(engine, path)` and `deepwell.load(path)`: an inference artifact holding the plan,
the policy and the model's weights, each planned low-precision site's weight pre-quantized in its
recipe (artifact/quantized.py), written atomically like a checkpoint (a directory with
weights.safetensors and manifest.json, every file's SHA-256 checked on load).

What "the loaded model's logits match the trained model's" means (tests/train/test_export.py):
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
  the shared path; tests/ops/test_quantized_linear.py's GPU test proves the op on the device.

Trust. An artifact is something people share, so nothing in it is code and loading it runs none:
- The model class the manifest names is only looked up, never imported: it must be one of
  deepwell's own models (deepwell.models), or the caller says what to build (`model=` an instance
  to fill, or `model_cls=` a class to build from the recorded config). The recorded config is
  checked on the meta device against the stored tensors' shapes before anything is allocated.
- Every value of the manifest is checked before use (types, recipes, dtypes, every site an
  nn.Linear of the model with the stored codes' shapes); the files are read through
  train/checkpoint.py, confined to the artifact's directory.
- `export` never deletes what deepwell did not write: it writes into a new or empty directory, or
  (with `overwrite=True`) replaces an artifact that holds exactly the files its manifest lists.
"""

from __future__ import annotations

import copy
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Callable

import torch

from .. import _native, models
from ..train import checkpoint, state
from ..train.checkpoint_files import MAX_MANIFEST_BYTES, read_bounded
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


def export(engine, path: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Writes the inference artifact of `engine` (a deepwell.Engine) to directory `path`: a new or
    empty directory, or with `overwrite=True` one that holds a deepwell artifact and nothing else
    (see `_check_destination`)."""
    if not hasattr(engine, "plan") or not hasattr(engine, "model"):
        raise ValueError(f"deepwell.export: expected a deepwell.Engine (deepwell.compile's result), got {type(engine).__name__}")
    final = Path(path)
    _check_destination(final, overwrite)
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
        "model": {"class": _class_name(cls), "config": _json_config(model), "dtype": str(_dtype(model)).removeprefix("torch.")},
        "plan": engine.plan.to_dict(),
        "policy": asdict(engine.plan.policy),
        "quantized_sites": sites,
        "aliases": aliases,
        "versions": {"torch": torch.__version__, "deepwell": _native.version()},
    }
    return checkpoint.write_atomic(final, {"weights": tensors}, body)


def _check_destination(final: Path, overwrite: bool) -> None:
    """Refuses a destination whose contents deepwell did not write: writing the artifact replaces
    the directory `final` whole (checkpoint.write_atomic), so anything else in it would be lost."""
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        raise FileExistsError(f"deepwell.export: {final} exists and is not a directory; the artifact is a directory of its own: choose a new path")
    if not final.exists() or not any(final.iterdir()):
        return
    if not _holds_only_an_artifact(final):
        raise FileExistsError(
            f"deepwell.export: {final} is a non-empty directory that is not a deepwell artifact (or holds files its manifest "
            "does not list); export never deletes files it did not write: choose a new or empty directory"
        )
    if not overwrite:
        raise FileExistsError(f"deepwell.export: {final} already holds a deepwell artifact; pass overwrite=True to replace it")


def _holds_only_an_artifact(directory: Path) -> bool:
    """Whether `directory` holds a deepwell-export manifest and exactly the files it lists (their
    contents are not hashed: a damaged artifact of ours may still be replaced)."""
    manifest = _manifest_or_none(directory)
    if manifest is None or manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        return False
    present = {p.relative_to(directory).as_posix() for p in directory.rglob("*") if not p.is_dir() or p.is_symlink()}
    return present == {*manifest["files"], checkpoint.MANIFEST}


def _manifest_or_none(directory: Path) -> dict | None:
    """`directory`'s manifest.json parsed, or None when it is missing, not a regular file of a
    manifest's size, or not a JSON object (only a hint of whose directory this is: nothing is loaded)."""
    try:
        manifest = json.loads(read_bounded(directory, checkpoint.MANIFEST, MAX_MANIFEST_BYTES, str(directory), "a manifest"))
    except (checkpoint.CheckpointError, ValueError):
        return None
    return manifest if isinstance(manifest, dict) else None


def read_manifest(path: str | os.PathLike) -> dict:
    """The verified manifest of an artifact (plan, policy, quantized sites, model class)."""
    return checkpoint.verify(path, FORMAT, VERSION)


def _class_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


#: The model classes `load` builds by name: deepwell's own. Any other class is built only when the
#: caller passes it (`model_cls=`), so an artifact never makes `load` import a module it names.
KNOWN_MODELS: dict[str, type[torch.nn.Module]] = {_class_name(getattr(models, n)): getattr(models, n) for n in models.__all__}

#: The dtypes a model may record (what `_dtype` writes for a floating-point model).
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def _bad(where: Path, what: str) -> checkpoint.CheckpointError:
    return checkpoint.CheckpointError(f"deepwell.load: {where}: {what}")


def _checked(manifest: dict, where: Path) -> dict:
    """The manifest's model, quantized sites and aliases after checking each value's type: the
    manifest's own SHA-256 proves no authorship (anyone can recompute it), so every value is input."""
    spec = manifest.get("model")
    if not isinstance(spec, dict) or not isinstance(spec.get("class"), str):
        raise _bad(where, f"the manifest's 'model' must be an object with a 'class' string, got {spec!r:.200}")
    if not (spec.get("config") is None or isinstance(spec["config"], dict)):
        raise _bad(where, f"the manifest's model 'config' must be an object or null, got {type(spec['config']).__name__}")
    if spec.get("dtype", "float32") not in _DTYPES:
        raise _bad(where, f"the manifest's model 'dtype' must be one of {sorted(_DTYPES)}, got {spec.get('dtype')!r:.80}")
    sites = manifest.get("quantized_sites")
    if not isinstance(sites, dict):
        raise _bad(where, f"the manifest's 'quantized_sites' must be an object, got {type(sites).__name__}")
    for name, site in sites.items():
        ok = isinstance(site, dict) and site.get("recipe") in QUANTIZED and all(
            type(site.get(k)) is int and site[k] > 0 for k in ("in_features", "out_features"))
        if not ok:
            raise _bad(where, f"quantized site {name!r:.200} must be {{recipe: one of {QUANTIZED}, in_features, out_features: positive ints}}, got {site!r:.200}")
    aliases = manifest.get("aliases")
    if not (isinstance(aliases, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in aliases.items())):
        raise _bad(where, "the manifest's 'aliases' must map names to names")
    for key in ("plan", "policy", "versions"):
        if key not in manifest:
            raise _bad(where, f"the manifest has no {key!r}")
    return spec


def _builder(spec: dict, model_cls: type | None, where: Path) -> tuple[dict[str, tuple], Callable[[], torch.nn.Module]]:
    """(its state dict's shapes, a function building it) for the model the artifact describes, from
    its recorded config: `model_cls` when the caller gives one, else the deepwell model the manifest
    names (looked up, never imported)."""
    if model_cls is None:
        model_cls = KNOWN_MODELS.get(spec["class"])
        if model_cls is None:
            raise ValueError(
                f"deepwell.load: {where} names model class {spec['class']!r:.200}, which is not one of deepwell's models "
                f"({', '.join(KNOWN_MODELS)}); load never imports a module an artifact names: pass model=<an instance to fill> "
                "or model_cls=<the class to build>"
            )
    elif not (isinstance(model_cls, type) and issubclass(model_cls, torch.nn.Module)):
        raise ValueError(f"deepwell.load: model_cls must be an nn.Module subclass, got {model_cls!r:.200}")
    if spec.get("config") is None:
        raise ValueError(f"deepwell.load: the artifact's model {spec['class']!r:.200} recorded no config; pass model=<an instance of it>")
    try:
        with torch.device("meta"):  # the shapes first: a config that does not fit allocates nothing
            shapes = {k: tuple(t.shape) for k, t in model_cls(**spec["config"]).state_dict().items()}
        return shapes, lambda: model_cls(**spec["config"]).to(_DTYPES[spec.get("dtype", "float32")])
    except (TypeError, ValueError) as e:
        raise ValueError(f"deepwell.load: {where}: {_class_name(model_cls)} cannot be built from the recorded config ({e})") from None


def _quantized_site(model: torch.nn.Module | None, shapes: dict, name: str, site: dict, weights: dict, where: Path) -> dict:
    """The stored codes of one quantized site, after checking that the model has an nn.Linear of
    that name and shape and that the codes are what `quantize_weight` makes for it."""
    out_f, in_f = site["out_features"], site["in_features"]
    key = f"{name}.weight"
    if model is not None:
        linear = model.get_submodule(name) if _has_submodule(model, name) else None
        if not isinstance(linear, torch.nn.Linear) or (linear.out_features, linear.in_features) != (out_f, in_f):
            raise _bad(where, f"quantized site {name!r:.200} ({out_f} x {in_f}) is not an nn.Linear of that shape in {type(model).__name__}")
    elif shapes.get(key) != (out_f, in_f):
        raise _bad(where, f"quantized site {name!r:.200} ({out_f} x {in_f}) is not a weight of that shape in the model (got {shapes.get(key)})")
    want = quantize_weight(torch.empty(out_f, in_f, device="meta"), site["recipe"])
    stored = {}
    for part, t in want.items():
        got = weights.pop(f"{key}.{part}", None)
        if got is None or got.dtype != t.dtype or got.shape != t.shape:
            found = "missing" if got is None else f"{got.dtype} {tuple(got.shape)}"
            raise _bad(where, f"quantized site {name!r:.200}: {key}.{part} must be {t.dtype} {tuple(t.shape)} ({site['recipe']}), got {found}")
        stored[part] = got
    return stored


def _has_submodule(model: torch.nn.Module, name: str) -> bool:
    try:
        model.get_submodule(name)
        return True
    except AttributeError:
        return False


def load(path: str | os.PathLike, model: torch.nn.Module | None = None, device: str | torch.device | None = None, *,
         model_cls: type[torch.nn.Module] | None = None) -> torch.nn.Module:
    """The exported model, in eval mode, without gradients: its low-precision sites are
    QuantizedLinear modules on the stored codes, the rest as trained. `model`: an instance of the
    architecture to fill; `model_cls`: the class to build from the artifact's recorded config;
    neither: the artifact must name one of deepwell's models (nothing an artifact names is ever
    imported: the module docs, "Trust"). The manifest is at `model.deepwell_artifact` (plan, policy, sites)."""
    parts, manifest, where = checkpoint.load(path, FORMAT)
    spec = _checked(manifest, where)
    weights = dict(parts.get("weights", {}))
    shapes, build = ({}, None) if model is not None else _builder(spec, model_cls, where)
    stored = {name: _quantized_site(model, shapes, name, site, weights, where) for name, site in manifest["quantized_sites"].items()}
    if model is None:
        _check_fit(shapes, weights, manifest, where)
        model = build()
    for name, site in manifest["quantized_sites"].items():
        bias = weights.pop(f"{name}.bias", None)
        q = QuantizedLinear(site["recipe"], site["in_features"], site["out_features"], stored[name], bias)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if not isinstance(getattr(parent, child, None), torch.nn.Linear):
            raise _bad(where, f"site {name!r:.200} is not an nn.Linear of {type(model).__name__}")
        setattr(parent, child, q)
    full = dict(weights)
    full.update({alias: weights[name] for alias, name in manifest["aliases"].items() if name in weights})
    try:
        missing, unexpected = model.load_state_dict(full, strict=False)
    except RuntimeError as e:  # a stored tensor of another shape than the model's
        raise ValueError(f"deepwell.load: {where} does not fit {type(model).__name__}: {e}") from None
    quantized_buffers = {f"{n}.{b}" for n in manifest["quantized_sites"] for b in ("weight_data", "weight_scale", "weight_global_scale", "bias")}
    missing = [k for k in missing if k not in quantized_buffers]
    if missing or unexpected:
        raise ValueError(f"deepwell.load: {where} does not fit {type(model).__name__}: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    if device is not None:
        model = model.to(device)
    model.eval().requires_grad_(False)
    model.deepwell_artifact = {k: manifest[k] for k in ("model", "plan", "policy", "quantized_sites", "versions")}
    return model


def _check_fit(shapes: dict, weights: dict, manifest: dict, where: Path) -> None:
    """The model the config builds (its shapes from the meta device) against the stored tensors,
    before it is built for real: a config edited to other sizes fails here, having allocated nothing."""
    stored = {**{k: tuple(t.shape) for k, t in weights.items()},
              **{a: tuple(weights[n].shape) for a, n in manifest["aliases"].items() if n in weights}}
    quantized = {f"{n}.weight" for n in manifest["quantized_sites"]}
    wrong = sorted(k for k, shape in shapes.items() if k not in quantized and stored.get(k, shape) != shape)
    if wrong:
        k = wrong[0]
        raise ValueError(f"deepwell.load: {where}: the recorded config builds {k} as {shapes[k]}, the artifact stores {stored[k]} "
                         f"({len(wrong)} tensors differ)")


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
