"""Attention sites in the plan (plan/attention.py, compiler/attention.py): the backend lists every
scaled-dot-product attention of a graph (SDPA calls, nn.MultiheadAttention, explicit matmul ->
softmax -> matmul chains) with its shapes and the kernel torch runs it with; dryrun prices it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend

import deepwell
from deepwell.compiler import backend
from deepwell.models import Llama
from deepwell.nn.attention import swap_attention
from deepwell.plan.attention import AttentionSite, Form, attention_cost, decide, sdpa_rate

B, T, HEADS, HEAD_DIM = 2, 24, 4, 16
DIM = HEADS * HEAD_DIM


class SdpaBlock(nn.Module):
    """q, k, v from one projection, then F.scaled_dot_product_attention."""

    def __init__(self, causal: bool = True):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.causal = causal

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        return self.out(o.transpose(1, 2).reshape(b, t, DIM))


class EagerBlock(nn.Module):
    """Attention written out as Hugging Face's eager attention writes it: scores, scale, additive
    causal mask, fp32 softmax, cast back, dropout, PV."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, HEADS, HEAD_DIM).permute(2, 0, 3, 1, 4)
        mask = torch.full((t, t), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        scores = torch.matmul(q, k.transpose(2, 3)) * HEAD_DIM**-0.5 + mask
        p = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        p = F.dropout(p, p=0.0, training=self.training)
        return self.out(torch.matmul(p, v).transpose(1, 2).reshape(b, t, DIM))


class MhaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x):
        t = x.shape[1]
        causal = torch.triu(torch.ones(t, t, dtype=torch.bool, device=x.device), 1)
        out, _ = self.attn(x, x, x, attn_mask=causal, is_causal=True)  # need_weights left at True
        return out


def _x(dtype=torch.float32):
    return torch.randn(B, T, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)


def _one_site(model, x, **autoplan):
    ir = deepwell.capture(model, (x,))
    assert len(ir.attention) == 1, ir.attention
    return deepwell.autoplan(ir, **autoplan)


@pytest.mark.parametrize("causal", [True, False])
def test_sdpa_call_is_a_site_with_its_shape_and_torchs_cpu_choice(causal):
    x = _x()
    plan = _one_site(SdpaBlock(causal), x, arch="cpu")
    (site,) = plan.attention
    assert site.form is Form.SDPA and site.causal is causal and site.name == ""
    assert (site.batch, site.heads, site.q_len, site.kv_len, site.head_dim) == (B, HEADS, T, T, HEAD_DIM)
    assert site.dtype == "torch.float32" and not site.masked
    q = torch.zeros(B, HEADS, T, HEAD_DIM)
    want = SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=causal))
    assert site.kernel == {SDPBackend.FLASH_ATTENTION: "flash (CPU)", SDPBackend.MATH: "math"}[want]
    table = plan.table()
    assert "1 attention sites" in table and f"{B}x{HEADS}x{T}x{T}x{HEAD_DIM}" in table and site.kernel in table
    assert plan.to_dict()["attention"][0]["shape"] == f"{B}x{HEADS}x{T}x{T}x{HEAD_DIM}"


@pytest.mark.parametrize("arch,dtype,kernel", [
    ("sm_90", torch.bfloat16, "cuDNN"),
    ("sm_100", torch.bfloat16, "cuDNN"),
    ("sm_80", torch.bfloat16, "flash"),
    ("sm_120", torch.float16, "flash"),
    ("sm_90", torch.float32, "memory-efficient"),
    ("sm_75", torch.bfloat16, "memory-efficient"),
])
def test_a_gpu_plan_names_the_kernel_torch_is_expected_to_pick(arch, dtype, kernel):
    """Made on this CPU machine for a GPU: the kernel torch's priority order puts first for the
    device and dtype, and the reason says torch chooses at run time."""
    plan = _one_site(SdpaBlock().to(dtype), _x(dtype), arch=arch)
    (site,) = plan.attention
    assert site.kernel == kernel and "chosen by torch at run time" in site.why


def test_explicit_attention_is_flagged_with_the_fix():
    x = _x(torch.bfloat16)
    plan = _one_site(EagerBlock().to(torch.bfloat16), x, arch="sm_90")
    (site,) = plan.attention
    assert site.form is Form.EXPLICIT and site.kernel.startswith("explicit") and site.masked
    assert (site.batch, site.heads, site.q_len, site.kv_len, site.head_dim) == (B, HEADS, T, T, HEAD_DIM)
    assert not site.causal  # the full square is computed, masked or not
    assert site.why.startswith("eager: misses the fused kernel") and "F.scaled_dot_product_attention" in site.why
    assert site.why in plan.table()


