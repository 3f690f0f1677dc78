"""`python -m deepwell.cli.kernels --compile-all --arch sm_90a,sm_100a,sm_120a`: compiles every CUDA
kernel deepwell can launch, for each arch, with NVRTC and no GPU; exits non-zero on any failure."""

from __future__ import annotations

import argparse
import sys

from .. import _native


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m deepwell.cli.kernels", description=__doc__)
    parser.add_argument("--compile-all", action="store_true", help="compile every kernel")
    parser.add_argument("--arch", default="sm_90a,sm_100a,sm_120a", help="comma-separated NVRTC archs")
    args = parser.parse_args(argv)
    if not args.compile_all:
        parser.print_help()
        return 2
    try:
        report = _native.compile_all([a.strip() for a in args.arch.split(",") if a.strip()])
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    print(f"NVRTC: {_native.nvrtc_path()}")
    print(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
