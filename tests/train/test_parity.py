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
    # The CPU model is fp32: the bf16 recipe's run is an fp32 baseline, and the table names it so.
    assert sum(line.startswith("| ") for line in table.splitlines()) == 5 and "held-out gap vs fp32" in table and "emulated" in table
    gap = results[3].heldout - results[0].heldout
    assert f"{gap:+.4f}" in table
    # The baseline at 3 seeds (the default): its spread, and each gap judged against it.
    assert len(results[0].heldout_seeds) == 3 and all(len(r.heldout_seeds) == 1 for r in results[1:])
    spread = results[0].spread
    assert f"a spread of {spread:.4f}" in table
    assert table.count("within noise") + table.count("beyond noise") == 4  # 3 rows and the legend's quote
    assert ("within noise" if abs(gap) <= spread else "beyond noise") in table.splitlines()[5]
    assert (tmp_path / "parity.png").read_bytes()[:4] == b"\x89PNG"
    assert [r["recipe"] for r in json.loads((tmp_path / "parity.json").read_text())] == ["bf16", "fp8_block", "mxfp8", "nvfp4"]
    assert "parity.png" in capsys.readouterr().out


def test_parity_refuses_unknown_recipes(capsys):
    import pytest

    with pytest.raises(SystemExit):
        parity.main(["--recipes", "fp4", "--size", "tiny"])
    assert "expected some of bf16, fp8_block, mxfp8, nvfp4, got 'fp4'" in capsys.readouterr().err


def test_main_job_precision_is_checked_against_the_recipe_table():
    """--precision accepts the recipe table's names and auto, and --help lists them all; anything
    else stops at parsing (exit 2), not after building the model."""
    from deepwell.cli.report import parse_args
    from deepwell.core import recipes

    for name in ("auto", *recipes.names()):
        assert parse_args(["--precision", name]).precision == name
    done = subprocess.run([sys.executable, "-m", "deepwell", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and all(name in done.stdout for name in ("auto", *recipes.names())), done.stdout
    assert "fp8_tensor" in done.stdout
    done = subprocess.run([sys.executable, "-m", "deepwell", "--precision", "fp7"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "invalid choice: 'fp7'" in done.stderr and "Traceback" not in done.stderr


def test_the_main_job_twice_into_one_out_directory(tmp_path):
    """Two runs of the job into one --out, the second with fewer steps: each writes its own run-N
    directory, so the second's checkpoint rotation never sees the first's higher steps (it deleted
    its own middle checkpoint, then failed to resume from it), and nothing else under --out is
    touched."""
    (tmp_path / "notes.txt").write_text("mine")

    def job(steps):
        cmd = [sys.executable, "-m", "deepwell", "--device", "cpu", "--quick", "--steps", str(steps), "--parity-steps", "0",
               "--out", str(tmp_path)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done.stdout

    first, second = job(4), job(2)
    assert f"outputs in {tmp_path / 'run-1'}/" in first and f"outputs in {tmp_path / 'run-2'}/" in second
    assert "steps 2..2 bit-identical to the first run" in second
    assert (tmp_path / "run-1" / "checkpoints" / "step_00000004").is_dir() and (tmp_path / "run-2" / "checkpoints" / "step_00000001").is_dir()
    assert (tmp_path / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt", "run-1", "run-2"]


def test_main_job_options():
    done = subprocess.run([sys.executable, "-m", "deepwell", "--help"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "--out" in done.stdout and "--parity-steps" in done.stdout
    done = subprocess.run([sys.executable, "-m", "deepwell", "--steps", "1"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "--steps must be at least 2" in done.stderr
