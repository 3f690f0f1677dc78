"""The byte-level standard-library corpus, its held-out split, the stateful batch loader and the
learning-rate schedule (deepwell.train.data, deepwell.train.schedule)."""

from __future__ import annotations

import math
import zlib

import pytest
import torch

from _training import corpus
from deepwell.train import ByteCorpus, TokenBatches, WarmupCosine, heldout_batches
from deepwell.train.data import _python_files


def test_the_corpus_is_real_text_split_by_file():
    c = corpus()
    assert c.train.dtype == torch.uint8 and c.train.numel() >= 400_000 and c.heldout.numel() > 0
    assert b"def " in bytes(c.train[:200_000].tolist()) and b"import " in bytes(c.heldout.tolist())
    assert c.files["train"] > 0 and c.files["heldout"] > 0 and "stdlib" in str(c)
    # The split is by file path: no held-out file's text appears among the training files.
    import sysconfig

    root = sysconfig.get_paths()["stdlib"]
    held = [f for f in _python_files(root) if zlib.crc32(f.encode()) % 10 == 0]
    assert held and all(zlib.crc32(f.encode()) % 10 != 0 for f in _python_files(root) if f not in held)


def test_the_corpus_is_deterministic():
    a, b = ByteCorpus.stdlib(max_bytes=100_000), ByteCorpus.stdlib(max_bytes=100_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.heldout, b.heldout)


def test_bad_corpus_arguments_say_what_was_expected(tmp_path):
    with pytest.raises(ValueError, match="heldout_every must be at least 2, got 1"):
        ByteCorpus.stdlib(heldout_every=1)
    with pytest.raises(RuntimeError, match="found no Python sources"):
        ByteCorpus.stdlib(root=str(tmp_path))


def test_the_loader_resumes_from_its_state():
    data = corpus().train
    straight = TokenBatches(data, 4, 16, seed=3)
    first = [next(straight) for _ in range(5)]
    again = TokenBatches(data, 4, 16, seed=3)
    again.load_state_dict({**straight.state_dict(), "index": 2})
    assert all(torch.equal(a, b) for a, b in zip(first[2:], [next(again) for _ in range(3)]))
    assert first[0].shape == (4, 17) and first[0].dtype == torch.int64
    assert not torch.equal(first[0], first[1])
    with pytest.raises(ValueError, match="the checkpoint's loader was"):
        TokenBatches(data, 8, 16, seed=3).load_state_dict(straight.state_dict())


def test_heldout_batches_are_fixed_windows():
    data = corpus().heldout
    a, b = heldout_batches(data, 4, 16, 3), heldout_batches(data, 4, 16, 3)
    assert len(a) == 3 and all(torch.equal(x, y) for x, y in zip(a, b))
    with pytest.raises(ValueError, match="hold fewer than"):
        heldout_batches(data[:20], 4, 16, 3)


def test_warmup_then_cosine():
    s = WarmupCosine(warmup_steps=4, decay_steps=14, min_ratio=0.1)
    assert [s(i) for i in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert s(4) == 1.0 and math.isclose(s(9), 0.55) and math.isclose(s(14), 0.1) and math.isclose(s(100), 0.1)
    assert WarmupCosine(2).with_steps(10) == WarmupCosine(2, 10)
    with pytest.raises(ValueError, match="min_ratio must be in"):
        WarmupCosine(min_ratio=2.0)
