//! How well a run knows its headline numbers: 95% intervals for the mean latency and the throughput
//! (batch means) and for p50 and p99 (order statistics), or why there is none.
//!
//! Mean: consecutive steps are correlated (clocks ramping, caches, the allocator, a neighbour), so
//! s/√n would be too narrow. The measured steps are cut into about 20 consecutive batches; batches
//! long enough to forget each other have nearly independent means, and a t interval over those means
//! holds. Batch means rather than a block bootstrap: no resampling, so the same samples give the same
//! interval every time, and one parameter (the batch count) instead of a block length and a
//! resample count. Throughput is `1000 / mean_ms · batch`, decreasing in the mean: its interval is
//! the mean's ends mapped through it.
//!
//! Percentiles: distribution-free intervals between two order statistics of the exact samples, whose
//! ranks come from the binomial distribution of how many samples fall below the true quantile. They
//! assume independent steps; a 95% interval for p99 needs at least 299 samples (0.99^299 < 0.05).

/// The confidence of every interval.
pub const CONFIDENCE: f64 = 0.95;

/// The number of batches the mean's interval aims for.
const BATCHES: usize = 20;

/// The fewest steps for the mean's interval: below, a verdict of too few iterations applies anyway.
const MIN_FOR_MEAN: usize = 10;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Interval {
    pub low: f64,
    pub high: f64,
}

impl Interval {
    /// The larger distance from `centre` to an end, relative to `centre`: the `± x%` of a summary.
    pub fn relative_half_width(&self, centre: f64) -> f64 {
        (centre - self.low).abs().max((self.high - centre).abs()) / centre.abs()
    }
}

/// An interval, or why the samples do not give one.
pub type Estimate = Result<Interval, String>;

/// The four intervals of a run, in milliseconds and samples per second.
#[derive(Debug, Clone, PartialEq)]
pub struct Uncertainty {
    pub mean_ms: Estimate,
    pub throughput: Estimate,
    pub p50_ms: Estimate,
    pub p99_ms: Estimate,
}

impl Uncertainty {
    pub fn of(latencies_ns: &[u64], batch: usize) -> Uncertainty {
        Uncertainty::of_runs(latencies_ns, batch, 1)
    }

    /// As [`Uncertainty::of`], for steps measured in runs of `unit` alike runs (a generation's decode
    /// steps, whose time grows with the context): the mean's batches are whole runs, so that the
    /// rise within a run is not taken for noise.
    pub fn of_runs(latencies_ns: &[u64], batch: usize, unit: usize) -> Uncertainty {
        let ms: Vec<f64> = latencies_ns.iter().map(|&l| l as f64 / 1e6).collect();
        let mean_ms = mean_interval_in_runs(&ms, unit);
        // Through 1000 / mean, an interval that reaches zero has no upper end: none is given.
        let throughput = mean_ms.clone().and_then(|m| {
            if m.low > 0.0 {
                Ok(throughput_of(m, batch))
            } else {
                Err(format!(
                    "the mean's interval reaches {:.3} ms: the steps are too spread for a throughput interval",
                    m.low
                ))
            }
        });
        Uncertainty {
            mean_ms,
            throughput,
            p50_ms: quantile_interval(&ms, 0.5),
            p99_ms: quantile_interval(&ms, 0.99),
        }
    }

    /// Why any interval is missing, joined; `None` when all are there.
    pub fn note(&self) -> Option<String> {
        let mut reasons: Vec<String> = [("mean", &self.mean_ms), ("p50", &self.p50_ms), ("p99", &self.p99_ms)]
            .iter()
            .filter_map(|(what, e)| e.as_ref().err().map(|why| format!("{what}: {why}")))
            .collect();
        // The throughput's own reason, where the mean has an interval and it still has none.
        if let (Ok(_), Err(why)) = (&self.mean_ms, &self.throughput) {
            reasons.push(format!("throughput: {why}"));
        }
        (!reasons.is_empty()).then(|| reasons.join("; "))
    }
}

/// The throughput interval of a mean-latency interval (ms): `1000 / mean · batch` is decreasing in
/// the mean, so the ends swap.
fn throughput_of(mean_ms: Interval, batch: usize) -> Interval {
    Interval {
        low: 1000.0 / mean_ms.high * batch as f64,
        high: 1000.0 / mean_ms.low * batch as f64,
    }
}

