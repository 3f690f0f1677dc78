"""deepwell.Trainer (deepwell.train.trainer): the log, the schedule, gradient accumulation through
deepwell.microbatches(), skipped non-finite steps, guardrail fallbacks in the log and in checkpoints,
the loss plot, resuming a data source without state, and its argument checks."""

from __future__ import annotations

import math

import pytest
import torch

import deepwell
from _training import EagerEngine, batches, engine, heldout, losses, trainer
from deepwell.train import Trainer, WarmupCosine
from deepwell.train.log import read


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    d = tmp_path_factory.mktemp("run")
    before = deepwell.weight_cache_info()
    t = trainer(engine(), 4, checkpoint_dir=d, eval_every=2)
    t.fit(batches(), heldout())
    return t, d, before, deepwell.weight_cache_info()


def test_the_log_has_loss_grad_norm_lr_and_throughput(run):
    t, d, _, _ = run
    records = read(d / "metrics.jsonl")
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["grad_norm"] > 0 and r["tokens_per_s"] > 0 and r["tokens"] == 2 * 4 * 32 * r["step"] for r in steps)
    assert [r["step"] for r in records if "eval_loss" in r] == [2, 4]
    assert [r["path"].rsplit("/", 1)[1] for r in records if r.get("event") == "checkpoint"] == ["step_00000004"]
    assert math.isfinite(losses(t)[-1]) and losses(t)[-1] < losses(t)[0]
    png = (d / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 5000


def test_the_schedule_sets_each_step_s_lr(run):
    t, _, _, _ = run
    s = WarmupCosine(2, 4)
    assert [r["lr"] for r in t.history if "lr" in r] == [3e-3 * s(i) for i in range(4)]


def test_micro_batches_quantize_each_weight_once_per_step(run):
    """grad_accum=2: the second micro-batch's forward and both backwards reuse the weights'
    quantized copies (deepwell.microbatches); 6 quantized sites x 4 steps."""
    _, _, before, after = run
    assert after["hits"] - before["hits"] >= 6 * 4 * 2
    assert after["entries"] == 0  # the scope closes with every step


def test_one_micro_batch_per_step_caches_no_weights():
    """grad_accum=1: no reuse scope, so no layer's quantized copies outlive its own pass (a scope
    would keep every layer's two FP8 copies from its forward to the optimizer step, and the
    backward would reuse them: hits)."""
    before = deepwell.weight_cache_info()
    t = trainer(engine(), 2, grad_accum=1).fit(batches())
    after = deepwell.weight_cache_info()
    assert t._reuse is False
    assert after["hits"] == before["hits"] and after["misses"] - before["misses"] >= 6 * 2 * 2


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = deepwell.Linear(64, 64, recipe="mxfp8", name="test_trainer.fc", guardrail_config=deepwell.GuardrailConfig(interval=1))

    def forward(self, x):
        return self.fc(x)


def _square_loss(eng, batch):
    return eng(batch).float().square().mean()


def test_non_finite_steps_are_skipped_and_fallbacks_logged(tmp_path):
    torch.manual_seed(0)
    net = _Net()
    data = [torch.randn(32, 64) for _ in range(4)]
    data[0][3, 5] = math.inf
    t = Trainer.from_engine(EagerEngine(net), max_steps=4, checkpoint_dir=tmp_path, loss_fn=_square_loss, progress=False, plot=False)
    before = net.fc.weight.detach().clone()
    t.step, t.max_steps = 0, 1
    t.fit(data)
    assert torch.equal(net.fc.weight, before)  # step 1 saw an inf: no update
    t.max_steps = 4
    t.fit(data)
    records = read(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records if r.get("event") == "skipped_step"] == [1]
    fallbacks = [r for r in records if r.get("event") == "guardrail_fallback"]
    assert len(fallbacks) == 1 and fallbacks[0]["layer"] == "fc" and "non-finite input" in fallbacks[0]["detail"]
    assert net.fc.guardrail.recipe == "bf16" and not torch.equal(net.fc.weight, before)

    # The fallback is quantization state: a fresh model resumes running bf16, with the event.
    fresh = _Net()
    assert fresh.fc.guardrail.recipe == "mxfp8"
    Trainer.from_engine(EagerEngine(fresh), max_steps=4, checkpoint_dir=tmp_path, loss_fn=_square_loss, progress=False, plot=False).fit(data, resume=True)
    assert fresh.fc.guardrail.recipe == "bf16" and fresh.fc.guardrail.record.events == net.fc.guardrail.record.events


def _reads(t: Trainer) -> list[list[int]]:
    """Records the steps each read that waited for the device's values covers."""
    seen, read_steps = [], t._read_steps

    def counted(bar=None, wait=True):
        records = read_steps(bar, wait)
        seen.append([r["step"] for r in records]) if records and wait else None
        return records

    t._read_steps = counted
    return seen


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_non_finite_step_is_skipped_on_the_device_as_when_waiting_every_step(tmp_path, device):
    """The default fused AdamW takes found_inf: the host waits for the losses only at the end (it
    takes each step's as they reach it: train/readback.py), and the weights, moments, step counts,
    history and log equal a run that waits every step (wait_every_step=True) bit for bit. A
    foreach AdamW cannot skip on the device: it waits."""
    data = [torch.randn(16, 32, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    data[2][1, 3] = math.inf  # step 3
    runs = {}
    for name, kw in {"device": {}, "waiting": {"wait_every_step": True}, "foreach": {}}.items():
        torch.manual_seed(0)
        net = torch.nn.Linear(32, 32).to(device)
        opt = deepwell.train.AdamW(net.parameters(), lr=1e-2, foreach=True) if name == "foreach" else None
        t = Trainer.from_engine(EagerEngine(net), optimizer=opt, max_steps=8, log_every=4, checkpoint_dir=tmp_path / name,
                                loss_fn=_square_loss, progress=False, plot=False, **kw)
        reads = _reads(t)
        t.fit(data)
        runs[name] = (net, t, reads, read(tmp_path / name / "metrics.jsonl"))
    net, t, reads, log = runs["device"]
    # The one wait, at the end, takes the steps still on their way (on the CPU none but the last).
    assert len(reads) == 1 and reads[0][-1] == 8 and (device == "cuda" or reads == [[8]]), reads
    assert [r["step"] for r in t.history] == list(range(1, 9)) and all(r["step_s"] > 0 for r in t.history)
    assert runs["waiting"][2] == runs["foreach"][2] == [[s] for s in range(1, 9)]
    wnet, wt, _, wlog = runs["waiting"]
    assert torch.equal(net.weight, wnet.weight) and torch.equal(net.bias, wnet.bias)
    for p, q in zip(net.parameters(), wnet.parameters()):
        a, b = t.optimizer.state[p], wt.optimizer.state[q]
        assert int(a["step"]) == int(b["step"]) == 7 and torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
    keys = ("step", "loss", "grad_norm", "lr", "tokens")
    same = lambda h: [tuple(r[k] for k in keys) for r in h if "loss" in r]  # noqa: E731
    assert same(t.history) == same(wt.history) and len(t.history) == 8
    assert not math.isfinite(t.history[2]["loss"]) and all(math.isfinite(r["loss"]) for i, r in enumerate(t.history) if i != 2)
    for records in (log, wlog):
        assert [r["step"] for r in records if r.get("event") == "skipped_step"] == [3]
        assert [r["step"] for r in records if "loss" in r] == [4, 8]
    assert runs["foreach"][1].history[2]["step"] == 3 and int(runs["foreach"][1].optimizer.state[runs["foreach"][0].weight]["step"]) == 7


def test_a_data_source_without_state_is_fast_forwarded(tmp_path):
    torch.manual_seed(0)
    data = [torch.randn(32, 64) for _ in range(6)]  # a list: no state_dict, so resume skips what was used
    torch.manual_seed(1)
    first = Trainer.from_engine(EagerEngine(_Net()), max_steps=1, checkpoint_dir=tmp_path, loss_fn=_square_loss, grad_accum=2, progress=False, plot=False)
    torch.manual_seed(1)
    straight = Trainer.from_engine(EagerEngine(_Net()), max_steps=3, loss_fn=_square_loss, grad_accum=2, progress=False)
    straight.fit(data)
    first.fit(data)
    resumed = Trainer.from_engine(EagerEngine(_Net()), max_steps=3, checkpoint_dir=tmp_path, loss_fn=_square_loss, grad_accum=2, progress=False, plot=False)
    resumed.fit(data, resume=True)
    assert resumed.batches_used == 6 and losses(resumed) == losses(straight)


def test_gc_every_collects_at_fixed_steps_with_automatic_collection_off():
    """gc_every=2: inside fit no automatic collection runs (each collection is one of the Trainer's
    young-generation ones, after steps 2 and 4), and the collector is on again afterwards; the
    default with one process leaves automatic collection alone."""
    import gc

    seen = []  # (generation, collector enabled, step) at each collection's start

    def watch(phase, info):
        if phase == "start":
            seen.append((info["generation"], gc.isenabled(), t.step))

    torch.manual_seed(0)
    data = [torch.randn(32, 64) for _ in range(5)]
    t = Trainer.from_engine(EagerEngine(_Net()), max_steps=5, loss_fn=_square_loss, progress=False, gc_every=2)
    gc.callbacks.append(watch)
    try:
        t.fit(data)
    finally:
        gc.callbacks.remove(watch)
    assert seen == [(1, False, 2), (1, False, 4)] and gc.isenabled()
    assert Trainer.from_engine(EagerEngine(_Net()), loss_fn=_square_loss).gc_every == 0


def test_each_step_moves_the_expert_biases_of_moe_blocks():
    """A model with DeepwellMoE blocks built with expert_bias=True: after every optimizer step the
    Trainer moves each block's bias by its bias_update_rate from the step's counts (grad_accum
    micro-batches summed) and restarts the counts; blocks without a bias are left alone."""
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = deepwell.DeepwellMoE(32, 16, 4, top_k=1, expert_bias=True, bias_update_rate=0.25)
            self.b = deepwell.DeepwellMoE(32, 16, 4, top_k=1)
            with torch.no_grad():  # every token to expert 0 in block a
                self.a.gate.weight.zero_()
                self.a.gate.weight[0] = 1.0

        def forward(self, x):
            return self.b(self.a(x))

    net = Net()
    data = [torch.rand(8, 32) for _ in range(4)]  # positive entries: expert 0's logit is the largest
    t = Trainer.from_engine(EagerEngine(net), max_steps=2, grad_accum=2, loss_fn=_square_loss, progress=False,
                            plot=False, optimizer=lambda p: torch.optim.SGD(p, lr=0.0))
    t.fit(data)
    # Expert 0 took all 16 tokens of each step (its softmax score stays far ahead of the bias):
    # each step adds 0.25 * [-1, 1, 1, 1] centred, [-0.375, 0.125, 0.125, 0.125].
    want = torch.tensor([-0.75, 0.25, 0.25, 0.25])
    assert torch.allclose(net.a.expert_bias, want), net.a.expert_bias
    assert torch.all(net.a.tokens_per_expert == 0) and net.b.expert_bias is None


def test_a_skipped_step_leaves_the_expert_biases_without_waiting():
    """A non-finite step with a fused optimizer: the expert bias stays and the step's counts carry
    into the next update, decided on the device, as the Trainer that waits every step does."""
    runs = {}
    for wait in (False, True):
        torch.manual_seed(0)
        moe = deepwell.DeepwellMoE(32, 16, 4, top_k=1, expert_bias=True, bias_update_rate=0.25)
        with torch.no_grad():  # every token to expert 0
            moe.gate.weight.zero_()
            moe.gate.weight[0] = 1.0
        data = [torch.rand(8, 32) for _ in range(4)]
        data[1][2, 0] = math.inf  # step 1 (batches 0 and 1) is not finite
        t = Trainer.from_engine(EagerEngine(moe), max_steps=1, grad_accum=2, loss_fn=_square_loss, progress=False, plot=False,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.0, fused=True), wait_every_step=wait)
        reads = _reads(t)
        t.fit(data)
        after_skip = (moe.expert_bias.clone(), moe.tokens_per_expert.clone())
        t.max_steps = 2
        t.fit(data)
        runs[wait] = (moe.expert_bias.clone(), moe.tokens_per_expert.clone(), reads, [r["step"] for r in t.history if not math.isfinite(r["loss"])], after_skip)
    assert runs[False][2] == [[1], [2]] == runs[True][2]  # each fit ends with a read
    assert runs[False][3] == runs[True][3] == [1]
    # After the skipped step: no bias moved, the step's 16 tokens still counted, for the next update.
    for bias, counts in (runs[False][4], runs[True][4]):
        assert torch.all(bias == 0) and counts.tolist() == [16.0, 0.0, 0.0, 0.0], (bias, counts)
    assert torch.equal(runs[False][0], runs[True][0]) and torch.equal(runs[False][1], runs[True][1])
    # One update (step 2) from both steps' counts: expert 0 took every token.
    assert torch.allclose(runs[False][0], torch.tensor([-0.375, 0.125, 0.125, 0.125])), runs[False][0]
    assert torch.all(runs[False][1] == 0)


def test_bad_arguments_say_what_was_expected():
    eng = EagerEngine(_Net())
    with pytest.raises(ValueError, match="grad_accum must be a positive int, got 0"):
        Trainer.from_engine(eng, grad_accum=0)
    with pytest.raises(ValueError, match="expected a deepwell.Engine"):
        Trainer.from_engine(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="optimizer holds tensors that are not"):
        Trainer.from_engine(eng, optimizer=torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1))
    with pytest.raises(ValueError, match="lr_schedule must be"):
        Trainer.from_engine(eng, lr_schedule=3)
    with pytest.raises(ValueError, match="gc_every must be a non-negative int or None, got -1"):
        Trainer.from_engine(eng, gc_every=-1)
    with pytest.raises(ValueError, match="resume=True needs a checkpoint_dir"):
        Trainer.from_engine(eng, max_steps=1, loss_fn=_square_loss).fit([torch.ones(2, 64)], resume=True)
    with pytest.raises(ValueError, match=r"training data ran out after 2 batches; max_steps=2 x grad_accum=2 needs 4"):
        Trainer.from_engine(eng, max_steps=2, grad_accum=2, loss_fn=_square_loss, progress=False).fit([torch.ones(2, 64)] * 2)
    with pytest.raises(ValueError, match="eval_data must be a finite list"):
        Trainer.from_engine(eng, max_steps=1, loss_fn=_square_loss).fit([torch.ones(2, 64)], batches())
    with pytest.raises(ValueError, match=r"a batch must be a \(batch, seq \+ 1\) tensor of token ids, got a 1-d"):
        Trainer.from_engine(eng, max_steps=1, progress=False).fit([torch.ones(64)])


def test_a_torch_lr_scheduler_is_stepped_and_checkpointed(tmp_path):
    def make(d):
        torch.manual_seed(0)
        net = _Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        return Trainer.from_engine(EagerEngine(net), optimizer=opt, lr_schedule=sched, max_steps=5, checkpoint_dir=d,
                                   loss_fn=_square_loss, progress=False, plot=False)

    data = [torch.randn(8, 64) for _ in range(5)]
    straight = make(None)
    straight.fit(data)
    assert [r["lr"] for r in straight.history] == [0.1, 0.1, 0.05, 0.05, 0.025]
    first = make(tmp_path)
    first.max_steps = 3
    first.fit(data)
    resumed = make(tmp_path)
    resumed.fit(data, resume=True)
    assert [r["lr"] for r in resumed.history] == [0.1, 0.1, 0.05, 0.05, 0.025] and losses(resumed) == losses(straight)
