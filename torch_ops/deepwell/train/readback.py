"""A training step's values (loss, gradient norm) on their way to the host, and the step's time,
without the host waiting for the GPU.

At a step's end `StepClock.push` enqueues, behind the step's work, a copy of the values into pinned
host memory and a CUDA event; `Readback.ready()` asks the event (no wait) and `ready(block=True)`
waits for it. Reading a value the moment the step is launched (`loss.item()`) instead makes the host
wait until the GPU has run everything queued, and the next step's first kernels then find the GPU
idle: every log point cost the 0.95B step on 2 H100s 10-25 ms in each of the next few steps, while
the host refilled the queue (benchmarks/bench_parallel.py --trainer). The same
pattern as the guardrails' statistics (nn/guardrails.py).

A step's time is the time between the CUDA events that end it and the step before (or the mark
set when training starts or resumes after an evaluation or a checkpoint): the GPU's own clock, so
it is each step's time, not a mean over the steps read together. On the CPU, the host's clock.
"""

from __future__ import annotations

import time

import torch


class Readback:
    """One step's values, copied to the host once the GPU gets there."""

    def __init__(self, host: torch.Tensor, start, end):
        self._host, self._start, self._end = host, start, end

    def ready(self, block: bool = False) -> bool:
        """Whether the values have reached the host; with `block`, waits until they have."""
        if isinstance(self._end, float):
            return True
        if block:
            self._end.synchronize()
            return True
        return self._end.query()

    def values(self) -> list[float]:
        """The values as Python floats (the host waits for them if they are not there yet)."""
        self.ready(block=True)
        return self._host.tolist()

    def seconds(self) -> float:
        """The step's time: from the previous step's end (or the mark) to this one's."""
        self.ready(block=True)
        if isinstance(self._end, float):
            return self._end - self._start
        return self._start.elapsed_time(self._end) / 1e3


class StepClock:
    """Marks steps' ends on the device's stream (CUDA events) or on the host's clock (CPU)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self._last = None
        self.mark()

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        # The device's own stream, where the step's work and the copy run, whichever device is current.
        event.record(torch.cuda.current_stream(self.device))
        return event

    def mark(self) -> None:
        """The next step's time starts here (training starts, or resumes after other work)."""
        self._last = self._now()

    def push(self, values: list[torch.Tensor]) -> Readback:
        """Ends a step whose values are the 0-d tensors `values`: their copy to the host is queued
        behind the step's work (as float64, exact for every float dtype), and the step's end marked."""
        stacked = torch.stack([v.detach().reshape(()).to(torch.float64) for v in values])
        if self.cuda:
            host = torch.empty(stacked.shape, dtype=torch.float64, pin_memory=True)
            host.copy_(stacked, non_blocking=True)
        else:
            host = stacked
        start, self._last = self._last, self._now()
        return Readback(host, start, self._last)
