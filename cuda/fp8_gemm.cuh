// Block-scaled FP8 GEMM for Hopper (sm_90a): deepwell's own kernel for the fp8_block recipe's
// GEMMs (docs/NUMERICS.md "FP8 block"; rust/ops/src/gemm/fp8_gemm.rs launches it and holds the CPU
// reference of what it computes).
//
//   out[r, c] = Out( sum over K-blocks kb of ( sa[kb, r] * sb(kb, c) * sum_{i in kb} A[r, i] * B[c, i] ) + bias[c] )
//
// A (rows, K) and B (cols, K) are E4M3 codes, both K-major (Hopper's FP8 MMA reads only that
// layout); every 128 consecutive elements along K share one fp32 scale: sa is A's 1x128 scales
// stored M-major, (K/128, rows); sb is either B's 128x128 tile scales (SB = 0: (cols/128, K/128)
// row-major, the weight of fprop / dgrad) or B's 1x128 scales M-major like A's (SB = 1: (K/128,
// cols), wgrad's x). Each 128-wide K-block is multiplied on the tensor cores into a fresh fp32
// fragment, then scaled and added to the running fp32 sum in registers ("promotion", as DeepGEMM
// does): the tensor cores never accumulate across two blocks' scales, so the result is the exact
// dequantized product up to fp32 accumulation order. Not bit-identical to cuBLASLt (another order).
//
// Structure (one CTA per SM, persistent over output tiles; docs/DESIGN.md "deepwell's FP8 GEMM"):
// - 3 warpgroups: warpgroups 0 and 1 multiply (64 rows each per wave), warpgroup 2's first warp
//   loads: TMA copies of A, B and their scales into a ring of STAGES shared-memory stages, each
//   guarded by a "full" mbarrier (copies landed) and an "empty" one (all 8 math warps done). The
//   192-row tile (MATH_WGS = 3) has three math warpgroups (12 math warps) and the load one fourth.
// - Tile BLOCK_M x 128 x 128 (K), BLOCK_M = 128 * WAVES: WAVES = 2 halves B's traffic per FLOP;
//   WAVES = 1 has the registers for two fragments, so each K-block's promotion overlaps the next
//   block's MMAs; CLUSTER = 2 (with WAVES = 1) pairs two CTAs on one 256-row tile sharing B by TMA
//   multicast (Rust's `Fp8Gemm::shape_for` decides, per launch).
// - GROUPING 0: one GEMM. GROUPING 1 (MoE forward / dgrad): A's rows are cut into groups by
//   `offsets` (G + 1 row starts, any sizes), group g multiplies its own B, and a tile never spans
//   two groups. Group g's B starts g * b_group_rows rows and g * b_group_k elements along K into
//   the B tensor: (G * cols, K) stacked weights (forward) or (cols, G * K) side by side (dgrad:
//   W^T of all experts from one transposing quantization of the (G * N, K) weights).
// - GROUPING 2 (MoE wgrad): group g sums only the K-blocks of [offsets[g], offsets[g+1])
//   (multiples of 128, else that group's output is NaN: a misaligned call is loud, never silently
//   wrong) into out[g] (G, rows, cols); an empty group writes zeros.
//
// Output rows beyond `rows` (or a group's end) and columns beyond `cols` are never written;
// elements TMA reads outside A or B are zeros. Constraints (checked by Rust): K % 128 == 0,
// rows % 4 == 0 and cols % 8 == 0 (16-byte scale rows for TMA; whole 16-byte output chunks), SB = 0:
// cols % 128 == 0, and `out` 16-byte aligned (Rust allocates it).
#pragma once
#include "common.cuh"
#include "sm90.cuh"

