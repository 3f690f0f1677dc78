"""Small reference models used by the main job, the tests and the benchmarks."""

from .llama import Llama

__all__ = ["Llama"]
