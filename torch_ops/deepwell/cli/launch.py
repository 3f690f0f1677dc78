"""The main job under torchrun (`torchrun --nproc-per-node N -m deepwell ...`): one process per
device joins the process group torchrun describes (WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR/PORT),
on NCCL for GPUs and gloo on the CPU; rank 0 alone prints. deepwell.autoplan then plans FSDP over
the processes and the Trainer trains each rank on its rows of every batch (docs/DESIGN.md
"Scale-out")."""

from __future__ import annotations

import contextlib
import os
import sys

import torch
import torch.distributed as dist


def world() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


@contextlib.contextmanager
def processes(device: torch.device):
    """Joins torchrun's process group for the block (nothing with one process); yields this
    process's device (cuda:LOCAL_RANK on GPUs). Other ranks' stdout is silenced."""
    if world() == 1:
        yield device
        return
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    quiet = open(os.devnull, "w") if dist.get_rank() != 0 else None
    stdout = sys.stdout
    if quiet is not None:
        sys.stdout = quiet
    try:
        yield device
    finally:
        sys.stdout = stdout
        if quiet is not None:
            quiet.close()
        dist.destroy_process_group()
