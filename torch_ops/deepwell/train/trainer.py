"""`deepwell.Trainer`: the training loop for a compiled `deepwell.Engine`.

    engine = deepwell.compile(deepwell.capture(model, (tokens,)), precision="auto")
    trainer = deepwell.Trainer.from_engine(engine, optimizer=lambda p: torch.optim.AdamW(p, lr=3e-4),
                                           lr_schedule=deepwell.train.WarmupCosine(100), grad_accum=4,
                                           max_steps=1000, log_every=10, checkpoint_dir="ckpt")
    trainer.fit(train_batches, eval_batches, resume=True)   # resume=True: from ckpt/latest if any

Each step: deepwell's stochastic-rounding seeds restarted from (seed, step); the schedule's lr set;
`grad_accum` micro-batches forward and backward, several inside `deepwell.microbatches()` (each
weight quantized once per step) unless FSDP2 shards the model (`_reuses_weights` says why), the loss
scaled by 1/grad_accum; the gradient norm clipped; the optimizer
step skipped and recorded when the loss or the norm is not finite; after it, the expert biases of
the model's deepwell.DeepwellMoE blocks built with `expert_bias=True` move towards balance from the
step's token counts (`update_expert_biases`, summed over the processes; torchtitan's optimizer
hook). Logged to metrics.jsonl every
`log_every` steps (loss, grad norm, lr, tokens/s), held-out loss every `eval_every` steps and at the
end, guardrail fallbacks (deepwell.Linear's, compiled sites') as they happen; checkpoints every `checkpoint_every`
steps and at the end (train/checkpoint.py); loss.png at the end (train/plots.py).

Under torchrun (several processes, the model sharded by deepwell.compile's plan) every batch is a
global batch: each rank trains on its rows of it, the logged loss and gradient norm are the ranks'
means, rank 0 alone logs and plots, and checkpoints are sharded: every rank writes its shards of
the model and optimizer state through torch.distributed.checkpoint (train/sharded.py), resumable
in any number of processes. checkpoint_format="full" gathers the state to rank 0 instead, which
writes the one-process format (whole safetensors files, what export() and other tools read;
train/distributed.py). There Python's automatic garbage collection is off during `fit`, and a
collection of the young generations runs every `gc_every` steps (default 50), at the same step on
every rank, as torchtitan does: a collection pause on one rank stalls the others at the next
collective (bench_parallel.py on 2 H100s: steps of 110-164 ms among 97-104 ms ones with automatic
collection, one such step in 30 without).

Waiting for the GPU. The host never waits for a step's loss and gradient norm: each step queues
their copy to the host behind its work (train/readback.py), and after every step the records of
the steps the GPU has finished join `history` (and metrics.jsonl at the log points), a step or so
late; `step_s` is each step's own time on the GPU's clock (CUDA events), `tokens_per_s` from it.
The host waits only before an evaluation or a checkpoint, and at the end. Skipping a non-finite
step needs no reading when the optimizer takes `found_inf` (torch's fused optimizers, as GradScaler
drives them; the default AdamW is fused): it gets 1.0 where the loss or the norm is not finite and
leaves the weights, the moments and the step count as they were (and DeepwellMoE expert biases
their bias and counts: update_expert_biases' `skipped`). Otherwise (another optimizer), or with
`wait_every_step=True`, the host reads both after every backward. Why: a read drains the GPU's
queue, and the next steps' first launches then find it idle. The 0.95B step on one H100
(benchmarks/bench_parallel.py --trainer): 95.6 ms waiting every step, 87.5 reading every 10 steps;
on 2 H100s each read every 10 steps still cost the next few steps 10-25 ms (docs/DESIGN.md "Scale-out"
has the numbers without any read).
Under FSDP2 the gradient norm is clipped on the local shards (train/clip.py).

A batch is a (batch, seq + 1) int64 tensor of token ids (next-token prediction on [:, :-1] ->
[:, 1:]) unless `loss_fn(engine, batch)` says otherwise. A data source with `state_dict()` /
`load_state_dict()` (train/data.py TokenBatches) is checkpointed; any other iterable is
fast-forwarded past the batches already used on resume.

The design documents' spelling (docs/OPS.md "Seed API aliases"): `optimizer="adamw_dw"` is the
default optimizer (deepwell.train.AdamW); `dataloader=` gives `fit` its training data
(max_steps default: one pass over it when it has a len()); `elastic=True` is for an external
launcher that restarts the job with another number of processes (torchrun's elastic mode):
checkpoints are sharded (torch.distributed.checkpoint, resumable in any number of processes,
train/sharded.py) and `fit` resumes from `checkpoint_dir`'s latest by default.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import warnings
from pathlib import Path
from typing import Callable, Iterable

import torch
import torch.nn.functional as F

from .. import _native
from ..compiler import guard
from ..nn.moe import DeepwellMoE, update_expert_biases
from ..nn.weight_cache import microbatches
from . import checkpoint, determinism, distributed, plots, sharded, state
from .data import TokenBatches
from .dirlock import DirectoryLock
from .log import JsonlLog
from .optim import AdamW, fusable
from .readback import StepClock
from .schedule import WarmupCosine, constant
from .trainer_checkpoints import TrainerCheckpoints


def next_token_loss(engine, batch: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of the logits for batch[:, :-1] against batch[:, 1:], in fp32."""
    if not isinstance(batch, torch.Tensor) or batch.dim() != 2 or batch.shape[1] < 2:
        got = f"{batch.dim()}-d tensor {tuple(batch.shape)}" if isinstance(batch, torch.Tensor) else type(batch).__name__
        raise ValueError(f"deepwell.Trainer: a batch must be a (batch, seq + 1) tensor of token ids, got a {got}")
    logits = engine(batch[:, :-1])
    return F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())


