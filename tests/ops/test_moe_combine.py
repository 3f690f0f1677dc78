"""The fused MoE value moves (deepwell.moe_gather_rows, moe_sum_slots, moe_slot_dots; Rust
rust/ops/src/ops/moe/combine*.rs, CUDA cuda/moe.cuh) against the pure-torch formulas they replaced
(kept in ops/moe.py as its float64 path: the slow, obviously correct reference): the same bits for the gathers and the
k-order sums, the documented fixed order for the dots, through moe_dispatch / moe_combine's forward
and backward; dropped slots, padding rows, zero-token experts, K = 1, D off the vector width;
errors; torch.compile; and (GPU) the CUDA kernels bit-identical to the CPU reference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import deepwell
from _util import same_bits

ops = torch.ops.deepwell
F = (torch.float32, torch.bfloat16, torch.float16)

# ---------------------------------------------------------------------------------------------
# The reference: the pure-torch formulas the fused ops replaced. ops/moe.py keeps them as its
# float64 path (and they are not what the fused ops run), so they are imported, not copied.

from deepwell.ops.moe import _acc as old_acc  # noqa: E402
from deepwell.ops.moe import _gather_rows as old_gather_rows  # noqa: E402
from deepwell.ops.moe import _sum_slots as old_sum_slots  # noqa: E402
from deepwell.ops.moe import _tokens as old_tokens  # noqa: E402


def old_dispatch(x, slot_of_row, k):
    return old_gather_rows(x, old_tokens(slot_of_row, k))


def old_d_rows(grad, weights, slot_of_row, k, dtype):
    acc = old_acc(dtype)
    w_row = old_gather_rows(weights.reshape(-1, 1).to(acc), slot_of_row)
    return (old_gather_rows(grad.to(acc), old_tokens(slot_of_row, k)) * w_row).to(dtype)


def old_d_weights(rows, row_of_slot, grad, wdtype):
    acc = old_acc(torch.promote_types(rows.dtype, wdtype))
    g = grad.to(acc)
    cols = [(old_gather_rows(rows, row_of_slot[:, j]).to(acc) * g).sum(-1) for j in range(row_of_slot.shape[1])]
    return torch.stack(cols, dim=1).to(wdtype)


def dots_in_kernel_order(rows, row_of_slot, grad):
    """cuda/moe.cuh moe_slot_dots' documented order in float32 numpy (every op rounds): lane l sums
    the chunks c ≡ l (mod 32) of 8 elements, then p[l] += p[l + off] for off = 16 .. 1. Padding the
    row with zeros adds +0 products, which leave a lane's sum unchanged (a sum of floats rounded to
    nearest is never -0 when it starts at +0)."""
    t, k = row_of_slot.shape
    d = rows.shape[1]
    rounds = -(-d // 256)
    x = np.zeros((t * k, rounds * 256), np.float32)
    g = np.zeros((t * k, rounds * 256), np.float32)
    ros = row_of_slot.reshape(-1).numpy()
    x[:, :d] = rows.float().numpy()[np.clip(ros, 0, None)]
    g[:, :d] = np.repeat(grad.float().numpy(), k, axis=0)
    x, g = x.reshape(t * k, rounds, 32, 8), g.reshape(t * k, rounds, 32, 8)
    p = np.zeros((t * k, 32), np.float32)
    for r in range(rounds):
        for j in range(8):
            p = p + x[:, r, :, j] * g[:, r, :, j]
    off = 16
    while off:
        p[:, :off] = p[:, :off] + p[:, off : 2 * off]
        off //= 2
    out = np.where(ros >= 0, p[:, 0], np.float32(0.0)).astype(np.float32)
    return torch.from_numpy(out.reshape(t, k))


# ---------------------------------------------------------------------------------------------
# Layouts


def layout(t, k, e, align=1, cf=0.0, seed=0):
    """(row_of_slot, slot_of_row) of a random routing; cf > 0 drops assignments."""
    g = torch.Generator().manual_seed(seed)
    experts, dropped, *_ = deepwell.moe_route(torch.randn(t, e, generator=g), None, k, "softmax", 0, 0, cf)
    row_of_slot, slot_of_row, _ = deepwell.moe_permute_index(experts, dropped, e, align)
    return row_of_slot, slot_of_row


LAYOUTS = {
    "plain": dict(t=19, k=2, e=4),
    "dropped+padding": dict(t=23, k=3, e=8, align=8, cf=0.5),
    "zero-token experts": dict(t=3, k=2, e=16, align=4),
    "k1": dict(t=17, k=1, e=4, align=2, cf=0.7),
    "k8": dict(t=9, k=8, e=16, align=4, cf=1.0),
}
DIMS = [16, 13, 1, 300]  # vector widths (8 bf16 / 4 fp32), off them (scalar), one, a long row


def rand(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def weights(t, k, seed):
    # Router weights are non-negative (softmax / sigmoid); a dropped slot then adds (+0) · w = +0
    # in the old formula too, signed zeros included.
    return torch.rand(t, k, generator=torch.Generator().manual_seed(seed))


def every_layout(test):
    """`test` for every routing layout, width and dtype."""
    for args in (("dtype", F), ("d", DIMS), ("name", LAYOUTS)):
        test = pytest.mark.parametrize(*args)(test)
    return test


@every_layout
def test_sum_slots_is_the_old_k_order_sum(name, d, dtype):
    row_of_slot, slot_of_row = layout(**LAYOUTS[name])
    t, k = row_of_slot.shape
    rows = rand(slot_of_row.shape[0], d, dtype=dtype, seed=1)
    w = weights(t, k, 2)
    assert same_bits(ops.moe_sum_slots(rows, row_of_slot, w), old_sum_slots(rows, row_of_slot, w).to(dtype))
    assert same_bits(ops.moe_sum_slots(rows, row_of_slot, None), old_sum_slots(rows, row_of_slot, None).to(dtype))


@every_layout
def test_gather_rows_is_the_old_gather(name, d, dtype):
    row_of_slot, slot_of_row = layout(**LAYOUTS[name])
    t, k = row_of_slot.shape
    x = rand(t, d, dtype=dtype, seed=3)
    w = weights(t, k, 4)
    got = ops.moe_gather_rows(x, slot_of_row, None, k)
    assert same_bits(got, old_dispatch(x, slot_of_row, k))
    assert torch.all(got[slot_of_row < 0] == 0)
    assert same_bits(ops.moe_gather_rows(x, slot_of_row, w, k), old_d_rows(x, w, slot_of_row, k, dtype))


@every_layout
def test_slot_dots_follow_the_documented_order(name, d, dtype):
    row_of_slot, slot_of_row = layout(**LAYOUTS[name])
    t, k = row_of_slot.shape
    rows = rand(slot_of_row.shape[0], d, dtype=dtype, seed=5)
    grad = rand(t, d, dtype=dtype, seed=6)
    got = ops.moe_slot_dots(rows, row_of_slot, grad)
    assert got.dtype == torch.float32 and got.shape == (t, k)
    assert same_bits(got, dots_in_kernel_order(rows, row_of_slot, grad))
    # The old formula summed in torch's order: the same dots up to fp32 rounding.
    torch.testing.assert_close(got, old_d_weights(rows, row_of_slot, grad, torch.float32), rtol=1e-5, atol=1e-5)
    assert torch.all(got[row_of_slot < 0] == 0)


def test_the_dots_order_is_not_sequential():
    """A row where the lanes and a left-to-right sum round differently: the op follows the lanes."""
    rows = torch.zeros(1, 16)
    rows[0, 0], rows[0, 1], rows[0, 8], rows[0, 9] = 2.0**24, 1.0, 1.0, 1.0
    ros = torch.zeros(1, 1, dtype=torch.int32)
    # Lane 0 (chunk 0): 2^24 + 1 rounds to 2^24; lane 1 (chunk 1): 1 + 1 = 2; the tree: 2^24 + 2,
    # exact. Left to right, each + 1 would round away: 2^24.
    assert ops.moe_slot_dots(rows, ros, torch.ones(1, 16)).item() == 2.0**24 + 2


@pytest.mark.parametrize("name", ["plain", "dropped+padding", "k1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_and_combine_forward_and_backward_match_the_old_formulas(name, dtype):
    row_of_slot, slot_of_row = layout(**LAYOUTS[name])
    t, k = row_of_slot.shape
    d = 24
    x = rand(t, d, dtype=dtype, seed=7).requires_grad_()
    w = weights(t, k, 8).requires_grad_()
    xp = deepwell.moe_dispatch(x, slot_of_row, row_of_slot)
    rows = (xp.float() * 1.5).to(dtype)  # the experts
    rows.retain_grad()
    y = deepwell.moe_combine(rows, w, row_of_slot, slot_of_row)
    gy = rand(t, d, dtype=dtype, seed=9)
    y.backward(gy)

    assert same_bits(xp, old_dispatch(x.detach(), slot_of_row, k))
    assert same_bits(y, old_sum_slots(rows.detach(), row_of_slot, w.detach()).to(dtype))
    want_d_rows = old_d_rows(gy, w.detach(), slot_of_row, k, dtype)
    assert same_bits(rows.grad, want_d_rows)
    torch.testing.assert_close(w.grad, old_d_weights(rows.detach(), row_of_slot, gy, torch.float32), rtol=1e-5, atol=1e-5)
    assert same_bits(w.grad, dots_in_kernel_order(rows.detach(), row_of_slot, gy))
    d_xp = (want_d_rows.float() * 1.5).to(dtype)
    assert same_bits(x.grad, old_sum_slots(d_xp, row_of_slot, None).to(dtype))


def test_float64_keeps_the_torch_path_and_its_gradients():
    row_of_slot, slot_of_row = layout(**LAYOUTS["dropped+padding"])
    t, k = row_of_slot.shape
    x = rand(t, 6, dtype=torch.float64, seed=10).requires_grad_()
    w = weights(t, k, 11).double().requires_grad_()

    def f(x, w):
        return deepwell.moe_combine(deepwell.moe_dispatch(x, slot_of_row, row_of_slot) * 2, w, row_of_slot, slot_of_row)

    torch.autograd.gradcheck(f, (x, w))


def test_strided_inputs_give_the_contiguous_bits():
    row_of_slot, slot_of_row = layout(**LAYOUTS["dropped+padding"])
    t, k = row_of_slot.shape
    rows = rand(16, slot_of_row.shape[0], dtype=torch.bfloat16, seed=12).t()  # (R, 16), transposed
    w = weights(k, t, 13).t()
    grad = rand(16, t, dtype=torch.bfloat16, seed=14).t()
    ros = row_of_slot.t().contiguous().t()
    assert same_bits(ops.moe_sum_slots(rows, ros, w), ops.moe_sum_slots(rows.contiguous(), row_of_slot, w.contiguous()))
    assert same_bits(ops.moe_slot_dots(rows, ros, grad), ops.moe_slot_dots(rows.contiguous(), row_of_slot, grad.contiguous()))
    assert same_bits(ops.moe_gather_rows(grad, slot_of_row, w, k), ops.moe_gather_rows(grad.contiguous(), slot_of_row, w.contiguous(), k))


def test_compiled_dispatch_and_combine_equal_eager():
    row_of_slot, slot_of_row = layout(**LAYOUTS["dropped+padding"])
    t, k = row_of_slot.shape
    x0 = rand(t, 16, dtype=torch.bfloat16, seed=15)
    w0 = weights(t, k, 16)

    def step(x, w):
        return deepwell.moe_combine(deepwell.moe_dispatch(x, slot_of_row, row_of_slot) * 2, w, row_of_slot, slot_of_row)

    def run(f):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = f(x, w)
        y.float().square().sum().backward()  # the compiled graph's backward (AOT autograd)
        return y, x.grad, w.grad

    torch._dynamo.reset()
    for a, b in zip(run(step), run(torch.compile(step, fullgraph=True, backend="aot_eager"))):
        assert same_bits(a, b)


# ---------------------------------------------------------------------------------------------
# Errors: a RuntimeError naming op, argument, expectation and value, the same from the fake kernel.

_ROS = torch.tensor([[0, 1], [2, -1]], dtype=torch.int32)
_SOR = torch.tensor([0, 1, 2, -1], dtype=torch.int32)


def _good(op):
    rows = torch.zeros(4, 8)
    return {
        "moe_gather_rows": dict(src=torch.zeros(2, 8), index=_SOR, weights=torch.ones(2, 2), top_k=2),
        "moe_sum_slots": dict(rows=rows, row_of_slot=_ROS, weights=torch.ones(2, 2)),
        "moe_slot_dots": dict(rows=rows, row_of_slot=_ROS, grad=torch.zeros(2, 8)),
    }[op]


BAD = [
    ("moe_sum_slots", dict(rows=torch.zeros(4, 8, dtype=torch.float64)), "argument 'rows' must have dtype torch.float32 or torch.bfloat16 or torch.float16, got torch.float64"),
    ("moe_sum_slots", dict(row_of_slot=_ROS.long()), "argument 'row_of_slot' must have dtype torch.int32, got torch.int64"),
    ("moe_sum_slots", dict(rows=torch.zeros(4)), "argument 'rows' must be 2-d (rows, hidden), got a 1-d tensor"),
    ("moe_sum_slots", dict(weights=torch.ones(2, 3)), "argument 'weights' must have shape [2, 2], got [2, 3]"),
    ("moe_sum_slots", dict(weights=torch.ones(2, 2, dtype=torch.bfloat16)), "argument 'weights' must have dtype torch.float32, got torch.bfloat16"),
    ("moe_sum_slots", dict(rows=torch.zeros(0, 8)), "argument 'rows' must be non-empty, got shape [0, 8]"),
    ("moe_slot_dots", dict(grad=torch.zeros(2, 8, dtype=torch.bfloat16)), "argument 'grad' must have dtype torch.float32, got torch.bfloat16"),
    ("moe_slot_dots", dict(grad=torch.zeros(3, 8)), "argument 'grad' must have shape [2, 8], got [3, 8]"),
    ("moe_gather_rows", dict(index=_SOR.reshape(2, 2)), "argument 'index' must be 1-d (rows), got a 2-d tensor"),
    ("moe_gather_rows", dict(top_k=0), "argument 'top_k' must be positive, got 0"),
    ("moe_gather_rows", dict(weights=torch.ones(4)), "argument 'weights' must have shape [2, 2], got [4]"),
    ("moe_gather_rows", dict(src=torch.zeros(2, 8, dtype=torch.int32)), "argument 'src' must have dtype"),
]


@pytest.mark.parametrize("op,bad,message", BAD, ids=[f"{o}-{m[:40]}" for o, _, m in BAD])
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_errors_are_the_same_in_rust_and_in_the_fake(op, bad, message, device):
    kw = {**_good(op), **bad}
    kw = {n: v.to(device) if isinstance(v, torch.Tensor) else v for n, v in kw.items()}
    with pytest.raises(RuntimeError, match=f"deepwell.{op}: ") as e:
        getattr(ops, op)(**kw)
    assert message in str(e.value)


OUT_OF_RANGE = [
    ("moe_sum_slots", dict(row_of_slot=torch.tensor([[0, 1], [4, -1]], dtype=torch.int32)), "argument 'row_of_slot' must hold -1 or rows in [0, 4), got 4 at [2]"),
    ("moe_sum_slots", dict(row_of_slot=torch.tensor([[0, -2], [1, 2]], dtype=torch.int32)), "got -2 at [1]"),
    ("moe_slot_dots", dict(row_of_slot=torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)), "argument 'row_of_slot' must hold -1 or rows in [0, 4), got 9 at [3]"),
    ("moe_gather_rows", dict(index=torch.tensor([0, 4, 2, -1], dtype=torch.int32)), "argument 'index' must hold -1 or slots in [0, 4), got 4 at [1]"),
    ("moe_gather_rows", dict(index=torch.tensor([0, 1, 2, -2**31], dtype=torch.int32)), "got -2147483648 at [3]"),
]


@pytest.mark.parametrize("op,bad,message", OUT_OF_RANGE, ids=[m[-20:] for _, _, m in OUT_OF_RANGE])
def test_out_of_range_indices_raise_on_the_cpu(op, bad, message):
    with pytest.raises(RuntimeError, match=f"deepwell.{op}: ") as e:
        getattr(ops, op)(**{**_good(op), **bad})
    assert message in str(e.value)


def test_meta_shapes():
    m = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in _good("moe_slot_dots").items()}
    assert ops.moe_slot_dots(**m).shape == (2, 2) and ops.moe_slot_dots(**m).dtype == torch.float32
    m = {n: v.to("meta") if isinstance(v, torch.Tensor) else v for n, v in _good("moe_gather_rows").items()}
    assert ops.moe_gather_rows(**m).shape == (4, 8)


# ---------------------------------------------------------------------------------------------
# GPU: the CUDA kernels give the CPU reference's bits (run on an H100 by whoever has one).

GPU_CASES = [
    dict(t=512, k=8, e=64, align=16, d=2048),  # vector path, the E64 layer's shape family
    dict(t=300, k=8, e=64, align=1, cf=1.0, d=256),  # dropped slots
    dict(t=37, k=1, e=8, align=8, cf=0.7, d=13),  # scalar path, K = 1
    dict(t=5, k=2, e=32, align=4, d=4),  # zero-token experts; fp32 vector, bf16 scalar
    dict(t=64, k=4, e=8, align=1, d=1000),  # 1000 % 8 == 0 but not a multiple of 256: partial lanes
    dict(t=40, k=2, e=8, align=2, d=300),  # 300 % 8 != 0: dots' scalar path, partial chunks
]


def _gpu_inputs(case, dtype, seed=0):
    case = dict(case)
    d = case.pop("d")
    row_of_slot, slot_of_row = layout(**case, seed=seed)
    t, k = row_of_slot.shape
    rows = rand(slot_of_row.shape[0], d, dtype=dtype, seed=seed + 1)
    x = rand(t, d, dtype=dtype, seed=seed + 2)
    w = weights(t, k, seed + 3)
    return row_of_slot, slot_of_row, rows, x, w, k


def _cuda(*ts):
    return [t.cuda() if isinstance(t, torch.Tensor) else t for t in ts]


@pytest.mark.gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=str)
@pytest.mark.parametrize("dtype", F)
def test_cuda_kernels_are_bit_identical_to_cpu(case, dtype):
    ros, sor, rows, x, w, k = _gpu_inputs(case, dtype)
    c_ros, c_sor, c_rows, c_x, c_w = _cuda(ros, sor, rows, x, w)
    pairs = [
        (ops.moe_sum_slots(rows, ros, w), ops.moe_sum_slots(c_rows, c_ros, c_w)),
        (ops.moe_sum_slots(rows, ros, None), ops.moe_sum_slots(c_rows, c_ros, None)),
        (ops.moe_gather_rows(x, sor, None, k), ops.moe_gather_rows(c_x, c_sor, None, k)),
        (ops.moe_gather_rows(x, sor, w, k), ops.moe_gather_rows(c_x, c_sor, c_w, k)),
        (ops.moe_slot_dots(rows, ros, x), ops.moe_slot_dots(c_rows, c_ros, c_x)),
    ]
    for i, (a, b) in enumerate(pairs):
        assert same_bits(a, b.cpu()), f"pair {i}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", F)
def test_cuda_scalar_path_of_misaligned_views_gives_the_same_bits(dtype):
    """Views at storage offset 1 are not 16-byte aligned: the kernels take their scalar paths, whose
    bits must equal the vector paths' and the CPU's."""
    ros, sor, rows, x, w, k = _gpu_inputs(dict(t=64, k=4, e=8, align=4, d=64), dtype)
    c_ros, c_sor, c_w = _cuda(ros, sor, w)
    c_rows = torch.cat([torch.zeros(1, device="cuda", dtype=dtype), rows.cuda().reshape(-1)])[1:].view(rows.shape)
    c_x = torch.cat([torch.zeros(1, device="cuda", dtype=dtype), x.cuda().reshape(-1)])[1:].view(x.shape)
    assert c_rows.data_ptr() % 16 != 0
    assert same_bits(ops.moe_sum_slots(c_rows, c_ros, c_w).cpu(), ops.moe_sum_slots(rows, ros, w))
    assert same_bits(ops.moe_gather_rows(c_x, c_sor, c_w, k).cpu(), ops.moe_gather_rows(x, sor, w, k))
    assert same_bits(ops.moe_gather_rows(c_x, c_sor, None, k).cpu(), ops.moe_gather_rows(x, sor, None, k))
    assert same_bits(ops.moe_slot_dots(c_rows, c_ros, c_x).cpu(), ops.moe_slot_dots(rows, ros, x))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_dispatch_and_combine_with_gradients_are_bit_identical_to_cpu(dtype):
    ros, sor, _, x0, w0, _ = _gpu_inputs(dict(t=256, k=8, e=64, align=8, cf=1.25, d=512), dtype)
    gy = rand(256, 512, dtype=dtype, seed=9)

    def run(device):
        # Fresh leaves per device (x0.to("cpu") would be x0 itself, and its grad would leak into
        # the CUDA run's graph).
        x = x0.detach().to(device, copy=True).requires_grad_()
        w = w0.detach().to(device, copy=True).requires_grad_()
        r, s = ros.to(device), sor.to(device)
        xp = deepwell.moe_dispatch(x, s, r)
        y = deepwell.moe_combine((xp.float() * 1.5).to(dtype), w, r, s)
        y.backward(gy.to(device))
        return [t.cpu() for t in (xp, y, x.grad, w.grad)]

    for a, b in zip(run("cpu"), run("cuda")):
        assert same_bits(a, b)


@pytest.mark.gpu
def test_cuda_out_of_range_indices_read_as_dropped_not_a_crash():
    rows = torch.randn(4, 8, device="cuda")
    ros = torch.tensor([[0, 99], [-7, 1]], dtype=torch.int32, device="cuda")
    out = ops.moe_sum_slots(rows, ros, None)
    want = torch.stack([rows[0], rows[1]])
    assert torch.equal(out, want)
    assert ops.moe_slot_dots(rows, ros, torch.ones(2, 8, device="cuda"))[:, 1].tolist()[0] == 0.0
    torch.cuda.synchronize()


@pytest.mark.gpu
def test_cuda_compiled_dispatch_and_combine_equal_eager():
    ros, sor, _, x0, w0, _ = _gpu_inputs(dict(t=128, k=4, e=16, align=8, d=256), torch.bfloat16)
    r, s = ros.cuda(), sor.cuda()

    def step(x, w):
        return deepwell.moe_combine(deepwell.moe_dispatch(x, s, r) * 2, w, r, s)

    def run(f):
        x, w = x0.cuda().requires_grad_(), w0.cuda().requires_grad_()
        y = f(x, w)
        y.float().square().sum().backward()
        return y, x.grad, w.grad

    torch._dynamo.reset()
    for a, b in zip(run(step), run(torch.compile(step, fullgraph=True))):
        assert same_bits(a, b)
