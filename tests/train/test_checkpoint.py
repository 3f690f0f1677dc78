"""Checkpoints (deepwell.train.checkpoint, deepwell.train.state): a resumed run continues the loss
curve bit for bit on the CPU; a truncated, corrupted, edited, missing or partial checkpoint is a
CheckpointError naming the file (and the previous intact checkpoint), and a writer that dies never
leaves `latest` naming a half-written checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from _training import batches, engine, heldout, losses, trainer
from deepwell.train import CheckpointError, checkpoint

STEPS, K = 6, 3


@pytest.fixture(scope="module")
def straight():
    """N steps in one go (checkpoints every K steps): the reference curve."""
    t = trainer(engine(), STEPS)
    t.fit(batches(), heldout())
    return t


@pytest.fixture(scope="module")
def first_half(tmp_path_factory):
    """K steps, checkpointed, in their own objects."""
    d = tmp_path_factory.mktemp("ckpt")
    trainer(engine(), K, checkpoint_dir=d).fit(batches(), heldout())
    return d


def test_resume_continues_the_loss_curve_bit_for_bit(straight, first_half):
    # Fresh model (other random init: the weights must come from the checkpoint), optimizer,
    # loader and global RNG state.
    torch.manual_seed(12345)
    t = trainer(engine(seed=7), STEPS, checkpoint_dir=first_half)
    t.fit(batches(), heldout(), resume=True)
    assert losses(t) == losses(straight)
    assert [r for r in t.history if "eval_loss" in r][-1] == [r for r in straight.history if "eval_loss" in r][-1]
    for (name, a), b in zip(straight.model.named_parameters(), t.model.parameters()):
        assert torch.equal(a, b), name
    for pa, pb in zip(straight.model.parameters(), t.model.parameters()):
        a, b = straight.optimizer.state[pa], t.optimizer.state[pb]
        assert all(torch.equal(a[k], b[k]) for k in ("exp_avg", "exp_avg_sq", "step"))


def test_the_checkpoint_holds_plan_policy_and_quantization_state(first_half):
    parts, state, path = checkpoint.load(first_half / "step_00000003")
    assert path.name == "step_00000003" and state["step"] == 3 and state["loader"]["index"] == 6
    assert state["plan"]["sites"] and state["policy"]["precision"] == "mxfp8"
    sites = state["quantization"]["sites"]
    assert sites["layers.0.feed_forward.w1"] == {"recipe": "mxfp8", "runs_in": "mxfp8", "emulated": True}
    assert "current scaling" in state["quantization"]["scales"]
    assert set(parts) == {"model", "optimizer", "rng"} and "torch_cpu" in parts["rng"]
    assert parts["optimizer"]["0.exp_avg"].shape == parts["model"]["tok_embeddings.weight"].shape


def _two_checkpoints(tmp_path):
    t = trainer(engine(), 2, checkpoint_dir=tmp_path, checkpoint_every=1)
    t.fit(batches())
    return tmp_path / "step_00000001", tmp_path / "step_00000002"


def _resume(d):
    trainer(engine(), 3, checkpoint_dir=d).fit(batches(), resume=True)


def test_corrupted_checkpoints_name_the_file_and_keep_the_previous_one(tmp_path):
    older, newest = _two_checkpoints(tmp_path)
    weights = newest / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # truncated
    with pytest.raises(CheckpointError, match=r"model\.safetensors has \d+ bytes, the manifest says") as e:
        _resume(tmp_path)
    assert f"the previous checkpoint {older} is intact" in str(e.value)
    assert checkpoint.verify(older)  # kept, and readable

    data = bytearray((older / "optimizer.safetensors").read_bytes())
    data[-5] ^= 0xFF  # same size, flipped bits
    (older / "optimizer.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"optimizer\.safetensors is corrupted"):
        checkpoint.load(older)


def test_an_edited_manifest_is_refused(tmp_path):
    _, newest = _two_checkpoints(tmp_path)
    manifest = json.loads((newest / "manifest.json").read_text())
    manifest["state"]["step"] = 1000
    (newest / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="manifest.json was modified after it was written"):
        _resume(tmp_path)
    (newest / "manifest.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="manifest.json is not valid JSON"):
        _resume(tmp_path)


def test_missing_files_and_partial_checkpoints(tmp_path):
    older, newest = _two_checkpoints(tmp_path)
    (newest / "rng.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"rng\.safetensors is missing"):
        _resume(tmp_path)
    (older / "manifest.json").unlink()
    with pytest.raises(CheckpointError, match="is partial: .*manifest.json is missing"):
        checkpoint.load(older)
    with pytest.raises(CheckpointError, match="holds no checkpoint"):
        trainer(engine(), 3).load_checkpoint(tmp_path / "nothing-here")


def test_a_writer_that_dies_leaves_latest_on_the_previous_checkpoint(tmp_path, monkeypatch):
    t = trainer(engine(), 2, checkpoint_dir=tmp_path, checkpoint_every=1)
    t.fit(batches())
    assert checkpoint.latest(tmp_path).name == "step_00000002"
    import safetensors.torch

    def dies(tensors, path, *a, **k):  # the process dies after writing part of a file
        open(path, "wb").write(b"\x00" * 10)
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(safetensors.torch, "save_file", dies)
    t.step = 3
    with pytest.raises(KeyboardInterrupt):
        t.save_checkpoint()
    monkeypatch.undo()
    assert checkpoint.latest(tmp_path).name == "step_00000002" and checkpoint.verify(tmp_path / "step_00000002")
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert list(tmp_path.glob(".tmp-*"))  # the debris, which no reader looks at ...
    t.save_checkpoint()
    assert not list(tmp_path.glob(".tmp-*")) and checkpoint.latest(tmp_path).name == "step_00000003"  # ... and the next writer removes


def test_keep_prunes_old_checkpoints(tmp_path):
    trainer(engine(), 4, checkpoint_dir=tmp_path, checkpoint_every=1, keep_checkpoints=2).fit(batches())
    assert [p.name for p in checkpoint.checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_keep_never_prunes_a_later_run_or_what_deepwell_did_not_write(tmp_path):
    """A directory holding another run's higher steps, and a step_* directory deepwell did not write:
    keep=1 prunes only this run's own earlier checkpoints. Pruning the newest by number would delete
    the checkpoint this run just wrote before it resumes from it."""
    trainer(engine(), 6, checkpoint_dir=tmp_path / "a", checkpoint_every=3, keep_checkpoints=3).fit(batches())
    (tmp_path / "a" / "step_00000000").mkdir()  # someone else's
    (tmp_path / "a" / "step_00000000" / "notes.txt").write_text("mine")
    assert [p.name for p in checkpoint.checkpoints(tmp_path / "a")] == ["step_00000000", "step_00000003", "step_00000006"]
    (tmp_path / "a" / checkpoint.LATEST).unlink()
    trainer(engine(), 2, checkpoint_dir=tmp_path / "a", checkpoint_every=1, keep_checkpoints=1).fit(batches())
    names = [p.name for p in checkpoint.checkpoints(tmp_path / "a")]
    assert names == ["step_00000000", "step_00000002", "step_00000003", "step_00000006"], names
    assert (tmp_path / "a" / "step_00000000" / "notes.txt").read_text() == "mine"
    assert checkpoint.verify(tmp_path / "a" / "step_00000002")


def test_resuming_under_another_plan_is_refused(first_half):
    t = trainer(engine("nvfp4"), 4, checkpoint_dir=first_half)
    with pytest.raises(ValueError, match=r"trained with another plan.*layers\.0\.attention\.wk: mxfp8 -> nvfp4"):
        t.fit(batches(), resume=True)


def test_the_sharded_format_in_one_process(straight, tmp_path):
    """checkpoint_format="sharded" (the default under several processes, tests/distributed/test_parallel.py)
    written by one process without torch.distributed: the model and optimizer through
    torch.distributed.checkpoint (no_dist) into dcp/, hashed by the manifest like every other file;
    a fresh Trainer resumes it bit for bit, and a damaged shard is a CheckpointError naming it."""
    trainer(engine(), K, checkpoint_dir=tmp_path, checkpoint_format="sharded").fit(batches(), heldout())
    step = tmp_path / "step_00000003"
    manifest = checkpoint.verify(step)
    assert {"dcp/.metadata", "dcp/__0_0.distcp", "rng-rank0.safetensors"} <= set(manifest["files"])
    assert not {"model.safetensors", "optimizer.safetensors"} & set(manifest["files"])
    assert manifest["state"]["checkpoint_format"] == "sharded" and manifest["state"]["world_size"] == 1
    torch.manual_seed(12345)
    t = trainer(engine(seed=7), STEPS, checkpoint_dir=tmp_path)  # the default: "full" for what it writes
    t.fit(batches(), heldout(), resume=step)
    assert t.checkpoint_format == "full" and losses(t) == losses(straight)
    for (name, a), b in zip(straight.model.named_parameters(), t.model.parameters()):
        assert torch.equal(a, b), name

    shard = step / "dcp" / "__0_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"dcp/__0_0\.distcp is corrupted .*there is no older intact checkpoint"):
        trainer(engine(), STEPS).load_checkpoint(step)


def test_checkpoint_format_must_be_full_or_sharded():
    with pytest.raises(ValueError, match="checkpoint_format must be 'full', 'sharded' or None, got 'dcp'"):
        trainer(engine(), 1, checkpoint_format="dcp")
