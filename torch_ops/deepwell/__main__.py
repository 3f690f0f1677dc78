"""`python -m deepwell`: what deepwell found (library, torch, devices), a quantization report, and a
short training run of a LLaMA-style model through the `deepwell` torch.compile backend."""

from __future__ import annotations

from .cli.report import main

if __name__ == "__main__":
    main()
