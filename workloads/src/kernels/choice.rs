//! Which measured algorithm a convolution keeps: the fastest, unless another within [`TOLERANCE`] of
//! its time needs at least [`MIN_SAVING`] less workspace.
//!
//! Why not simply the fastest: cuDNN's FFT and Winograd algorithms often win by a few percent with
//! workspaces of hundreds of MiB (docs/kernels.md#convolutions). A run without CUDA graphs keeps the
//! largest workspace it met for as long as it runs; a captured step's graph holds each one while its
//! convolution runs, and there the rule changed no peak. Both legacy (`conv2d`) and graph
//! (`conv_nhwc`) convolutions choose by this rule.

/// How much slower than the fastest a leaner candidate may be and still be chosen.
pub(crate) const TOLERANCE: f32 = 0.10;

/// How much less workspace than the fastest's a slower candidate must need to be chosen: below it the
/// memory saved is not worth any time.
pub(crate) const MIN_SAVING: usize = 8 << 20;

/// One candidate as measured: its time and the workspace it needs.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Measured {
    pub ms: f32,
    pub workspace: usize,
}

/// The index in `measured` of the candidate to keep: the fastest (the first of equals), or, of those
/// within [`TOLERANCE`] of its time that need at least [`MIN_SAVING`] less workspace, the one needing
/// the least (the faster of equals); None when there is none.
pub(crate) fn leanest_near_fastest(measured: &[Measured]) -> Option<usize> {
    let (fastest, f) = measured
        .iter()
        .enumerate()
        .min_by(|(_, a), (_, b)| a.ms.total_cmp(&b.ms))?;
    let bound = f.ms * (1.0 + TOLERANCE);
    let leaner = measured
        .iter()
        .enumerate()
        .filter(|(_, m)| m.ms <= bound && m.workspace + MIN_SAVING <= f.workspace)
        .min_by(|(_, a), (_, b)| a.workspace.cmp(&b.workspace).then(a.ms.total_cmp(&b.ms)));
    Some(leaner.map_or(fastest, |(i, _)| i))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn m(ms: f32, workspace: usize) -> Measured {
        Measured { ms, workspace }
    }

    #[test]
    fn keeps_the_fastest_when_every_leaner_one_is_too_slow() {
        // ResNet-50's first 3x3 convolution at batch 128 (f32, on the H100): FFT tiling wins by 29%.
        let found = [
            m(0.590, 160_432_128),
            m(0.731, 463_011_840),
            m(0.830, 1024),
            m(1.382, 0),
        ];
        assert_eq!(leanest_near_fastest(&found), Some(0));
    }

    #[test]
    fn takes_the_leanest_within_the_tolerance() {
        // Its last 3x3 convolution at batch 1: Winograd (45 MiB) 7% ahead of implicit GEMM (2 KiB).
        let found = [m(0.153, 47_185_920), m(0.164, 2048), m(0.231, 0), m(0.442, 614_596_608)];
        assert_eq!(leanest_near_fastest(&found), Some(1));
        // The strided one at batch 128: GEMM (220 MiB) within 6% of FFT tiling (544 MiB).
        let found = [
            m(1.049, 570_425_344),
            m(1.114, 231_211_008),
            m(1.292, 1024),
            m(1.430, 0),
        ];
        assert_eq!(leanest_near_fastest(&found), Some(1));
    }

    #[test]
    fn the_bound_is_relative_to_the_fastest_wherever_it_is_listed() {
        // Not sorted by time (the graph API's candidates come in the heuristic's order).
        let found = [m(1.2, 0), m(1.0, 64 << 20), m(1.09, 4096), m(1.11, 0)];
        assert_eq!(leanest_near_fastest(&found), Some(2));
    }

    #[test]
    fn a_small_saving_is_not_worth_any_time() {
        let found = [m(1.0, 4 << 20), m(1.05, 0)];
        assert_eq!(leanest_near_fastest(&found), Some(0));
        let found = [m(1.0, 9 << 20), m(1.05, 0)];
        assert_eq!(leanest_near_fastest(&found), Some(1));
    }

    #[test]
    fn the_faster_of_equally_lean_candidates() {
        let found = [m(1.05, 0), m(1.0, 0), m(1.02, 0)];
        assert_eq!(leanest_near_fastest(&found), Some(1));
        let found = [m(1.0, 64 << 20), m(1.06, 0), m(1.03, 0)];
        assert_eq!(leanest_near_fastest(&found), Some(2));
    }

    #[test]
    fn none_from_nothing() {
        assert_eq!(leanest_near_fastest(&[]), None);
    }
}