class BmmBlock(nn.Module):
    """nn.MultiheadAttention's explicit path as F.multi_head_attention_forward writes it (heads folded
    into the batch): baddbmm(mask, q·scale, kᵀ), softmax, dropout, bmm."""

    def forward(self, q, k, v, mask):
        scores = torch.baddbmm(mask, q * HEAD_DIM**-0.5, k.transpose(-2, -1))
        return torch.bmm(F.dropout(F.softmax(scores, dim=-1), p=0.1), v)


def test_folded_heads_explicit_attention():
    q, k, v = (torch.randn(B * HEADS, T, HEAD_DIM) for _ in range(3))
    (site,) = deepwell.capture(BmmBlock(), (q, k, v, torch.zeros(T, T))).attention
    assert site.form is Form.EXPLICIT and site.masked and site.dropout
    assert (site.batch, site.heads, site.batch_heads, site.q_len, site.kv_len, site.head_dim) == (
        None, None, B * HEADS, T, T, HEAD_DIM)
    assert site.shape == f"({B * HEADS})x{T}x{T}x{HEAD_DIM}"


def test_multihead_attention_explicit_then_sdpa_once_swapped():
    """nn.MultiheadAttention under need_weights=True computes attention explicitly (the fix names the
    swap); DeepwellMultiheadAttention runs SDPA, and torch hands it the causal hint."""
    model, x = MhaBlock(), _x()
    (site,) = _one_site(model, x, arch="cpu").attention
    assert site.form is Form.EXPLICIT and site.name == "attn" and site.module_type == "MultiheadAttention"
    assert "swaps nn.MultiheadAttention for DeepwellMultiheadAttention" in site.why
    assert (site.batch, site.heads, site.q_len, site.kv_len, site.head_dim) == (B, HEADS, T, T, HEAD_DIM)
    swap_attention(model)
    (site,) = _one_site(model, x, arch="cpu").attention
    assert site.form is Form.SDPA and site.causal and not site.masked
    assert site.module_type == "DeepwellMultiheadAttention" and site.kernel


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_hugging_face_llama_attention(impl):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=DIM, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=HEADS, num_key_value_heads=2, max_position_embeddings=64,
                                      attn_implementation=impl)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    ir = deepwell.capture(model, seq_len=T, batch_size=B)
    plan = deepwell.autoplan(ir, arch="sm_90")
    assert [a.name for a in plan.attention] == ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    for site in plan.attention:
        assert (site.batch, site.heads, site.q_len, site.kv_len, site.head_dim) == (B, HEADS, T, T, HEAD_DIM)
        if impl == "eager":
            assert site.form is Form.EXPLICIT and "attn_implementation='sdpa'" in site.why
        else:
            assert site.form is Form.SDPA and site.causal and site.kernel == "cuDNN" and site.kv_heads == 2


def test_backend_plans_attention_and_optimize_counts_it(capsys):
    torch._dynamo.reset()
    model, x = SdpaBlock(), _x()
    compiled = deepwell.optimize(model, verbose=True)
    compiled(x)
    out = capsys.readouterr().out
    plan = backend.last_plan()
    assert len(plan.attention) == 1 and plan.attention[0].q_len == T
    assert "1 attention sites" in out and f"attention sites: 1 (not rewritten: torch runs them) by kernel: 1 {plan.attention[0].kernel}" in out


def _site(t: int, causal: bool = True, form: Form = Form.SDPA, dtype: str = "torch.bfloat16") -> AttentionSite:
    return AttentionSite("s", "", form, B * HEADS, t, t, 128, causal, dtype, "cuda:0", batch=B, heads=HEADS)


