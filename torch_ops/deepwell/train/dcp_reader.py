"""Reading a sharded checkpoint's torch.distributed.checkpoint (DCP) files without running code
they name. DCP stores two pickles: its `.metadata` (FileSystemReader.read_metadata is a plain
pickle.load) and the non-tensor values of the state dict (the optimizer's param groups: lr, betas,
...), which DefaultLoadPlanner.load_bytes reads with torch.load(weights_only=False). A pickle runs
whatever callable it names, and the manifest's hashes prove no authorship (anyone can recompute
them), so resuming an edited checkpoint would run the editor's code.

`SafeReader` unpickles `.metadata` with `find_class` limited to what DCP writes for the state
deepwell saves (found by tracing a real save, tests/train/test_checkpoint_trust.py keeps the list
honest): DCP's metadata dataclasses, torch.Size, dtypes, layouts and paths. Anything else is a
CheckpointError saying that this is not a checkpoint deepwell wrote and that `trust=True` reads it
with torch's own reader. It also refuses a shard file name that is not one of the checkpoint's
verified `dcp/` files. `SafePlanner` loads the non-tensor values with torch.load(weights_only=True).
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from .checkpoint_files import CheckpointError, open_regular

#: module -> the names `.metadata` may use from it (torch: also every dtype, see `_allowed`).
ALLOWED = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch": {"Size"},
    "torch.serialization": {"_get_layout"},  # returns one of torch's layouts by name, nothing else
    # StorageMeta.checkpoint_id: where the saving run wrote (a path object: only data).
    "pathlib": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
    "pathlib._local": {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"},
}


def _allowed(module: str, name: str) -> bool:
    if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
        return True
    return name in ALLOWED.get(module, ())


def not_ours(where: str, what: str) -> CheckpointError:
    return CheckpointError(
        f"{where}: {what}, so it is not a checkpoint deepwell wrote. DCP metadata is a pickle, which can run any code "
        "it names: if you trust where this checkpoint came from, resume it with trust=True (Trainer.fit(..., trust=True) "
        "or load_checkpoint(..., trust=True)), which reads it with torch's own reader"
    )


class _Unpickler(pickle.Unpickler):
    def __init__(self, f, where: str):
        super().__init__(f)
        self.where = where

    def find_class(self, module: str, name: str):
        if not _allowed(module, name):
            raise not_ours(self.where, f"its DCP metadata names {module}.{name}, which DCP does not write")
        return super().find_class(module, name)


class SafeReader(FileSystemReader):
    """DCP's FileSystemReader on `<ckpt>/dcp` whose metadata is unpickled by `_Unpickler` and
    whose shard files are the checkpoint's verified ones (`files`: the manifest's names under
    `dcp/`, e.g. "__0_0.distcp")."""

    def __init__(self, ckpt: Path, dcp_dir: str, files: set[str]):
        super().__init__(ckpt / dcp_dir)
        self.ckpt, self.dcp_dir, self.files = ckpt, dcp_dir, files
        self.where = f"checkpoint {ckpt}"
        self._metadata: Metadata | None = None

    def read_metadata(self) -> Metadata:  # no **kwargs: DCP then never falls back to per-rank files
        if self._metadata is None:
            self._metadata = self._read()
        return self._metadata

    def _read(self) -> Metadata:
        name = f"{self.dcp_dir}/.metadata"
        with open_regular(self.ckpt, name, self.where) as (f, _):
            try:
                metadata = _Unpickler(f, self.where).load()
            except CheckpointError:
                raise
            except Exception as e:
                raise not_ours(self.where, f"its {name} cannot be unpickled as DCP metadata ({type(e).__name__}: {e})") from None
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise not_ours(self.where, f"its {name} holds a {type(metadata).__name__}, not DCP's Metadata with storage data")
        for info in metadata.storage_data.values():
            path = getattr(info, "relative_path", None)
            if not isinstance(path, str) or path not in self.files:
                raise not_ours(self.where, f"its {name} points at shard file {path!r:.80}, which is not one of the manifest's {self.dcp_dir}/ files")
            if getattr(info, "transform_descriptors", None):
                raise not_ours(self.where, f"its {name} asks for stream transforms {info.transform_descriptors!r:.80}, which deepwell never writes")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
            metadata.storage_meta = StorageMeta()
        elif not isinstance(metadata.storage_meta, StorageMeta):
            raise not_ours(self.where, f"its {name} holds a {type(metadata.storage_meta).__name__} as storage_meta")
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with the non-tensor values read by torch.load(weights_only=True)."""

    def __init__(self, where: str):
        super().__init__()
        self.where = where

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            obj = torch.load(value, weights_only=True)
        except Exception as e:
            raise not_ours(self.where, f"its DCP value {read_item.dest_index.fqn!r} is not plain data ({type(e).__name__}: {e})") from None
        # Re-serialized from what weights_only admits (plain data and tensors), so the parent's
        # own torch.load of it, which places the value where the state dict wants it, runs nothing.
        safe = io.BytesIO()
        torch.save(obj, safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)
