"""benchmarks/bench_train_step.py's interleaved rounds (`--rounds`): every run takes every place in
the order, and a run's speed over bf16 and torchao is paired within each round. CPU only: the
order and the ratios are plain Python; the timing itself needs a GPU."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "benchmarks"))
bench = pytest.importorskip("bench_train_step")


def test_every_run_takes_every_place_once_over_as_many_rounds():
    runs = ["bf16", "torchao", "auto", "fp8_tensor"]
    orders = [bench.round_order(runs, r) for r in range(len(runs))]
    assert orders[0] == runs
    for place in range(len(runs)):
        assert sorted(order[place] for order in orders) == sorted(runs)
    assert bench.round_order(runs, len(runs) + 1) == orders[1]  # rounds past the count wrap


def test_ratios_are_paired_within_a_round(capsys):
    # torchao is faster in round 0, deepwell in round 1: each round's own ratio, not the ratio of
    # the runs' medians (that would read 1.0x for both rounds' drift).
    means = {"bf16": [100.0, 120.0], "torchao": [80.0, 100.0], "deepwell": [82.0, 95.0]}
    out = bench.print_rounds(means, "bf16", "torchao")
    ratios = sorted([80.0 / 82.0, 100.0 / 95.0])
    assert out["deepwell"]["vs_torchao"] == pytest.approx((sum(ratios) / 2, ratios[0], ratios[1]))
    assert out["deepwell"]["vs_bf16"][1:] == pytest.approx((100.0 / 82.0, 120.0 / 95.0))
    assert out["torchao"]["vs_torchao"] == (1.0, 1.0, 1.0)
    assert out["bf16"]["median_ms"] == 110.0
    assert "deepwell" in capsys.readouterr().out


def test_without_torchao_there_is_no_torchao_ratio():
    out = bench.print_rounds({"bf16": [100.0, 90.0], "deepwell": [80.0, 70.0]}, "bf16", None)
    assert "vs_torchao" not in out["deepwell"]
    assert out["deepwell"]["vs_bf16"][0] == pytest.approx((100 / 80 + 90 / 70) / 2)
