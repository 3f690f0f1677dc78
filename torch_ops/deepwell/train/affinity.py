"""Each process of a multi-GPU run on its own physical cores.

Why: a 2-GPU fp8_block step of the 0.95B model needs ~81 ms of host time for ~98 ms of GPU work,
and in some runs one rank's host ran 25-50% slower for the whole run, stalling both GPUs at every
collective (docs/DESIGN.md "Scale-out"). One suspect is the scheduler placing the two processes'
threads (main, autograd, NCCL) on the same physical cores; pinning each rank to its own cores
rules that out. Not measured on GPUs yet: `bench_parallel.py --pin-cores` is the measurement.

The split: the CPUs this process may use, grouped into physical cores (hyperthread siblings
together, from Linux's /sys topology), cut into `local_world` contiguous runs of cores, one per
local rank. Where the topology cannot be read, each CPU counts as a core.
"""

from __future__ import annotations

import os

TOPOLOGY = "/sys/devices/system/cpu/cpu{}/topology/{}"


def read_core(cpu: int) -> tuple[int, int] | None:
    """(package, core) of logical CPU `cpu`, or None when Linux does not say."""
    try:
        with open(TOPOLOGY.format(cpu, "physical_package_id")) as f:
            package = int(f.read())
        with open(TOPOLOGY.format(cpu, "core_id")) as f:
            return package, int(f.read())
    except (OSError, ValueError):
        return None


def physical_cores(cpus, core_of=read_core) -> list[list[int]]:
    """`cpus` grouped by physical core (siblings together), cores ordered by their first CPU."""
    cores: dict[object, list[int]] = {}
    for cpu in sorted(cpus):
        key = core_of(cpu)
        cores.setdefault(("cpu", cpu) if key is None else key, []).append(cpu)
    return sorted(cores.values(), key=lambda c: c[0])


def cores_for(local_rank: int, local_world: int, cpus=None, core_of=read_core) -> list[int]:
    """The logical CPUs of `local_rank`'s share: its contiguous run of whole physical cores (the
    first ranks take one more core when they do not divide evenly; with more ranks than cores,
    ranks share cores round-robin)."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"deepwell.pin_cores: local_rank must be in [0, {local_world}), got {local_rank}")
    cores = physical_cores(os.sched_getaffinity(0) if cpus is None else cpus, core_of)
    if local_world > len(cores):
        return sorted(cores[local_rank % len(cores)])
    base, extra = divmod(len(cores), local_world)
    start = local_rank * base + min(local_rank, extra)
    mine = cores[start:start + base + (local_rank < extra)]
    return sorted(cpu for core in mine for cpu in core)


def pin_cores(local_rank: int | None = None, local_world: int | None = None) -> list[int]:
    """Pins every thread of this process (and the threads it starts later) to `cores_for` its
    local rank; returns those CPUs. Defaults: torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE. Call it
    first, before CUDA and torch.distributed start their threads (later threads inherit it; the
    ones already running are moved too)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1")) if local_world is None else local_world
    mine = cores_for(local_rank, local_world)
    for task in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(task), mine)
        except (OSError, ValueError):  # a thread that ended meanwhile
            pass
    os.sched_setaffinity(0, mine)
    return mine
