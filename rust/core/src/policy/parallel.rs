//! How a training job spreads over the processes it was launched with: data parallelism with
//! FSDP2-style sharding of weights, gradients and optimizer states, and tensor parallelism where a
//! rank would not fit otherwise. A pure decision from sizes (no torch): the caller measures the
//! model and the devices, this picks the degrees and says why (docs/DESIGN.md "Scale-out").
//!
//! Per-rank memory with data degree `d` and tensor degree `t` (`d * t` = world size):
//!   state       = (weights + gradients + optimizer states) / (d * t)   (FSDP shards all three)
//!   activations = activations of the rank's micro-batch / t            (TP splits the hidden dims;
//!                                                                       an upper bound on the saving)
//!   gathered    = 2 * largest sharding unit / t                        (the unit being computed and
//!                                                                       the next one, prefetched)
//! A degree fits when its total stays under `HEADROOM` of the device's memory.

/// Share of a device's memory a plan may use (the rest: allocator fragmentation, NCCL, CUDA context).
pub const HEADROOM: f64 = 0.9;

/// SMs given to FSDP's collectives on GPUs: torch's GEMMs leave them free (torch's SM carveout,
/// which sets cuBLASLt's SM count target) and NCCL runs on at most that many CTAs (its `max_ctas`),
/// so a collective always finds its SMs. cuBLASLt's FP8 GEMMs on Hopper are persistent kernels
/// sized to every SM: a collective launched next to one gets its SMs only as the GEMM's CTAs
/// retire, the peer's collective waits on it, and the GEMMs queued behind run in two waves.
/// Measured (bench_parallel.py; docs/BASELINES.md), the 0.95B LLaMA, fp8_block, FSDP over 2 ranks,
/// 4x2048 tokens each: on 2 H200s, NCCL kernels 76 ms per 115 ms step with no carveout; on 2 H100s,
/// 112.1 ms per step with 16 SMs left and NCCL's own CTA count, 108.1 ms with 8 SMs and 8 CTAs
/// (8 CTAs still move a 2-rank all-gather at ~100 GB/s).
///
/// The carveout costs the GEMMs more than its share of SMs: their tile counts fall short of whole
/// waves. One block's GEMMs of that step (fprop, dgrad, wgrad; cuBLASLt's block-scaled modes, H100,
/// `bench_gemm.py --carveouts`, benchmarks/results/bench_gemm-carveout-*) take 2.49 ms on 132 SMs,
/// 2.65 on 128 (+6%), 2.80 on 124 (+13%: ~5 ms of a 100 ms step), 2.73 on 120, 3.01 on 116. Fewer
/// SMs for the collectives did not pay on 2 H100s (bench_parallel-1b-{sm4,bwd4,i-*}): 4 SMs and
/// 4 CTAs left the forward's all-gathers exposed (forward 40 against 33-34 ms of GPU time; steps
/// 104.4 / 105.7 against 101.6 / 100.0 ms), and 4 SMs in the backward only (the forward keeping 8)
/// gained ~0.5 ms a step by median in three of four runs, inside the spread.
///
/// Data parallelism alone on a single node's GPUs with peer access moves FSDP's
/// collectives on their copy engines instead (`Collectives::CopyEngine`), which need no SM at all, so the GEMMs keep every SM
/// and this carveout applies only where NCCL carries them.
pub const COMM_SMS: u32 = 8;

/// What carries FSDP2's all-gathers and reduce-scatters.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Collectives {
    /// torch.distributed's process group (NCCL on GPUs, gloo on CPUs), beside `sm_carveout` SMs.
    ProcessGroup,
    /// The GPUs' copy engines over peer links, through PyTorch's symmetric memory
    /// (torch_ops/deepwell/distributed/copy_engine.py): no SMs taken from the GEMMs. For data parallelism
    /// alone (no tensor degree) within one node whose GPUs reach each other directly. Measured on
    /// 2 H100s (NVLink), the 0.95B LLaMA at 4x2048 tokens per GPU, fp8_block, alternated with NCCL
    /// on 8 SMs in three leases
    /// (benchmarks/results/bench_parallel-1b-ce-*): 94.0-96.5 ms a step by mean (medians
    /// 93.1-94.5) against 95.6-98.7 (94.9-95.7); one GPU 85.7 ms, so 1.78-1.82x against 1.74-1.79x.
    CopyEngine,
}

