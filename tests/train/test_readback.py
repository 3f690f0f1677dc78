"""train/readback.py: a step's values reach the host without the host waiting, exactly, and each
step is timed from the previous step's end."""

from __future__ import annotations

import pytest
import torch

from deepwell.train.readback import StepClock


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_values_arrive_exactly_in_every_float_dtype(device):
    clock = StepClock(torch.device(device))
    values = [torch.tensor(1 / 3, dtype=dt, device=device) for dt in (torch.float32, torch.bfloat16, torch.float64, torch.float16)]
    values.append(torch.tensor(float("inf"), device=device))
    values.append(torch.tensor(float("nan"), device=device))
    got = clock.push(values).values()
    want = [v.item() for v in values]
    assert got[:5] == want[:5] and got[5] != got[5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_each_step_is_timed_from_the_previous_ones_end(device):
    clock = StepClock(torch.device(device))
    steps = [clock.push([torch.zeros((), device=device)]) for _ in range(3)]
    assert all(s.ready(block=True) and s.seconds() >= 0 for s in steps)
    if device == "cuda":  # the events chain: each interval starts at the previous one's end event
        assert steps[1]._start is steps[0]._end and steps[2]._start is steps[1]._end


@pytest.mark.gpu
def test_the_host_does_not_wait_for_a_busy_gpu():
    """A kernel that spins ~0.5 s is queued before the push: the values are not there at once
    (the push did not wait), and are after ready(block=True)."""
    clock = StepClock(torch.device("cuda"))
    x = torch.ones((), device="cuda")
    torch.cuda._sleep(int(1e9))  # ~0.5 s at ~2 GHz
    pending = clock.push([x * 2])
    assert not pending.ready()
    assert pending.ready(block=True) and pending.values() == [2.0]
