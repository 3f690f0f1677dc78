"""The backend's `recompute_codes` option (compiler/backend.py `_quantize_once`):
x's row codes are made once in the forward for all the sites reading x, and its column codes in the
backward from x instead of being saved. Proved against the saved codes, the slow obviously-correct
path: the backward's codes are the forward's (same bits, when Inductor rounds a recomputed x as the
forward rounded it), the forward saves less, each pass writes only the copy its GEMMs read, the
quantizer runs once more per input, and dryrun counts the smaller saved set.
CPU (the emulated recipes); the GPU case runs the native kernels the same way."""

from __future__ import annotations

import deepwell
import pytest
import torch
from _util import adamw_steps, deepwell_calls, saved_activation_bytes
from deepwell.models import Llama

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
PRECISIONS = ["fp8_block", "fp8_tensor"]


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return Llama(1000, 512, 2, 8, 1024, max_seq=64).to(device=device, dtype=torch.bfloat16)


def _tokens(device: str) -> torch.Tensor:
    return torch.randint(0, 1000, (2, 64), generator=torch.Generator().manual_seed(1)).to(device)


def _compiled(model, precision: str, **options):
    torch._dynamo.reset()
    policy = deepwell.PrecisionPolicy(precision=precision, first_last_bf16=False, min_features=0)
    return torch.compile(model, backend="deepwell", options={"policy": policy, **options})


def _quantizer_calls(run) -> int:
    """How many calls of a rowcol quantizer (either namespace) `run()` made."""
    return sum(name.endswith("_quantize_rowcol") for name in deepwell_calls(run))


def _train(precision: str, device: str, recompute: bool, steps: int = 2):
    """Losses and final weights of `steps` AdamW steps, and the quantizer calls of the last step
    (uncached: a graph loaded from a cache would not be partitioned again)."""
    model = _model(device)
    compiled = _compiled(model, precision, recompute_codes=recompute)
    return adamw_steps(compiled, model, _tokens(device), steps, _quantizer_calls)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_backward_makes_the_forwards_codes_again(precision, device):
    """With Inductor rounding every bf16 intermediate as eager does (`emulate_precision_casts`), a
    recomputed x is the forward's x to the bit, so two AdamW steps give the same bits as the saved
    codes; the quantizer runs twice per input instead of once (forward, then backward)."""
    with torch._inductor.config.patch(emulate_precision_casts=True):
        losses, weights, calls = _train(precision, device, recompute=True)
        ref_losses, ref_weights, ref_calls = _train(precision, device, recompute=False)
    assert ref_calls > 0 and calls == 2 * ref_calls
    assert torch.equal(losses, ref_losses)
    for w, r in zip(weights, ref_weights):
        assert torch.equal(w, r)


def _copies_per_graph(precision: str, device: str) -> dict[str, list[str]]:
    """The `copies` argument of every rowcol quantizer call in the forward and backward graphs
    Inductor compiles for one uncached step with `recompute_codes`, read by a post-grad pass."""
    seen = {"forward": [], "backward": []}

    def record(graph: torch.fx.Graph) -> None:
        backward = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        for n in graph.nodes:
            target = n.target
            if isinstance(target, torch._ops.OpOverload) and target._opname.endswith("_quantize_rowcol"):
                seen["backward" if backward else "forward"].append(n.args[3])

    model = _model(device)
    with torch._inductor.config.patch(post_grad_custom_post_pass=record):
        adamw_steps(_compiled(model, precision, recompute_codes=True), model, _tokens(device), 1, lambda step: step())
    return seen


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("precision", PRECISIONS)
def test_each_pass_writes_only_the_copy_its_gemms_read(precision, device):
    """The forward quantizes each input once, its row copy alone (fprop); the backward once per
    input too, its column copy alone (wgrad): the sites reading one x share one call each way
    (AOTAutograd's CSE merges their backwards' calls), and the partitioner runs the column calls in
    the backward instead of saving their outputs from the forward."""
    seen = _copies_per_graph(precision, device)
    assert seen["forward"] and set(seen["forward"]) == {"rows"}
    assert set(seen["backward"]) == {"cols"} and len(seen["backward"]) == len(seen["forward"])


