"""Planning: which recipe each GEMM site runs and what a training step will cost. The decisions are
Rust's (rust/core/src/policy, through the C API); these modules are their typed fronts.

| module | what |
|---|---|
| `recipes` | the recipe table, each device's auto recipe and NVRTC target, site roles (from Rust) |
| `policy` | `PrecisionPolicy`, `LayerInfo`, `LayerDecision`: the per-site decision |
| `sites` | `Site`, `Plan` (a graph's decisions, printable), `plan_sites` |
| `backend` | the `deepwell` torch.compile backend: find GEMM sites, plan, rewrite, hand to Inductor |
| `hardware` | `probe()`: the devices, their native recipes and links |
| `engine` | the step API: `capture`, `autoplan`, `compile` |
| `dryrun` | `dryrun(engine)`: predicted peak memory and step time (per rank) |
| `memory` | the tensors a forward saves for the backward, measured on fake tensors |
| `parallel` | the data / tensor degrees of a job (Rust's `parallel_plan`) |
| `shard` | applies them: tensor parallelism, then FSDP2 `fully_shard` per unit (the embedding, groups of `unit_blocks` blocks, the norm with the LM head) and at the root |
| `tensor_parallel` | Megatron's layout on LLaMA blocks through DTensor's `parallelize_module` |
| `fp8_all_gather` | which fp8_block weights FSDP2 gathers as FP8 codes (`autoplan(..., fp8_all_gather=True)`) |
| `fp8_weights` | the FSDP2 extension tensors that gather them and run scaled_linear from the codes |
"""