namespace deepwell {

constexpr int GEMM_THREADS = 384;     // 2 math warpgroups + 1 load warpgroup
// Threads of a CTA with MATH_WGS math warpgroups (2, or 3 for the 192-row tile) and the load one.
__host__ __device__ constexpr int gemm_threads(int math_wgs) { return 128 * (math_wgs + 1); }
static_assert(gemm_threads(2) == GEMM_THREADS, "the default CTA");
constexpr int GEMM_BLOCK_N = 128;
constexpr int GEMM_BLOCK_K = 128;     // = the recipe's block: one scale per operand row per K-block
constexpr int GEMM_STAGES_W1 = 6;     // 6 x 32 KiB of A + B
constexpr int GEMM_STAGES_W2 = 4;     // 4 x 48 KiB
constexpr int GEMM_WIDE_N = 192;      // the wide tile's columns (128 rows x 192: see GemmSmem)
constexpr int GEMM_STAGES_WIDE = 5;   // 5 x 40 KiB
constexpr int GEMM_STAGES_WG3 = 4;    // 4 x 40 KiB: 5 leave no room for 12 warps' epilogue slabs
constexpr int GEMM_GROUP_M = 8;       // tiles raster 8 row-tiles at a time (B stays in L2)
constexpr int GEMM_MATH_REGS = 232;   // registers per math thread after reallocation
constexpr int GEMM_LOAD_REGS = 40;    // 128 * 40 + 256 * 232 <= 65536
// Three math warpgroups: 384 * 160 + 128 * 32 = 65536, the register file (FlashAttention-3's split
// for three consumer warpgroups; the loader's 32 rather than the minimum 24 leave it room).
constexpr int GEMM_MATH_REGS_WG3 = 160;
constexpr int GEMM_LOAD_REGS_WG3 = 32;
constexpr int GEMM_EPI_ROWS = 8;      // the epilogue stages 8 rows x 64 columns per warp at a time
constexpr int GEMM_EPI_COLS = 64;
constexpr int GEMM_EPI_SLAB = 2048;  // bytes per warp: 8 x 64 fp32 (the widest Out)
static_assert(GEMM_EPI_SLAB == GEMM_EPI_ROWS * GEMM_EPI_COLS * 4, "one slab holds 8 x 64 fp32");

}  // namespace deepwell

// The tile schedule and the promotion / epilogue helpers read the constants above.
#include "fp8_gemm_epilogue.cuh"
#include "fp8_gemm_schedule.cuh"

