"""Checkpoint files: safetensors for tensors, a JSON manifest for everything else, written atomically.

Layout of `checkpoint_dir`:

    step_00000100/            one checkpoint: <part>.safetensors files and manifest.json
    step_00000200/            (a sharded one also dcp/: torch.distributed.checkpoint's files, train/sharded.py)
    latest                    the name of the newest complete checkpoint (one line)

A checkpoint is written into a hidden temporary directory (`.tmp-step_...`), every file fsynced, the
manifest last, then renamed to its final name (atomic on POSIX) and only then named in `latest`
(written to a temporary file and renamed over it). A writer that dies leaves a `.tmp-*` directory,
which no reader looks at and the next writer deletes; `latest` always names a complete checkpoint,
and older checkpoints are pruned (`keep`) only after the new one is in place.

The manifest records each file's size (every file of the checkpoint, those in subdirectories too) and SHA-256 and its own SHA-256 (over its canonical JSON), so
a truncated or edited file, an edited manifest and a missing file are each a `CheckpointError` that
names the file, never a silent partial load.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import torch

FORMAT, VERSION = "deepwell-checkpoint", 1
MANIFEST = "manifest.json"
LATEST = "latest"
_PREFIX = "step_"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be read: missing, partial, corrupted or edited."""


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _canonical(body: dict) -> bytes:
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _cpu_contiguous(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}


