"""Modules and training-time state: `deepwell.Linear` (`linear`), its run-time guardrails
(`guardrails`), and when the linear layers may reuse a quantized weight (`weight_cache`)."""

from .linear import Linear

__all__ = ["Linear"]
