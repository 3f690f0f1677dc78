"""`python -m deepwell`: what deepwell found (library, torch, device) and a quantization report."""

from __future__ import annotations

from .report import main

if __name__ == "__main__":
    main()
