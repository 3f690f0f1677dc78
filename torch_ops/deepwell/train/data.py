"""Real text every machine has offline: the Python standard library's own source files, read as bytes
(a byte-level vocabulary of 256), with a deterministic held-out split, and a stateful batch loader
whose position is part of a checkpoint.

The split is by file, so no held-out window shares text with a training window: a file is held out
when the CRC-32 of its path relative to the standard library is 0 mod `heldout_every` (default 10,
about 10% of the files). Files are read in sorted path order. The corpus is the same on every
machine with the same Python version (another version ships other sources: the loss values move,
the method does not).
"""

from __future__ import annotations

import os
import sysconfig
import zlib
from dataclasses import dataclass, field

import torch

#: Directories of the standard library that hold third-party or generated code, not the stdlib's own.
_SKIPPED_DIRS = {"site-packages", "dist-packages", "__pycache__"}


@dataclass
class ByteCorpus:
    """Training and held-out bytes (uint8 tensors) and where they came from."""

    train: torch.Tensor
    heldout: torch.Tensor
    source: str
    files: dict = field(default_factory=dict)  # {"train": n, "heldout": n}

    vocab: int = 256

    def __str__(self) -> str:
        return (
            f"{self.source}: {self.train.numel() / 1e6:.1f} MB training text from {self.files['train']} files, "
            f"{self.heldout.numel() / 1e6:.1f} MB held out from {self.files['heldout']} other files (byte-level, vocab 256)"
        )

    @classmethod
    def stdlib(cls, max_bytes: int | None = None, heldout_every: int = 10, root: str | None = None) -> "ByteCorpus":
        """The `.py` files of the standard library at `root` (default: this Python's), at most
        `max_bytes` of training text (files are taken whole, in order, until the budget is spent)."""
        if heldout_every < 2:
            raise ValueError(f"ByteCorpus.stdlib: heldout_every must be at least 2, got {heldout_every!r}")
        root = root or sysconfig.get_paths()["stdlib"]
        if not os.path.isdir(root):
            raise RuntimeError(f"ByteCorpus.stdlib: the standard library directory {root!r} does not exist")
        parts: dict[str, list[bytes]] = {"train": [], "heldout": []}
        sizes = {"train": 0, "heldout": 0}
        budget = {"train": max_bytes, "heldout": None if max_bytes is None else max(max_bytes // heldout_every, 1)}
        for rel in _python_files(root):
            split = "heldout" if zlib.crc32(rel.encode()) % heldout_every == 0 else "train"
            if budget[split] is not None and sizes[split] >= budget[split]:
                continue
            with open(os.path.join(root, rel), "rb") as f:
                text = f.read()
            parts[split].append(text + b"\n\n")
            sizes[split] += len(text) + 2
        if not parts["train"] or not parts["heldout"]:
            raise RuntimeError(f"ByteCorpus.stdlib: found no Python sources to split under {root!r}")

        def as_tensor(chunks: list[bytes]) -> torch.Tensor:
            return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8)

        files = {k: len(v) for k, v in parts.items()}
        return cls(as_tensor(parts["train"]), as_tensor(parts["heldout"]), f"Python {sysconfig.get_python_version()} stdlib", files)


def _python_files(root: str) -> list[str]:
    """Every .py file under root, as sorted relative paths."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIPPED_DIRS)
        found.extend(os.path.relpath(os.path.join(dirpath, f), root) for f in filenames if f.endswith(".py"))
    return sorted(found)


class TokenBatches:
    """An endless stream of (batch, seq_len + 1) int64 windows of `data`, at random offsets (as
    nanoGPT's get_batch). Batch i's offsets come from a generator seeded with (seed, i) alone, so the
    loader's whole state is the index of the next batch: `state_dict()` / `load_state_dict()` resume
    the stream exactly (the Trainer stores it in every checkpoint)."""

    def __init__(self, data: torch.Tensor, batch: int, seq_len: int, seed: int = 0):
        if data.dim() != 1 or data.dtype != torch.uint8:
            raise ValueError(f"TokenBatches: data must be a 1-d uint8 tensor of bytes, got {data.dim()}-d {data.dtype}")
        if batch < 1 or seq_len < 1:
            raise ValueError(f"TokenBatches: batch and seq_len must be positive, got batch={batch}, seq_len={seq_len}")
        if data.numel() < seq_len + 2:
            raise ValueError(f"TokenBatches: {data.numel()} bytes are too few for windows of {seq_len + 1}")
        self.data, self.batch, self.seq_len, self.seed = data, batch, seq_len, seed
        self.index = 0

    def __iter__(self):
        return self

    def __next__(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.index)
        self.index += 1
        starts = torch.randint(0, self.data.numel() - self.seq_len - 1, (self.batch,), generator=g)
        return torch.stack([self.data[s : s + self.seq_len + 1] for s in starts.tolist()]).long()

    def state_dict(self) -> dict:
        return {"index": self.index, "seed": self.seed, "batch": self.batch, "seq_len": self.seq_len}

    def load_state_dict(self, state: dict) -> None:
        mine = {"seed": self.seed, "batch": self.batch, "seq_len": self.seq_len}
        theirs = {k: state.get(k) for k in mine}
        if theirs != mine:
            raise ValueError(f"TokenBatches.load_state_dict: the checkpoint's loader was {theirs}, this one is {mine}")
        self.index = int(state["index"])


def heldout_batches(data: torch.Tensor, batch: int, seq_len: int, count: int) -> list[torch.Tensor]:
    """`count` fixed (batch, seq_len + 1) batches of evenly spaced windows over all of `data`: the
    same held-out set at every evaluation."""
    n = batch * count
    span = data.numel() - seq_len - 1
    if span < n:
        raise ValueError(f"heldout_batches: {data.numel()} bytes hold fewer than {n} windows of {seq_len + 1}")
    starts = [i * span // n for i in range(n)]
    windows = torch.stack([data[s : s + seq_len + 1] for s in starts]).long()
    return list(windows.split(batch))
