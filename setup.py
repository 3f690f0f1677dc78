"""Builds the Rust shared library (rust/ops, a plain cdylib: no Python binding, no torch or CUDA at
build time) into the `deepwell` package, which lives in torch_ops/deepwell."""

from setuptools import find_packages, setup
from setuptools_rust import Binding, RustExtension

setup(
    name="deepwell",
    version="0.1.0",
    description="Low-precision (MXFP8, NVFP4, block-scaled FP8) training for PyTorch, with a Rust core",
    python_requires=">=3.10",
    package_dir={"": "torch_ops"},
    packages=find_packages("torch_ops"),
    rust_extensions=[
        RustExtension(
            "deepwell._deepwell",
            path="rust/ops/Cargo.toml",
            binding=Binding.NoBinding,
            # Release even for in-place/editable builds (setuptools-rust builds those in debug).
            debug=False,
        )
    ],
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
