"""deepwell.nn.DeepwellMultiheadAttention against torch.nn.MultiheadAttention: the same outputs and
gradients (fp32 to 1e-5 relative; bf16 within bf16 rounding) with every mask kind, batch_first both
ways and the module's rare options; (output, None) unless need_weights=True is passed, then the
exact weights; state dicts load both ways; swap_attention / deepwell.optimize on whole models
(nn.MultiheadAttention and Hugging Face eager attention), the report of what was kept, and the
module under torch.compile(backend="deepwell")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import deepwell
from deepwell.nn.attention import DeepwellMultiheadAttention, attention_report, swap_attention

E, H, L, S, B = 32, 4, 12, 12, 3


def _pair(dtype=torch.float32, **kw):
    torch.manual_seed(0)
    ref = nn.MultiheadAttention(E, H, **kw).to(dtype)
    with torch.no_grad():  # non-zero biases, so their gradients are compared too
        for p in ref.parameters():
            if p.dim() == 1:
                p.normal_(0, 0.1)
    return ref, DeepwellMultiheadAttention.from_module(ref)


def _inputs(batch_first, dtype=torch.float32, kdim=E, vdim=E, self_attention=True):
    g = torch.Generator().manual_seed(1)
    shape = (B, L, E) if batch_first else (L, B, E)
    q = torch.randn(*shape, generator=g).to(dtype)
    if self_attention:
        return q, q, q
    kshape = (B, S) if batch_first else (S, B)
    return q, torch.randn(*kshape, kdim, generator=g).to(dtype), torch.randn(*kshape, vdim, generator=g).to(dtype)


def _masks(kind, dtype=torch.float32):
    """(attn_mask, key_padding_mask, is_causal) in nn.MultiheadAttention's conventions (bool: True =
    masked out; float: added to the scores)."""
    g = torch.Generator().manual_seed(2)
    causal = torch.triu(torch.ones(L, S, dtype=torch.bool), 1)
    padding = torch.zeros(B, S, dtype=torch.bool)
    padding[0, -3:] = True
    padding[2, -1] = True
    bias = torch.randn(L, S, generator=g).to(dtype)
    return {
        "none": (None, None, False),
        "attn_bool": (causal, None, False),
        "attn_float": (bias, None, False),
        "attn_3d_bool": (torch.rand(B * H, L, S, generator=g) < 0.3, None, False),
        "causal": (causal, None, True),
        "padding_bool": (None, padding, False),
        "padding_float": (None, torch.zeros(B, S, dtype=dtype).masked_fill(padding, float("-inf")), False),
        "causal_and_padding": (causal, padding, True),
        "float_and_padding": (bias, torch.zeros(B, S, dtype=dtype).masked_fill(padding, -1e4), False),
    }[kind]


def _run(module, inputs, **kw):
    """Output and the gradients of the inputs and parameters for a fixed output gradient."""
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    if inputs[0] is inputs[1] is inputs[2]:
        leaves = [leaves[0]] * 3
    out, weights = module(*leaves, **kw)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    module.zero_grad(set_to_none=True)
    out.backward(dy)
    grads = [leaves[0].grad] + ([] if leaves[1] is leaves[0] else [leaves[1].grad, leaves[2].grad])
    grads += [p.grad for _, p in sorted(module.named_parameters())]
    return out.detach(), weights, grads


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


MASKS = ["none", "attn_bool", "attn_float", "attn_3d_bool", "causal", "padding_bool", "padding_float",
         "causal_and_padding", "float_and_padding"]


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", MASKS)
def test_fp32_outputs_and_gradients_match(batch_first, mask):
    ref, dw = _pair(batch_first=batch_first)
    attn_mask, kpm, is_causal = _masks(mask)
    kw = dict(attn_mask=attn_mask, key_padding_mask=kpm, is_causal=is_causal)
    out_r, w_r, g_r = _run(ref.train(), _inputs(batch_first), **kw)
    out_d, w_d, g_d = _run(dw.train(), _inputs(batch_first), **kw)
    assert w_r is not None and w_d is None  # the one difference: no weights unless asked for
    assert _rel(out_d, out_r) < 1e-5
    for a, b in zip(g_d, g_r):
        assert _rel(a, b) < 1e-5


@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("mask", ["none", "causal", "causal_and_padding"])
def test_bf16_within_bf16_rounding(batch_first, mask):
    """Both modules in bf16 against the fp32 module: the drop-in's error is bf16 rounding's, no larger
    than the explicit path's (which rounds the (L, S) scores and probabilities to bf16 too)."""
    ref32, _ = _pair(batch_first=batch_first)
    ref, dw = _pair(torch.bfloat16, batch_first=batch_first)
    attn_mask, kpm, is_causal = _masks(mask)
    kw = dict(attn_mask=attn_mask, key_padding_mask=kpm, is_causal=is_causal)
    exact = _run(ref32.train(), _inputs(batch_first), **kw)
    explicit = _run(ref.train(), _inputs(batch_first, torch.bfloat16), **kw)
    sdpa = _run(dw.train(), _inputs(batch_first, torch.bfloat16), **kw)
    for d, r, x in zip([sdpa[0], *sdpa[2]], [explicit[0], *explicit[2]], [exact[0], *exact[2]]):
        assert d.dtype == torch.bfloat16
        assert _rel(d, x) < 2e-2
        assert _rel(d, x) <= 2 * _rel(r, x) + 4e-3


