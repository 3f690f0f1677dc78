//! Pure decisions about the device: which NVRTC target to build for and how big a grid to launch.
//! No GPU needed; unit-tested below (docs/DESIGN.md "Conventions").

/// The NVRTC `--gpu-architecture` for a compute capability. Arch-specific targets ("a") where they
/// exist (sm_90a, sm_100a, sm_101a, sm_103a, sm_120a, sm_121a), so a cubin may use every feature of
/// the exact chip; deepwell's kernels need sm_89+ for the FP8 conversion instructions.
pub fn nvrtc_arch(major: i32, minor: i32) -> Result<String, String> {
    if (major, minor) < (8, 9) {
        return Err(format!(
            "deepwell's CUDA kernels need compute capability 8.9 or newer (FP8 conversions); this GPU is {major}.{minor}"
        ));
    }
    let suffix = if major >= 9 { "a" } else { "" };
    Ok(format!("sm_{major}{minor}{suffix}"))
}

/// Validates a user-given arch such as "sm_90a" (for the compile-all command).
pub fn parse_arch(s: &str) -> Result<String, String> {
    let digits = s.strip_prefix("sm_").map(|r| r.trim_end_matches(['a', 'f']));
    match digits {
        Some(d) if (2..=3).contains(&d.len()) && d.chars().all(|c| c.is_ascii_digit()) => Ok(s.to_owned()),
        _ => Err(format!("'{s}' is not an arch like sm_90a, sm_100a or sm_120a")),
    }
}

/// Blocks for a grid-stride kernel: enough to cover `work` items at `per_block` items per block,
/// capped at one wave (`per_sm` resident blocks on each of `sms` multiprocessors; grid-stride loops
/// cover the rest), and at least one.
pub fn grid_blocks(work: u64, per_block: u64, sms: u32, per_sm: u32) -> u32 {
    let needed = work.div_ceil(per_block.max(1));
    let cap = u64::from(sms.max(1)) * u64::from(per_sm.max(1));
    needed.clamp(1, cap) as u32
}

/// SMs a persistent kernel (one CTA per SM, looping over its tiles: deepwell's FP8 GEMMs) may
/// occupy when `left_to_collectives` SMs are kept free for collectives running beside it on other
/// streams (FSDP's all-gathers and reduce-scatters; torch's SM carveout gives cuBLASLt's GEMMs the
/// same budget): all the others, at least one.
pub fn persistent_sms(sms: u32, left_to_collectives: u32) -> u32 {
    sms.saturating_sub(left_to_collectives).max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arch_strings() {
        assert_eq!(nvrtc_arch(9, 0).unwrap(), "sm_90a");
        assert_eq!(nvrtc_arch(10, 0).unwrap(), "sm_100a");
        assert_eq!(nvrtc_arch(12, 0).unwrap(), "sm_120a");
        assert_eq!(nvrtc_arch(8, 9).unwrap(), "sm_89");
        assert!(nvrtc_arch(8, 0).unwrap_err().contains("8.0"));
    }

    #[test]
    fn arch_parsing() {
        assert!(parse_arch("sm_90a").is_ok() && parse_arch("sm_100a").is_ok() && parse_arch("sm_89").is_ok());
        assert!(parse_arch("90a").is_err() && parse_arch("sm_x").is_err() && parse_arch("sm_1000a").is_err());
    }

    #[test]
    fn persistent_kernels_leave_the_collectives_their_sms() {
        assert_eq!(persistent_sms(132, 0), 132);
        assert_eq!(persistent_sms(132, 8), 124);
        // A carveout as large as the GPU still launches one CTA (the kernel loops over every tile).
        assert_eq!(persistent_sms(132, 132), 1);
        assert_eq!(persistent_sms(132, u32::MAX), 1);
    }

    #[test]
    fn grids() {
        assert_eq!(grid_blocks(0, 256, 132, 8), 1);
        assert_eq!(grid_blocks(1000, 256, 132, 8), 4);
        assert_eq!(grid_blocks(1 << 30, 256, 132, 8), 132 * 8);
    }
}
