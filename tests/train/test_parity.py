"""`python -m deepwell.parity` on a tiny model: one run per recipe from the same initial weights on
the same batches, the plot, and the table of final losses and gaps to bf16 (deepwell.train.parity);
and the main job's command line names its new options."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from deepwell.train import parity


def test_parity_trains_every_recipe_and_writes_the_plot_and_table(tmp_path, capsys):
    results = parity.main(["--size", "tiny", "--steps", "3", "--out", str(tmp_path), "--device", "cpu"])
    assert [r.recipe for r in results] == ["bf16", "fp8_block", "mxfp8", "nvfp4"]
    assert all(len(r.losses) == 3 and all(map(torch.isfinite, map(torch.tensor, r.losses))) for r in results)
    # Same initial weights and data: the first loss differs only by the first forward's quantization.
    first = [r.losses[0] for r in results]
    assert max(first) - min(first) < 0.05 and len(set(first)) > 1
    assert results[0].runs_as == "fp32 (unquantized)" and all(r.runs_as.endswith("emulated") for r in results[1:])
    table = (tmp_path / "parity.md").read_text()
    assert sum(line.startswith("| ") for line in table.splitlines()) == 5 and "held-out gap vs bf16" in table and "emulated" in table
    gap = results[3].heldout - results[0].heldout
    assert f"{gap:+.4f}" in table
    assert (tmp_path / "parity.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["recipe"] for r in json.loads((tmp_path / "parity.json").read_text())] == ["bf16", "fp8_block", "mxfp8", "nvfp4"]
    assert "parity.png" in capsys.readouterr().out


def test_parity_refuses_unknown_recipes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        parity.main(["--recipes", "fp4", "--size", "tiny"])
    assert "expected some of bf16, fp8_block, mxfp8, nvfp4, got 'fp4'" in capsys.readouterr().err


def test_main_job_options():
    done = subprocess.run([sys.executable, "-m", "deepwell", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "--out" in done.stdout and "--parity-steps" in done.stdout
    done = subprocess.run([sys.executable, "-m", "deepwell", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr
