"""Sharded checkpoints: the model's and the optimizer's state written by every rank through
torch.distributed.checkpoint (DCP), so no rank ever holds the whole state (the "full" format of
train/distributed.py gathers it to rank 0, which writes the one-process files).

Layout of one sharded checkpoint (train/checkpoint.py writes the rest, atomically as always):

    step_00000100/
      dcp/                    DCP's own files: .metadata and one __<rank>_0.distcp per rank
      rng-rank<r>.safetensors each rank's random generators (python and numpy: the manifest's rng.ranks[r])
      guardrails.safetensors  rank 0's deepwell.Linear guardrail statistics (when there are any)
      manifest.json           everything else, and every file's SHA-256, dcp/ included

Saving: rank 0 makes the checkpoint's temporary directory, every rank writes its DCP shards and
its RNG file into it, and after that (a collective: every rank's files exist) rank 0 hashes them
all into the manifest and renames the directory, as for the one-process format.

Loading: rank 0 verifies every hash (train/distributed.py on_rank0), then `dcp.load` into this
run's own sharded state dicts and `set_state_dict`: DCP reshards, so a checkpoint written by N
processes resumes in M. With one process and torch.distributed not initialised it loads with
`no_dist=True` (DCP reads the whole tensors). Each rank takes its own saved RNG streams; a rank the
saving run did not have (resuming with more processes) takes rank 0's, as every rank does with
the full format, which saves rank 0's alone.

Trust: DCP's files hold pickles (its `.metadata`, and the optimizer's non-tensor values), and a
pickle can run any code it names. DCP's files are always the checkpoint's own `dcp/` (the manifest
cannot point elsewhere), and by default they are read by train/dcp_reader.py, which admits only
what DCP writes for deepwell's state; a checkpoint whose pickles name anything else is a
CheckpointError. `trust=True` reads them with torch's own reader and planner: only for
checkpoints from a source you trust.
"""

from __future__ import annotations

import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist

from ..distributed.units import world_size
from . import checkpoint, state
from .checkpoint_files import CheckpointError, require
from .distributed import rank

FORMATS = ("full", "sharded")
DCP_DIR = "dcp"


def resolve_format(fmt: str | None) -> str:
    """The Trainer's `checkpoint_format`: None is "sharded" under several processes, else "full"."""
    if fmt is None:
        return "sharded" if world_size() > 1 else "full"
    if fmt not in FORMATS:
        raise ValueError(f"deepwell.Trainer: checkpoint_format must be 'full', 'sharded' or None, got {fmt!r}")
    return fmt


def _rng_stem(r: int) -> str:
    return f"rng-rank{r}"


@contextmanager
def _no_dist_quiet():
    # DCP warns that it assumes one process when torch.distributed is not initialised: that is
    # exactly the case it is asked for here (no_dist=True), so the warning says nothing new.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _state_dicts(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    """This rank's shards (DTensors under FSDP2 and tensor parallelism), keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, opt_sd = get_state_dict(model, opt)
    return {"model": model_sd, "optimizer": opt_sd}


def save(directory: Path, step: int, model: torch.nn.Module, opt: torch.optim.Optimizer, parts: dict, meta: dict,
         keep: int | None) -> Path:
    """Checkpoint `step` in the sharded format; every rank calls it. `parts` (rank 0's tensors
    beyond model, optimizer and RNG) and `meta` as for checkpoint.save."""
    import torch.distributed.checkpoint as dcp

    world, me = world_size(), rank()
    staged = [str(checkpoint.begin(directory, step)) if me == 0 else None]
    if world > 1:
        dist.broadcast_object_list(staged, src=0)  # rank 0's temporary directory, for every rank
    staged = Path(staged[0])
    with _no_dist_quiet():
        dcp.save(_state_dicts(model, opt), checkpoint_id=staged / DCP_DIR, no_dist=not dist.is_initialized())
    rng, rng_meta = state.rng_state()
    checkpoint.write_part(staged, _rng_stem(me), rng)
    metas = [None] * world if me == 0 else None
    if world > 1:
        dist.gather_object(rng_meta, metas, dst=0)  # returns on rank 0 once every rank wrote its files
    else:
        metas = [rng_meta]
    final = directory / checkpoint.step_dir_name(step)
    if me == 0:
        meta = {**meta, "checkpoint_format": "sharded", "world_size": world, "dcp": DCP_DIR, "rng": {"ranks": metas}}
        final = checkpoint.save(directory, step, parts, meta, keep, staged=staged)
    if world > 1:
        dist.barrier()  # the other ranks see the checkpoint only once it is complete
    return final