def begin(directory: str | os.PathLike, step: int) -> Path:
    """A fresh temporary directory to write checkpoint `step` into, after deleting the `.tmp-*`
    directories of writers that died. Under several processes rank 0 calls this and the others
    write their files into the same directory (a file system all ranks share, as DCP assumes)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-*"):  # left by a writer that died
        shutil.rmtree(stale, ignore_errors=True)
    return staging(root / step_dir_name(step))


def save(directory: str | os.PathLike, step: int, parts: dict[str, dict[str, torch.Tensor]], state: dict, keep: int | None = None,
         staged: Path | None = None) -> Path:
    """Writes checkpoint `step` (parts: file stem -> tensors; state: JSON-able) and returns its path.
    `staged`: the `begin` directory other files of the checkpoint were already written into (the
    manifest covers them too). Keeps the newest `keep` checkpoints (None: all)."""
    root = Path(directory)
    staged = begin(root, step) if staged is None else staged
    final = commit(staged, root / step_dir_name(step), parts, {"format": FORMAT, "version": VERSION, "step": step, "state": state})
    name = final.name
    pointer = root / f".tmp-{LATEST}-{os.getpid()}"
    pointer.write_text(name + "\n")
    _fsync_file(pointer)
    os.replace(pointer, root / LATEST)
    _fsync_dir(root)
    if keep is not None:
        for old in checkpoints(root)[:-keep] if keep > 0 else []:
            if old != final:
                shutil.rmtree(old, ignore_errors=True)
    return final


def write_atomic(final: Path, parts: dict[str, dict[str, torch.Tensor]], body: dict) -> Path:
    """Writes `parts` as <stem>.safetensors and `body` (with the files' sizes and SHA-256, and its
    own SHA-256) as manifest.json into a temporary sibling of `final`, fsynced, then renamed to
    `final` (an existing `final` is swapped out first and deleted after)."""
    return commit(staging(Path(final)), Path(final), parts, body)


def write_part(directory: Path, stem: str, tensors: dict[str, torch.Tensor]) -> Path:
    """`directory`/<stem>.safetensors, fsynced (the manifest hashes it later)."""
    from safetensors.torch import save_file

    path = directory / f"{stem}.safetensors"
    save_file(_cpu_contiguous(tensors), str(path))
    _fsync_file(path)
    return path


def staging(final: Path) -> Path:
    """An empty temporary sibling of `final` (hidden: no reader looks at `.tmp-*`)."""
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def commit(tmp: Path, final: Path, parts: dict[str, dict[str, torch.Tensor]], body: dict) -> Path:
    """`write_atomic` into the staging directory `tmp`: the manifest lists every file under `tmp`
    (those already there, such as DCP's shard files in a subdirectory, and `parts`), by path
    relative to the checkpoint."""
    for stem, tensors in parts.items():
        write_part(tmp, stem, tensors)
    files = {}
    for path in sorted(p for p in tmp.rglob("*") if p.is_file()):
        # Files other processes wrote were fsynced by them; the hash reads them back once more.
        files[path.relative_to(tmp).as_posix()] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    body = {**body, "files": files}
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({**body, "sha256": hashlib.sha256(_canonical(body)).hexdigest()}, indent=1))
    _fsync_file(manifest)
    for d in [p for p in tmp.rglob("*") if p.is_dir()] + [tmp]:
        _fsync_dir(d)
    if final.exists():
        old = final.parent / f".tmp-old-{final.name}-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)
    return final


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The complete-looking checkpoint directories under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and p.name[len(_PREFIX):].isdigit()]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` names one checkpoint (not a directory of them)."""
    p = Path(path)
    return (p / MANIFEST).exists() or p.name.startswith(_PREFIX)


def latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names (None when the directory has none). A `latest` that names a
    missing directory is an error, not a reason to pick another checkpoint silently."""
    root = Path(directory)
    pointer = root / LATEST
    if not pointer.exists():
        found = checkpoints(root)
        return found[-1] if found else None
    name = pointer.read_text().strip()
    if not name.startswith(_PREFIX) or "/" in name:
        raise CheckpointError(f"{pointer}: expected the name of a checkpoint directory (step_NNNNNNNN), got {name!r}")
    return root / name


def verify(path: str | os.PathLike, fmt: str = FORMAT, version: int = VERSION) -> dict:
    """The manifest of checkpoint `path` after checking it and every file it lists; raises
    CheckpointError naming the first file that is missing, truncated, corrupted or edited. (Export
    artifacts use the same layout with fmt "deepwell-export".)"""
    ckpt = Path(path)
    manifest_path = ckpt / MANIFEST
    if not ckpt.is_dir():
        raise CheckpointError(f"checkpoint {ckpt}: no such directory")
    if not manifest_path.exists():
        raise CheckpointError(f"checkpoint {ckpt} is partial: {manifest_path} is missing (its writer did not finish)")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"checkpoint {ckpt}: {manifest_path} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or manifest.get("version") != version:
        got = {k: manifest.get(k) for k in ("format", "version")} if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"checkpoint {ckpt}: {manifest_path} is not a {fmt} v{version} manifest, got {got}")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != hashlib.sha256(_canonical(body)).hexdigest():
        raise CheckpointError(f"checkpoint {ckpt}: {manifest_path} was modified after it was written (its SHA-256 does not match its content)")
    for name, want in manifest["files"].items():
        f = ckpt / name
        if not f.exists():
            raise CheckpointError(f"checkpoint {ckpt}: {f} is missing")
        size = f.stat().st_size
        if size != want["bytes"]:
            raise CheckpointError(f"checkpoint {ckpt}: {f} has {size} bytes, the manifest says {want['bytes']} (truncated or replaced)")
        if _sha256(f) != want["sha256"]:
            raise CheckpointError(f"checkpoint {ckpt}: {f} is corrupted (its SHA-256 differs from the manifest's)")
    return manifest


def load(path: str | os.PathLike, fmt: str = FORMAT) -> tuple[dict[str, dict[str, torch.Tensor]], dict, Path]:
    """(parts, state, path) of a verified checkpoint (the manifest itself as state for fmt != FORMAT)."""
    ckpt = Path(path)
    manifest = verify(ckpt, fmt)
    return read_parts(ckpt, manifest), (manifest["state"] if fmt == FORMAT else manifest), ckpt


def read_parts(ckpt: Path, manifest: dict, stems: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The top-level <stem>.safetensors files of a verified checkpoint (`stems`: only those); files
    in subdirectories (DCP's shards) are read by their own reader."""
    from safetensors.torch import load_file

    parts = {}
    for name in manifest["files"]:
        stem = name.removesuffix(".safetensors")
        if "/" in name or stem == name or (stems is not None and stem not in stems):
            continue
        try:
            parts[stem] = load_file(str(ckpt / name))
        except Exception as e:  # safetensors raises its own error type
            raise CheckpointError(f"checkpoint {ckpt}: {ckpt / name} cannot be read as safetensors ({e})") from None
    return parts


def previous_intact(path: Path) -> Path | None:
    """The newest checkpoint older than `path` that verifies (what to resume from instead)."""
    for p in reversed(checkpoints(path.parent)):
        if p.name < path.name:
            try:
                verify(p)
                return p
            except CheckpointError:
                continue
    return None