/// The throughput's 95% interval as a relative half-width (the larger side), when the steps give one:
/// what `--target-precision` waits for. The batch size cancels out.
/// `unit`: the steps of one run of alike runs (1 for steps alike), as [`Uncertainty::of_runs`].
pub fn throughput_precision(latencies_ns: &[u64], unit: usize) -> Option<f64> {
    let ms: Vec<f64> = latencies_ns.iter().map(|&l| l as f64 / 1e6).collect();
    let mean = mean_interval_in_runs(&ms, unit).ok().filter(|i| i.low > 0.0)?;
    let centre = 1000.0 / (ms.iter().sum::<f64>() / ms.len() as f64);
    Some(throughput_of(mean, 1).relative_half_width(centre))
}

/// The batch-means interval of the mean of `x` (in order of measurement).
pub fn mean_interval(x: &[f64]) -> Estimate {
    mean_interval_in_runs(x, 1)
}

/// As [`mean_interval`], each batch a whole number of runs of `unit` steps (the steps of one
/// generation); with runs, at least two of them.
fn mean_interval_in_runs(x: &[f64], unit: usize) -> Estimate {
    let n = x.len();
    if n < MIN_FOR_MEAN {
        return Err(format!("{n} steps; an interval needs at least {MIN_FOR_MEAN}"));
    }
    let unit = unit.max(1);
    let runs = n / unit;
    if unit > 1 && runs < 2 {
        return Err(format!(
            "{runs} generation; an interval needs at least 2, each a batch of its steps"
        ));
    }
    let size = unit * (runs / BATCHES).max(1);
    let k = n / size;
    // The earliest steps are the ones left over: they are the likeliest to still be warming up.
    let used = &x[n - k * size..];
    let means: Vec<f64> = used.chunks(size).map(|c| c.iter().sum::<f64>() / size as f64).collect();
    let mean = means.iter().sum::<f64>() / k as f64;
    let var = means.iter().map(|m| (m - mean).powi(2)).sum::<f64>() / (k - 1) as f64;
    let half = t_975(k - 1) * (var / k as f64).sqrt();
    // The interval is for the mean of every step: centred on it, as the reported mean is.
    let all = x.iter().sum::<f64>() / n as f64;
    Ok(Interval {
        low: all - half,
        high: all + half,
    })
}

/// The distribution-free interval of the `q` quantile of `x`, between two order statistics.
pub fn quantile_interval(x: &[f64], q: f64) -> Estimate {
    let n = x.len();
    let alpha = 1.0 - CONFIDENCE;
    // P(all n samples fall below the quantile) = q^n: the top order statistic cannot cover more.
    let top_miss = q.powi(n as i32);
    if n == 0 || top_miss > alpha {
        let need = (alpha.ln() / q.ln()).ceil() as usize;
        return Err(format!(
            "{n} steps; a {:.0}% interval for p{} needs at least {need}",
            CONFIDENCE * 100.0,
            q * 100.0
        ));
    }
    // cdf[j] = P(B ≤ j), B ~ Binomial(n, q) the count of samples below the quantile.
    let cdf = binomial_cdf(n, q);
    let below = |j: usize| if j == 0 { 0.0 } else { cdf[j - 1] }; // P(B < j)
    let above = |j: usize| 1.0 - below(j); // P(B ≥ j)
                                           // The upper rank first, spending at most half the miss probability (or all the top rank leaves,
                                           // for p99 at a few hundred samples); the lower rank takes what remains, so that the interval misses
                                           // with probability below(l) + above(u) ≤ 1 − CONFIDENCE.
    let u = (1..=n).find(|&u| above(u) <= alpha / 2.0).unwrap_or(n);
    let lower_budget = alpha - above(u);
    let Some(l) = (1..=u).rev().find(|&l| below(l) <= lower_budget) else {
        return Err(format!(
            "{n} steps are too few for a {:.0}% interval of p{}",
            CONFIDENCE * 100.0,
            q * 100.0
        ));
    };
    let mut sorted = x.to_vec();
    sorted.sort_by(f64::total_cmp);
    Ok(Interval {
        low: sorted[l - 1],
        high: sorted[u - 1],
    })
}

