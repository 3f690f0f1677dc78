"""Checkpoint files: safetensors for tensors, a JSON manifest for everything else, written atomically.

Layout of `checkpoint_dir`:

    step_00000100/            one checkpoint: <part>.safetensors files and manifest.json
    step_00000200/            (a sharded one also dcp/: torch.distributed.checkpoint's files, train/sharded.py)
    latest                    the name of the newest complete checkpoint (one line)

A checkpoint is written into a hidden temporary directory (`.tmp-step_...`), every file fsynced, the
manifest last, then renamed to its final name (atomic on POSIX) and only then named in `latest`
(written to a temporary file and renamed over it). A writer that dies leaves a `.tmp-*` directory,
which no reader looks at and the next writer deletes; `latest` always names a complete checkpoint,
and older checkpoints are pruned (`keep`) only after the new one is in place: only earlier steps
than the new one, and only directories with deepwell's manifest (`prunable`). Re-saving a step that
exists swaps the two directories in one step (Linux renameat2 RENAME_EXCHANGE); where the system
cannot, the old one is moved aside to `.tmp-old-<name>-<pid>` first, and `recover` (run by the next
writer, and by a Trainer before it resumes) renames it back if the writer died before the new one
took its name. One Trainer at a time writes a directory (train/dirlock.py).

The manifest records each file's size (every file of the checkpoint, those in subdirectories too) and SHA-256 and its own SHA-256 (over its canonical JSON), so
a truncated or edited file, an edited manifest and a missing file are each a `CheckpointError` that
names the file, never a silent partial load. Those hashes detect damage, not authorship (an editor
can recompute them), so reading treats the directory as untrusted input (train/checkpoint_files.py):
the manifest's keys are checked, its file names confined to the checkpoint, only regular files read,
and every read bounded.
"""

from __future__ import annotations

import ctypes
import errno
import functools
import hashlib
import json
import os
import re
import shutil
from pathlib import Path

import torch

from .checkpoint_files import MAX_MANIFEST_BYTES, CheckpointError, check_name, fd_path, open_regular, read_bounded, require, sha256

FORMAT, VERSION = "deepwell-checkpoint", 1
MANIFEST = "manifest.json"
LATEST = "latest"
_PREFIX = "step_"
_STEP_NAME = re.compile(r"step_[0-9]+")
#: `latest` holds one checkpoint's name and a newline; anything longer is not a pointer deepwell wrote.
MAX_LATEST_BYTES = 256
#: Keys (and JSON types) of a checkpoint manifest's body beyond format, version and files.
_BODY = {"step": int, "state": dict}


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _sha256(path: Path) -> str:
    """The SHA-256 of a file this process just wrote (its own staging directory)."""
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
    recover(root)
    for stale in root.glob(".tmp-*"):  # left by a writer that died
        if stale.is_dir() and not stale.is_symlink():
            shutil.rmtree(stale, ignore_errors=True)
        else:
            stale.unlink(missing_ok=True)
    return staging(root / step_dir_name(step))


def recover(directory: str | os.PathLike) -> list[Path]:
    """Renames back each checkpoint a writer moved aside (`.tmp-old-<name>-<pid>`, see `commit`)
    and died before the new one took its name: with `<name>` missing, that directory is the
    complete old checkpoint. Returns the checkpoints put back."""
    root = Path(directory)
    restored = []
    for old in sorted(root.glob(".tmp-old-*")) if root.is_dir() else []:
        name, _, pid = old.name.removeprefix(".tmp-old-").rpartition("-")
        final = root / name
        if name and pid.isdigit() and old.is_dir() and not old.is_symlink() and not os.path.lexists(final):
            os.rename(old, final)
            restored.append(final)
    if restored:
        _fsync_dir(root)
    return restored


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
        for old in prunable(root, step, keep):
            shutil.rmtree(old, ignore_errors=True)
    return final