def test_attention_cost_is_quadratic_in_t_and_half_when_causal():
    """Within one measured rate (keys up to 2048: the shortest measured length's), time is FLOPs
    over a constant: 4x for twice the sequence, half for a causal site; the FLOPs are
    3.5 x 4·B·H·T²·D (forward and backward)."""
    t = 512
    cost = lambda *sites: attention_cost(list(sites), "sm_90").ms  # noqa: E731
    assert cost(_site(2 * t)) == pytest.approx(4 * cost(_site(t)))
    assert cost(_site(t, causal=True)) == pytest.approx(cost(_site(t, causal=False)) / 2)
    assert attention_cost([_site(t, causal=False)], "sm_90").flops == pytest.approx(3.5 * 4 * B * HEADS * t * t * 128)
    rate, source = sdpa_rate("sm_90", t)
    assert rate == 384.0 and "measured" in source and "borrowed" not in source
    assert "borrowed" in sdpa_rate("sm_100", t)[1]
    # Longer keys run at a higher measured rate (interpolated in log2 T between the measured ones):
    # 4x the FLOPs, less than 4x the time.
    assert sdpa_rate("sm_90", 8192)[0] == 524.0 and sdpa_rate("sm_90", 4096)[0] == pytest.approx((384 + 524) / 2)
    assert cost(_site(8192)) / cost(_site(4096)) == pytest.approx(4 * (384 + 524) / 2 / 524)
    # Explicit attention costs more than the fused kernel at the same shape, causal or not.
    assert cost(_site(t, causal=False, form=Form.EXPLICIT)) > cost(_site(t, causal=False))


def test_saved_bytes_fused_against_explicit():
    fused, explicit = _site(T), _site(T, form=Form.EXPLICIT)
    rows = B * HEADS * T
    assert fused.saved_bytes() == rows * 128 * 2 + rows * 4  # out (bf16) + logsumexp (fp32)
    assert explicit.saved_bytes() == rows * 128 * 2 + rows * T * 2  # out + the probabilities


def test_seq_len_feeds_the_plan_and_dryrun():
    """optimize's training shape sets the attention sites' lengths; dryrun's attention time grows
    4x for twice the sequence (both under the shortest measured length), and is in the step."""
    estimates, plans = [], []
    for seq in (32, 64):
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = Llama(256, 64, 2, 4, 128, max_seq=128).to(torch.bfloat16)
        compiled = deepwell.optimize(model, seq_len=seq, batch_size=2, options=deepwell.CompileOptions(arch="sm_90"))
        engine = compiled.deepwell_engine
        plans.append(engine.plan)
        estimates.append(deepwell.dryrun(compiled))
    for plan, seq in zip(plans, (32, 64)):
        assert len(plan.attention) == 2 and all(a.q_len == a.kv_len == seq and a.causal for a in plan.attention)
    short, long = estimates
    assert long.attention_ms == pytest.approx(4 * short.attention_ms)
    assert short.attention_sites == 2 and 0 < short.attention_ms < short.step_ms
    assert short.bf16_step_ms - short.attention_ms > 0
    assert 0 < short.attention_bytes <= short.activations
    assert "attention: 2 sites" in str(short)


def test_autoplan_scales_attention_to_the_training_shape():
    torch.manual_seed(0)
    model = Llama(256, 64, 2, 4, 128, max_seq=128)
    ir = deepwell.capture(model, seq_len=32, batch_size=2)
    plan = deepwell.autoplan(ir, seq_len=4096, global_batch=8, arch="sm_90")
    assert all((a.batch, a.q_len, a.kv_len, a.batch_heads) == (8, 4096, 4096, 8 * 4) for a in plan.attention)
    assert [(a.q_len, a.batch) for a in ir.attention] == [(32, 2)] * 2  # the IR keeps the captured shape


@pytest.mark.gpu
@pytest.mark.parametrize("heads,seq,head_dim", [(16, 2048, 128), (8, 512, 64)])
def test_gpu_plan_names_the_kernel_torch_picks(heads, seq, head_dim):
    """On this GPU, for bf16 causal SDPA: the plan's kernel is the one torch's dispatcher selects for
    the site's shapes (`torch._fused_sdp_choice` on CUDA tensors of those shapes)."""
    names = {SDPBackend.CUDNN_ATTENTION: "cuDNN", SDPBackend.FLASH_ATTENTION: "flash",
             SDPBackend.EFFICIENT_ATTENTION: "memory-efficient", SDPBackend.MATH: "math"}
    major, minor = torch.cuda.get_device_capability()
    arch = f"sm_{major}{minor}"
    q = torch.randn(2, heads, seq, head_dim, device="cuda", dtype=torch.bfloat16)
    site = AttentionSite("s", "", Form.SDPA, 2 * heads, seq, seq, head_dim, True, "torch.bfloat16", "cuda:0",
                         batch=2, heads=heads)
    decide(site, arch)
    assert site.kernel == names[SDPBackend(torch._fused_sdp_choice(q, q, q, is_causal=True))], site.why
