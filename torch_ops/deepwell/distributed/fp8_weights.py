"""FP8 weight all-gather for FSDP2 (the fp8_block recipe): the two tensor subclasses through which
FSDP2's extension points (`fsdp_pre_all_gather` / `fsdp_post_all_gather` on the sharded parameter's
local tensor) gather a weight's E4M3 codes and 128x128 tile scales instead of its high-precision
values, about half the bytes of bf16 (a quarter of fp32). Which weights take this path:
`fp8_all_gather.py`.

- `Fp8BlockShard`: the sharded parameter's local tensor (what the optimizer updates and checkpoints
  see through the DTensor). A thin wrapper of the plain shard: every op runs on the plain tensor, the
  few FSDP2 uses to build and pad the shard keep the wrapper. Before each all-gather it quantizes
  its rows (`fp8_block_quantize`, 128x128 tiles, power-of-two scales, docs/NUMERICS.md "FP8 block").
- `Fp8BlockGathered`: the unsharded parameter FSDP2 builds from the gathered codes and scales. Its
  only readers are `deepwell.scaled_linear` and its backward, which it runs from the codes:
  `quantized_linear` (the forward) and `quantized_linear_backward` (dgrad from the same tiles
  transposed, wgrad from dy and x alone); any other op on it is an error naming the op.

Exactness: FSDP2 shards dim 0 (out_features). When each rank holds whole 128-row tile rows (both
dims multiples of 128, out_features of 128 * data ranks), a tile never straddles two shards, so the
tiles quantized per shard and gathered are the tiles of the whole weight: the same codes and scales
`scaled_linear` computes from the gathered high-precision weight (quantization is per tile, its
scale the tile's own amax). The forward, dgrad and wgrad are therefore bit-identical to the
high-precision all-gather with the same recipe (tests/distributed/test_fp8_all_gather.py proves it over
training steps). The gradient is a plain tensor of the parameter's dtype, so FSDP2's reduce-scatter
is unchanged.
"""

from __future__ import annotations

import torch
import torch.utils._pytree as pytree

from ..core.recipes import family

ops = torch.ops.deepwell
aten = torch.ops.aten

#: Tile edge of fp8_block's weight scales (docs/NUMERICS.md "FP8 block").
TILE = 128

# The ops FSDP2 applies to a sharded parameter while building and padding it (chunk -> split,
# new_zeros, narrow -> slice, copy_, view, as_strided, clone, _to_copy, empty_like, alias, detach):
# their results stay shards of this kind; everything else (the optimizer's arithmetic, norms,
# state-dict copies) runs on the plain tensor and returns plain tensors.
_KEEP_SHARD = {
    aten.detach.default,
    aten.alias.default,
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.split.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.clone.default,
}