def prunable(directory: str | os.PathLike, step: int, keep: int) -> list[Path]:
    """The checkpoints that saving `step` with `keep` deletes: of those at `step` or before, all
    but the newest `keep` (counting `step` itself), and only directories holding a deepwell
    checkpoint manifest. A checkpoint of a later step is another run's (or one this run will
    overwrite when it gets there), never a reason to delete this run's own; a step_* directory
    without deepwell's manifest is not deepwell's to delete."""
    if keep <= 0:
        return []
    upto = [p for p in checkpoints(directory) if int(p.name[len(_PREFIX):]) <= step]
    return [p for p in upto[:-keep] if _has_our_manifest(p)]


def _has_our_manifest(path: Path) -> bool:
    try:
        raw = read_bounded(path, MANIFEST, MAX_MANIFEST_BYTES, f"checkpoint {path}", "a manifest")
        manifest = json.loads(raw)
    except (CheckpointError, OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(manifest, dict) and manifest.get("format") == FORMAT


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
    if not final.exists():
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        return final
    if _exchange(tmp, final):
        replaced = tmp  # now holds the old checkpoint
    else:
        # No atomic exchange here: between these two renames no directory has the name, and a
        # writer that dies there leaves the complete old checkpoint in `replaced`, which `recover`
        # renames back.
        replaced = final.parent / f".tmp-old-{final.name}-{os.getpid()}"
        os.rename(final, replaced)
        os.rename(tmp, final)
    _fsync_dir(final.parent)  # the new one in place for good before the old one goes
    shutil.rmtree(replaced, ignore_errors=True)
    return final


@functools.cache
def _renameat2():
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2  # glibc >= 2.28
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swaps the existing directories `a` and `b` in one step (Linux renameat2 with
    RENAME_EXCHANGE): a re-saved checkpoint replaces the old one with no moment at which the name
    is missing. False where the system or the file system cannot."""
    fn = _renameat2()
    if fn is None:
        return False
    at_fdcwd, rename_exchange = -100, 2  # <fcntl.h>, <linux/fs.h>
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(a), None, str(b))


def checkpoints(directory: str | os.PathLike) -> list[Path]:
    """The complete-looking checkpoint directories under `directory`, oldest first."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_NAME.fullmatch(p.name)]
    return sorted(found, key=lambda p: int(p.name[len(_PREFIX):]))


def is_checkpoint(path: str | os.PathLike) -> bool:
    """Whether `path` names one checkpoint (not a directory of them): it holds a manifest, or its
    name is step_<digits> (one whose writer did not finish). A directory of checkpoints named
    `step_sweep` is not one."""
    p = Path(path)
    return os.path.lexists(p / MANIFEST) or bool(_STEP_NAME.fullmatch(p.name))


def latest(directory: str | os.PathLike) -> Path | None:
    """The checkpoint `latest` names (None when the directory has none). A `latest` that names a
    missing directory is an error, not a reason to pick another checkpoint silently."""
    root = Path(directory)
    pointer = root / LATEST
    if not os.path.lexists(pointer):
        found = checkpoints(root)
        return found[-1] if found else None
    where = f"checkpoint directory {root}"
    raw = read_bounded(root, LATEST, MAX_LATEST_BYTES, where, "a `latest` pointer (one checkpoint name)")
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        name = None
    if name is None or not _STEP_NAME.fullmatch(name):
        raise CheckpointError(
            f"{pointer}: expected the name of a checkpoint directory (step_NNNNNNNN), got {raw[:80]!r}; "
            "delete it to resume from the newest step_* directory, or write that directory's name into it"
        )
    return root / name


def verify(path: str | os.PathLike, fmt: str = FORMAT, version: int = VERSION, *, schema: dict | None = None) -> dict:
    """The manifest of checkpoint `path` after checking it and every file it lists; raises
    CheckpointError naming the first file that is missing, truncated, corrupted or edited, or the
    manifest key that is missing or of the wrong type. (Export artifacts use the same layout with
    fmt "deepwell-export".) `schema`: the keys the body must hold (checkpoint_files.require;
    default: a checkpoint's step and state for FORMAT, nothing more for other formats)."""
    ckpt = Path(path)
    manifest_path = ckpt / MANIFEST
    where = f"checkpoint {ckpt}"
    if not ckpt.is_dir():
        raise CheckpointError(f"{where}: no such directory")
    if not os.path.lexists(manifest_path):
        raise CheckpointError(f"{where} is partial: {manifest_path} is missing (its writer did not finish)")
    raw = read_bounded(ckpt, MANIFEST, MAX_MANIFEST_BYTES, where, "a manifest")
    try:
        manifest = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{where}: {manifest_path} is not valid JSON ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != fmt or manifest.get("version") != version:
        got = {k: manifest.get(k) for k in ("format", "version")} if isinstance(manifest, dict) else type(manifest).__name__
        raise CheckpointError(f"{where}: {manifest_path} is not a {fmt} v{version} manifest, got {got}")
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    if manifest.get("sha256") != hashlib.sha256(_canonical(body)).hexdigest():
        raise CheckpointError(f"{where}: {manifest_path} was modified after it was written (its SHA-256 does not match its content)")
    if schema is None:
        schema = _BODY if fmt == FORMAT else {}
    require(manifest, {"files": dict, **schema}, where)
    for name in manifest["files"]:
        require(manifest["files"], {check_name(name, where): {"bytes": int, "sha256": str}}, where, "files.")
    step = manifest.get("step")
    if fmt == FORMAT and isinstance(step, int) and _STEP_NAME.fullmatch(ckpt.name) and int(ckpt.name[len(_PREFIX):]) != step:
        raise CheckpointError(
            f"{where}: manifest.json describes step {manifest['step']}, not this directory's: it is stale (copied from "
            "another checkpoint) or the directory was renamed, so it does not describe these files"
        )
    for name, want in manifest["files"].items():
        with open_regular(ckpt, name, where) as (f, size):
            if size != want["bytes"]:
                raise CheckpointError(
                    f"{where}: {ckpt / name} has {size} bytes, the manifest says {want['bytes']}: manifest.json does not "
                    "describe this file (truncated or replaced after it was written, or a stale manifest from another save)"
                )
            if sha256(f, size) != want["sha256"]:
                raise CheckpointError(
                    f"{where}: {ckpt / name} is corrupted or manifest.json is stale: its SHA-256 differs from the "
                    "manifest's (the file changed after the manifest was written, or the manifest comes from another save)"
                )
    return manifest


def load(path: str | os.PathLike, fmt: str = FORMAT, *, schema: dict | None = None) -> tuple[dict[str, dict[str, torch.Tensor]], dict, Path]:
    """(parts, state, path) of a verified checkpoint (the manifest itself as state for fmt != FORMAT)."""
    ckpt = Path(path)
    manifest = verify(ckpt, fmt, schema=schema)
    return read_parts(ckpt, manifest), (manifest["state"] if fmt == FORMAT else manifest), ckpt


def read_parts(ckpt: Path, manifest: dict, stems: list[str] | None = None) -> dict[str, dict[str, torch.Tensor]]:
    """The top-level <stem>.safetensors files of a verified checkpoint (`stems`: only those); files
    in subdirectories (DCP's shards) are read by their own reader. Each is opened as `verify`
    checked it (a regular file, no link, the manifest's size) and read through that open file."""
    from safetensors.torch import load_file

    parts, where = {}, f"checkpoint {ckpt}"
    for name, want in manifest["files"].items():
        stem = name.removesuffix(".safetensors")
        if "/" in name or stem == name or (stems is not None and stem not in stems):
            continue
        with open_regular(ckpt, name, where) as (f, size):
            if size != want["bytes"]:
                raise CheckpointError(f"{where}: {ckpt / name} changed after it was verified ({size} bytes, the manifest says {want['bytes']})")
            try:
                parts[stem] = load_file(fd_path(f, ckpt / name))
            except Exception as e:  # safetensors raises its own error type
                raise CheckpointError(f"{where}: {ckpt / name} cannot be read as safetensors ({e})") from None
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
