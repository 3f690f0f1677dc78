"""`deepwell.probe()`: the devices deepwell sees, what each runs natively (from the Rust recipe
table, the `arch_info` entry), and the links between GPUs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import torch

from .. import _native


@dataclass
class DeviceInfo:
    index: int
    name: str
    #: "sm_90"; `variant` is the arch-specific target deepwell compiles kernels for ("sm_90a").
    arch: str
    variant: str
    sms: int
    memory_bytes: int
    family: str
    #: recipes with a native GEMM, fastest first; the others run as exact emulation.
    native_recipes: list[str]
    auto_recipe: str
    auto_reason: str

    # The design documents' names (docs/OPS.md "Seed API aliases"). "Supports" means a native GEMM:
    # every recipe runs on every device, the others as exact emulation.
    @property
    def is_blackwell(self) -> bool:
        return "Blackwell" in self.family

    @property
    def blackwell_variant(self) -> str | None:
        """"sm_100 (datacenter Blackwell)", "sm_120 (consumer Blackwell)"; None off Blackwell."""
        return f"{self.arch} ({self.family})" if self.is_blackwell else None

    @property
    def supports_mxfp8(self) -> bool:
        return "mxfp8" in self.native_recipes

    @property
    def supports_fp4(self) -> bool:
        return "nvfp4" in self.native_recipes


@dataclass
class Hardware:
    devices: list[DeviceInfo] = field(default_factory=list)
    #: [{"src", "dst", "p2p"}]: peer access between GPU pairs (NVLink or PCIe P2P).
    links: list[dict] = field(default_factory=list)
    torch_version: str = torch.__version__
    cuda_version: str | None = torch.version.cuda

    @property
    def gpus(self) -> list[DeviceInfo]:
        """The design's name for `devices`."""
        return self.devices

    @property
    def arch(self) -> str:
        """The first GPU's arch, or "cpu"."""
        return self.devices[0].arch if self.devices else "cpu"

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    def __str__(self) -> str:
        lines = [f"torch {self.torch_version}, CUDA {self.cuda_version}"]
        if not self.devices:
            cpu = _native.call("arch_info", {"arch": "cpu"})
            lines.append(f"no GPU: reference kernels on the CPU ({cpu['auto_reason']})")
        for d in self.devices:
            lines.append(
                f"cuda:{d.index} {d.name}: {d.arch} ({d.family}, kernels for {d.variant}), {d.sms} SMs, "
                f"{d.memory_bytes / 2**30:.0f} GiB; native: {', '.join(d.native_recipes)}; {d.auto_reason}"
            )
        for link in self.links:
            lines.append(f"cuda:{link['src']} -> cuda:{link['dst']}: {'peer access' if link['p2p'] else 'no peer access'}")
        return "\n".join(lines)


def probe() -> Hardware:
    hw = Hardware()
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i in range(n):
        p = torch.cuda.get_device_properties(i)
        info = _native.call("arch_info", {"arch": f"sm_{p.major}{p.minor}"})
        hw.devices.append(
            DeviceInfo(
                i, p.name, info["arch"], info["variant"], p.multi_processor_count, p.total_memory,
                info["family"], info["native"], info["auto"], info["auto_reason"],
            )
        )
    for i in range(n):
        for j in range(n):
            if i != j:
                hw.links.append({"src": i, "dst": j, "p2p": bool(torch.cuda.can_device_access_peer(i, j))})
    return hw


def print_hardware_info(hw: Hardware | None = None) -> None:
    """Prints `hw` (default: `probe()`)."""
    print(hw if hw is not None else probe())
