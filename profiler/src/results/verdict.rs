//! Whether a run's numbers can be trusted, and why not. The verdict travels with every row.

use std::fmt;

/// Fewer measured iterations than this and the median, the p99 and the stability check mean little.
pub const MIN_ITERATIONS: usize = 10;
/// The largest spread allowed between the medians of the three measurement windows.
pub const MAX_WINDOW_SPREAD: f64 = 0.10;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    Ok,
    TooFewIterations,
    /// The latency drifted during the measurement: thermal or power throttling, clocks still ramping,
    /// another tenant on the device, or a warm-up too short.
    Unstable,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Ok => "ok",
            Verdict::TooFewIterations => "too_few_iterations",
            Verdict::Unstable => "unstable",
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
}

/// The rule: at least [`MIN_ITERATIONS`] measured iterations; then the measured iterations are cut
/// into three consecutive windows of equal size (the oldest `n mod 3` are left out) and the run is
/// unstable when the largest window median exceeds the smallest by more than [`MAX_WINDOW_SPREAD`].
/// Medians, not means, so that a single hiccup does not condemn a run while a drift does.
pub fn assess(latencies_ns: &[u64]) -> Assessment {
    let n = latencies_ns.len();
    if n < MIN_ITERATIONS {
        return Assessment {
            verdict: Verdict::TooFewIterations,
            reason: format!(
                "{n} measured iteration{}; at least {MIN_ITERATIONS} are needed to trust the median and check stability",
                if n == 1 { "" } else { "s" }
            ),
        };
    }
    let w = n / 3;
    let tail = &latencies_ns[n - 3 * w..];
    let medians: Vec<f64> = tail.chunks(w).map(median).collect();
    let lo = medians.iter().cloned().fold(f64::INFINITY, f64::min);
    let hi = medians.iter().cloned().fold(0.0, f64::max);
    let spread = hi / lo - 1.0;
    let listed = medians.iter().map(|m| format!("{:.3}", m / 1e6)).collect::<Vec<_>>().join(", ");
    let reason = format!(
        "medians of 3 windows of {w} iterations: {listed} ms, spread {:.1}% (limit {:.0}%)",
        spread * 100.0,
        MAX_WINDOW_SPREAD * 100.0
    );
    // Compared as a difference rather than the ratio above, so that exactly 10% is not pushed over
    // the limit by rounding.
    let verdict = if hi - lo > MAX_WINDOW_SPREAD * lo { Verdict::Unstable } else { Verdict::Ok };
    Assessment { verdict, reason }
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

    const MS: u64 = 1_000_000;

    #[test]
    fn fewer_than_ten_iterations_are_too_few() {
        let a = assess(&[MS; 9]);
        assert_eq!(a.verdict, Verdict::TooFewIterations);
        assert!(a.reason.starts_with("9 measured iterations"), "{}", a.reason);
        assert_eq!(assess(&[MS; 10]).verdict, Verdict::Ok);
    }

    #[test]
    fn alternating_steps_are_stable_over_even_windows() {
        let lat: Vec<u64> = (0..30).map(|i| if i % 2 == 0 { MS } else { 3 * MS }).collect();
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert!(a.reason.contains("2.000, 2.000, 2.000 ms"), "{}", a.reason);
    }

    #[test]
    fn a_drift_in_the_last_window_is_unstable() {
        // 20 iterations at 1 ms, 10 at 1.2 ms: the third window's median is 20% higher.
        let lat: Vec<u64> = (0..30).map(|i| if i < 20 { MS } else { 12 * MS / 10 }).collect();
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Unstable);
        assert!(a.reason.contains("spread 20.0%"), "{}", a.reason);
    }

    #[test]
    fn the_limit_is_ten_percent_inclusive() {
        let at = |last: u64| (0..30).map(move |i| if i < 20 { 100 * MS } else { last });
        assert_eq!(assess(&at(110 * MS).collect::<Vec<_>>()).verdict, Verdict::Ok);
        assert_eq!(assess(&at(111 * MS).collect::<Vec<_>>()).verdict, Verdict::Unstable);
    }

    #[test]
    fn single_spikes_do_not_make_a_run_unstable() {
        let mut lat = vec![MS; 30];
        lat[4] = 50 * MS;
        lat[25] = 40 * MS;
        assert_eq!(assess(&lat).verdict, Verdict::Ok);
    }

    #[test]
    fn oldest_remainder_is_left_out_of_the_windows() {
        // 31 iterations: the first (slow, a leftover of warm-up) is not in any window.
        let mut lat = vec![MS; 31];
        lat[0] = 10 * MS;
        let a = assess(&lat);
        assert_eq!(a.verdict, Verdict::Ok, "{}", a.reason);
        assert!(a.reason.contains("windows of 10 iterations"), "{}", a.reason);
    }
}
