"""What FSDP's collectives cost the GEMMs beside them, NCCL's kernels against the copy engines
(torch_ops/deepwell/distributed/copy_engine.py), on 2 GPUs of one node. Per rank: a copy-engine pull of a
peer's 256 MB symmetric buffer alone, NCCL's all-gather of the same bytes alone, then 40 FP8 GEMMs
(torch._scaled_mm, 8192^3, cuBLASLt's persistent kernels) alone and with 6 collectives issued on
another stream first: NCCL's, the copy engines', and NCCL's again with the GEMMs leaving it 8 SMs
(torch's SM carveout, as the process-group plan does). Times are the best of 3.

    torchrun --standalone --nproc-per-node 2 benchmarks/probe_copy_engine.py

Writes benchmarks/results/probe_copy_engine-<device>-<date>.json. NVLink multicast stays off
(NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1), as the lent machines require.
"""

from __future__ import annotations

import datetime
import json
import os
import time

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

N = 128 << 20  # bf16 elements: 256 MB
M = 8192


def main() -> None:
    from torch.distributed import _symmetric_memory as symm_mem

    rank = int(os.environ["RANK"])
    dev = torch.device("cuda", rank)
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    group = dist.group.WORLD
    peer_rank = 1 - rank

    buf = symm_mem.empty(N, dtype=torch.bfloat16, device=dev)
    handle = symm_mem.rendezvous(buf, group.group_name)
    buf.fill_(rank + 1)
    torch.cuda.synchronize()
    dist.barrier()
    peer = handle.get_buffer(peer_rank, (N,), torch.bfloat16)
    out = torch.empty(N, dtype=torch.bfloat16, device=dev)
    gathered = torch.empty(2 * N, dtype=torch.bfloat16, device=dev)
    side = torch.cuda.Stream()

    def copy_engine():
        with torch.cuda.stream(side):
            handle.barrier()
            out.copy_(peer)
            handle.barrier()

    def nccl():
        with torch.cuda.stream(side):
            dist.all_gather_into_tensor(gathered, buf, group=group)

    def alone(fn, reps=10):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / reps * 1e3

    copy_engine()
    torch.cuda.synchronize()
    assert torch.all(out == peer_rank + 1).item(), "the pulled buffer is not the peer's"
    rows = {"copy-engine pull 256 MB": alone(copy_engine), "NCCL all-gather 2 x 256 MB": alone(nccl)}

    a = torch.randn(M, M, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(M, M, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)

    def gemms(n=40):
        for _ in range(n):
            torch._scaled_mm(a, b, one, one, out_dtype=torch.bfloat16)

    def beside(comm, reps=3):
        best = float("inf")
        for _ in range(reps):
            torch.cuda.synchronize()
            dist.barrier()
            t = time.perf_counter()
            for _ in range(6 if comm else 0):
                comm()
            gemms()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - t) * 1e3)
        return best

    gemms(5)
    rows["40 FP8 GEMMs alone"] = beside(None)
    rows["40 FP8 GEMMs + 6 NCCL all-gathers"] = beside(nccl)
    rows["40 FP8 GEMMs + 6 copy-engine pulls"] = beside(copy_engine)
    torch._C._set_sm_carveout_experimental(8)
    rows["40 FP8 GEMMs, 8 SMs left"] = beside(None)
    rows["40 FP8 GEMMs, 8 SMs left + 6 NCCL all-gathers"] = beside(nccl)
    torch._C._set_sm_carveout_experimental(0)

    if rank == 0:
        name = torch.cuda.get_device_name(dev)
        print(f"# probe_copy_engine: {name} x 2, torch {torch.__version__}, CUDA {torch.version.cuda}")
        for k, v in rows.items():
            print(f"{k:48s} {v:8.2f} ms")
        out_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
        date = datetime.date.today().isoformat()
        path = os.path.join(out_dir, f"probe_copy_engine-{name.replace(' ', '_')}-{date}.json")
        with open(path, "w") as f:
            json.dump({"device": name, "torch": torch.__version__, "cuda": torch.version.cuda, "date": date,
                       "ms": rows}, f, indent=1)
        print("wrote", path)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