@pytest.mark.parametrize("options", [dict(add_bias_kv=True), dict(add_zero_attn=True), dict(kdim=20, vdim=24),
                                     dict(bias=False), dict(add_bias_kv=True, add_zero_attn=True, kdim=20, vdim=24)])
@pytest.mark.parametrize("batch_first", [True, False])
def test_rare_options_are_swapped_and_match(options, batch_first):
    """The rare options run in torch's own need_weights=False branch too, so they are swapped."""
    ref, dw = _pair(batch_first=batch_first, **options)
    self_attn = "kdim" not in options
    inputs = _inputs(batch_first, kdim=options.get("kdim", E), vdim=options.get("vdim", E), self_attention=self_attn)
    padding = _masks("padding_bool")[1]
    out_r, _, g_r = _run(ref.train(), inputs, key_padding_mask=padding)
    out_d, w_d, g_d = _run(dw.train(), inputs, key_padding_mask=padding)
    assert w_d is None and _rel(out_d, out_r) < 1e-5
    for a, b in zip(g_d, g_r):
        assert _rel(a, b) < 1e-5
    model = nn.Sequential(nn.MultiheadAttention(E, H, batch_first=batch_first, **options))
    assert swap_attention(model) == 1 and isinstance(model[0], DeepwellMultiheadAttention)


def test_unbatched_input():
    ref, dw = _pair()
    x = torch.randn(L, E)
    mask = _masks("causal")[0]
    assert _rel(dw(x, x, x, attn_mask=mask)[0], ref(x, x, x, attn_mask=mask)[0]) < 1e-5


@pytest.mark.parametrize("average", [True, False])
def test_need_weights_true_returns_the_exact_weights(average):
    ref, dw = _pair(batch_first=True)
    x = _inputs(True)[0]
    attn_mask, kpm, _ = _masks("causal_and_padding")
    out_r, w_r = ref(x, x, x, key_padding_mask=kpm, attn_mask=attn_mask, average_attn_weights=average)
    out_d, w_d = dw(x, x, x, key_padding_mask=kpm, need_weights=True, attn_mask=attn_mask, average_attn_weights=average)
    assert torch.equal(out_d, out_r) and torch.equal(w_d, w_r)
    assert w_d.shape == ((B, L, S) if average else (B, H, L, S))
    # positionally, as nn.MultiheadAttention's signature orders it
    assert torch.equal(dw(x, x, x, kpm, True, attn_mask)[1], ref(x, x, x, kpm, True, attn_mask)[1])
    assert dw(x, x, x, kpm, False, attn_mask)[1] is None


def test_dropout_in_train_mode_only():
    ref, dw = _pair(batch_first=True, dropout=0.5)
    x = _inputs(True)[0]
    torch.manual_seed(0)
    a = dw.train()(x, x, x)[0]
    b = dw(x, x, x)[0]
    assert not torch.allclose(a, b)  # dropout is on, with fresh draws per call
    with torch.no_grad():
        evald = dw.eval()(x, x, x)[0]
        assert _rel(evald, ref.eval()(x, x, x, need_weights=False)[0]) < 1e-5
    assert _rel(dw.eval()(x, x, x)[0], ref.eval()(x, x, x)[0]) < 1e-5


def test_state_dict_round_trip_both_ways():
    ref, dw = _pair(batch_first=True, add_bias_kv=True)
    assert list(dw.state_dict()) == list(ref.state_dict())
    fresh_dw = DeepwellMultiheadAttention(E, H, batch_first=True, add_bias_kv=True)
    fresh_dw.load_state_dict(ref.state_dict())
    fresh_ref = nn.MultiheadAttention(E, H, batch_first=True, add_bias_kv=True)
    fresh_ref.load_state_dict(fresh_dw.state_dict())
    x = _inputs(True)[0]
    out = ref(x, x, x)[0]
    assert _rel(fresh_dw(x, x, x)[0], out) < 1e-5
    assert torch.equal(fresh_ref(x, x, x)[0], out)


class _Block(nn.Module):
    def __init__(self, attention):
        super().__init__()
        self.norm = nn.LayerNorm(E)
        self.attn = attention

    def forward(self, x):
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool, device=x.device), 1)
        out, _ = self.attn(self.norm(x), self.norm(x), self.norm(x), attn_mask=mask, is_causal=True)
        return x + out


