"""The main job (`python -m deepwell`): print the library and hardware deepwell found; quantize real
tensors (an nn.Linear weight and a heavy-tailed activation) in every format, on the GPU when there is
one, with the error statistics of each (ms = quantize + dequantize); then train a small LLaMA-style
model with the `deepwell` torch.compile backend (deepwell.cli.demo)."""

from __future__ import annotations

import time

import torch

from .. import _native
from .demo import train_demo
from ..plan.hardware import probe
from ..ops import (
    fp8_block_dequantize,
    fp8_block_quantize,
    mxfp8_dequantize,
    mxfp8_quantize,
    nvfp4_dequantize,
    nvfp4_quantize,
)


def _device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _device_line(device: torch.device) -> str:
    if device.type == "cpu":
        return "no CUDA device: running the CPU reference kernels"
    p = torch.cuda.get_device_properties(device)
    return f"{p.name} (sm_{p.major}{p.minor}, {p.multi_processor_count} SMs): running the CUDA kernels (NVRTC-compiled on first use)"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _formats():
    """(name, round trip x -> dequantized float32) for each format the library offers."""
    f32 = torch.float32
    return [
        ("mxfp8 e4m3 rceil", lambda x: mxfp8_dequantize(*mxfp8_quantize(x), out_dtype=f32)),
        ("mxfp8 e4m3 floor", lambda x: mxfp8_dequantize(*mxfp8_quantize(x, scale_mode="floor"), out_dtype=f32)),
        ("mxfp8 e5m2 rceil", lambda x: mxfp8_dequantize(*mxfp8_quantize(x, elem="e5m2"), out_dtype=f32)),
        ("nvfp4 1x16", lambda x: nvfp4_dequantize(*nvfp4_quantize(x), out_dtype=f32)),
        ("nvfp4 16x16", lambda x: nvfp4_dequantize(*nvfp4_quantize(x, block_2d=True), out_dtype=f32)),
        ("fp8_block 1x128", lambda x: fp8_block_dequantize(*fp8_block_quantize(x), out_dtype=f32)),
        (
            "fp8_block 128x128",
            lambda x: fp8_block_dequantize(*fp8_block_quantize(x, 128, 128), 128, 128, out_dtype=f32),
        ),
    ]


def _tensors(device: torch.device, seed: int = 0) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.nn.Linear(4096, 4096, bias=False).weight.detach()
    # Activations of trained LLMs are heavy-tailed with a few outlier channels; a Student-t sample
    # with three outlier columns stands in for one here.
    act = torch.distributions.StudentT(4.0).sample((2048, 4096))
    act[:, torch.randint(0, 4096, (3,), generator=g)] *= 40.0
    return [("linear weight 4096x4096", weight.bfloat16().to(device)), ("activation 2048x4096", act.bfloat16().to(device))]


def main() -> None:
    torch.manual_seed(0)
    device = _device()
    print(f"deepwell {_native.version()}  library: {_native.library_path()}")
    print(f"torch {torch.__version__}  device: {_device_line(device)}")
    print(probe())
    for fmt, round_trip in _formats():  # warm-up: the first CUDA call of each kernel compiles it
        round_trip(torch.ones(256, 256, device=device))
    for name, x in _tensors(device):
        ref = x.double()
        print(f"\n{name} ({x.dtype}): error of dequantize(quantize(x)) vs x")
        print(f"  {'format':<20}{'rel. RMSE':>11}{'SQNR dB':>9}{'max |err|':>11}{'zeros %':>9}{'ms':>8}")
        for fmt, round_trip in _formats():
            _sync(device)
            t0 = time.perf_counter()
            y = round_trip(x)
            _sync(device)
            ms = (time.perf_counter() - t0) * 1e3
            y = y.double()
            err = y - ref
            rel = (err.norm() / ref.norm()).item()
            sqnr = 10 * torch.log10(ref.pow(2).sum() / err.pow(2).sum()).item()
            zeros = 100.0 * ((y == 0) & (ref != 0)).double().mean().item()
            print(f"  {fmt:<20}{rel:>11.3e}{sqnr:>9.2f}{err.abs().max().item():>11.3e}{zeros:>9.3f}{ms:>8.1f}")
    train_demo(device)
