//! CUDA kernels of the MoE ops (cuda/moe.cuh), bit-exact with `cpu.rs`.

use super::{PermuteIndex, Route};
use crate::error::{Error, Op, Result};
use crate::tensor::Tensor;

pub(super) fn route(op: Op, _r: Route) -> Result<Vec<Tensor>> {
    Err(Error::Unsupported { op, what: "no CUDA kernel yet".into() })
}

pub(super) fn permute_index(op: Op, _p: PermuteIndex) -> Result<Vec<Tensor>> {
    Err(Error::Unsupported { op, what: "no CUDA kernel yet".into() })
}
