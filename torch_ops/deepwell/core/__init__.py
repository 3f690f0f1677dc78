"""The Rust core's tables and decisions, typed (rust/core/src/policy through the C API): the lowest
layer of the package, which everything else may read and which reads nothing of deepwell but the
library itself (`_native`).

| module | what |
|---|---|
| `recipes` | the recipe table (`Recipe`), each device's auto recipe and NVRTC target, site roles |
| `policy` | `PrecisionPolicy`, `LayerInfo`, `LayerDecision`: the per-site decision |
"""