namespace deepwell {

// Shared memory of one CTA, from a 1024-byte aligned base (Rust's `Fp8Gemm::smem_bytes` mirrors
// it, plus 1024 bytes of alignment slack):
//   [stages x (A tile BLOCK_M x 128 B | B tile BN x 128 B)] [stages x waves x sa: 128 + SA_PAD fp32,
//   padded to 128 B]
//   [stages x sb: 128 fp32, SB = 1 only] [2 x stages mbarriers, padded to 128 B]
//   [4 * MATH_WGS math warps x the epilogue's staging slab: GEMM_EPI_SLAB bytes each]
// A copy's innermost start must be 16-byte aligned, so a row group starting at any row (GROUPING 1)
// loads its scales from the multiple of 4 below it: SA_PAD = 4 more floats per wave.
// A wave is WAVE_ROWS = 64 * MATH_WGS rows (each math warpgroup multiplies 64 of them).
template <int WAVES, int SB, int GROUPING, int BN = GEMM_BLOCK_N, int MATH_WGS = 2>
struct GemmSmem {
    static constexpr int WAVE_ROWS = 64 * MATH_WGS;
    static constexpr int BLOCK_M = WAVE_ROWS * WAVES;
    static constexpr int STAGES = MATH_WGS == 3         ? GEMM_STAGES_WG3
                                  : BN == GEMM_WIDE_N ? GEMM_STAGES_WIDE
                                  : WAVES == 2        ? GEMM_STAGES_W2
                                                      : GEMM_STAGES_W1;
    static constexpr int A_BYTES = BLOCK_M * GEMM_BLOCK_K;
    static constexpr int STAGE_BYTES = A_BYTES + BN * GEMM_BLOCK_K;
    static constexpr int SA_PAD = GROUPING == 1 ? 4 : 0;
    static constexpr int SA_WAVE = WAVE_ROWS + SA_PAD;                // floats one copy moves per wave
    static constexpr int SA_WAVE_FLOATS = ((SA_WAVE * 4 + 127) / 128) * 32;  // each copy lands 128-aligned
    static constexpr int SA_STAGE_BYTES = WAVES * SA_WAVE_FLOATS * 4;
    static constexpr int SA_OFF = STAGES * STAGE_BYTES;
    static constexpr int SB_OFF = SA_OFF + STAGES * SA_STAGE_BYTES;
    static constexpr int BAR_OFF = SB_OFF + (SB == 1 ? STAGES * GEMM_BLOCK_N * 4 : 0);
    static constexpr int EPI_OFF = BAR_OFF + ((2 * STAGES * 8 + 127) / 128) * 128;
    static constexpr int BYTES = EPI_OFF + 4 * MATH_WGS * GEMM_EPI_SLAB;
    // Bytes each stage's copies deliver (the full barrier's transaction count).
    static constexpr uint32_t TX_BYTES = STAGE_BYTES + WAVES * SA_WAVE * 4 + (SB == 1 ? GEMM_BLOCK_N * 4 : 0);
};


// tma_a: A (rows, K) uint8, box (128, BLOCK_M), 128-byte swizzle; tma_b: B (B rows,
// B's K extent), box (128, 128), 128-byte swizzle; tma_sa: sa (K/128, rows) fp32, box (WAVE_ROWS +
// SA_PAD, 1) per wave; tma_sb (SB = 1): sb (K/128, cols) fp32, box (128, 1), else unused.
// sb_tiles (SB = 0): B's tile scales, a group's K-blocks contiguous: tile (c, kb) of group g at
// sb_tiles[c * sb_tile_row + g * sb_group + kb] ((groups, cols/128, K/128) for stacked weights,
// (cols/128, groups * K/128) side by side). bias: (cols) fp32 or null. offsets: (groups + 1)
// int32 (GROUPING 1, 2), else null. out: (rows, cols), or (groups, rows, cols) for GROUPING 2.
// For GROUPING 2, K is the total length of A's and B's rows and `offsets` cut it. Grid: min(tiles,
// SMs) CTAs (persistent); gemm_threads(MATH_WGS) threads; dynamic shared memory as GemmSmem says.
//
// CLUSTER = 2 (WAVES = 1 only): clusters of 2 CTAs take 256-row tiles, rank r the rows [128 r,
// 128 r + 128), and share the tile's B: each CTA copies 64 of B's 128 rows into both CTAs' shared
// memory (TMA multicast; tma_b's box is then (128, 64)), so B costs each CTA half the L2 traffic
// of a 128-row tile, as 256-row tiles do, while each math warpgroup keeps 64 rows and the registers
// for the pipelined promotion. A stage is refilled only when the math warps of both CTAs have
// released it (each arrives on both CTAs' "empty" barriers). Grid: a multiple of 2.
//
// BN = GEMM_WIDE_N (WAVES = 1, SB = 0, dense, CLUSTER = 1 only): 128 x 192 tiles. Each warpgroup's
// 64 x 192 fragment (96 registers) and running sum (96) leave no room for a second fragment, so it
// waits for each K-block's MMAs before promoting them (the two warpgroups overlap each other), but
// it reads 21% fewer shared-memory bytes per MMA than the 256-row tile (A 64 x 32 and B 192 x 32 per
// 96 tensor-core cycles, against B 128 x 32 per 64) and waits once per 64 x 192 instead of twice per
// 64 x 256. A tile's 192 columns span two of B's 128-column scale tiles: columns below the next
// multiple of 128 (128 or 64 of them, SPLIT fragment column groups) take the first tile's scale.
//
// HALVES = 1 (the wide tile only): each K-block's 192 columns are multiplied as two 96-column halves
// into two fragments (48 registers each), A read once into registers (ldmatrix) for both; the first
// half is promoted while the second's MMAs run, so a warpgroup leaves the tensor cores idle only
// for the second half's promotion. Same fused multiply-adds in the same order: the same bits.
//
// MATH_WGS = 3 (WAVES = 1, SB = 0, dense, CLUSTER = 1, BN = 128 only): 192 x 128 tiles, four
// warpgroups (512 threads), warpgroups 0-2 multiplying 64 rows each and warpgroup 3 loading. With
// 160 registers per math thread (setmaxnreg; 384 * 160 + 128 * 32 = 65536) a warpgroup holds one
// running sum and one fragment, so it waits for each K-block's MMAs (wait_group 0) before promoting
// them, as the 256-row tile does; the bet is that with three independent warpgroups, one promoting
// still leaves two with MMAs queued on the tensor cores. B is read once per 192 rows. Same fused
// multiply-adds in the same K order: the same bits.
template <class Out, int WAVES, int SB, int GROUPING, int CLUSTER, int BN = GEMM_BLOCK_N, int HALVES = 0,
          int MATH_WGS = 2>
__global__ void __launch_bounds__(gemm_threads(MATH_WGS), 1)
    fp8_block_gemm(const __grid_constant__ TmaDesc tma_a, const __grid_constant__ TmaDesc tma_b,
                   const __grid_constant__ TmaDesc tma_sa, const __grid_constant__ TmaDesc tma_sb,
                   const float* sb_tiles, const float* bias, const int* offsets, void* out, int64_t rows,
                   int64_t cols, int64_t k, int groups, int64_t b_group_rows, int64_t b_group_k,
                   int64_t sb_tile_row, int64_t sb_group) {
#if defined(DEEPWELL_SM90A)
    static_assert(CLUSTER == 1 || (CLUSTER == 2 && WAVES == 1), "clusters of 2 take 128-row tiles each");
    static_assert(BN == GEMM_BLOCK_N || (BN == GEMM_WIDE_N && WAVES == 1 && SB == 0 && GROUPING == 0 && CLUSTER == 1),
                  "the wide tile is a dense 128-row tile against tile-scaled B");
    static_assert(HALVES == 0 || BN == GEMM_WIDE_N, "halves split the wide tile");
    static_assert(MATH_WGS == 2 || (MATH_WGS == 3 && WAVES == 1 && SB == 0 && GROUPING == 0 && CLUSTER == 1 &&
                                    BN == GEMM_BLOCK_N),
                  "three math warpgroups: a dense 192-row tile against tile-scaled B");
    using S = GemmSmem<WAVES, SB, GROUPING, BN, MATH_WGS>;
    using namespace sm90;
    extern __shared__ uint8_t gemm_smem_raw[];
    uint8_t* smem = reinterpret_cast<uint8_t*>((reinterpret_cast<uint64_t>(gemm_smem_raw) + 1023) & ~uint64_t(1023));
    const uint32_t smem0 = smem_addr(smem);
    const uint32_t bars = smem0 + S::BAR_OFF;  // full[s] at bars + 8s, empty[s] at bars + 8(STAGES + s)
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    constexpr int MATH_WARPS = 4 * MATH_WGS;
    constexpr int MATH_REGS = MATH_WGS == 3 ? GEMM_MATH_REGS_WG3 : GEMM_MATH_REGS;
    constexpr int LOAD_REGS = MATH_WGS == 3 ? GEMM_LOAD_REGS_WG3 : GEMM_LOAD_REGS;
    const uint32_t rank = CLUSTER == 2 ? cluster_rank() : 0;

    if (threadIdx.x == 0) {
        for (int s = 0; s < S::STAGES; ++s) {
            mbar_init(bars + 8 * s, 1);                                   // the loader's arrive + the copies' bytes
            mbar_init(bars + 8 * (S::STAGES + s), MATH_WARPS * CLUSTER);  // one arrive per math warp of the cluster
        }
        mbar_fence_init();
    }
    // The peer's barriers must be initialised before any copy or arrival reaches them.
    if (CLUSTER == 2)
        cluster_sync();
    else
        __syncthreads();

    // The job of tile t of this CTA's walk (its cluster's t-th 128 * CLUSTER-row tile, its own rows).
    auto job = [&](int64_t t, gemm_detail::Job& j) {
        if (!gemm_detail::job_of<S::BLOCK_M * CLUSTER, GROUPING, BN>(t, offsets, rows, cols, k, groups, b_group_rows,
                                                                 b_group_k, j))
            return false;
        j.row0 += S::BLOCK_M * rank;
        return true;
    };
    // A math warp's release of a stage, to the loader of every CTA that writes into it: lane r
    // arrives on CTA r's barrier (the two arrivals in parallel, as DeepGEMM does).
    auto release = [&](int stage) {
        const uint32_t empty = bars + 8 * (S::STAGES + stage);
        if (CLUSTER == 1) {
            if (lane == 0) mbar_arrive(empty);
        } else {
            if (lane < CLUSTER) mbar_arrive_cluster(empty, lane);
        }
    };

    if (warp >= MATH_WARPS) {
        // The load warpgroup: its first warp walks the tiles; lane 0 issues the copies.
        regs_release<LOAD_REGS>();
        if (warp == MATH_WARPS) {
            int stage = 0;
            uint32_t phase = 0;
            for (int64_t t = blockIdx.x / CLUSTER;; t += gridDim.x / CLUSTER) {
                gemm_detail::Job j;
                if (!job(t, j)) break;
                if (lane == 0) {
                    for (int kb = j.kb0; kb < j.kb1; ++kb) {
                        const uint32_t full = bars + 8 * stage, empty = bars + 8 * (S::STAGES + stage);
                        mbar_wait(empty, phase ^ 1);  // a fresh barrier passes parity 1 at once
                        mbar_arrive_expect_tx(full, S::TX_BYTES);
                        const uint32_t a = smem0 + stage * S::STAGE_BYTES;
                        const int kc = kb * GEMM_BLOCK_K;
                        tma_load_2d(a, &tma_a, kc, static_cast<int>(j.row0), full);
                        if (CLUSTER == 1) {
                            tma_load_2d(a + S::A_BYTES, &tma_b, static_cast<int>(j.b_k0) + kc, static_cast<int>(j.b_row0),
                                        full);
                        } else {
                            // This CTA's half of B's 128 rows, into both CTAs (the same offset).
                            const uint32_t half = 64 * GEMM_BLOCK_K * rank;
                            tma_load_2d_multicast(a + S::A_BYTES + half, &tma_b, static_cast<int>(j.b_k0) + kc,
                                                  static_cast<int>(j.b_row0) + 64 * rank, full, 0x3);
                        }
                        const int sa_row = static_cast<int>(j.row0) & ~(S::SA_PAD ? 3 : 0);
                        for (int w = 0; w < WAVES; ++w)
                            tma_load_2d(smem0 + S::SA_OFF + stage * S::SA_STAGE_BYTES + w * S::SA_WAVE_FLOATS * 4, &tma_sa,
                                        sa_row + S::WAVE_ROWS * w, kb, full);
                        if (SB == 1)
                            tma_load_2d(smem0 + S::SB_OFF + stage * GEMM_BLOCK_N * 4, &tma_sb, static_cast<int>(j.col0),
                                        kb, full);
                        if (++stage == S::STAGES) {
                            stage = 0;
                            phase ^= 1;
                        }
                    }
                }
                __syncwarp();
            }
        }
    } else {
        // The math warpgroups: wg multiplies rows [64 wg, 64 wg + 64) of each WAVE_ROWS-row wave.
        regs_claim<MATH_REGS>();
        const int wg = warp / 4, wl = warp % 4;
        const int frag_row = 64 * wg + 16 * wl + lane / 4;  // rows frag_row and frag_row + 8 of a wave
        const int frag_col = 2 * (lane % 4);                // columns 8j + frag_col + {0, 1}
        int stage = 0;
        uint32_t phase = 0;
        // For a warpgroup whose 64 rows lie wholly past the tile's end: nothing to multiply, but
        // it still releases each stage once it is full, which paces it with the loader (an early
        // arrival could complete a later phase of the stage's "empty" barrier). Returns kb1.
        auto pace_idle = [&](int kb, int kb1) {
            for (; kb < kb1; ++kb) {
                mbar_wait(bars + 8 * stage, phase);
                release(stage);
                if (++stage == S::STAGES) {
                    stage = 0;
                    phase ^= 1;
                }
            }
            return kb;
        };
        for (int64_t t = blockIdx.x / CLUSTER;; t += gridDim.x / CLUSTER) {
            gemm_detail::Job j;
            if (!job(t, j)) break;
            // SB = 0: B's 128x128 tile scale of each K-block, read from global one K-block ahead
            // (the load's latency hides behind a whole block's MMAs).
            const float* sb_row = sb_tiles;
            if (SB == 0) sb_row += (j.col0 / GEMM_BLOCK_N) * sb_tile_row + j.group * sb_group;
            float sb_next = SB == 0 && j.kb0 < j.kb1 ? __ldg(sb_row + j.kb0) : 0.0f;
            const int sa_shift = static_cast<int>(j.row0) & (S::SA_PAD ? 3 : 0);
            float acc[WAVES][BN / 2];
#pragma unroll
            for (int w = 0; w < WAVES; ++w)
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) acc[w][i] = 0.0f;

            if constexpr (BN == GEMM_WIDE_N) {
                // The wide tile: B's scale tiles of the tile's columns, the second clamped into B
                // (its columns past `cols` are never stored). Both read one K-block ahead.
                const int64_t tile_lo = j.col0 / GEMM_BLOCK_K;
                const float* lo_row = sb_tiles + tile_lo * sb_tile_row;
                const float* hi_row = (tile_lo + 1) * GEMM_BLOCK_K < cols ? lo_row + sb_tile_row : lo_row;
                // 128 columns under the first scale tile when the tile starts on one, else 64.
                const bool split_16 = j.col0 % GEMM_BLOCK_K == 0;
                {
                    float lo_next = j.kb0 < j.kb1 ? __ldg(lo_row + j.kb0) : 0.0f;
                    float hi_next = j.kb0 < j.kb1 ? __ldg(hi_row + j.kb0) : 0.0f;
                    for (int kb = j.kb0; kb < j.kb1; ++kb) {
                        const float sb_lo = lo_next, sb_hi = hi_next;
                        if (kb + 1 < j.kb1) {
                            lo_next = __ldg(lo_row + kb + 1);
                            hi_next = __ldg(hi_row + kb + 1);
                        }
                        mbar_wait(bars + 8 * stage, phase);
                        const uint32_t a = smem0 + stage * S::STAGE_BYTES;
                        const float* sa = reinterpret_cast<const float*>(smem + S::SA_OFF + stage * S::SA_STAGE_BYTES);
                        const float sa0 = sa[frag_row], sa1 = sa[frag_row + 8];
                        const float s0_lo = sa0 * sb_lo, s1_lo = sa1 * sb_lo, s0_hi = sa0 * sb_hi, s1_hi = sa1 * sb_hi;
                        if constexpr (HALVES == 1) {
                            uint32_t ar[GEMM_BLOCK_K / 32][4];
#pragma unroll
                            for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk) ldmatrix_a(ar[kk], a, 64 * wg + 16 * wl, 32 * kk, lane);
                            float fa[BN / 4], fb[BN / 4];
                            fence_registers(fa);
                            fence_registers(fb);
                            wgmma_fence();
                            const uint64_t db = smem_desc_sw128(a + S::A_BYTES);
                            constexpr int HALF_B = (BN / 2) * GEMM_BLOCK_K / 16;  // descriptor units of 96 rows
#pragma unroll
                            for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk) wgmma_m64n96k32_e4m3_rs(fa, ar[kk], db + 2 * kk, kk);
                            wgmma_commit();
#pragma unroll
                            for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk)
                                wgmma_m64n96k32_e4m3_rs(fb, ar[kk], db + HALF_B + 2 * kk, kk);
                            wgmma_commit();
                            fence_registers(fa);
                            fence_registers(fb);
                            wgmma_wait<1>();  // the first half is done, the second may still run
                            fence_registers(fa);
                            if (split_16)
                                gemm_detail::promote_split<GEMM_BLOCK_K / 8>(acc[0], fa, s0_lo, s1_lo, s0_hi, s1_hi);
                            else
                                gemm_detail::promote_split<GEMM_BLOCK_K / 16>(acc[0], fa, s0_lo, s1_lo, s0_hi, s1_hi);
                            wgmma_wait<0>();
                            fence_registers(fb);
                            release(stage);
                            if (split_16)
                                gemm_detail::promote_split<GEMM_BLOCK_K / 8, BN / 16>(acc[0], fb, s0_lo, s1_lo, s0_hi, s1_hi);
                            else
                                gemm_detail::promote_split<GEMM_BLOCK_K / 16, BN / 16>(acc[0], fb, s0_lo, s1_lo, s0_hi, s1_hi);
                            if (++stage == S::STAGES) {
                                stage = 0;
                                phase ^= 1;
                            }
                            continue;
                        }
                        float part[BN / 2];
                        fence_registers(part);
                        wgmma_fence();
                        const uint64_t da = smem_desc_sw128(a + 64 * wg * GEMM_BLOCK_K);
                        const uint64_t db = smem_desc_sw128(a + S::A_BYTES);
#pragma unroll
                        for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk) wgmma_m64n192k32_e4m3(part, da + 2 * kk, db + 2 * kk, kk);
                        wgmma_commit();
                        fence_registers(part);
                        wgmma_wait<0>();
                        fence_registers(part);
                        release(stage);  // everything of the stage is in registers
                        // A uniform branch with no MMA in flight: ptxas keeps the MMAs asynchronous.
                        if (split_16)
                            gemm_detail::promote_split<GEMM_BLOCK_K / 8>(acc[0], part, s0_lo, s1_lo, s0_hi, s1_hi);
                        else
                            gemm_detail::promote_split<GEMM_BLOCK_K / 16>(acc[0], part, s0_lo, s1_lo, s0_hi, s1_hi);
                        if (++stage == S::STAGES) {
                            stage = 0;
                            phase ^= 1;
                        }
                    }
                }
            } else if constexpr (WAVES == 1 && MATH_WGS == 2) {
                // 128-row tiles: two fragments, so the promotion of K-block kb - 1 runs while kb's
                // MMAs are on the tensor cores (wait_group 1 instead of 0). The promotions are the
                // same fused multiply-adds in the same K order as below: the same bits.
                float part[2][64];
                int held = 0;  // the stage whose MMAs are in flight and not yet promoted
                float held_sa0 = 0.0f, held_sa1 = 0.0f, held_sb = 0.0f;
                // Promotes the held stage's finished fragment and gives the stage back to the loader
                // (SB = 0 before the promotion: everything it needs is in registers; SB = 1 after
                // it, which reads the stage's column scales).
                auto retire = [&](float(&done)[64]) {
                    const float* sbs = reinterpret_cast<const float*>(smem + S::SB_OFF) + held * GEMM_BLOCK_N;
                    if (SB == 0) release(held);
                    gemm_detail::promote<SB>(acc[0], done, held_sa0, held_sa1, held_sb, sbs, frag_col);
                    if (SB == 1) release(held);
                };
                // Issues K-block kb's MMAs into `issue`; unless it is the first of its batch, then
                // waits for the previous block's (in `done`) and promotes them.
                auto step = [&](float(&issue)[64], float(&done)[64], bool first, int kb) {
                    const float sb_tile = sb_next;
                    if (SB == 0 && kb + 1 < j.kb1) sb_next = __ldg(sb_row + kb + 1);
                    mbar_wait(bars + 8 * stage, phase);
                    const uint32_t a = smem0 + stage * S::STAGE_BYTES;
                    fence_registers(issue);
                    wgmma_fence();
                    const uint64_t da = smem_desc_sw128(a + 64 * wg * GEMM_BLOCK_K);
                    const uint64_t db = smem_desc_sw128(a + S::A_BYTES);
#pragma unroll
                    for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk) wgmma_m64n128k32_e4m3(issue, da + 2 * kk, db + 2 * kk, kk);
                    wgmma_commit();
                    fence_registers(issue);
                    const float* sa = reinterpret_cast<const float*>(smem + S::SA_OFF + stage * S::SA_STAGE_BYTES) + sa_shift;
                    const float sa0 = sa[frag_row], sa1 = sa[frag_row + 8];
                    if (!first) {
                        wgmma_wait<1>();  // kb - 1's MMAs are done; kb's may still run
                        fence_registers(done);
                        retire(done);
                    }
                    held = stage;
                    held_sa0 = sa0;
                    held_sa1 = sa1;
                    held_sb = sb_tile;
                    if (++stage == S::STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                };
                auto finish = [&](float(&last)[64]) {
                    wgmma_wait<0>();
                    fence_registers(last);
                    retire(last);
                };
                // Batches of 4, 2 and 1 K-blocks, each issued before the previous one is promoted,
                // and none left in flight at a batch's end: ptxas serializes every MMA of the
                // kernel (C7514) when a pending group crosses a loop's back edge or a batch is cut
                // short by a branch, so each batch is whole and straight-line.
                float(&p0)[64] = part[0];
                float(&p1)[64] = part[1];
                int kb = j.kb0;
                // A row group's last tile, a cluster's second CTA past the rows. SB = 0 only: with
                // SB = 1 (wgrads, whose rows are whole weights) the branch cost spills, measured
                // with ptxas -v.
                if (SB == 0 && j.row0 + 64 * wg >= j.row_end) kb = pace_idle(kb, j.kb1);
                for (; kb + 4 <= j.kb1; kb += 4) {
                    step(p0, p1, true, kb);
                    step(p1, p0, false, kb + 1);
                    step(p0, p1, false, kb + 2);
                    step(p1, p0, false, kb + 3);
                    finish(p1);
                }
                for (; kb + 2 <= j.kb1; kb += 2) {
                    step(p0, p1, true, kb);
                    step(p1, p0, false, kb + 1);
                    finish(p1);
                }
                if (kb < j.kb1) {
                    step(p0, p1, true, kb);
                    finish(p0);
                }
            } else {
                // One fragment per warpgroup: 256-row tiles (two waves) and 192-row ones (one wave
                // of three warpgroups).
                int kb = j.kb0;
                if (MATH_WGS == 3 && j.row0 + 64 * wg >= j.row_end) kb = pace_idle(kb, j.kb1);
                for (; kb < j.kb1; ++kb) {
                    const float sb_tile = sb_next;
                    if (SB == 0 && kb + 1 < j.kb1) sb_next = __ldg(sb_row + kb + 1);
                    mbar_wait(bars + 8 * stage, phase);
                    const uint32_t a = smem0 + stage * S::STAGE_BYTES;
                    const float* sa = reinterpret_cast<const float*>(smem + S::SA_OFF + stage * S::SA_STAGE_BYTES) + sa_shift;
                    const float* sbs = reinterpret_cast<const float*>(smem + S::SB_OFF) + stage * GEMM_BLOCK_N;
#pragma unroll
                    for (int w = 0; w < WAVES; ++w) {
                        float part[64];
                        fence_registers(part);
                        wgmma_fence();
                        const uint64_t da = smem_desc_sw128(a + (S::WAVE_ROWS * w + 64 * wg) * GEMM_BLOCK_K);
                        const uint64_t db = smem_desc_sw128(a + S::A_BYTES);
#pragma unroll
                        for (int kk = 0; kk < GEMM_BLOCK_K / 32; ++kk) wgmma_m64n128k32_e4m3(part, da + 2 * kk, db + 2 * kk, kk);
                        wgmma_commit();
                        // The row scales load while the MMAs run.
                        const float sa0 = sa[S::SA_WAVE_FLOATS * w + frag_row], sa1 = sa[S::SA_WAVE_FLOATS * w + frag_row + 8];
                        wgmma_wait<0>();
                        fence_registers(part);
                        // SB = 0: everything of the stage is in registers after the last wave's MMAs:
                        // release it before promoting, so the next copy starts sooner.
                        if (SB == 0 && w == WAVES - 1) release(stage);
                        gemm_detail::promote<SB>(acc[w], part, sa0, sa1, sb_tile, sbs, frag_col);
                    }
                    // SB = 1: the column scales were read by the promotion above; now the stage is free.
                    if (SB == 1) release(stage);
                    if (++stage == S::STAGES) {
                        stage = 0;
                        phase ^= 1;
                    }
                }
            }

            // Epilogue: + bias, round to Out, and out through this warp's shared slab, 8 rows x 64
            // columns at a time. The fragment holds column pairs spread over 8 rows; stored straight
            // to global, every 4-byte store touched 8 rows (8 partial sectors), and a short-K tile
            // (an expert's wgrad: ~9 K-blocks) spent about as long storing as multiplying. From the
            // slab each store is a 16-byte chunk of a whole row segment. Only __syncwarp: the slab
            // is the warp's own.
            const int64_t out0 = GROUPING == 2 ? j.group * rows * cols : 0;
            const float nan = __int_as_float(0x7FC00000);
            uint8_t* slab = smem + S::EPI_OFF + warp * GEMM_EPI_SLAB;
            using L = gemm_detail::Slab<Out>;
