"""Learning-rate schedules as pure functions of the optimizer step: the multiplier of each param
group's initial lr. Being pure, a schedule needs no state in a checkpoint beyond the step."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class WarmupCosine:
    """Linear warmup from 0 over `warmup_steps`, then cosine decay to `min_ratio` of the peak at
    `decay_steps` (default: the Trainer's max_steps), flat after (as torchtitan's and nanoGPT's).

    factor(s) = (s + 1) / warmup_steps                                  for s < warmup_steps
              = min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2     p = (s - warmup) / (decay - warmup)
    """

    warmup_steps: int = 0
    decay_steps: int | None = None
    min_ratio: float = 0.1

    def __post_init__(self):
        if not isinstance(self.warmup_steps, int) or self.warmup_steps < 0:
            raise ValueError(f"WarmupCosine: warmup_steps must be a non-negative int, got {self.warmup_steps!r}")
        if self.decay_steps is not None and (not isinstance(self.decay_steps, int) or self.decay_steps < 1):
            raise ValueError(f"WarmupCosine: decay_steps must be a positive int or None, got {self.decay_steps!r}")
        if not 0.0 <= self.min_ratio <= 1.0:
            raise ValueError(f"WarmupCosine: min_ratio must be in [0, 1], got {self.min_ratio!r}")

    def with_steps(self, max_steps: int) -> "WarmupCosine":
        """This schedule with decay_steps defaulted to `max_steps`."""
        if self.decay_steps is not None:
            return self
        return WarmupCosine(self.warmup_steps, max_steps, self.min_ratio)

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        decay = self.decay_steps if self.decay_steps is not None else step + 1
        if decay <= self.warmup_steps:
            return 1.0
        p = min((step - self.warmup_steps) / (decay - self.warmup_steps), 1.0)
        return self.min_ratio + (1.0 - self.min_ratio) * 0.5 * (1.0 + math.cos(math.pi * p))


def constant(step: int) -> float:
    """No schedule: the initial lr throughout."""
    return 1.0
