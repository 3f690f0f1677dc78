"""Builds the Rust shared library (rust/ops, a plain cdylib: no Python binding, no torch or CUDA at
build time) into the `deepwell` package, which lives in torch_ops/deepwell.

`pip wheel .` gives one wheel for every Python >= 3.10 and torch >= 2.10: py3-none, because the
library is loaded with ctypes (no Python C API, no interpreter ABI), and manylinux_2_N for the
newest glibc symbol version the built library needs (`_manylinux_tag`)."""

import os
import re
import struct
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.command.build_ext import build_ext
from setuptools_rust import Binding, RustExtension, Strip

LIBRARY = "deepwell._deepwell"
_SHT_GNU_VERNEED = 0x6FFFFFFE


def glibc_versions_needed(path):
    """The GLIBC_2.N symbol versions an ELF64 little-endian shared library needs, as (2, N) pairs,
    from its version-needs section (SHT_GNU_verneed: Elf64_Verneed entries, each with a chain of
    Elf64_Vernaux naming one version in the linked string table)."""
    data = Path(path).read_bytes()
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQII", data, shoff + i * shentsize) for i in range(shnum)]
    found = set()
    for _, kind, _, _, offset, _, link, count in sections:
        if kind != _SHT_GNU_VERNEED:
            continue
        strtab = sections[link][4]
        entry = offset
        for _ in range(count):
            _, aux_count, _, aux, next_entry = struct.unpack_from("<HHIII", data, entry)
            at = entry + aux
            for _ in range(aux_count):
                _, _, _, name, next_aux = struct.unpack_from("<IHHII", data, at)
                text = data[strtab + name : data.index(b"\0", strtab + name)].decode()
                if m := re.fullmatch(r"GLIBC_2\.(\d+)(?:\.\d+)?", text):
                    found.add((2, int(m.group(1))))
                at += next_aux
            entry += next_entry
    return found


def _manylinux_tag(plat, library):
    """`linux_<arch>` -> `manylinux_2_N_<arch>`, N the newest glibc minor version `library` needs:
    the wheel then installs wherever that glibc or a newer one is. Its only other needs are libgcc_s, libm
    and the dynamic loader, which every manylinux policy allows; torch and CUDA are found at run
    time with dlopen, never linked (docs/DESIGN.md "How Rust reaches PyTorch"). A library built
    against another libc (musl) keeps the plain `linux_<arch>` tag."""
    versions = glibc_versions_needed(library)
    if not plat.startswith("linux_") or not versions:
        return plat
    return f"manylinux_2_{max(versions)[1]}_{plat[len('linux_'):]}"


class BuildExt(build_ext):
    def get_ext_fullpath(self, ext_name):
        # A plain `_deepwell.so`, not `_deepwell.cpython-3XX-...so`: ctypes loads it, so it belongs
        # to no interpreter, and the one wheel carries it for every Python.
        path = super().get_ext_fullpath(ext_name)
        if ext_name == LIBRARY:
            return os.path.join(os.path.dirname(path), LIBRARY.rpartition(".")[2] + ".so")
        return path


class BdistWheel(bdist_wheel):
    def get_tag(self):
        _, _, plat = super().get_tag()
        libraries = sorted(Path(self.bdist_dir).rglob("_deepwell*.so"))
        if libraries:
            plat = _manylinux_tag(plat, libraries[0])
        return "py3", "none", plat


setup(
    name="deepwell",
    version="0.1.0",
    description="Low-precision (MXFP8, NVFP4, block-scaled FP8) training for PyTorch, with a Rust core",
    python_requires=">=3.10",
    package_dir={"": "torch_ops"},
    packages=find_packages("torch_ops"),
    rust_extensions=[
        RustExtension(
            LIBRARY,
            path="rust/ops/Cargo.toml",
            binding=Binding.NoBinding,
            # Release even for in-place/editable builds (setuptools-rust builds those in debug).
            debug=False,
            # The release profile keeps line tables (about 18 of the library's 21 MB) for
            # development builds' backtraces; the packaged copy drops them (`strip -S`, binutils,
            # beside the linker cargo needs) and keeps the symbol table, so a backtrace still names
            # functions. cargo's own output is left as it is.
            strip=Strip.Debug,
        )
    ],
    cmdclass={"build_ext": BuildExt, "bdist_wheel": BdistWheel},
    # tqdm: the Trainer's progress bar; matplotlib: the loss plots (Agg, no display); safetensors:
    # checkpoints and exported models.
    install_requires=["torch>=2.10", "numpy", "tqdm", "matplotlib", "safetensors>=0.4"],
    # transformers: the Hugging Face MoE conversions' parity tests (tests/nn/test_moe_hf.py,
    # tests/distributed/test_moe_ep.py), against transformers 5's MoE blocks; without it they would
    # be skipped.
    # pytest-xdist: .ci/run runs the test tiers one file per core (-n 2).
    extras_require={
        "test": ["pytest>=8", "pytest-xdist>=3.5", "hypothesis>=6", "expecttest", "transformers>=5.23,<6"]
    },
    # The only registration of the torch.compile backend (registering it in code as well makes
    # Dynamo fail with "duplicate name"): torch.compile(m, backend="deepwell") needs no import.
    entry_points={"torch_dynamo_backends": ["deepwell = deepwell.compiler.backend:backend"]},
    zip_safe=False,
)