impl Collectives {
    pub fn name(self) -> &'static str {
        match self {
            Collectives::ProcessGroup => "process_group",
            Collectives::CopyEngine => "copy_engine",
        }
    }
}

/// FSDP units of blocks when the gathered weights stay for the backward: the first unit is one
/// block and each next one doubles, up to `MAX_BLOCKS_PER_UNIT`. Measured on 2 H100s, the 0.95B
/// LLaMA at 4x2048 tokens per GPU (benchmarks/results/bench_parallel-1b-{units-*,ab-*}):
/// - Every unit costs host time each step: FSDP2's hooks took 2-3 ms per unit on rank 0 (CPU-only
///   profile: post-backward reduce 16.2 ms and pre-forward 7.8 ms a step over 10 units), and with
///   units of 2 blocks the step is close to bound by its host (launching the forward took 37-44 ms
///   against 19-24 ms on one GPU).
/// - Nothing overlaps the first unit's all-gather at the step's start nor the reduce-scatter of the
///   unit the backward ends with: with units of 8 blocks the host ran 30-50 ms ahead of the GPU,
///   yet the step took 102.6 ms, a 0.8 GB gather and reduction exposed at the ends.
///
/// Doubling keeps one block at each end and 5 block units for 16 blocks; each unit's gather
/// (prefetched one unit ahead) hides under the previous unit's forward while a block's forward
/// takes at least twice its gather (~1.7 ms against ~0.5 ms here). Against units of 2, alternated
/// 3 times in one lease: 101.0-101.3 ms a step against 101.3-101.8 (medians 100.0-100.4 against
/// 100.4-101.1), a gain inside the run-to-run spread but in every pair. When weights are
/// re-gathered for the backward a unit stays one block: two gathered units is the memory counted.
pub const MAX_BLOCKS_PER_UNIT: u32 = 8;

/// Why the embedding and the LM head join the block units at the two ends when the weights stay
/// gathered. Units of their own cost each step what every FSDP unit costs the host (its hooks, its
/// collectives' launches) and buy no overlap: the embedding's forward is a gather too short to
/// cover the first block's all-gather, the end of the backward waits for both the first block's
/// and the embedding's reduce-scatters either way, and the LM head's all-gather and reduce-scatter
/// overlap the blocks' compute in either layout. So joining them exposes no more communication
/// and saves two units. Measured on 2 H100s, the 0.95B LLaMA at 4x2048 tokens per
/// GPU, copy-engine collectives, alternated in three leases (benchmarks/results/bench_parallel-1b-ends-*):
/// 94.5-96.4 ms a step by mean in five runs (medians 92.8-95.2) against 97.8-107.6 in four
/// (medians 92.0-102.5) with units of their own, one GPU 85.4-86.1: 1.79-1.82x against 1.60-1.75x.
/// The best steps are alike; the joined runs had fewer stretches where a host could not launch as
/// fast as its GPU ran (the 2-GPU step is close to bound by its host; docs/DESIGN.md "Scale-out").
pub const ENDS_JOIN_BLOCKS: &str = "the embedding joins the first unit and the final norm with the LM head the last \
     (each FSDP unit costs host time every step; joined, no collective is less hidden)";

