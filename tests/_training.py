"""Helpers shared by the training tests: a tiny byte-level LLaMA compiled with a plan, the corpus
slice it trains on, and a Trainer with the settings the tests use."""

from __future__ import annotations

import functools

import torch

import deepwell
from deepwell.train import ByteCorpus, TokenBatches, Trainer, WarmupCosine, heldout_batches
from deepwell.train.parity import ModelConfig, build_engine

CONFIG = ModelConfig.for_device(torch.device("cpu"), "tiny")  # 1 layer, d=128, 4x32 tokens


@functools.cache
def corpus() -> ByteCorpus:
    return ByteCorpus.stdlib(max_bytes=400_000)


def engine(recipe: str = "mxfp8", seed: int = 0):
    """A fresh model (same initial weights for the same seed), planned with `recipe`, compiled."""
    return build_engine(CONFIG, recipe, torch.device("cpu"), seed)


def batches(seed: int = 1) -> TokenBatches:
    return TokenBatches(corpus().train, CONFIG.batch, CONFIG.seq_len, seed=seed)


def heldout(count: int = 2) -> list[torch.Tensor]:
    return heldout_batches(corpus().heldout, CONFIG.batch, CONFIG.seq_len, count)


def trainer(eng, steps: int, checkpoint_dir=None, **kw) -> Trainer:
    settings = dict(
        optimizer=lambda p: torch.optim.AdamW(p, lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1),
        lr_schedule=WarmupCosine(2),
        grad_accum=2,
        max_steps=steps,
        log_every=1,
        checkpoint_dir=checkpoint_dir,
        progress=False,
    )
    settings.update(kw)
    return Trainer.from_engine(eng, **settings)


def losses(t: Trainer) -> list[float]:
    return [r["loss"] for r in t.history if "loss" in r]


class EagerEngine:
    """What the Trainer needs of an engine (a model and a call), without compiling: for modules
    the compile backend does not trace (deepwell.Linear's guardrails read host state)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, *args):
        return self.model(*args)


__all__ = ["CONFIG", "EagerEngine", "batches", "corpus", "deepwell", "engine", "heldout", "losses", "trainer"]
