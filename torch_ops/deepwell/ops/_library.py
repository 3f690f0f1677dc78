"""The `deepwell` op namespace. Schemas are written once, here in Python (where tags are available on
every torch >= 2.10); the Rust library registers the kernels for them, and each op module registers
its fake kernel (and autograd formula, for differentiable ops)."""

from __future__ import annotations

import torch

#: Kept alive for the life of the process: destroying a Library deregisters its ops.
LIB = torch.library.Library("deepwell", "DEF")


def define(schema: str, tags: tuple = ()) -> None:
    LIB.define(schema, tags=tags)
