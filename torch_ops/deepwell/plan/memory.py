"""What a model keeps in memory during a training step, measured without a device: the tensors
autograd saves in one forward (run on fake tensors). Used by `dryrun` and the parallel planner."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode


def saved_activation_bytes(model: torch.nn.Module, example_inputs: tuple) -> tuple[int, int]:
    """(total, largest) bytes of the tensors autograd saves in one eager forward, on fake tensors."""
    seen: dict[int, int] = {}
    params = {id(p) for p in model.parameters()} | {id(b) for b in model.buffers()}

    def pack(t):
        if id(t) not in params:
            storage = t.untyped_storage()  # views share it; its C pointer identifies it
            seen[storage._cdata] = storage.nbytes()
        return t

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        inputs = tuple(mode.from_tensor(x) if isinstance(x, torch.Tensor) else x for x in example_inputs)
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(*inputs)
    return sum(seen.values()), max(seen.values(), default=0)
