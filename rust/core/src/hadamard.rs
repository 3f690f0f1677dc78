//! The 16-point random Hadamard transform of the NVFP4 recipe (arXiv 2509.25149 §4.2;
//! docs/NUMERICS.md NVFP4 step 6): `H = (1/4) * diag(s) * H16`, `H16` the Sylvester Hadamard matrix
//! (`H16[i][j] = (-1)^popcount(i & j)`), `s` one fixed sign vector shared by every layer (the
//! one Transformer Engine ships). `H` is orthogonal (`H * H^T = I`), so the wgrad GEMM
//! `(X H)(H^T Y)` equals `X Y` up to rounding; `H * H` is not the identity.
//!
//! The fp32 order of operations is part of the contract, so that the CUDA kernel can match it
//! bit for bit: fast Walsh-Hadamard butterflies with h = 1, 2, 4, 8 in that order, each
//! `(a, b) -> (a + b, a - b)`, then `v[i] *= 0.25 * s[i]` (one exact power-of-two multiply up to
//! sign, identical to multiplying by 0.25 then by the sign).

/// The fixed sign vector `s` of the transform.
pub const HADAMARD_SIGNS: [f32; 16] = [1., 1., 1., -1., 1., -1., -1., -1., -1., -1., -1., 1., -1., 1., -1., -1.];

/// In-place `v <- (1/4) * diag(s) * H16 * v`, in the fp32 order documented above.
#[inline]
pub fn hadamard16(v: &mut [f32; 16]) {
    let mut h = 1;
    while h < 16 {
        let mut i = 0;
        while i < 16 {
            for j in i..i + h {
                let (a, b) = (v[j], v[j + h]);
                v[j] = a + b;
                v[j + h] = a - b;
            }
            i += 2 * h;
        }
        h *= 2;
    }
    for (x, s) in v.iter_mut().zip(HADAMARD_SIGNS) {
        *x *= 0.25 * s;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_vectors_give_scaled_signed_columns() {
        for j in 0..16 {
            let mut v = [0f32; 16];
            v[j] = 1.0;
            hadamard16(&mut v);
            for (i, &y) in v.iter().enumerate() {
                let h = if (i & j).count_ones() % 2 == 0 { 1.0 } else { -1.0 };
                assert_eq!(y, 0.25 * HADAMARD_SIGNS[i] * h, "column {j}, row {i}");
            }
        }
    }
}
