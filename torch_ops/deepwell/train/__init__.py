"""Training on top of a compiled `deepwell.Engine`: the Trainer (trainer.py), its checkpoints
(checkpoint.py, state.py; sharded.py under several processes), learning-rate schedules
(schedule.py), AdamW for sharded models (optim.py), the byte-level standard-library corpus (data.py), inference artifacts (export.py,
quantized.py), the per-recipe parity run (parity.py) and the loss plots (plots.py)."""

from .checkpoint import CheckpointError
from .data import ByteCorpus, TokenBatches, heldout_batches
from .export import export, load, planned_eager
from .optim import AdamW
from .schedule import WarmupCosine
from .trainer import Trainer, next_token_loss

__all__ = [
    "AdamW",
    "ByteCorpus",
    "CheckpointError",
    "TokenBatches",
    "Trainer",
    "WarmupCosine",
    "export",
    "heldout_batches",
    "load",
    "next_token_loss",
    "planned_eager",
]
