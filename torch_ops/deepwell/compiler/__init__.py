"""The `deepwell` torch.compile backend and the step API's compile (docs/DESIGN.md "The backend's
graph passes").

| module | what |
|---|---|
| `backend` | find a graph's GEMM sites, plan them, write each site's strategy, rewrite, hand to Inductor |
| `attention` | find a graph's attention (SDPA calls, nn.MultiheadAttention, explicit matmul -> softmax -> matmul) |
| `fuse_mlp` | one `fp8_block_swiglu_mlp` per fusable SwiGLU MLP (option `fused_mlp`) |
| `guard` | the run-time guardrails of a graph's quantized sites: statistics every N calls, per-site bf16 fallback (option `fallback`) |
| `graph_ops` | the compiled graphs' calls to the autograd-free `deepwell_graph` twins (option `graph_ops`) |
| `engine` | the step API: `capture`, `autoplan`, `compile`, `Engine` |
"""
