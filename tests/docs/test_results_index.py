"""benchmarks/results/INDEX.md is what benchmarks/index_results.py generates from the files present
(each benchmark's current baseline per GPU, and the other runs something cites), and no results file
is left out of it: a new run is indexed, a superseded one pruned (`--prune`), in the same change."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import index_results  # noqa: E402


def test_the_index_is_current_and_lists_every_file():
    names = index_results.names_on_disk()
    base, others = index_results.kept(names)
    listed = set(others) | {n for files in base.values() for n in files}
    assert sorted(set(names) - listed) == [], "run python benchmarks/index_results.py --prune"
    assert index_results.INDEX.read_text() == index_results.render(base, others), "run python benchmarks/index_results.py"


def test_names_are_read_as_script_tag_gpu_and_date():
    known = index_results.scripts()
    assert index_results.describe("bench_train_step-8b-rounds3-NVIDIA_H200-2026-11-29.json", known) == (
        "bench_train_step", "NVIDIA_H200", "2026-11-29", "8b-rounds3")
    assert index_results.describe("bench_gemm-NVIDIA_H100_80GB_HBM3-2026-11-26.log", known) == (
        "bench_gemm", "NVIDIA_H100_80GB_HBM3", "2026-11-26", "")
    assert index_results.describe("ncu-tiles-NVIDIA_H200-2026-12-02.log", known)[0] == "other"