#pragma unroll
            for (int w = 0; w < WAVES; ++w) {
#pragma unroll
                for (int h = 0; h < 2; ++h) {
#pragma unroll
                    for (int half = 0; half < BN / GEMM_EPI_COLS; ++half) {
#pragma unroll
                        for (int jj = 0; jj < GEMM_EPI_COLS / 8; ++jj) {
                            const int jn = half * (GEMM_EPI_COLS / 8) + jj;
                            const int64_t c = j.col0 + 8 * jn + frag_col;
                            const bool in = bias && c < cols;
                            float lo = acc[w][4 * jn + 2 * h] + (in ? bias[c] : 0.0f);
                            float hi = acc[w][4 * jn + 2 * h + 1] + (in ? bias[c + 1] : 0.0f);
                            if (j.bad) lo = hi = nan;
                            gemm_detail::store_pair<Out>(slab, L::at(lane / 4, 8 * jj + frag_col), lo, hi);
                        }
                        __syncwarp();
                        const int64_t row0 = j.row0 + S::WAVE_ROWS * w + 64 * wg + 16 * wl + 8 * h;
                        gemm_detail::store_slab<Out>(slab, out, out0, row0, j.row_end,
                                                     j.col0 + half * GEMM_EPI_COLS, cols, lane);
                        __syncwarp();  // the slab is rewritten next
                    }
                }
            }
        }
    }
    // Neither CTA of a cluster may exit while the other can still copy into its shared memory or
    // arrive on its barriers.
    if (CLUSTER == 2) cluster_sync();
#endif
}

}  // namespace deepwell
