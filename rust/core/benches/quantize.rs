//! Throughput of the CPU reference quantizers on a 4096x4096 bf16 tensor (bytes of input per
//! second). Small sample sizes keep the whole run near a minute on two cores.

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use deepwell_core::{fp8_block_quantize, mxfp8_quantize, nvfp4_quantize, Dims3, Fp8Elem, Nvfp4Options, ScaleMode};
use half::bf16;
use std::hint::black_box;
use std::time::Duration;

const N: usize = 4096;

/// Deterministic pseudo-random values spanning a few binades (an LCG: no RNG dependency).
fn input() -> Vec<bf16> {
    let mut s: u32 = 12345;
    (0..N * N)
        .map(|_| {
            s = s.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            bf16::from_f32(((s >> 8) as f32 / 16_777_216.0 - 0.5) * 8.0)
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let x = input();
    let mut data = vec![0u8; N * N];
    let mut g = c.benchmark_group("quantize_4096x4096_bf16");
    g.sample_size(10)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(3))
        .throughput(Throughput::Bytes((N * N * 2) as u64));

    for (name, dim) in [("mxfp8_rows", 1), ("mxfp8_dim0", 0)] {
        let dims = Dims3::from_shape(&[N, N], dim);
        let mut scale = vec![0u8; N * N / 32];
        g.bench_function(name, |b| {
            b.iter(|| mxfp8_quantize(black_box(&x), dims, ScaleMode::Rceil, Fp8Elem::E4M3, &mut data, &mut scale))
        });
    }

    let mut packed = vec![0u8; N * N / 2];
    let mut scale = vec![0u8; N * N / 16];
    for (name, opts) in [
        ("nvfp4", Nvfp4Options::default()),
        ("nvfp4_2d", Nvfp4Options { block_2d: true, ..Default::default() }),
        ("nvfp4_sr_rht", Nvfp4Options { stochastic_seed: Some(7), hadamard: true, ..Default::default() }),
    ] {
        g.bench_function(name, |b| b.iter(|| nvfp4_quantize(black_box(&x), N, N, 4.0, &opts, &mut packed, &mut scale)));
    }

    for (name, br) in [("fp8_block_1x128", 1), ("fp8_block_128x128", 128)] {
        let mut scale_inv = vec![0f32; N * N / 128 / br];
        g.bench_function(name, |b| {
            b.iter(|| fp8_block_quantize(black_box(&x), 1, N, N, br, 128, true, &mut data, &mut scale_inv))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
