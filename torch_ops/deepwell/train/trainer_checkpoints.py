"""The checkpoint half of `deepwell.Trainer` (trainer.py): what a checkpoint of a training run
holds, saving it in either format (train/checkpoint.py one process, train/sharded.py several), and
restoring every piece of state from one after checking it was written by deepwell for this plan.
A mixin: it reads the Trainer's attributes (engine, model, optimizer, step, history, ...)."""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path

import torch

from .. import _native
from ..compiler import guard
from . import checkpoint, distributed, sharded, state
from .schedule import WarmupCosine


class TrainerCheckpoints:
    """`Trainer`'s checkpoint methods (see the module docs)."""

    def state(self) -> tuple[dict[str, dict[str, torch.Tensor]], dict]:
        """(tensor parts, JSON state) of a checkpoint at the current step in the one-process
        ("full") format; under several processes the model and optimizer state gathered to rank 0."""
        self._read_steps()  # the history complete
        model, aliases = distributed.model_tensors(self.model)
        opt, opt_meta = distributed.optimizer_state(self.model, self.optimizer)
        rng, rng_meta = state.rng_state()
        guard, guard_meta = state.guardrail_state(self.model)
        meta = {**self._meta(guard_meta), "checkpoint_format": "full", "model_aliases": aliases, "optimizer": opt_meta, "rng": rng_meta}
        parts = {"model": model, "optimizer": opt, "rng": rng}
        if guard:
            parts["guardrails"] = guard
        return parts, meta

    def _meta(self, guard_meta: dict) -> dict:
        """The JSON state both formats share: everything but the model, optimizer and RNG. The
        compiled sites' guardrail statistics still on their way are read first (the host waits for
        them), so the fallen-back sites saved are all those the run has seen."""
        if guard.poll_model(self.model):
            self._guardrail_events()  # logged at this step, before the checkpoint's record
        plan = getattr(self.engine, "plan", None)
        loader = getattr(self, "_loader", None)
        return {
            "step": self.step,
            "batches_used": self.batches_used,
            "tokens_seen": self.tokens_seen,
            "seed": self.seed,
            "history": self.history,
            "loader": loader.state_dict() if loader is not None and hasattr(loader, "state_dict") else None,
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "lr_schedule": asdict(self.lr_schedule) if isinstance(self.lr_schedule, WarmupCosine) else repr(self.lr_schedule),
            "plan": plan.to_dict() if plan is not None else None,
            "policy": asdict(plan.policy) if plan is not None else None,
            "quantization": {
                "scales": "current scaling: recomputed from each tensor's amax at every call, nothing cached across steps",
                "sites": {s.name: {"recipe": s.recipe, "runs_in": s.runs_in, "emulated": bool(s.decision and s.decision.emulated)} for s in plan.sites} if plan is not None else {},
                "guarded_layers": guard_meta,
                # compiled sites whose guardrail fell back (compiler/guard.py), by weight parameter
                "site_fallbacks": guard.fallback_state(self.model),
            },
            "versions": {"torch": torch.__version__, "deepwell": _native.version()},
        }

    def save_checkpoint(self) -> Path:
        if self.checkpoint_dir is None:
            raise ValueError("deepwell.Trainer.save_checkpoint: the Trainer has no checkpoint_dir")
        with self._writing():
            return self._save_checkpoint()

    def _save_checkpoint(self) -> Path:
        self._read_steps()  # the history complete

        if self.checkpoint_format == "sharded":
            guard, guard_meta = state.guardrail_state(self.model)  # rank 0's, as in the full format
            sharded.save(self.checkpoint_dir, self.step, self.model, self.optimizer, {"guardrails": guard} if guard else {},
                         self._meta(guard_meta), self.keep_checkpoints)
        else:
            parts, meta = self.state()  # (every rank takes part in gathering a sharded model's state)
            if distributed.is_main():
                checkpoint.save(self.checkpoint_dir, self.step, parts, meta, self.keep_checkpoints)
            distributed.barrier()  # the other ranks see the checkpoint only once it is complete
        self.last_checkpoint = self.checkpoint_dir / checkpoint.step_dir_name(self.step)
        self.log.write({"step": self.step, "event": "checkpoint", "path": str(self.last_checkpoint)})
        return self.last_checkpoint

    def load_checkpoint(self, path: str | os.PathLike, train_data=None, trust: bool = False) -> Path:
        """Restores every piece of state from checkpoint `path` (one step_* directory, or a
        checkpoint directory: its latest). Raises CheckpointError naming the bad file, and the
        newest older checkpoint that is intact.

        `trust`: a sharded checkpoint's DCP files hold pickles, which can run any code they name.
        By default they are read by a restricted unpickler that admits only what DCP writes for
        deepwell's state (train/dcp_reader.py), and a checkpoint deepwell did not write is a
        CheckpointError; trust=True reads them with torch's own reader instead: only for a
        checkpoint from a source you trust. (The full format holds no pickle.)"""
        path = Path(path)
        target = path if checkpoint.is_checkpoint(path) else checkpoint.latest(path)
        if target is None:
            raise checkpoint.CheckpointError(f"{path} holds no checkpoint")
        manifest = distributed.on_rank0(lambda: self._verified(Path(target)))  # rank 0 hashes, every rank raises
        meta = manifest["state"]
        self._check_plan(meta, target)
        state.check_guardrail_state(self.model, meta["quantization"]["guarded_layers"], target)
        site_fallbacks = meta["quantization"].get("site_fallbacks", {})  # none in a checkpoint from before compiled guardrails
        if not isinstance(site_fallbacks, dict):
            raise checkpoint.CheckpointError(f"checkpoint {target}: the manifest's state.quantization.site_fallbacks must be an object: the manifest was edited")
        guard.restore_fallbacks(self.model, site_fallbacks, f"deepwell.Trainer: checkpoint {target}")
        if meta.get("checkpoint_format", "full") == "sharded":
            parts, rng_meta = sharded.load(self.model, self.optimizer, target, manifest, trust)
        else:
            parts, rng_meta = checkpoint.read_parts(target, manifest), meta["rng"]
            distributed.load_model_tensors(self.model, parts["model"], meta["model_aliases"])
            distributed.load_optimizer_state(self.model, self.optimizer, parts["optimizer"], meta["optimizer"])
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        if self.scheduler is not None and meta["scheduler"] is not None:
            self.scheduler.load_state_dict(meta["scheduler"])
        state.load_rng_state(parts["rng"], rng_meta)
        state.load_guardrail_state(self.model, parts.get("guardrails", {}), meta["quantization"]["guarded_layers"], target)
        self._events_seen = {n: len(g.record.events) for n, g in state.guarded_layers(self.model).items()}
        self._events_seen.update({f"site:{n}": len(r.events) for n, r in guard.records_of(self.model).items()})
        self.step, self.batches_used, self.tokens_seen = meta["step"], meta["batches_used"], meta["tokens_seen"]
        self.history = meta["history"]
        if meta["loader"] is not None and train_data is not None and hasattr(train_data, "load_state_dict"):
            train_data.load_state_dict(meta["loader"])
        self.last_checkpoint = target
        self.log.write({"step": self.step, "event": "resumed", "path": str(target)})
        return target

    @staticmethod
    def _verified(target: Path) -> dict:
        """The manifest of checkpoint `target` once every file checks; else a CheckpointError that
        also names the newest older checkpoint that is intact."""
        try:
            manifest = checkpoint.verify(target)
            if state.check_manifest(manifest, target) == "sharded":
                sharded.check_manifest(manifest, target)
            return manifest
        except checkpoint.CheckpointError as e:
            prev = checkpoint.previous_intact(target)
            hint = f"; the previous checkpoint {prev} is intact: resume from it (fit(..., resume={str(prev)!r}))" if prev else "; there is no older intact checkpoint"
            raise checkpoint.CheckpointError(f"{e}{hint}") from None

    def _check_plan(self, meta: dict, target: Path) -> None:
        """Resuming under another plan would silently change every quantized site's numerics."""
        plan = getattr(self.engine, "plan", None)
        if plan is None or meta["plan"] is None:
            return
        mine = {s.name: s.recipe for s in plan.sites}
        sites = meta["plan"].get("sites")
        if not (isinstance(sites, list) and all(isinstance(s, dict) and isinstance(s.get("name"), str) and isinstance(s.get("recipe"), str) for s in sites)):
            raise checkpoint.CheckpointError(f"checkpoint {target}: the manifest's state.plan.sites must be a list of {{name, recipe}} objects: the manifest was edited")
        theirs = {s["name"]: s["recipe"] for s in sites}
        if mine != theirs:
            diff = sorted(n for n in set(mine) | set(theirs) if mine.get(n) != theirs.get(n))
            raise ValueError(
                f"deepwell.Trainer: checkpoint {target} was trained with another plan; sites that differ "
                f"(checkpoint -> engine): {', '.join(f'{n}: {theirs.get(n)} -> {mine.get(n)}' for n in diff[:8])}"
            )

    def _resume(self, resume, train_data, trust: bool) -> None:
        if resume is True:
            if self.checkpoint_dir is None:
                raise ValueError("deepwell.Trainer.fit: resume=True needs a checkpoint_dir (or pass the checkpoint's path)")
            if checkpoint.latest(self.checkpoint_dir) is None:
                return  # nothing saved yet: a fresh start, as torchtitan and Lightning do
            self.load_checkpoint(self.checkpoint_dir, train_data, trust)
        else:
            self.load_checkpoint(resume, train_data, trust)
