"""One dense fp8_block fprop shape (16384 x 4096 x 4096) through deepwell's sm_90a kernel, cuBLASLt's
blockwise mode (1x128 x 128x128) and cuBLASLt tensor-wise, each twice, for Nsight Compute to read
their counters side by side (what bounds each: tensor pipes, L2, issue slots). Run it under ncu, with
the card's clocks as they are:

    ncu --clock-control none --section SpeedOfLight --section ComputeWorkloadAnalysis \\
        --section MemoryWorkloadAnalysis -k regex:"gemm|nvjet|sm90" python benchmarks/profile_gemm.py

`--tiles 256,128,2x128` runs deepwell's kernel in each of those tile shapes (forced through the
`fp8_gemm_tile` entry), each twice, in that order; the default is Rust's own choice.
"""

import argparse

import torch
import torch.nn.functional as F

from deepwell import _native  # (importing deepwell registers torch.ops.deepwell)

ops = torch.ops.deepwell
M, K, N = 16384, 4096, 4096


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiles", default="auto",
                        help="comma-separated: auto, 128, 256, 2x128, 128x192, 128x192h, 192")
    tiles = [None if t == "auto" else t for t in parser.parse_args().tiles.split(",")]
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    a, sa = ops.fp8_block_quantize(x, 1, 128)
    b, sb = ops.fp8_block_quantize(w, 128, 128)
    sa_m_major, one = sa.t().contiguous().t(), torch.ones((), device="cuda")
    st = F.ScalingType
    for tile in tiles:
        _native.call("fp8_gemm_tile", {"tile": tile})
        for _ in range(2):
            ops.fp8_block_gemm(a, sa, b, sb, None, torch.bfloat16)
    _native.call("fp8_gemm_tile", {"tile": None})
    for _ in range(2):
        F.scaled_mm(a, b.t(), sa_m_major, st.BlockWise1x128, sb.t(), st.BlockWise128x128, output_dtype=torch.bfloat16)
    for _ in range(2):
        torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