/// The processes of the job and their devices.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Cluster {
    /// Processes (one device each).
    pub world_size: u32,
    /// Devices per node: tensor parallelism stays within a node.
    pub devices_per_node: u32,
    /// Memory of one device in bytes; 0 when unknown (CPU processes): every degree fits.
    pub memory_bytes: u64,
    /// Whether the node's devices reach each other directly (NVLink / PCIe peer access): tensor
    /// parallelism all-reduces in every layer and is only planned over such links.
    pub peer_access: bool,
}

/// The model's sizes, measured by the caller.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ModelSize {
    pub weight_bytes: u64,
    pub gradient_bytes: u64,
    pub optimizer_bytes: u64,
    /// Saved activations of one rank's micro-batch.
    pub activation_bytes: u64,
    /// Weights of the largest sharding unit (a transformer block): FSDP gathers a unit at a time.
    pub largest_unit_bytes: u64,
    /// Transformer blocks (0 when the caller found none: no block units are planned).
    pub blocks: u32,
}

#[derive(Clone, Debug, PartialEq)]
pub struct ParallelPlan {
    pub data: u32,
    pub tensor: u32,
    /// Shard weights, gradients and optimizer states over the data ranks (FSDP2 `fully_shard`).
    pub fsdp: bool,
    /// FSDP2's `reshard_after_forward`: free the gathered weights after each unit's forward (and
    /// gather again for its backward) unless keeping them fits.
    pub reshard_after_forward: bool,
    /// Predicted bytes per rank (the model above; 0 for one process: dryrun's figure applies).
    pub per_rank_bytes: u64,
    /// SMs the GEMMs leave free for FSDP's overlapped collectives, and the CTAs NCCL may use for
    /// them (`COMM_SMS` on GPUs with data parallelism over NCCL, else 0: the copy engines need no
    /// SMs, and tensor parallelism's all-reduces run between GEMMs, not beside them).
    pub sm_carveout: u32,
    /// What carries FSDP's collectives (`Collectives`).
    pub collectives: Collectives,
    /// FSDP's units of consecutive blocks in forward order, as block counts summing to
    /// `ModelSize::blocks` (`unit_blocks`: 1, 2, 4, ... when the weights stay gathered, else 1
    /// each); empty without data parallelism.
    pub unit_blocks: Vec<u32>,
    /// The modules before the blocks (the embedding) share the first block unit and those after
    /// them (the final norm, the LM head) the last, instead of units of their own: true where the
    /// weights stay gathered under data parallelism alone (`ENDS_JOIN_BLOCKS` says why), else false
    /// (a unit stays one block when two gathered units is the memory counted).
    pub ends_join_blocks: bool,
    /// Units ahead whose all-gathers each unit's forward starts (1 with data parallelism, else 0):
    /// FSDP2 starts a unit's all-gather when the host reaches it, so without this the gathers
    /// overlap compute only as far as the host runs ahead of the GPU.
    pub forward_prefetch: u32,
    pub reason: String,
}

fn gib(b: u64) -> String {
    format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64)
}

/// Per-rank bytes with data degree `d` and tensor degree `t`; the second figure keeps every
/// unit's gathered weights from forward to backward (`reshard_after_forward` false).
fn per_rank(m: &ModelSize, d: u32, t: u32) -> (u64, u64) {
    let ranks = u64::from(d) * u64::from(t);
    let t = u64::from(t);
    let state = (m.weight_bytes + m.gradient_bytes + m.optimizer_bytes).div_ceil(ranks);
    let resharded = state + m.activation_bytes / t + 2 * m.largest_unit_bytes / t;
    // Kept gathered: each rank holds the whole (TP-split) weights, not 1/d of them.
    let kept = resharded + (m.weight_bytes / t).saturating_sub(m.weight_bytes.div_ceil(ranks));
    (resharded, kept)
}

/// The degrees for `c` and `m` (see the module docs).
pub fn plan(c: &Cluster, m: &ModelSize) -> ParallelPlan {
    plan_with_tensor(c, m, None)
}

