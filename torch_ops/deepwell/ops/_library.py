"""The `deepwell` op namespace. Schemas are written once, here in Python (where tags are available on
every torch >= 2.10); the Rust library registers the kernels for them, and each op module registers
its fake kernel (and autograd formula, for differentiable ops).

Every schema is defined twice: `deepwell::<op>`, what users and eager code call, and
`deepwell_graph::<op>`, the same schema and the same Rust kernels with no autograd formula, which
the deepwell backend's compiled graphs call instead (compiler/graph_ops.py says why)."""

from __future__ import annotations

import torch

#: Kept alive for the life of the process: destroying a Library deregisters its ops.
LIB = torch.library.Library("deepwell", "DEF")
GRAPH_LIB = torch.library.Library("deepwell_graph", "DEF")


def define(schema: str, tags: tuple = ()) -> None:
    LIB.define(schema, tags=tags)
    GRAPH_LIB.define(schema, tags=tags)
    name = schema.split("(", 1)[0]

    def fake(*args, **kwargs):
        # The twin's fake kernel is the `deepwell` op's own, reached by calling it (under
        # FakeTensorMode that runs its fake), so the two can never disagree on a shape.
        return getattr(torch.ops.deepwell, name).default(*args, **kwargs)

    torch.library.register_fake(f"deepwell_graph::{name}", fake, lib=GRAPH_LIB)
