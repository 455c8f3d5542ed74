//! When requests arrive: the whole schedule drawn in advance from a seeded process, so that the
//! offered load never depends on how fast the model answers (an open loop).

use std::time::Duration;

use rand::{Rng, SeedableRng};

/// The arrival process of a load step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Arrival {
    /// Independent arrivals at a constant mean rate: exponential gaps, as MLPerf's Server scenario
    /// and most serving traffic.
    Poisson,
    /// Evenly spaced arrivals: no bursts, the easiest load a rate can offer.
    Constant,
}

impl Arrival {
    pub fn as_str(self) -> &'static str {
        match self {
            Arrival::Poisson => "poisson",
            Arrival::Constant => "constant",
        }
    }
}

/// The arrival times of `count` requests at `rate` per second, as offsets from the schedule's start,
/// ascending. The same seed gives the same schedule.
pub fn schedule(arrival: Arrival, rate: f64, count: usize, seed: u64) -> Vec<Duration> {
    arrivals(arrival, rate, seed).take(count).collect()
}

/// The arrival times at `rate` per second, drawn one at a time (a step need not hold its schedule):
/// the same seed gives the same times as [`schedule`].
pub fn arrivals(arrival: Arrival, rate: f64, seed: u64) -> impl Iterator<Item = Duration> {
    assert!(rate > 0.0 && rate.is_finite(), "a rate above zero");
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut t = 0.0f64;
    (0u64..).map(move |i| match arrival {
        Arrival::Constant => Duration::from_secs_f64(i as f64 / rate),
        Arrival::Poisson => {
            // 1 - U lies in (0, 1]: the gap is finite.
            let u: f64 = rng.random();
            t += -(1.0 - u).ln() / rate;
            Duration::from_secs_f64(t)
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(s: &[Duration]) -> Vec<f64> {
        let mut prev = 0.0;
        s.iter()
            .map(|t| {
                let g = t.as_secs_f64() - prev;
                prev = t.as_secs_f64();
                g
            })
            .collect()
    }

    /// The Kolmogorov–Smirnov statistic of `x` against the exponential distribution of `rate`.
    fn ks_exponential(x: &[f64], rate: f64) -> f64 {
        let mut x = x.to_vec();
        x.sort_by(f64::total_cmp);
        let n = x.len() as f64;
        x.iter()
            .enumerate()
            .map(|(i, &v)| {
                let cdf = 1.0 - (-rate * v).exp();
                (cdf - i as f64 / n).abs().max(((i + 1) as f64 / n - cdf).abs())
            })
            .fold(0.0, f64::max)
    }

    #[test]
    fn poisson_gaps_fit_the_exponential_and_the_rate_holds() {
        let rate = 2500.0;
        for seed in [1, 2, 3] {
            let s = schedule(Arrival::Poisson, rate, 20_000, seed);
            let g = gaps(&s);
            // The 1% critical value of KS at n = 20,000 is 1.63 / √n.
            let d = ks_exponential(&g, rate);
            assert!(d < 1.63 / (g.len() as f64).sqrt(), "seed {seed}: D = {d}");
            // 20,000 arrivals take 8 s at 2,500/s; their count in 8 s is Poisson: ±3σ = ±424.
            let in_8s = s.iter().filter(|t| t.as_secs_f64() < 8.0).count() as f64;
            assert!(
                (in_8s - 20_000.0).abs() < 3.0 * 20_000f64.sqrt(),
                "seed {seed}: {in_8s}"
            );
        }
        // The test can fail: gaps of the wrong rate, or uniform ones, are rejected.
        let g = gaps(&schedule(Arrival::Poisson, rate, 20_000, 1));
        assert!(ks_exponential(&g, rate * 1.1) > 1.63 / (g.len() as f64).sqrt());
        let g = gaps(&schedule(Arrival::Constant, rate, 20_000, 1));
        assert!(ks_exponential(&g, rate) > 1.63 / (g.len() as f64).sqrt());
    }

    #[test]
    fn schedules_are_seeded_ascending_and_constant_ones_even() {
        assert_eq!(
            schedule(Arrival::Poisson, 100.0, 500, 7),
            schedule(Arrival::Poisson, 100.0, 500, 7)
        );
        assert_ne!(
            schedule(Arrival::Poisson, 100.0, 500, 7),
            schedule(Arrival::Poisson, 100.0, 500, 8)
        );
        let s = schedule(Arrival::Poisson, 100.0, 500, 7);
        assert!(s.windows(2).all(|w| w[0] <= w[1]));
        let c = schedule(Arrival::Constant, 200.0, 5, 0);
        assert_eq!(c, (0..5).map(|i| Duration::from_millis(5 * i)).collect::<Vec<_>>());
    }
}
