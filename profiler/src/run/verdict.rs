//! Whether a run's numbers can be trusted, and why not. The verdict travels with every row.
//!
//! Drift: the measured steps' early half against their late half, two ways at once. A Mann-Whitney
//! rank test at [`SIGNIFICANCE`] says whether the late steps are systematically slower or faster
//! than the early ones rather than noise (ranks, so a few spikes weigh like any other step), and the
//! change of the halves' medians must exceed [`MIN_DRIFT`] to matter in practice. `unstable` needs
//! both: a significant but tiny drift is real and harmless, a large difference that noise explains is
//! not a drift. When the halves are too small for the test ever to reach its significance, the run
//! has too few iterations to judge, never `unstable`.
//!
//! Outliers (modified z-score above [`OUTLIER_Z`], as Iglewicz and Hoaglin define it and hyperfine
//! uses) are counted and reported with how far they move the mean; they do not change the verdict.
//!
//! On a GPU the sampler's [`Evidence`] joins in: clocks slowed by heat or the hardware, and other
//! processes on the device (see `evidence.rs` for what counts). Everything that applies is a
//! [`Flag`] (the `verdict_flags` column); the `verdict` is the first of these, in this precedence:
//! `shared` (someone else computed on the device: the numbers are not this workload's alone),
//! `throttled` (the clocks were slowed by something outside the run), `unstable` (the latencies
//! drifted, cause unknown), `too_few_iterations` (too little to judge), else `ok`. A known cause
//! outranks its symptom: a shared or throttled run usually drifts too. The other flags warn and
//! leave the verdict alone: `power_capped`, `outliers` (moving the mean by more than
//! [`OUTLIER_MEAN_SHIFT`]), `precision_not_reached` (stopped at `--max-duration`), `sampler_off`,
//! `sampler_failed` (then throttling and neighbours were not checked), `processes_unattributed`,
//! `graphs_refused` (CUDA graphs were asked for, but a capture was refused: the steps ran launched
//! from the host, which the `kernel_options` column does not say).

use std::fmt;

use crate::run::evidence::{Evidence, Sampling};

/// Fewer measured iterations than this and the median and the p99 mean little.
pub const MIN_ITERATIONS: usize = 10;
/// The rank test's two-sided significance: the rate at which steady noise is called a drift.
pub const SIGNIFICANCE: f64 = 0.01;
/// The smallest change between the early and late halves' medians that counts as a drift.
pub const MIN_DRIFT: f64 = 0.05;
/// A step whose modified z-score exceeds this is an outlier.
pub const OUTLIER_Z: f64 = 3.5;
/// Outliers that move the mean by more than this (relative) are warned about.
pub const OUTLIER_MEAN_SHIFT: f64 = 0.01;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    TooFewIterations,
    /// The latency drifted during the measurement: thermal or power throttling, clocks still ramping,
    /// another tenant on the device, or a warm-up too short.
    Unstable,
    /// The GPU's clocks were slowed (heat, hardware slowdown, power brake) during the measurement.
    Throttled,
    /// Another process computed on the same device or slice during the measurement.
    Shared,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::TooFewIterations => "too_few_iterations",
            Verdict::Unstable => "unstable",
            Verdict::Throttled => "throttled",
            Verdict::Shared => "shared",
        }
    }
}

/// Something that applies to a run's numbers. The first four decide the verdict, in this order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Flag {
    Shared,
    Throttled,
    Unstable,
    TooFewIterations,
    PowerCapped,
    Outliers,
    PrecisionNotReached,
    SamplerOff,
    SamplerFailed,
    ProcessesUnattributed,
    GraphsRefused,
}