def _tokens(batch) -> int:
    if isinstance(batch, torch.Tensor) and batch.dim() == 2:
        return batch.shape[0] * (batch.shape[1] - 1)
    if isinstance(batch, (tuple, list)) and batch and isinstance(batch[-1], torch.Tensor):
        return batch[-1].numel()  # (inputs, targets)
    return 0


def _positive_int(name: str, v, allow_none: bool = False):
    if v is None and allow_none:
        return v
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"deepwell.Trainer: {name} must be a positive int{' or None' if allow_none else ''}, got {v!r}")
    return v


#: `max_steps` when neither it nor a `dataloader` with a len() is given.
DEFAULT_MAX_STEPS = 1000

#: Optimizer names `from_engine` takes: the design's name for its default (deepwell.train.AdamW).
OPTIMIZER_NAMES = ("adamw_dw",)

#: Steps between garbage collections under several processes (torchtitan's default gc_freq).
GC_EVERY = 50
_END = object()  # what next() returns once the training data runs out


class Trainer(TrainerCheckpoints):
    """See the module docs. Build with `Trainer.from_engine(engine, ...)`; its checkpoint methods
    (`state`, `save_checkpoint`, `load_checkpoint`) are trainer_checkpoints.py's."""

    def __init__(
        self,
        engine,
        optimizer: torch.optim.Optimizer,
        lr_schedule=None,
        grad_accum: int = 1,
        max_steps: int | None = None,
        log_every: int = 10,
        checkpoint_dir: str | os.PathLike | None = None,
        checkpoint_every: int | None = None,
        keep_checkpoints: int | None = 3,
        clip_grad_norm: float | None = 1.0,
        eval_every: int | None = None,
        loss_fn: Callable | None = None,
        log_dir: str | os.PathLike | None = None,
        progress: bool = True,
        seed: int = 0,
        plot: bool = True,
        deterministic: bool | None = None,
        checkpoint_format: str | None = None,
        gc_every: int | None = None,
        wait_every_step: bool = False,
        dataloader: Iterable | None = None,
        elastic: bool = False,
    ):
        who = "deepwell.Trainer"
        if not isinstance(elastic, bool):
            raise ValueError(f"{who}: elastic must be a bool, got {elastic!r}")
        if elastic and checkpoint_format not in (None, "sharded"):
            raise ValueError(f"{who}: elastic=True needs checkpoint_format='sharded' (resumable in any number of "
                             f"processes), got {checkpoint_format!r}")
        if elastic and checkpoint_dir is None:
            warnings.warn(f"{who}: elastic=True without a checkpoint_dir: a restarted job has no checkpoint to resume "
                          "from", stacklevel=3)
        #: The training data `fit` uses when given none (the design's `dataloader=`).
        self.dataloader = dataloader
        #: Sharded checkpoints and resume by default (module docs).
        self.elastic = elastic
        if elastic:
            checkpoint_format = "sharded"
        self.engine = engine
        self.model: torch.nn.Module = engine.model
        for name, m in self.model.named_modules():
            # An expert-parallel block trains wrong here without an error: nothing calls
            # reduce_gradients, the norm clipping sees only this rank's experts, and the
            # checkpoints (train/sharded.py, train/distributed.py) take them for replicated.
            if isinstance(m, DeepwellMoE) and m.ep_size > 1:
                raise RuntimeError(
                    f"{who}: {name or m.name} is expert-parallel (deepwell.expert_parallel over {m.ep_size} "
                    "processes), which the Trainer does not support: it would not reduce the gradients, its "
                    "gradient-norm clipping would see only this process's experts, and its checkpoints do not "
                    "know that the experts are sharded. Train with a loop of your own that calls "
                    "deepwell.reduce_gradients(model) after each backward, and checkpoint with "
                    "torch.distributed.checkpoint on model.state_dict() and "
                    "deepwell.expert_optimizer_state_dict(model, optimizer)"
                )
        #: The plan's tensor degree: that many adjacent ranks take the same rows of each batch.
        self._tensor = engine.plan.parallelism["tensor"] if getattr(engine, "plan", None) else 1
        self.optimizer = optimizer
        self.grad_accum = _positive_int("grad_accum", grad_accum)
        if max_steps is None:  # one pass over a `dataloader` of known length, else DEFAULT_MAX_STEPS
            sized = dataloader is not None and hasattr(dataloader, "__len__")
            max_steps = max(1, len(dataloader) // max(1, grad_accum)) if sized else DEFAULT_MAX_STEPS
        self.max_steps = _positive_int("max_steps", max_steps)
        self.log_every = _positive_int("log_every", log_every)
        self.checkpoint_every = _positive_int("checkpoint_every", checkpoint_every, allow_none=True)
        self.eval_every = _positive_int("eval_every", eval_every, allow_none=True)
        if clip_grad_norm is not None and not clip_grad_norm > 0:
            raise ValueError(f"{who}: clip_grad_norm must be positive or None, got {clip_grad_norm!r}")
        self.clip_grad_norm = clip_grad_norm
        #: Steps between Python garbage collections with automatic collection off during fit; 0:
        #: automatic collection (the default with one process, see the module docs).
        if gc_every is None:
            gc_every = GC_EVERY if distributed.world_size() > 1 else 0
        if not isinstance(gc_every, int) or isinstance(gc_every, bool) or gc_every < 0:
            raise ValueError(f"{who}: gc_every must be a non-negative int or None, got {gc_every!r}")
        self.gc_every = gc_every
        #: Read each step's loss and gradient norm as it ends (the host waits for the GPU every
        #: step) rather than as they reach the host; see "Waiting for the GPU" in the module docs.
        self.wait_every_step = bool(wait_every_step)
        self._pending: list[dict] = []  # steps run whose loss and norm have not been read yet
        self._clock: StepClock | None = None  # marks the steps' ends (readback.py); made by fit
        # What a step would otherwise find by walking the model's modules or the optimizer's groups
        # (host time in every step of a host-bound loop): found again at the start of every fit,
        # the model and optimizer being fixed while it runs.
        self._skip_on_device: bool | None = None  # _skips_on_device()
        self._guarded: dict | None = None  # state.guarded_layers(model)
        self._reuse: bool | None = None  # _reuses_weights()
        self.keep_checkpoints = keep_checkpoints
        #: "sharded" (the default under several processes: each rank writes its shards through
        #: torch.distributed.checkpoint, train/sharded.py) or "full" (the default with one process:
        #: whole safetensors files; under several processes rank 0 gathers the whole state to write them).
        self.checkpoint_format = sharded.resolve_format(checkpoint_format)
        self.checkpoint_dir = Path(checkpoint_dir) if checkpoint_dir is not None else None
        self.log_dir = Path(log_dir) if log_dir is not None else self.checkpoint_dir
        self.loss_fn = loss_fn or next_token_loss
        self.progress, self.seed, self.plot = progress, int(seed), plot
        if deterministic is None:
            # On the CPU the deterministic kernels cost little and make resume bit for bit; on a GPU
            # they cost speed (docs/DESIGN.md "Determinism"), so they are asked for.
            deterministic = next(self.model.parameters()).device.type == "cpu"
        if not isinstance(deterministic, bool):
            raise ValueError(f"{who}: deterministic must be a bool or None, got {deterministic!r}")
        #: Whether `fit` runs deterministic kernels (train/determinism.py): resume continues bit for bit.
        self.deterministic = deterministic
        self.scheduler = None  # a torch LRScheduler, stepped after each optimizer step
        if isinstance(lr_schedule, torch.optim.lr_scheduler.LRScheduler):
            self.scheduler, self.lr_schedule = lr_schedule, None
        elif isinstance(lr_schedule, WarmupCosine):
            self.lr_schedule = lr_schedule.with_steps(self.max_steps)
        elif lr_schedule is None or callable(lr_schedule):
            self.lr_schedule = lr_schedule or constant
        else:
            raise ValueError(f"{who}: lr_schedule must be a WarmupCosine, a callable step -> lr factor, a torch LRScheduler or None, got {lr_schedule!r}")
        for group in self.optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.step = 0
        self.batches_used = 0
        self.tokens_seen = 0
        #: one record per step ({"step", "loss", "grad_norm", "lr", "tokens_per_s", ...}) and per
        #: evaluation ({"step", "eval_loss"}), restored from a checkpoint on resume.
        self.history: list[dict] = []
        main = distributed.is_main()  # with several processes, rank 0 alone writes logs and plots
        self.log = JsonlLog(self.log_dir / "metrics.jsonl" if self.log_dir is not None and main else None)
        self.progress = self.progress and main
        self.plot = self.plot and main
        self._events_seen = {}
        self._sites_version = -1  # compiler/guard.py's _VERSION when the compiled sites' events were last logged
        self.last_checkpoint: Path | None = None
        #: Held while this Trainer runs or saves (rank 0): one writer per checkpoint_dir (train/dirlock.py).
        self._lock = DirectoryLock(self.checkpoint_dir) if self.checkpoint_dir is not None and main else None

    @classmethod
    def from_engine(
        cls,
        engine,
        optimizer: torch.optim.Optimizer | Callable | None = None,
        lr_schedule=None,
        grad_accum: int = 1,
        max_steps: int | None = None,
        log_every: int = 10,
        checkpoint_dir: str | os.PathLike | None = None,
        **kwargs,
    ) -> "Trainer":
        """A Trainer for `engine` (a `deepwell.compile` result). `optimizer`: an optimizer on
        `engine.model`'s parameters, a callable params -> optimizer, or None (or "adamw_dw") for AdamW(lr=3e-4,
        betas=(0.9, 0.95), weight_decay=0.1), fused where torch has the kernel (so a non-finite step
        is skipped on the device: "Waiting for the GPU" in the module docs): deepwell.train.AdamW,
        torch's AdamW stepped on the local shards of a sharded model (train/optim.py says why). Other keyword arguments: see `Trainer`."""
        if not hasattr(engine, "model") or not callable(engine):
            raise ValueError(f"deepwell.Trainer.from_engine: expected a deepwell.Engine (deepwell.compile's result), got {type(engine).__name__}")
        params = list(engine.model.parameters())
        if isinstance(optimizer, str):
            if optimizer not in OPTIMIZER_NAMES:
                raise ValueError(f"deepwell.Trainer.from_engine: unknown optimizer {optimizer!r}: {', '.join(OPTIMIZER_NAMES)} "
                                 "(the default AdamW), a torch Optimizer or a callable params -> Optimizer")
            optimizer = None
        if optimizer is None:
            optimizer = AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=fusable(params))
        elif not isinstance(optimizer, torch.optim.Optimizer):
            if not callable(optimizer):
                raise ValueError(f"deepwell.Trainer.from_engine: optimizer must be a torch Optimizer, a callable params -> Optimizer or None, got {optimizer!r}")
            optimizer = optimizer(params)
        owned = {id(p) for g in optimizer.param_groups for p in g["params"]}
        if not owned <= {id(p) for p in params}:
            raise ValueError("deepwell.Trainer.from_engine: the optimizer holds tensors that are not the engine's model parameters")
        return cls(engine, optimizer, lr_schedule, grad_accum, max_steps, log_every, checkpoint_dir, **kwargs)

    # -----------------------------------------------------------------------------------------
    # The loop

    def fit(self, train_data: Iterable | None = None, eval_data: Iterable | None = None,
            resume: bool | str | os.PathLike | None = None, trust: bool = False) -> "Trainer":
        """Trains until `max_steps` (or the end of the data) on `train_data` (an iterable of batches,
        `grad_accum` per step; default: the Trainer's `dataloader`),
        evaluating on `eval_data` (a finite list of batches). `resume`: True continues from `checkpoint_dir`'s latest
        checkpoint when there is one; a path resumes from that checkpoint (an error if unreadable).
        None: True with `elastic` and a checkpoint_dir, else False.
        `trust`: see `load_checkpoint` (a sharded checkpoint's DCP metadata is a pickle).
        While it runs, the Trainer holds `checkpoint_dir`'s lock: another Trainer on the same
        directory is a CheckpointError (train/dirlock.py).
        With `deterministic` (default: True for a model on the CPU) the loop runs deterministic
        kernels (train/determinism.py: torch.use_deterministic_algorithms, as Lightning's flag, and
        Inductor's deterministic mode): Inductor's code otherwise accumulates the embedding gradient
        with parallel atomic adds, whose order, and so the weights' last bits, changes from run to
        run; with it a resumed run continues bit for bit, on a GPU too."""
        if train_data is None:
            train_data = self.dataloader
        if train_data is None:
            raise ValueError("deepwell.Trainer.fit: no training data: pass fit(train_data) or Trainer(..., dataloader=...)")
        if resume is None:
            resume = self.elastic and self.checkpoint_dir is not None
        was_collecting = gc.isenabled()
        if self.gc_every:
            gc.disable()
        try:
            with determinism.deterministic_kernels(self.deterministic), self._writing():
                return self._fit(train_data, eval_data, resume, trust)
        finally:
            if was_collecting:
                gc.enable()

    @contextlib.contextmanager
    def _writing(self):
        """Holds checkpoint_dir's lock (rank 0, when there is a checkpoint_dir) unless already held."""
        if self._lock is None or self._lock.held:
            yield
            return
        self._lock.acquire()
        try:
            checkpoint.recover(self.checkpoint_dir)  # a checkpoint a writer that died moved aside
            yield
        finally:
            self._lock.release()

    def _fit(self, train_data, eval_data, resume, trust: bool) -> "Trainer":
        from tqdm.auto import tqdm

        self._loader = train_data
        if resume:
            self._resume(resume, train_data, trust)
        batches = iter(train_data)
        if not hasattr(train_data, "load_state_dict"):
            for used in range(self.batches_used):  # a data source without state: skip what was used
                if next(batches, _END) is _END:
                    raise ValueError(
                        f"deepwell.Trainer.fit: the training data has {used} batches, but the checkpoint {self.last_checkpoint} "
                        f"already used {self.batches_used}: resume with the data it trained on (or a data source with "
                        "state_dict() and load_state_dict(), such as TokenBatches, which the checkpoint restores)"
                    )
        if isinstance(eval_data, TokenBatches):
            raise ValueError("deepwell.Trainer.fit: eval_data must be a finite list of batches (heldout_batches(...)), got an endless TokenBatches")
        eval_batches = list(eval_data) if eval_data is not None else None
        bar = tqdm(total=self.max_steps, initial=self.step, unit="step", disable=not self.progress, mininterval=0.5, dynamic_ncols=True)
        self._skip_on_device, self._guarded = self._skips_on_device(), state.guarded_layers(self.model)
        self._reuse = self._reuses_weights()
        self.model.train()  # once: evaluate() sets it back after its eval mode
        self._clock = StepClock(next(self.model.parameters()).device)
        try:
            while self.step < self.max_steps:
                waited = self._train_step(batches)
                if self.gc_every and self.step % self.gc_every == 0:
                    gc.collect(1)
                self._guardrail_events()
                due_eval = bool(eval_batches and self.eval_every and self.step % self.eval_every == 0)
                due_checkpoint = bool(self.checkpoint_dir and self.checkpoint_every and self.step % self.checkpoint_every == 0)
                self._read_steps(bar, wait=waited or due_eval or due_checkpoint or self.step == self.max_steps)
                bar.update(1)  # after the read: the bar's last line shows the last step's loss, not the one before
                if due_eval:
                    self._evaluate(eval_batches, bar)
                if due_checkpoint:
                    self.save_checkpoint()
                if due_eval or due_checkpoint:
                    self._clock.mark()  # the steps' times leave them out
        finally:
            bar.close()
        if eval_batches and not any(r.get("step") == self.step and "eval_loss" in r for r in self.history):
            self._evaluate(eval_batches, None)
        if self.checkpoint_dir and (self.last_checkpoint is None or self.last_checkpoint.name != checkpoint.step_dir_name(self.step)):
            self.save_checkpoint()
        if self.plot and self.log_dir is not None:
            plots.loss_curve(self.history, self.log_dir / "loss.png")
        return self

    def _lr_factor(self) -> float:
        return float(self.lr_schedule(self.step)) if self.lr_schedule is not None else 1.0

    def _sr_seed(self) -> int:
        """The stochastic-rounding seed sequence of this step: a function of (seed, step) alone."""
        return (self.seed * 0x9E3779B97F4A7C15 + self.step * 0xBF58476D1CE4E5B9 + 1) & (2**64 - 1)

    def _train_step(self, batches) -> bool:
        """One optimizer step; its loss and gradient norm join `_pending` (read by `_read_steps`).
        Returns whether the host waited for the GPU (then the step's values are ready)."""
        _native.manual_seed(self._sr_seed())
        if self.scheduler is None:
            factor = self._lr_factor()
            for group in self.optimizer.param_groups:
                group["lr"] = group["initial_lr"] * factor
        device = next(self.model.parameters()).device
        total, tokens = None, 0
        if self._reuse is None:
            self._reuse = self._reuses_weights()
        with microbatches() if self._reuse else contextlib.nullcontext():
            for _ in range(self.grad_accum):
                batch = next(batches, None)
                if batch is None:
                    raise ValueError(
                        f"deepwell.Trainer: the training data ran out after {self.batches_used} batches; "
                        f"max_steps={self.max_steps} x grad_accum={self.grad_accum} needs {self.max_steps * self.grad_accum}"
                    )
                self.batches_used += 1
                tokens += _tokens(batch)
                batch = distributed.shard_rows(batch, tensor=self._tensor)
                batch = batch.to(device, non_blocking=True) if isinstance(batch, torch.Tensor) else batch
                loss = self.loss_fn(self.engine, batch) / self.grad_accum
                loss.backward()
                total = loss.detach() if total is None else total + loss.detach()
        params = [p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]
        norm = distributed.replicated(distributed.clip_grad_norm(params, self.clip_grad_norm if self.clip_grad_norm else math.inf))
        loss = distributed.replicated(distributed.mean(total))
        norm = norm.to(loss.device)
        lr = self.optimizer.param_groups[0]["lr"]
        # A non-finite step would poison the weights and the optimizer's moments: it is skipped (as
        # loss-scaling trainers do) and logged. An optimizer that takes `found_inf` (torch's fused
        # ones, as GradScaler uses them) skips on the device, so the host need not wait here.
        if self._skip_on_device is None:
            self._skip_on_device = self._skips_on_device()
        waits = self.wait_every_step or not self._skip_on_device
        if waits:
            if math.isfinite(loss.item()) and math.isfinite(norm.item()):
                self.optimizer.step()
                update_expert_biases(self.model)
        else:
            skipped = ~(torch.isfinite(loss) & torch.isfinite(norm))
            self.optimizer.found_inf = skipped.float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
            update_expert_biases(self.model, skipped=skipped)
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        if waits and device.type == "cuda":
            torch.cuda.synchronize(device)
        self.step += 1
        self.tokens_seen += tokens
        if self._clock is None:
            self._clock = StepClock(device)
        values = self._clock.push([loss, norm])
        self._pending.append({"step": self.step, "values": values, "lr": lr, "tokens": self.tokens_seen, "step_tokens": tokens})
        return waits

    def _reuses_weights(self) -> bool:
        """Whether a step's micro-batches run inside `deepwell.microbatches()`, each weight quantized
        once for all of them: only with several micro-batches and weights that stay in place.

        A scope makes a weight's two operands (fprop and dgrad) at its first forward and keeps both
        until the optimizer step. With one micro-batch that saves one re-read of the weight per step
        and keeps every layer's FP8 copies alive through the forward and backward: on the 0.95B
        model, 2 bytes per parameter, the peak 17.05 GiB a GPU against 15.58 without (FSDP2 on 2
        H100s, benchmarks/bench_parallel.py). FSDP2 gathers each weight into fresh memory for every
        micro-batch (and, resharding after the forward, again for its backward), so a scope never
        reuses an operand across micro-batches there: at most a backward reuses its own forward's
        copies, for the memory above (2 gloo processes, 2 micro-batches, resharded: 56 misses and
        0-3 hits a step)."""
        return self.grad_accum > 1 and not distributed.fsdp_sharded(self.model)

    def _skips_on_device(self) -> bool:
        """Whether a non-finite step can be skipped without the host reading the loss: the
        optimizer takes `found_inf` (torch's fused Adam, AdamW, SGD, ...; DeepwellMoE expert biases
        take the same flag, update_expert_biases' `skipped`)."""
        return getattr(self.optimizer, "_step_supports_amp_scaling", False) and all(g.get("fused") for g in self.optimizer.param_groups)

    def _read_steps(self, bar=None, wait: bool = True) -> list[dict]:
        """Records the pending steps whose loss and gradient norm have reached the host, oldest
        first, in `history` (with `wait`, every pending step: the host waits for the GPU), logs the
        skipped ones, and writes the log-point records to metrics.jsonl. Called after every step
        without `wait`: a record is written about a step after its step ran (readback.py)."""
        ready = 0
        while ready < len(self._pending) and self._pending[ready]["values"].ready(block=wait):
            ready += 1
        done, self._pending = self._pending[:ready], self._pending[ready:]
        records = []
        for p in done:
            (loss_value, norm_value), seconds = p["values"].values(), p["values"].seconds()
            record = {"step": p["step"], "loss": loss_value, "grad_norm": norm_value, "lr": p["lr"], "tokens": p["tokens"],
                      "step_s": seconds, "tokens_per_s": p["step_tokens"] / seconds if seconds > 0 else 0.0}
            self.history.append(record)
            records.append(record)
            if not (math.isfinite(loss_value) and math.isfinite(norm_value)):
                self.log.write({"step": p["step"], "event": "skipped_step", "reason": f"loss {loss_value}, grad norm {norm_value}: not finite"})
            if p["step"] % self.log_every == 0 or p["step"] == self.max_steps:
                self.log.write(record)
        if bar is not None and records:
            bar.set_postfix(loss=f"{records[-1]['loss']:.4f}", tok_s=f"{records[-1]['tokens_per_s']:.0f}", refresh=False)
        return records

    @torch.no_grad()
    def evaluate(self, batches: Iterable) -> float:
        """Mean loss over `batches` (no gradients, no optimizer step)."""
        device = next(self.model.parameters()).device
        self.model.eval()
        losses = []
        for b in batches:
            b = distributed.shard_rows(b, "deepwell.Trainer.evaluate", self._tensor)
            losses.append(distributed.mean(self.loss_fn(self.engine, b.to(device) if isinstance(b, torch.Tensor) else b)).item())
        self.model.train()
        if not losses:
            raise ValueError("deepwell.Trainer.evaluate: no batches to evaluate on")
        return sum(losses) / len(losses)

    def _evaluate(self, batches: list, bar) -> None:
        value = self.evaluate(batches)
        record = {"step": self.step, "eval_loss": value}
        self.history.append(record)
        self.log.write(record)
        if bar is not None and self.progress:
            bar.write(f"step {self.step}: held-out loss {value:.4f}")

    def _guardrail_events(self) -> None:
        """Logs every guardrail fallback that happened since the last step: of deepwell.Linear
        layers, and of compiled GEMM sites (compiler/guard.py; looked for only when a site's
        running recipe changed in this process)."""
        for name, g in (self._guarded if self._guarded is not None else state.guarded_layers(self.model)).items():
            seen = self._events_seen.get(name, 0)
            for event in g.record.events[seen:]:
                self.log.write({"step": self.step, "event": "guardrail_fallback", "layer": name, "detail": event, "running": g.recipe})
            self._events_seen[name] = len(g.record.events)
        if self._sites_version == guard.version():
            return
        self._sites_version = guard.version()
        for name, r in guard.records_of(self.model).items():
            seen = self._events_seen.get(f"site:{name}", 0)
            for event in r.events[seen:]:
                self.log.write({"step": self.step, "event": "guardrail_fallback", "site": r.name, "weight": name, "detail": event,
                                "running": r.active_recipe})
            self._events_seen[f"site:{name}"] = len(r.events)
