"""Running on several GPUs: applying a plan's parallel degrees (docs/DESIGN.md "Scale-out").

| module | what |
|---|---|
| `units` | the job's world, a model's blocks and its FSDP units |
| `shard` | applies a plan: tensor parallelism, then FSDP2 `fully_shard` per unit and at the root |
| `tensor_parallel` | Megatron's layout on LLaMA blocks through DTensor's `parallelize_module` |
| `fp8_all_gather` | which fp8_block weights FSDP2 gathers as FP8 codes, and applying it |
| `fp8_weights` | the FSDP2 extension tensors that gather them and run scaled_linear from the codes |
| `copy_engine` | FSDP2's collectives on the GPUs' copy engines instead of SMs |
"""