/// `plan`, with the tensor degree fixed to `forced` when given (autoplan's `tensor_parallel=`; the
/// caller checks that it divides the world size): the data degree takes the rest, and the memory,
/// the carveout, the units and the prefetch follow from those degrees as for the planner's own.
pub fn plan_with_tensor(c: &Cluster, m: &ModelSize, forced: Option<u32>) -> ParallelPlan {
    let world = c.world_size.max(1);
    if world == 1 {
        return ParallelPlan {
            data: 1,
            tensor: 1,
            fsdp: false,
            reshard_after_forward: false,
            per_rank_bytes: 0,
            sm_carveout: 0,
            collectives: Collectives::ProcessGroup,
            unit_blocks: Vec::new(),
            ends_join_blocks: false,
            forward_prefetch: 0,
            reason: "one process: no sharding (launch with torchrun --nproc-per-node N to use N GPUs)".into(),
        };
    }
    let budget = (c.memory_bytes as f64 * HEADROOM) as u64;
    let fits = |b: u64| c.memory_bytes == 0 || b <= budget;
    // Tensor degrees: powers of two dividing the world, within a node, over peer links only.
    let degrees: Vec<u32> = [1u32, 2, 4, 8]
        .into_iter()
        .filter(|&t| world % t == 0 && t <= c.devices_per_node.max(1) && (t == 1 || c.peer_access))
        .collect();
    let chosen = degrees.iter().copied().find(|&t| fits(per_rank(m, world / t, t).0));
    let (own, own_fits) = match chosen {
        Some(t) => (t, true),
        None => (*degrees.last().unwrap_or(&1), false),
    };
    let tensor = forced.unwrap_or(own).max(1);
    let fitted = if forced.is_some() { fits(per_rank(m, world / tensor, tensor).0) } else { own_fits };
    let data = world / tensor;
    let (resharded, kept) = per_rank(m, data, tensor);
    let keep = fits(kept) && c.memory_bytes != 0;
    let per_rank_bytes = if keep { kept } else { resharded };
    let memory = if c.memory_bytes == 0 { "device memory unknown".to_string() } else { gib(budget) + " usable" };
    let head = match (data, tensor) {
        (_, 1) => format!("FSDP over {data} data ranks"),
        (1, _) => format!("tensor parallel {tensor}, no data parallelism"),
        _ => format!("FSDP over {data} data ranks x tensor parallel {tensor}"),
    };
    let mut reason = format!("{world} processes: {head}, {} per rank ({memory})", gib(per_rank_bytes));
    if forced.is_some_and(|t| t != own) {
        reason += &format!(
            "; tensor degree forced by tensor_parallel={tensor} (the planner chose data {} x tensor {own})",
            world / own
        );
    } else if tensor > 1 && fitted {
        reason += &format!("; data parallel alone needs {} per rank", gib(per_rank(m, world, 1).0));
    }
    if !fitted {
        reason += if forced.is_some() {
            "; does not fit at this tensor degree"
        } else {
            "; does not fit even at the largest tensor degree this cluster allows"
        };
    }
    reason += if keep {
        "; weights stay gathered between forward and backward (fits)"
    } else {
        "; weights re-gathered for the backward (reshard after forward)"
    };
    // Memory known: the processes have GPUs (CPU processes report 0).
    let gpus = data > 1 && c.memory_bytes != 0;
    // Only where the data ranks are the whole world (no tensor degree): the 2-GPU runs measured
    // and tested it there; a data group beside tensor groups has not run on GPUs.
    let collectives = if gpus && tensor == 1 && c.peer_access && world <= c.devices_per_node.max(1) {
        Collectives::CopyEngine
    } else {
        Collectives::ProcessGroup
    };
    let sm_carveout = if gpus && collectives == Collectives::ProcessGroup { COMM_SMS } else { 0 };
    if collectives == Collectives::CopyEngine {
        reason += "; FSDP's collectives on the copy engines over peer links (the GEMMs keep every SM)";
    } else if sm_carveout > 0 {
        reason +=
            &format!("; GEMMs leave {sm_carveout} SMs to the collectives they overlap, NCCL runs on as many CTAs");
    }
    let unit_blocks = if data > 1 { unit_blocks(m.blocks, keep) } else { Vec::new() };
    if unit_blocks.iter().any(|&n| n > 1) {
        reason += &format!(
            "; FSDP units of {unit_blocks:?} blocks (one block at each end of the step, fewer units on the host)"
        );
    }
    // Data parallelism alone, as measured: beside tensor groups the embedding and the LM head are
    // split differently from the blocks (vocabulary-parallel only with sequence parallelism), a
    // unit mixing them has not run.
    let ends_join_blocks = keep && tensor == 1 && !unit_blocks.is_empty();
    if ends_join_blocks {
        reason += &format!("; {ENDS_JOIN_BLOCKS}");
    }
    ParallelPlan {
        data,
        tensor,
        fsdp: data > 1,
        reshard_after_forward: !keep,
        per_rank_bytes,
        sm_carveout,
        collectives,
        unit_blocks,
        ends_join_blocks,
        forward_prefetch: u32::from(data > 1),
        reason,
    }
}