def check_manifest(manifest: dict, ckpt: Path) -> None:
    """Raises CheckpointError when a sharded checkpoint's manifest lacks what `load` reads: its
    DCP directory (exactly DCP_DIR, inside the checkpoint), the processes' count, and each rank's
    RNG state and file."""
    where = f"checkpoint {ckpt}"
    meta = manifest["state"]
    require(meta, {"world_size": int, "dcp": str, "rng": {"ranks": list}}, where, "state.")
    if meta["dcp"] != DCP_DIR:
        raise CheckpointError(
            f"{where}: the manifest's state.dcp must be {DCP_DIR!r} (the checkpoint's own subdirectory, where deepwell "
            f"writes DCP's files), got {meta['dcp']!r:.200}: the manifest was edited"
        )
    world, ranks = meta["world_size"], meta["rng"]["ranks"]
    if world < 1 or len(ranks) != world:
        raise CheckpointError(f"{where}: the manifest says {world} processes saved it but holds RNG state for {len(ranks)}: the manifest was edited")
    for r, rng_meta in enumerate(ranks):
        require({"rng": rng_meta}, {"rng": {"python": list, "numpy": list, "cuda_devices": int}}, where, f"state.rng.ranks[{r}].")
    for name in (f"{DCP_DIR}/.metadata", *(f"{_rng_stem(r)}.safetensors" for r in range(world))):
        if name not in manifest["files"]:
            raise CheckpointError(f"{where}: the manifest lists no {name}, which every sharded checkpoint holds: the manifest was edited")


def _failure(e: BaseException) -> BaseException:
    """The first rank's own exception inside DCP's CheckpointException (a dict rank -> (exception,
    traceback)), so a CheckpointError of train/dcp_reader.py keeps its message."""
    for failure in getattr(e, "failures", {}).values():
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, BaseException):
            return inner
    return e


def load(model: torch.nn.Module, opt: torch.optim.Optimizer, ckpt: Path, manifest: dict, trust: bool = False) -> tuple[dict, dict]:
    """Loads a verified sharded checkpoint's model and optimizer state into `model` and `opt`;
    returns (parts, rng meta) for the rest: this rank's "rng" and rank 0's "guardrails".
    `trust`: read DCP's pickles with torch's own reader (see "Trust" in the module docs)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from .dcp_reader import SafePlanner, SafeReader

    check_manifest(manifest, ckpt)
    meta = manifest["state"]
    sd = _state_dicts(model, opt)
    where = ckpt / DCP_DIR
    if trust:
        reader, planner = dcp.FileSystemReader(where), None
    else:
        shards = {n.removeprefix(f"{DCP_DIR}/") for n in manifest["files"] if n.startswith(f"{DCP_DIR}/") and n.count("/") == 1}
        reader, planner = SafeReader(ckpt, DCP_DIR, shards), SafePlanner(f"checkpoint {ckpt}")
        reader.read_metadata()  # here, so that its CheckpointError is not wrapped by DCP's
    try:
        with _no_dist_quiet():
            dcp.load(sd, storage_reader=reader, planner=planner, no_dist=not dist.is_initialized())
    except (Exception, CheckpointException) as e:  # CheckpointException (every rank's failure) is a BaseException
        inner = _failure(e)
        if isinstance(inner, CheckpointError):
            raise CheckpointError(str(inner)) from None
        raise CheckpointError(
            f"checkpoint {ckpt}: the sharded state in {where} does not fit this model and optimizer "
            f"(saved by {meta['world_size']} processes; torch.distributed.checkpoint says: {inner})"
        ) from None
    set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optimizer"])
    own = rank() if rank() < meta["world_size"] else 0
    parts = checkpoint.read_parts(ckpt, manifest, [_rng_stem(own), "guardrails"])
    parts["rng"] = parts.pop(_rng_stem(own))
    return parts, meta["rng"]["ranks"][own]
