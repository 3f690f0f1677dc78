"""Training on top of a compiled `deepwell.Engine`: the Trainer (trainer.py, its checkpoint half
trainer_checkpoints.py), its checkpoints (checkpoint.py, state.py; sharded.py under several
processes), learning-rate schedules (schedule.py), AdamW for sharded models (optim.py), the
byte-level standard-library corpus (data.py), the per-recipe parity run (parity.py) and the loss
plots (plots.py). Inference artifacts are `deepwell.artifact`'s."""

from .checkpoint import CheckpointError
from .data import ByteCorpus, TokenBatches, heldout_batches
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
    "heldout_batches",
    "next_token_loss",
]