impl Flag {
    pub fn as_str(self) -> &'static str {
        match self {
            Flag::Shared => "shared",
            Flag::Throttled => "throttled",
            Flag::Unstable => "unstable",
            Flag::TooFewIterations => "too_few_iterations",
            Flag::PowerCapped => "power_capped",
            Flag::Outliers => "outliers",
            Flag::PrecisionNotReached => "precision_not_reached",
            Flag::SamplerOff => "sampler_off",
            Flag::SamplerFailed => "sampler_failed",
            Flag::ProcessesUnattributed => "processes_unattributed",
            Flag::GraphsRefused => "graphs_refused",
        }
    }

    /// The verdict this flag gives when no flag before it applies; `None` for warnings.
    fn verdict(self) -> Option<Verdict> {
        match self {
            Flag::Shared => Some(Verdict::Shared),
            Flag::Throttled => Some(Verdict::Throttled),
            Flag::Unstable => Some(Verdict::Unstable),
            Flag::TooFewIterations => Some(Verdict::TooFewIterations),
            _ => None,
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct Assessment {
    pub verdict: Verdict,
    pub reason: String,
    /// Steps whose modified z-score exceeds [`OUTLIER_Z`].
    pub outliers: usize,
    /// (mean with the outliers − mean without) / mean without.
    pub outlier_mean_shift: f64,
    /// Everything that applies, in precedence order; the verdict is decided by the first.
    pub flags: Vec<Flag>,
}

impl Assessment {
    /// Adds what the GPU sampler saw, and a stop bound's note, to the latencies' assessment.
    pub fn with_evidence(mut self, evidence: &Evidence, stop_note: Option<&str>) -> Self {
        let mut add = |flag: Flag, on: bool| {
            if on {
                self.flags.push(flag);
            }
        };
        add(Flag::Shared, evidence.shared());
        add(Flag::Throttled, evidence.throttled());
        add(Flag::PowerCapped, evidence.power_cap_share.is_some_and(|s| s > 0.0));
        add(Flag::PrecisionNotReached, stop_note.is_some());
        add(Flag::SamplerOff, evidence.sampling == Sampling::Off);
        add(Flag::SamplerFailed, matches!(evidence.sampling, Sampling::Failed(_)));
        add(Flag::ProcessesUnattributed, evidence.unattributed);
        self.flags.sort();
        self.flags.dedup();
        self.verdict = self.flags.iter().find_map(|f| f.verdict()).unwrap_or(Verdict::Ok);
        let mut reason = self.reason.clone();
        for extra in [stop_note.map(str::to_string), evidence.describe()]
            .into_iter()
            .flatten()
        {
            reason = format!("{reason}; {extra}");
        }
        self.reason = reason;
        self
    }

    /// Adds `graphs_refused` when the workload's CUDA-graph captures were refused (one line per
    /// reason), with why: the steps ran launched from the host although the options asked for graphs.
    /// A warning: the numbers are right for what ran.
    pub fn with_refused_graphs(mut self, reasons: &[String]) -> Self {
        if !reasons.is_empty() {
            self.flags.push(Flag::GraphsRefused);
            self.flags.sort();
            self.flags.dedup();
            self.reason = format!(
                "{}; CUDA graphs refused, steps launched from the host: {}",
                self.reason,
                reasons.join("; ")
            );
        }
        self
    }

    /// The flags as the `verdict_flags` column holds them.
    pub fn flag_names(&self) -> Vec<&'static str> {
        self.flags.iter().map(|f| f.as_str()).collect()
    }

    /// A warning for the user when the outliers move the mean by more than [`OUTLIER_MEAN_SHIFT`].
    pub fn outlier_warning(&self) -> Option<String> {
        (self.outlier_mean_shift.abs() > OUTLIER_MEAN_SHIFT).then(|| {
            format!(
                "{} outlier step(s) move the mean by {:+.1}% (p50 is unaffected); an interrupted or shared device?",
                self.outliers,
                self.outlier_mean_shift * 100.0
            )
        })
    }
}

pub fn assess(latencies_ns: &[u64]) -> Assessment {
    let n = latencies_ns.len();
    let half = n / 2;
    // With an odd count the middle step belongs to neither half.
    judge(latencies_ns, &latencies_ns[..half], &latencies_ns[n - half..], "")
}

/// As [`assess`], for the decode steps of whole generations of `steps` each: drift is judged between
/// the first and the last half of the generations, whose steps cover the same positions (a step's
/// time grows with the context it attends to, so the two halves of one generation differ anyway).
pub fn assess_generations(latencies_ns: &[u64], steps: usize) -> Assessment {
    let generations = latencies_ns.len() / steps.max(1);
    if generations < 2 {
        let mut a = judge(latencies_ns, &[], &[], "");
        if a.verdict == Verdict::Ok {
            a.verdict = Verdict::TooFewIterations;
            a.flags.push(Flag::TooFewIterations);
            a.flags.sort();
            a.reason =
                format!("{generations} measured generation; at least 2 are needed to judge drift between generations");
        }
        return a;
    }
    let half = generations / 2;
    judge(
        latencies_ns,
        &latencies_ns[..half * steps],
        &latencies_ns[(generations - half) * steps..],
        " of generations",
    )
}

/// The verdict on `latencies_ns` from its outliers and the drift between `early` and `late` (the
/// halves `halves` names in the reason).
fn judge(latencies_ns: &[u64], early: &[u64], late: &[u64], halves: &str) -> Assessment {
    let n = latencies_ns.len();
    let (outliers, outlier_mean_shift) = outliers(latencies_ns);
    let assessment = |verdict: Verdict, reason| {
        let mut flags: Vec<Flag> = match verdict {
            Verdict::TooFewIterations => vec![Flag::TooFewIterations],
            Verdict::Unstable => vec![Flag::Unstable],
            _ => Vec::new(),
        };
        if outlier_mean_shift.abs() > OUTLIER_MEAN_SHIFT {
            flags.push(Flag::Outliers);
        }
        Assessment {
            verdict,
            reason,
            outliers,
            outlier_mean_shift,
            flags,
        }
    };
    if n < MIN_ITERATIONS {
        let s = if n == 1 { "" } else { "s" };
        return assessment(
            Verdict::TooFewIterations,
            format!(
                "{n} measured iteration{s}; at least {MIN_ITERATIONS} are needed to trust the median and judge drift"
            ),
        );
    }
    if early.is_empty() || late.is_empty() {
        return assessment(Verdict::Ok, String::new());
    }
    let (m_early, m_late) = (median(early), median(late));
    let change = m_late / m_early - 1.0;
    let p = mann_whitney_p(early, late);
    let reason = format!(
        "early/late half{halves} medians {:.3}/{:.3} ms ({:+.1}%, drift counts above {:.0}%), rank test p = {:.2e} (significant below {SIGNIFICANCE})",
        m_early / 1e6,
        m_late / 1e6,
        change * 100.0,
        MIN_DRIFT * 100.0,
        p
    );
    let verdict = if p < SIGNIFICANCE && change.abs() > MIN_DRIFT {
        Verdict::Unstable
    } else {
        Verdict::Ok
    };
    assessment(verdict, reason)
}

/// The two-sided p-value of the Mann-Whitney U test between `a` and `b`: exact where there are no
/// ties and the groups are small, the normal approximation with the tie correction otherwise.
pub fn mann_whitney_p(a: &[u64], b: &[u64]) -> f64 {
    let (n1, n2) = (a.len(), b.len());
    // U = pairs where a's step is above b's, ties counting a half.
    let mut u = 0.0;
    for &x in a {
        for &y in b {
            u += if x > y {
                1.0
            } else if x == y {
                0.5
            } else {
                0.0
            };
        }
    }
    let mut all: Vec<u64> = a.iter().chain(b).copied().collect();
    all.sort_unstable();
    let ties = all.windows(2).any(|w| w[0] == w[1]);
    let mean = (n1 * n2) as f64 / 2.0;
    if !ties && n1 <= 25 && n2 <= 25 {
        return exact_p(n1, n2, u);
    }
    // Tie correction: Σ(t³ − t) over groups of equal values.
    let mut tie_sum = 0.0;
    let mut i = 0;
    while i < all.len() {
        let j = all[i..].iter().take_while(|&&v| v == all[i]).count();
        tie_sum += (j * j * j - j) as f64;
        i += j;
    }
    let n = (n1 + n2) as f64;
    let var = (n1 * n2) as f64 / 12.0 * ((n + 1.0) - tie_sum / (n * (n - 1.0)));
    if var <= 0.0 {
        return 1.0;
    }
    // Continuity correction of a half toward the mean.
    let z = ((u - mean).abs() - 0.5).max(0.0) / var.sqrt();
    (2.0 * normal_upper_tail(z)).min(1.0)
}

/// Exact two-sided p of U for groups of `n1` and `n2` without ties: the count of arrangements by U.
fn exact_p(n1: usize, n2: usize, u: f64) -> f64 {
    let max = n1 * n2;
    // counts[i][j][k]: arrangements of i and j values with U = k, built one value at a time.
    let mut prev: Vec<Vec<f64>> = vec![vec![0.0; max + 1]; n2 + 1];
    for row in prev.iter_mut() {
        row[0] = 1.0; // i = 0: U is 0 whatever j.
    }
    for i in 1..=n1 {
        let mut cur: Vec<Vec<f64>> = vec![vec![0.0; max + 1]; n2 + 1];
        cur[0][0] = 1.0; // j = 0
        for j in 1..=n2 {
            for k in 0..=i * j {
                // The largest value is from a (above all j of b's: adds j) or from b (adds 0).
                let from_a = if k >= j { prev[j][k - j] } else { 0.0 };
                cur[j][k] = from_a + cur[j - 1][k];
            }
        }
        prev = cur;
    }
    let counts = &prev[n2];
    let total: f64 = counts.iter().sum();
    let d = (u - max as f64 / 2.0).abs();
    // Both tails: U as far from its mean as observed, either way.
    let tail: f64 = counts
        .iter()
        .enumerate()
        .filter(|(k, _)| (*k as f64 - max as f64 / 2.0).abs() >= d - 1e-9)
        .map(|(_, c)| c)
        .sum();
    (tail / total).min(1.0)
}

/// P(Z > z) for a standard normal Z (Abramowitz and Stegun 7.1.26 through erfc; error below 1.5e-7).
fn normal_upper_tail(z: f64) -> f64 {
    let x = z / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.3275911 * x);
    let poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))));
    0.5 * poly * (-x * x).exp()
}