class Fp8BlockShard(torch.Tensor):
    """A rank's shard of an fp8_block weight: `_tensor` is the plain shard (rows of the weight)."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            layout=tensor.layout,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is aten.detach.default:
            return Fp8BlockShard(args[0]._tensor.detach())
        plain_args, kwargs = pytree.tree_map_only(Fp8BlockShard, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*plain_args, **kwargs)
        first = func._schema.arguments[0] if func._schema.arguments else None
        if first is not None and first.alias_info is not None and first.alias_info.is_write and isinstance(out, torch.Tensor):
            return args[0]  # an in-place op (the optimizer's) returns the tensor it wrote: this shard
        if func not in _KEEP_SHARD:
            return out
        return pytree.tree_map_only(torch.Tensor, Fp8BlockShard, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return Fp8BlockShard(inner["_tensor"])

    def __repr__(self) -> str:
        return f"Fp8BlockShard({self._tensor})"

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        """(codes, tile scales) of this shard, what FSDP2 gathers. The shard is cast to FSDP2's
        param_dtype first when it has one, as the high-precision path would gather it."""
        w = self._tensor
        if mp_policy is not None and mp_policy.param_dtype is not None:
            w = w.to(mp_policy.param_dtype)
        data, scale = ops.fp8_block_quantize(w.contiguous(), TILE, TILE, True)
        return (data, scale), None

    def fsdp_post_all_gather(self, all_gather_outputs, metadata, param_dtype, *, out=None):
        """The unsharded parameter from the gathered (N, K) codes and (N/128, K/128) scales (each
        rank's rows in rank order: the whole weight's). With `out` (every all-gather after the
        first) FSDP2 has refilled the same storages, which `out` already views."""
        data, scale = all_gather_outputs
        if out is not None:
            out._data, out._scale = data, scale
            return None
        return Fp8BlockGathered(data, scale, param_dtype), (data, scale)


class Fp8BlockGathered(torch.Tensor):
    """A gathered fp8_block weight: shape (N, K) and dtype of the parameter, held as E4M3 codes
    `_data` (N, K) and fp32 tile scales `_scale` (N/128, K/128)."""

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        return torch.Tensor._make_wrapper_subclass(
            cls, data.size(), dtype=dtype, device=data.device, requires_grad=requires_grad
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, requires_grad: bool = False):
        self._data, self._scale = data, scale

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __tensor_flatten__(self):
        return ["_data", "_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Fp8BlockGathered(inner["_data"], inner["_scale"], dtype)

    def _stable_hash_for_caching(self) -> str:
        """AOTAutograd's cache key: what the compiled graph depends on (the codes' and scales' layout
        follows from the shape)."""
        return f"Fp8BlockGathered({list(self.shape)}, {self.dtype}, requires_grad={self.requires_grad})"

    def __repr__(self) -> str:
        return f"Fp8BlockGathered(shape={list(self.shape)}, dtype={self.dtype}, codes {self._data.dtype})"

    def _same(self) -> "Fp8BlockGathered":
        return Fp8BlockGathered(self._data, self._scale, self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        kwargs = kwargs or {}
        if func is ops.scaled_linear.default:
            x, w, bias, recipe, *_ = _bind(func, args, kwargs)
            _check_recipe(func, recipe)
            return ops.quantized_linear(x, w._data, w._scale, None, bias, recipe)
        if func is ops.scaled_linear_backward.default:
            dy, x, w, recipe, seed, need_x, need_w = _bind(func, args, kwargs)
            _check_recipe(func, recipe)
            return ops.quantized_linear_backward(dy, x, w._data, w._scale, recipe, w.dtype, need_x, need_w)
        w = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Fp8BlockGathered))
        if func in (aten.detach.default, aten.alias.default):
            return w._same()
        # FSDP2 views the unsharded tensor with the parameter's own contiguous size and strides.
        if func is aten.as_strided.default and _identity_view(w, *args[1:]):
            return w._same()
        if func in (aten.zeros_like.default, aten.empty_like.default):
            dtype = kwargs.get("dtype") or w.dtype
            fill = torch.zeros if func is aten.zeros_like.default else torch.empty
            return fill(w.shape, dtype=dtype, device=w.device)
        if _propagating_shapes(w):
            # Dynamo runs the captured F.linear on fake tensors for its shapes before the deepwell
            # backend rewrites it into scaled_linear: a stand-in of the parameter's shape and dtype
            # gives them. Nothing computed here ever runs.
            with w._data.fake_mode:
                stand_in = torch.empty(w.shape, dtype=w.dtype, device=w.device)
            args, kwargs = pytree.tree_map_only(Fp8BlockGathered, lambda _: stand_in, (args, kwargs))
            return func(*args, **kwargs)
        raise RuntimeError(
            f"deepwell: {func} reached a weight FSDP2 gathered as fp8_block codes "
            f"({list(w.shape)}); only deepwell.scaled_linear with recipe 'fp8_block' reads them. Plan this "
            "site fp8_block, or shard without fp8_all_gather (deepwell.autoplan(..., fp8_all_gather=False))"
        )


def _bind(func, args, kwargs) -> list:
    """The op's arguments in schema order, defaults filled."""
    schema = func._schema.arguments
    out = list(args)
    for a in schema[len(args):]:
        out.append(kwargs[a.name] if a.name in kwargs else a.default_value)
    return out


def _check_recipe(func, recipe: str) -> None:
    if family(recipe) != "fp8_block":
        raise RuntimeError(
            f"deepwell: {func} with recipe {recipe!r} reached a weight FSDP2 gathered as fp8_block codes; "
            "only recipe 'fp8_block' can run from them"
        )


def _identity_view(w: torch.Tensor, size, stride, storage_offset=0) -> bool:
    return list(size) == list(w.shape) and list(stride) == list(w.stride()) and not storage_offset


def _propagating_shapes(w: Fp8BlockGathered) -> bool:
    """Whether an op on `w` only computes shapes: Dynamo's fake propagation (fake inner tensors, no
    graph being traced), as opposed to a real call or AOTAutograd tracing what will run."""
    from torch._subclasses.fake_tensor import FakeTensor

    tracing = torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.PROXY) is not None
    return isinstance(w._data, FakeTensor) and not tracing