class _OwnForward(nn.MultiheadAttention):
    def forward(self, *args, **kw):
        out, w = super().forward(*args, **kw)
        return out * 2, w


def _model(kept=False):
    torch.manual_seed(0)
    blocks = [_Block(nn.MultiheadAttention(E, H, batch_first=True)) for _ in range(2)]
    if kept:
        blocks.append(_Block(_OwnForward(E, H, batch_first=True)))
    return nn.Sequential(*blocks, nn.Linear(E, E))


def test_swap_attention_shares_parameters_and_reports_what_it_kept():
    model = _model(kept=True)
    x = torch.randn(B, L, E)
    before = model(x)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)  # built before the swap: it must still train the model
    assert swap_attention(model) == 2
    assert [type(b.attn) for b in model[:3]] == [DeepwellMultiheadAttention] * 2 + [_OwnForward]
    assert list(model.parameters()) == params and all(a is b for a, b in zip(model.parameters(), params))
    assert _rel(model(x), before) < 1e-5
    model(x).square().mean().backward()
    w = model[0].attn.in_proj_weight.detach().clone()
    opt.step()
    assert not torch.equal(w, model[0].attn.in_proj_weight)
    report = attention_report(model)
    assert report.swapped == ["0.attn", "1.attn"]
    assert report.kept == {"2.attn": "_OwnForward overrides nn.MultiheadAttention.forward"}
    assert swap_attention(model) == 0  # nothing left to swap
    kept = _model()
    assert swap_attention(kept, keep_attention_weights=True) == 0
    assert attention_report(kept, True).kept == {"0.attn": "keep_attention_weights=True",
                                                 "1.attn": "keep_attention_weights=True"}


def test_training_loss_matches_after_swap():
    """A few SGD steps of the same model, both ways: the same losses (fp32)."""
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(5))
    losses = []
    for swap in (False, True):
        model = _model()
        if swap:
            swap_attention(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        run = []
        for _ in range(3):
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_optimize_verbose_reports_the_swap(capsys):
    model = _model(kept=True)
    x = torch.randn(B, L, E)
    before = model(x).detach()
    compiled = deepwell.optimize(model, verbose=True)
    out = capsys.readouterr().out
    assert "2 nn.MultiheadAttention -> deepwell.nn.DeepwellMultiheadAttention" in out
    assert "need_weights=True" in out
    assert "kept 2.attn: _OwnForward overrides nn.MultiheadAttention.forward" in out
    assert isinstance(model[0].attn, DeepwellMultiheadAttention)
    y = compiled(x)
    assert _rel(y.detach(), before) < 1e-5
    y.sum().backward()
    summary = capsys.readouterr().out
    assert "attention: 2 nn.MultiheadAttention -> deepwell.nn.DeepwellMultiheadAttention" in summary
    plain = _model()
    deepwell.optimize(plain, keep_attention_weights=True, verbose=True)
    assert "kept 0.attn: keep_attention_weights=True" in capsys.readouterr().out
    assert type(plain[0].attn) is nn.MultiheadAttention


def test_under_torch_compile_deepwell_backend():
    torch._dynamo.reset()
    model = _model()
    swap_attention(model)
    x = torch.randn(B, L, E, requires_grad=True)
    eager_out = model(x)
    eager_out.square().mean().backward()
    eager_grads = [x.grad.clone()] + [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    x.grad = None
    compiled = torch.compile(model, backend="deepwell")
    out = compiled(x)
    out.square().mean().backward()
    assert _rel(out.detach(), eager_out.detach()) < 1e-5
    for a, b in zip([x.grad] + [p.grad for p in model.parameters()], eager_grads):
        assert _rel(a, b) < 1e-4


def test_hugging_face_eager_attention_switched_to_sdpa(capsys):
    transformers = pytest.importorskip("transformers")

    def eager_llama():  # a config each: set_attn_implementation changes the model's config in place
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=97,
                                          max_position_embeddings=64, attn_implementation="eager")
        return transformers.LlamaForCausalLM(config)

    torch.manual_seed(0)
    model = eager_llama().eval()
    tokens = torch.randint(0, 97, (2, 16))
    before = model(tokens).logits
    assert model.config._attn_implementation == "eager"
    assert swap_attention(model) == 1
    assert model.config._attn_implementation == "sdpa" and model.model.config._attn_implementation == "sdpa"
    assert _rel(model(tokens).logits, before) < 1e-5
    assert attention_report(model).switched == [""] and attention_report(model).kept == {}
    other = eager_llama()
    deepwell.optimize(other, verbose=True)
    assert "1 Hugging Face model(s) switched from eager attention to sdpa" in capsys.readouterr().out
    kept = eager_llama()
    assert swap_attention(kept, keep_attention_weights=True) == 0
    assert attention_report(kept, True).kept == {"": "Hugging Face eager attention, keep_attention_weights=True"}