/// P(B ≤ j) for j = 0..n, B ~ Binomial(n, p), through log-space terms (n can be a million steps).
fn binomial_cdf(n: usize, p: f64) -> Vec<f64> {
    let (lp, lq) = (p.ln(), (1.0 - p).ln());
    let mut log_pmf = Vec::with_capacity(n + 1);
    let mut log_choose = 0.0f64;
    for j in 0..=n {
        if j > 0 {
            log_choose += ((n - j + 1) as f64).ln() - (j as f64).ln();
        }
        log_pmf.push(log_choose + j as f64 * lp + (n - j) as f64 * lq);
    }
    let mut acc = 0.0;
    log_pmf
        .into_iter()
        .map(|l| {
            acc += l.exp();
            acc.min(1.0)
        })
        .collect()
}

/// The 97.5% quantile of Student's t with `df` degrees of freedom (two-sided 95%).
fn t_975(df: usize) -> f64 {
    const TABLE: [f64; 30] = [
        12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228, 2.201, 2.179, 2.160, 2.145, 2.131,
        2.120, 2.110, 2.101, 2.093, 2.086, 2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
    ];
    match df {
        0 => f64::INFINITY,
        1..=30 => TABLE[df - 1],
        // The normal quantile with the first two terms of its expansion in 1/df: within 0.001
        // above 30.
        _ => {
            let (z, d): (f64, f64) = (1.959964, df as f64);
            z + (z.powi(3) + z) / (4.0 * d) + (5.0 * z.powi(5) + 16.0 * z.powi(3) + 3.0 * z) / (96.0 * d * d)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    fn normal(rng: &mut StdRng) -> f64 {
        // Box-Muller: rand 0.9 without rand_distr.
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-300), rng.random());
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// The share of `seeds` samples of `n` whose interval covers `truth`.
    fn coverage(
        seeds: u64,
        n: usize,
        truth: f64,
        draw: impl Fn(&mut StdRng, usize) -> Vec<f64>,
        interval: impl Fn(&[f64]) -> Estimate,
    ) -> f64 {
        let covered = (0..seeds)
            .filter(|&s| {
                let x = draw(&mut StdRng::seed_from_u64(s), n);
                let i = interval(&x).unwrap();
                i.low <= truth && truth <= i.high
            })
            .count();
        covered as f64 / seeds as f64
    }

    fn iid(f: fn(&mut StdRng) -> f64) -> impl Fn(&mut StdRng, usize) -> Vec<f64> {
        move |rng, n| (0..n).map(|_| f(rng)).collect()
    }

    fn near_95(c: f64, what: &str) {
        eprintln!("{what}: coverage {c:.3}");
        assert!((c - 0.95).abs() <= 0.025, "{what}: coverage {c:.3}");
    }

    #[test]
    fn a_generation_s_rise_is_not_noise_when_batches_are_whole_generations() {
        // Ten alike generations, each of 127 decode steps rising from 10 to 20 ms without noise: the
        // mean is known exactly, so whole-generation batches give a zero-width interval, where
        // batches cut across generations see the rise as noise.
        let one: Vec<u64> = (0..127).map(|i| 10_000_000 + 10_000_000 * i / 126).collect();
        let steps = one.repeat(10);
        let cut = Uncertainty::of(&steps, 1).throughput.unwrap();
        let whole = Uncertainty::of_runs(&steps, 1, 127).throughput.unwrap();
        let centre = 1000.0 / (steps.iter().sum::<u64>() as f64 / steps.len() as f64 / 1e6);
        assert!(cut.relative_half_width(centre) > 0.01, "{cut:?}");
        assert!(whole.relative_half_width(centre) < 1e-9, "{whole:?}");
        assert!(throughput_precision(&steps, 127).unwrap() < 1e-9);
        assert!(throughput_precision(&steps, 1).unwrap() > 0.01);
        // One generation gives no interval, and says why.
        let e = Uncertainty::of_runs(&one, 1, 127).mean_ms.unwrap_err();
        assert!(e.contains("1 generation; an interval needs at least 2"), "{e}");
    }

    #[test]
    fn mean_intervals_cover_at_their_nominal_rate() {
        // Latencies in ms: normal 10 ± 1; lognormal with σ = 0.5 and 1 (mean e^(σ²/2)); AR(1) with
        // φ = 0.5 around 10 (each step leans on the last).
        let normal_ms = iid(|r| 10.0 + normal(r));
        near_95(coverage(2000, 30, 10.0, &normal_ms, mean_interval), "normal n=30");
        near_95(coverage(2000, 300, 10.0, &normal_ms, mean_interval), "normal n=300");
        near_95(
            coverage(
                2000,
                300,
                (0.125f64).exp(),
                iid(|r| (0.5 * normal(r)).exp()),
                mean_interval,
            ),
            "lognormal 0.5 n=300",
        );
        near_95(
            coverage(2000, 3000, (0.5f64).exp(), iid(|r| normal(r).exp()), mean_interval),
            "lognormal 1 n=3000",
        );
        let ar1 = |rng: &mut StdRng, n: usize| {
            let mut e = 0.0;
            (0..n)
                .map(|_| {
                    e = 0.5 * e + normal(rng);
                    10.0 + e
                })
                .collect::<Vec<f64>>()
        };
        near_95(coverage(2000, 1000, 10.0, ar1, mean_interval), "AR(1) n=1000");
        // The naive s/√n interval on the same AR(1) steps covers far less: what batch means fix.
        let naive = |x: &[f64]| -> Estimate {
            let n = x.len() as f64;
            let m = x.iter().sum::<f64>() / n;
            let s = (x.iter().map(|v| (v - m).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
            Ok(Interval {
                low: m - 1.96 * s / n.sqrt(),
                high: m + 1.96 * s / n.sqrt(),
            })
        };
        assert!(coverage(2000, 1000, 10.0, ar1, naive) < 0.85);
    }

    #[test]
    fn percentile_intervals_cover_at_their_nominal_rate() {
        // The true p50 of N(10, 1) is 10; the true p99 of a lognormal(0, 1) is e^2.3263.
        // Their exact coverage is at least 95% (ranks are whole numbers); the simulation's own error
        // at 2000 seeds is about half a point.
        near_95(
            coverage(2000, 30, 10.0, iid(|r| 10.0 + normal(r)), |x| quantile_interval(x, 0.5)),
            "p50 n=30",
        );
        near_95(
            coverage(2000, 300, 10.0, iid(|r| 10.0 + normal(r)), |x| {
                quantile_interval(x, 0.5)
            }),
            "p50 n=300",
        );
        let p99 = 2.326348f64.exp();
        near_95(
            coverage(2000, 500, p99, iid(|r| normal(r).exp()), |x| quantile_interval(x, 0.99)),
            "p99 n=500",
        );
        near_95(
            coverage(2000, 299, p99, iid(|r| normal(r).exp()), |x| quantile_interval(x, 0.99)),
            "p99 n=299",
        );
    }

    #[test]
    fn a_mean_interval_that_reaches_zero_gives_no_throughput_interval() {
        // Twenty 1 ms steps and one of 3 s: batch means so spread that the mean's interval goes
        // below zero, where 1000 / mean has no upper end.
        let mut steps = vec![1_000_000u64; 20];
        steps[10] = 3_000_000_000;
        let u = Uncertainty::of(&steps, 1);
        assert!(u.mean_ms.as_ref().unwrap().low <= 0.0, "{u:?}");
        let e = u.throughput.as_ref().unwrap_err();
        assert!(e.contains("too spread for a throughput interval"), "{e}");
        assert!(u.note().unwrap().contains("throughput: the mean's interval reaches"));
    }

    #[test]
    fn too_few_steps_say_how_many_are_needed() {
        let x: Vec<f64> = (0..298).map(|i| i as f64).collect();
        let e = quantile_interval(&x, 0.99).unwrap_err();
        assert!(e.contains("298 steps") && e.contains("at least 299"), "{e}");
        assert!(quantile_interval(&(0..299).map(|i| i as f64).collect::<Vec<_>>(), 0.99).is_ok());
        assert!(mean_interval(&[1.0; 9]).unwrap_err().contains("at least 10"));
        let u = Uncertainty::of(&[1_000_000; 50], 4);
        assert_eq!(
            u.note().unwrap(),
            "p99: 50 steps; a 95% interval for p99 needs at least 299"
        );
        // Identical steps: a zero-width interval at the value.
        assert_eq!(u.mean_ms, Ok(Interval { low: 1.0, high: 1.0 }));
        assert_eq!(
            u.throughput,
            Ok(Interval {
                low: 4000.0,
                high: 4000.0
            })
        );
    }

    #[test]
    fn the_t_quantiles_meet_the_normal_one() {
        assert_eq!(t_975(19), 2.093);
        assert!((t_975(31) - 2.040).abs() < 0.002 && (t_975(1000) - 1.962).abs() < 0.001);
    }
}