/// The block counts of FSDP's units over `blocks` blocks (see `MAX_BLOCKS_PER_UNIT`): 1, 2, 4, ...
/// up to the cap when the weights stay gathered (`keep`), the last unit what is left; else 1 each.
pub fn unit_blocks(blocks: u32, keep: bool) -> Vec<u32> {
    let mut units = Vec::new();
    let (mut left, mut next) = (blocks, 1u32);
    while left > 0 {
        let n = next.min(left);
        units.push(n);
        left -= n;
        if keep {
            next = (next * 2).min(MAX_BLOCKS_PER_UNIT);
        }
    }
    units
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    /// A ~1B model in bf16 with AdamW states in bf16: 2 + 2 + 4 bytes per parameter.
    fn model(activations_gib: u64) -> ModelSize {
        ModelSize {
            weight_bytes: 2 * GIB,
            gradient_bytes: 2 * GIB,
            optimizer_bytes: 4 * GIB,
            activation_bytes: activations_gib * GIB,
            largest_unit_bytes: GIB / 8,
            blocks: 16,
        }
    }

    fn cluster(world: u32, memory_gib: u64) -> Cluster {
        Cluster { world_size: world, devices_per_node: 8, memory_bytes: memory_gib * GIB, peer_access: true }
    }

    #[test]
    fn one_process_shards_nothing() {
        let p = plan(&cluster(1, 80), &model(10));
        assert_eq!((p.data, p.tensor, p.fsdp), (1, 1, false));
        assert!(p.reason.contains("torchrun"), "{}", p.reason);
    }

    #[test]
    fn data_parallel_when_it_fits() {
        let p = plan(&cluster(2, 80), &model(10));
        assert_eq!((p.data, p.tensor, p.fsdp), (2, 1, true));
        // 8 GiB of state / 2 + 10 GiB + 2 x 1/8 GiB = 14.25 GiB; keeping 1 GiB more gathered fits.
        assert!(!p.reshard_after_forward);
        assert_eq!(p.per_rank_bytes, 4 * GIB + 10 * GIB + GIB / 4 + GIB);
        assert_eq!((p.unit_blocks, p.forward_prefetch), (vec![1, 2, 4, 8, 1], 1));
        assert!(p.reason.contains("FSDP units of [1, 2, 4, 8, 1] blocks"), "{}", p.reason);
        // Kept gathered: the embedding and the LM head join the end units, and the plan says why.
        assert!(p.ends_join_blocks);
        assert!(p.reason.contains(ENDS_JOIN_BLOCKS), "{}", p.reason);
    }

    #[test]
    fn kept_units_double_from_one_block_up_to_the_cap() {
        assert_eq!(unit_blocks(16, true), vec![1, 2, 4, 8, 1]);
        assert_eq!(unit_blocks(32, true), vec![1, 2, 4, 8, 8, 8, 1]);
        assert_eq!(unit_blocks(3, true), vec![1, 2]);
        assert_eq!(unit_blocks(2, false), vec![1, 1]);
        assert!(unit_blocks(0, true).is_empty());
        for blocks in 0..100 {
            for keep in [true, false] {
                let units = unit_blocks(blocks, keep);
                assert_eq!(units.iter().sum::<u32>(), blocks);
                assert!(units.iter().all(|&n| (1..=MAX_BLOCKS_PER_UNIT).contains(&n)));
                assert!(units.first().is_none_or(|&n| n == 1), "{units:?}");
            }
        }
    }

    #[test]
    fn tensor_parallel_when_activations_do_not_fit() {
        // 100 GiB of activations: 2 ranks of 80 GiB need TP 2 (4 + 50 + 1/8 GiB).
        let p = plan(&cluster(2, 80), &model(100));
        assert_eq!((p.data, p.tensor), (1, 2));
        assert!(!p.fsdp);
        assert!(p.reason.contains("data parallel alone needs"), "{}", p.reason);
        // No peer access: TP is not planned, the plan says it does not fit.
        let p = plan(&Cluster { peer_access: false, ..cluster(2, 80) }, &model(100));
        assert_eq!((p.data, p.tensor), (2, 1));
        assert!(p.reason.contains("does not fit"), "{}", p.reason);
    }

    #[test]
    fn tensor_degree_stays_within_a_node() {
        let c = Cluster { devices_per_node: 2, ..cluster(8, 80) };
        let p = plan(&c, &model(300));
        assert_eq!((p.data, p.tensor), (4, 2));
        assert!(p.reason.contains("does not fit"));
    }

    #[test]
    fn reshard_after_forward_when_keeping_does_not_fit() {
        // 64 GiB of weights over 8 ranks: keeping them gathered costs 56 GiB more per rank.
        let m = ModelSize { weight_bytes: 64 * GIB, gradient_bytes: 64 * GIB, optimizer_bytes: 128 * GIB, ..model(20) };
        let p = plan(&cluster(8, 80), &m);
        assert_eq!((p.data, p.tensor), (8, 1));
        assert!(p.reshard_after_forward);
        assert_eq!(p.per_rank_bytes, 32 * GIB + 20 * GIB + GIB / 4);
        // Re-gathered units stay one block each, the ends in units of their own: the plan counted
        // two blocks in flight.
        assert_eq!((p.unit_blocks, p.forward_prefetch, p.ends_join_blocks), (vec![1; 16], 1, false));
        assert!(!p.reason.contains(ENDS_JOIN_BLOCKS), "{}", p.reason);
    }

    #[test]
    fn unknown_memory_fits_and_reshards() {
        let p = plan(&cluster(2, 0), &model(10));
        assert_eq!((p.data, p.tensor), (2, 1));
        assert!(p.reshard_after_forward);
        assert!(p.reason.contains("unknown"));
    }

    #[test]
    fn one_node_with_peer_access_moves_the_collectives_on_copy_engines() {
        let p = plan(&cluster(2, 80), &model(10));
        assert_eq!((p.collectives, p.sm_carveout), (Collectives::CopyEngine, 0));
        assert!(p.reason.contains("copy engines"), "{}", p.reason);
        // Without peer access, across nodes, or on CPUs: the process group's collectives.
        let no_peers = Cluster { peer_access: false, ..cluster(2, 80) };
        assert_eq!(plan(&no_peers, &model(10)).collectives, Collectives::ProcessGroup);
        let two_nodes = Cluster { devices_per_node: 1, ..cluster(2, 80) };
        assert_eq!(plan(&two_nodes, &model(10)).collectives, Collectives::ProcessGroup);
        assert_eq!(plan(&cluster(2, 0), &model(10)).collectives, Collectives::ProcessGroup);
        assert_eq!(plan(&cluster(1, 80), &model(10)).collectives, Collectives::ProcessGroup);
    }

    #[test]
    fn gpus_with_data_parallelism_over_nccl_leave_sms_to_the_collectives() {
        let p = plan(&Cluster { peer_access: false, ..cluster(2, 80) }, &model(10));
        assert_eq!((p.collectives, p.sm_carveout), (Collectives::ProcessGroup, COMM_SMS));
        assert!(p.reason.contains("SMs"), "{}", p.reason);
        // CPU processes (memory unknown), one process, and tensor parallelism alone: no carveout.
        assert_eq!(plan(&cluster(2, 0), &model(10)).sm_carveout, 0);
        assert_eq!(plan(&cluster(1, 80), &model(10)).sm_carveout, 0);
        let p = plan(&cluster(2, 80), &model(100));
        assert_eq!((p.data, p.tensor, p.sm_carveout), (1, 2, 0));
        // No data parallelism: no FSDP units to group, join or prefetch.
        assert_eq!((p.unit_blocks, p.forward_prefetch, p.ends_join_blocks), (vec![], 0, false));
        let p = plan(&cluster(1, 80), &model(10));
        assert_eq!((p.unit_blocks, p.forward_prefetch, p.ends_join_blocks), (vec![], 0, false));
        // No blocks found: no block units for the ends to join.
        let p = plan(&cluster(2, 80), &ModelSize { blocks: 0, ..model(10) });
        assert_eq!((p.unit_blocks, p.ends_join_blocks), (vec![], false));
    }

    #[test]
    fn a_forced_tensor_degree_plans_everything_else_for_its_degrees() {
        // The planner picks data 2; forced tensor 2 leaves no data parallelism: no carveout, units
        // or prefetch, and the rank's bytes are predicted for the split (not dropped).
        let p = plan_with_tensor(&cluster(2, 80), &model(10), Some(2));
        assert_eq!(
            (p.data, p.tensor, p.fsdp, p.sm_carveout, p.unit_blocks.len(), p.forward_prefetch),
            (1, 2, false, 0, 0, 0)
        );
        assert_eq!(p.per_rank_bytes, 4 * GIB + 5 * GIB + GIB / 8);
        assert!(
            p.reason.contains("forced by tensor_parallel=2") && p.reason.contains("data 2 x tensor 1"),
            "{}",
            p.reason
        );
        // The planner picks tensor 2 (activations do not fit); forced data parallelism gets the
        // collectives' SMs it would have had, and the plan says the degree does not fit.
        let p = plan_with_tensor(&cluster(2, 80), &model(100), Some(1));
        assert_eq!((p.data, p.tensor, p.collectives, p.forward_prefetch), (2, 1, Collectives::CopyEngine, 1));
        assert!(p.reason.contains("does not fit at this tensor degree"), "{}", p.reason);
        // data 2 x tensor 2: FSDP over the data ranks, its collectives on NCCL beside the carveout
        // (the copy engines serve data parallelism alone), with its prefetch.
        let p = plan_with_tensor(&cluster(4, 80), &model(10), Some(2));
        assert_eq!((p.data, p.tensor, p.collectives, p.forward_prefetch), (2, 2, Collectives::ProcessGroup, 1));
        assert_eq!(p.sm_carveout, COMM_SMS);
        // Kept gathered, but beside tensor groups: the ends keep units of their own.
        assert!(!p.reshard_after_forward && !p.ends_join_blocks);
        // Forcing the planner's own degree changes nothing.
        assert_eq!(plan_with_tensor(&cluster(2, 80), &model(10), Some(1)), plan(&cluster(2, 80), &model(10)));
    }
}
