"""Planning: what each GEMM site runs, what each attention runs, and what a training step will
cost, on top of the core's decisions (rust/core/src/policy, through the C API).

| module | what |
|---|---|
| `sites` | `Site`, `Plan` (a graph's decisions and each site's strategy, printable), `plan_sites` |
| `attention` | `AttentionSite`: an attention's shapes, the kernel torch runs it with and why, its FLOPs, saved bytes and time |
| `options` | `CompileOptions`: every option of the backend, its default, and the site strategy rule |
| `hardware` | `probe()`: the devices, their native recipes and links |
| `parallel` | the data / tensor degrees of a job (Rust's `parallel_plan`) |
| `memory` | the tensors a forward saves for the backward, measured on fake tensors |
| `dryrun` | `dryrun(engine)`: predicted peak memory and step time (per rank) |
"""