/// (count, relative mean shift) of the steps whose modified z-score exceeds [`OUTLIER_Z`].
fn outliers(latencies_ns: &[u64]) -> (usize, f64) {
    if latencies_ns.len() < 3 {
        return (0, 0.0);
    }
    let med = median(latencies_ns);
    let deviations: Vec<u64> = latencies_ns
        .iter()
        .map(|&l| (l as f64 - med).abs().round() as u64)
        .collect();
    let mad = median(&deviations);
    if mad == 0.0 {
        return (0, 0.0);
    }
    let is_outlier = |l: u64| 0.6745 * (l as f64 - med).abs() / mad > OUTLIER_Z;
    let (kept, count) = latencies_ns.iter().fold((Vec::new(), 0), |(mut kept, count), &l| {
        if is_outlier(l) {
            (kept, count + 1)
        } else {
            kept.push(l as f64);
            (kept, count)
        }
    });
    let mean_all = latencies_ns.iter().map(|&l| l as f64).sum::<f64>() / latencies_ns.len() as f64;
    let mean_kept = kept.iter().sum::<f64>() / kept.len() as f64;
    (count, mean_all / mean_kept - 1.0)
}

fn median(window: &[u64]) -> f64 {
    let mut v = window.to_vec();
    v.sort_unstable();
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m] as f64
    } else {
        (v[m - 1] as f64 + v[m] as f64) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    const MS: u64 = 1_000_000;

    fn noise(seed: u64, n: usize, spread: f64) -> Vec<u64> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n)
            .map(|_| ((10.0 + spread * (rng.random::<f64>() - 0.5)) * MS as f64) as u64)
            .collect()
    }

    #[test]
    fn fewer_than_ten_iterations_are_too_few() {
        let a = assess(&[MS; 9]);
        assert_eq!(a.verdict, Verdict::TooFewIterations);
        assert!(a.reason.starts_with("9 measured iterations"), "{}", a.reason);
        assert_eq!(assess(&[MS; 10]).verdict, Verdict::Ok);
    }

    #[test]
    fn generations_are_judged_against_each_other_not_their_first_steps_against_their_last() {
        // Each generation's steps grow from 10 to 20 ms as the context grows; four alike generations
        // are steady, where comparing the halves of all steps (assess) calls them unstable.
        let one: Vec<u64> = (0..16).map(|i| (10 + 10 * i / 15) * MS).collect();
        let first_and_second = one.repeat(2);
        let four = one.repeat(4);
        assert_eq!(assess(&one).verdict, Verdict::Unstable);
        let a = assess_generations(&four, 16);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert!(a.reason.contains("half of generations medians"), "{}", a.reason);
        assert_eq!(assess_generations(&first_and_second, 16).verdict, Verdict::Ok);
        // Four generations, the last two 50% slower throughout: a drift.
        let slower: Vec<u64> = one.iter().map(|l| l * 3 / 2).collect();
        let drifting = [one.clone(), one.clone(), slower.clone(), slower].concat();
        assert_eq!(assess_generations(&drifting, 16).verdict, Verdict::Unstable);
        // One generation cannot be judged against another.
        let a = assess_generations(&one, 16);
        assert_eq!(a.verdict, Verdict::TooFewIterations);
        assert!(a.reason.starts_with("1 measured generation"), "{}", a.reason);
        assert_eq!(a.flags, vec![Flag::TooFewIterations]);
    }

    #[test]
    fn steady_noise_is_called_a_drift_no_more_often_than_the_significance() {
        // Uniform noise of ±20% around 10 ms, 1000 seeds, 30 and 200 steps: false alarms at most 1%
        // (plus the simulation's own error, ~0.3 points).
        for n in [30, 200] {
            let alarms = (0..1000)
                .filter(|&s| assess(&noise(s, n, 4.0)).verdict == Verdict::Unstable)
                .count();
            assert!(alarms <= 13, "{n} steps: {alarms} false alarms in 1000");
        }
    }

    #[test]
    fn a_slow_ramp_is_found_and_noise_of_the_same_spread_is_not() {
        // 200 steps rising 20% end to end inside the same ±20% noise (the halves' medians ~10% apart):
        // found in nearly every seed.
        let found = (0..1000)
            .filter(|&s| {
                let lat: Vec<u64> = noise(s, 200, 4.0)
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| (l as f64 * (1.0 + 0.2 * i as f64 / 199.0)) as u64)
                    .collect();
                assess(&lat).verdict == Verdict::Unstable
            })
            .count();
        assert!(found >= 900, "{found} of 1000 ramps found");
    }

    #[test]
    fn a_significant_but_small_change_is_not_unstable() {
        // The late half 2% slower, without noise: the rank test is certain, the change too small.
        let lat: Vec<u64> = (0..40).map(|i| if i < 20 { 100 * MS } else { 102 * MS }).collect();
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert!(a.reason.contains("+2.0%"), "{}", a.reason);
        let lat: Vec<u64> = (0..40).map(|i| if i < 20 { 100 * MS } else { 120 * MS }).collect();
        assert_eq!(assess(&lat).verdict, Verdict::Unstable);
    }

    #[test]
    fn alternating_steps_are_stable() {
        // Halves of 15 alternating 1 and 3 ms steps have medians 1 and 3 ms (one more of each), a
        // large difference that the rank test rightly calls noise.
        let lat: Vec<u64> = (0..30).map(|i| if i % 2 == 0 { MS } else { 3 * MS }).collect();
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert!(
            a.reason.contains("1.000/3.000 ms") && a.reason.contains("p = 7.38e-1"),
            "{}",
            a.reason
        );
    }

    #[test]
    fn the_exact_test_and_the_approximation_agree_where_both_apply() {
        let (a, b): (Vec<u64>, Vec<u64>) = (
            (0..20).map(|i| 100 + 3 * i).collect(),
            (0..20).map(|i| 130 + 3 * i + 1).collect(),
        );
        let exact = mann_whitney_p(&a, &b);
        // The same data with one tie forces the approximation.
        let mut b2 = b.clone();
        b2[0] = a[19];
        let approx = mann_whitney_p(&a, &b2);
        assert!(
            exact < 1e-3 && approx < 1e-3 && (exact.ln() - approx.ln()).abs() < 1.0,
            "{exact} {approx}"
        );
        // Identical groups: no evidence at all.
        assert_eq!(mann_whitney_p(&[5; 10], &[5; 10]), 1.0);
        // Groups of 5 with every early step faster: the smallest exact p, 2 / C(10, 5).
        assert!((mann_whitney_p(&[1, 2, 3, 4, 5], &[6, 7, 8, 9, 10]) - 2.0 / 252.0).abs() < 1e-12);
    }

    #[test]
    fn the_verdict_follows_the_precedence_and_every_flag_is_kept() {
        use crate::gpu::sampler::{GpuProcess, Sample};
        use crate::run::evidence::{reasons, Expected};
        // A drifting run (+20% in the late half) on a throttled, shared GPU at its power cap.
        let lat: Vec<u64> = (0..40).map(|i| if i < 20 { 100 * MS } else { 120 * MS }).collect();
        let readings = |reasons: u64, others: &[u32]| -> Vec<Sample> {
            (0..20)
                .map(|_| Sample {
                    gpu_throttle_reasons: Some(reasons),
                    compute_processes: Some(
                        [1].iter()
                            .chain(others)
                            .map(|&pid| GpuProcess {
                                pid,
                                name: Some("p".into()),
                                used_mib: None,
                            })
                            .collect(),
                    ),
                    ..Default::default()
                })
                .collect()
        };
        let us = Expected {
            pids: vec![1],
            mps_server: false,
        };
        let judge = |samples: Vec<Sample>| assess(&lat).with_evidence(&Evidence::from_samples(&samples, &us), None);
        let all = judge(readings(reasons::HW_THERMAL | reasons::SW_POWER_CAP, &[2]));
        assert_eq!(all.verdict, Verdict::Shared);
        assert_eq!(all.flag_names(), ["shared", "throttled", "unstable", "power_capped"]);
        assert!(
            all.reason
                .contains("other processes on the device: 2 p (100% of readings)"),
            "{}",
            all.reason
        );
        assert_eq!(judge(readings(reasons::HW_THERMAL, &[])).verdict, Verdict::Throttled);
        assert_eq!(judge(readings(reasons::SW_POWER_CAP, &[])).verdict, Verdict::Unstable);
        // The power cap alone, on steady latencies: ok, flagged.
        let steady = assess(&[MS; 40]).with_evidence(
            &Evidence::from_samples(&readings(reasons::SW_POWER_CAP, &[]), &us),
            None,
        );
        assert_eq!(
            (steady.verdict, steady.flag_names()),
            (Verdict::Ok, vec!["power_capped"])
        );
        // A failed sampler and a stop bound warn and leave the verdict alone.
        let failed = assess(&[MS; 40]).with_evidence(
            &Evidence::none(Sampling::Failed("NVML: Unknown".into())),
            Some("stopped at the 20 s bound"),
        );
        assert_eq!(
            (failed.verdict, failed.flag_names()),
            (Verdict::Ok, vec!["precision_not_reached", "sampler_failed"])
        );
        assert!(
            failed
                .reason
                .contains("; stopped at the 20 s bound; GPU sampler failed (NVML: Unknown)"),
            "{}",
            failed.reason
        );
        // Too few iterations on a shared device: shared comes first.
        let few = assess(&[MS; 5]).with_evidence(&Evidence::from_samples(&readings(0, &[9]), &us), None);
        assert_eq!(
            (few.verdict, few.flag_names()),
            (Verdict::Shared, vec!["shared", "too_few_iterations"])
        );
    }

    #[test]
    fn single_spikes_are_outliers_not_drift_and_are_reported() {
        let mut lat: Vec<u64> = noise(1, 30, 0.5);
        lat[4] = 50 * MS;
        lat[25] = 40 * MS;
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert_eq!(a.outliers, 2);
        // Two spikes of ~35 ms over 30 steps of 10 ms move the mean by about 23%.
        assert!((a.outlier_mean_shift - 0.23).abs() < 0.02, "{}", a.outlier_mean_shift);
        assert!(a
            .outlier_warning()
            .unwrap()
            .contains("2 outlier step(s) move the mean by +2"));
        assert_eq!(a.flags, vec![Flag::Outliers]);
        assert_eq!(assess(&noise(2, 30, 0.5)).outlier_warning(), None);
    }
}