def _grads(precision: str | None, recompute: bool = False) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One compiled forward and backward's loss and gradients; `precision` None: fp32 eager."""
    model = _model("cpu")
    if precision is None:
        loss = model.float()(_tokens("cpu")).square().mean()
    else:
        loss = _compiled(model, precision, recompute_codes=recompute)(_tokens("cpu")).float().square().mean()
    loss.backward()
    return loss.detach(), [p.grad.float() for p in model.parameters()]


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("precision", PRECISIONS)
def test_by_default_the_gradients_are_as_accurate_as_with_the_saved_codes(precision):
    """Inductor keeps a fused kernel's bf16 intermediates in fp32 by default, so the x the backward
    recomputes (from the residual stream, or SwiGLU's inputs) can differ from the forward's in its
    last bf16 bit, which flips the FP8 codes of the wgrad operand that sit on a rounding boundary:
    the same loss, and gradients that differ from the saved codes' by FP8 rounding (2-3% here, as
    `fp8_block_codes=False` differs, tests/compiler/test_backend.py) and are as close to fp32 eager."""
    loss, grads = _grads(precision, recompute=True)
    ref_loss, ref_grads = _grads(precision)
    _, exact = _grads(None)
    assert torch.equal(loss, ref_loss)  # the forward is the same code
    error = max(_rel(g, e) for g, e in zip(grads, exact))
    ref_error = max(_rel(g, e) for g, e in zip(ref_grads, exact))
    assert error < 0.16 and error < ref_error * 1.1


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_forward_saves_no_codes(precision):
    """Saved for the backward: less than with the codes, and no more than fp8_block's per-site
    `scaled_linear` path, which saves neither codes nor x (fp8_tensor's amax scalars aside)."""
    tokens = _tokens("cpu")

    def saved(recipe, **options):
        model = _model("cpu")
        compiled = _compiled(model, recipe, **options)
        compiled(tokens).float().square().mean().backward()  # compiles; the next call is measured
        return saved_activation_bytes(compiled, tokens, model)

    codes, recomputed = saved(precision), saved(precision, recompute_codes=True)
    per_site = saved("fp8_block", fp8_block_codes=False)
    assert recomputed < codes and recomputed <= per_site + 4 * 32  # fp8_tensor keeps each x's amax, a scalar


def test_dryrun_counts_the_smaller_saved_set():
    model = _model("cpu")
    ir = deepwell.capture(model, (_tokens("cpu"),))
    plan = deepwell.autoplan(ir, precision="fp8_block")
    saved = deepwell.dryrun(deepwell.compile(ir, plan=plan)).activations
    recomputed = deepwell.dryrun(deepwell.compile(ir, plan=plan, recompute_codes=True)).activations
    assert 0 < recomputed < saved


def test_optimize_and_compile_pass_the_option_and_the_backend_checks_its_name(monkeypatch):
    seen = []
    ir = deepwell.capture(_model("cpu"), (_tokens("cpu"),))
    monkeypatch.setattr(torch, "compile", lambda model, **kw: seen.append(kw["options"]) or model)
    deepwell.optimize(torch.nn.Identity(), precision="fp8_block", recompute_codes=True)
    deepwell.compile(ir, precision="fp8_block", recompute_codes=True)
    assert [o.recompute_codes for o in seen] == [True, True]
    monkeypatch.undo()
    torch._dynamo.reset()
    with pytest.raises(Exception, match="recompute_codes"):  # the unknown option's message lists the known ones
        torch.compile(_model("cpu"), backend="deepwell", options={"recompute_codez": True})(_tokens("cpu"))


def test_fused_mlp_leaves_the_row_copy_sites_alone():
    """`fused_mlp` fuses MLPs whose sites save x's codes (`fp8_block_linear` given both copies); with
    `recompute_codes` the sites run on row copies and the fused op, which saves its codes, would
    undo the option: nothing is fused (dryrun's `_saved_codes`, empty with the option, fuses none
    either)."""
    from deepwell.compiler import backend

    before = backend.STATS["fused_mlps"]
    model = _model("cpu")
    calls = deepwell_calls(lambda: _compiled(model, "fp8_block", recompute_codes=True, fused_mlp=True)(_tokens("cpu")))
    assert backend.STATS["fused_mlps"] == before
    assert "fp8_block_swiglu_mlp" not in calls and "fp8_block_linear" in calls
    torch._dynamo.reset()
