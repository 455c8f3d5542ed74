//! The highest rate whose p99 stays within an objective: bracketing by doubling or halving from a
//! first guess, then bisection (on the geometric mean) until the bracket is within the resolution.
//! The capacity is the bracket's low end: a rate that was measured to pass.

use anyhow::Result;

/// Runs one load step at a rate and says whether its p99 met the objective.
pub trait StepRunner {
    fn run_step(&mut self, qps: f64) -> Result<bool>;
}

/// How the search goes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SearchPlan {
    /// The first rate tried.
    pub start_qps: f64,
    /// Stop once high / low − 1 is at most this (0.02: 2%).
    pub resolution: f64,
    /// Below this rate the search gives up: nothing meets the objective.
    pub floor_qps: f64,
    /// At most this many steps, whatever the bracket.
    pub max_steps: usize,
    /// Above this rate no step is run (the most requests a step may offer, over its duration).
    pub ceiling_qps: f64,
}

/// What the search found.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchOutcome {
    /// The highest rate that met the objective; `None` when even the floor did not.
    pub capacity_qps: Option<f64>,
    /// The bracket at the end: the highest pass and the lowest failure (`None`: none failed).
    pub low: Option<f64>,
    pub high: Option<f64>,
    /// Every step: its rate and whether it met the objective, in order.
    pub steps: Vec<(f64, bool)>,
    /// Why the search stopped short of its resolution, when it did.
    pub note: Option<String>,
}

pub fn search(runner: &mut dyn StepRunner, plan: SearchPlan) -> Result<SearchOutcome> {
    anyhow::ensure!(
        plan.start_qps > 0.0 && plan.resolution > 0.0 && plan.start_qps <= plan.ceiling_qps,
        "a search needs a start rate and a resolution above zero, and a start no higher than its ceiling"
    );
    let mut steps = Vec::new();
    let (mut low, mut high): (Option<f64>, Option<f64>) = (None, None);
    let mut note = None;
    let mut qps = plan.start_qps;
    loop {
        if steps.len() >= plan.max_steps {
            note = Some(format!(
                "stopped after {} steps short of the {:.0}% resolution",
                steps.len(),
                plan.resolution * 100.0
            ));
            break;
        }
        let met = runner.run_step(qps)?;
        steps.push((qps, met));
        if met {
            low = Some(low.map_or(qps, |l: f64| l.max(qps)));
        } else {
            high = Some(high.map_or(qps, |h: f64| h.min(qps)));
        }
        qps = match (low, high) {
            (Some(l), Some(h)) if h < l => {
                note = Some(format!(
                    "{h:.1} requests/s failed after {l:.1} passed: at the knee, noise decides; the capacity is the highest rate that passed"
                ));
                break;
            }
            (Some(l), Some(h)) if h / l - 1.0 <= plan.resolution => break,
            (Some(l), Some(h)) => (l * h).sqrt(),
            (Some(l), None) if l >= plan.ceiling_qps => {
                note = Some(format!(
                    "{l:.1} requests/s met the objective, and no step may offer more: the capacity is at least that"
                ));
                break;
            }
            (Some(l), None) => (l * 2.0).min(plan.ceiling_qps),
            (None, Some(h)) if h / 2.0 < plan.floor_qps => {
                note = Some(format!("no rate tried, down to {h:.3} requests/s, met the objective"));
                break;
            }
            (None, Some(h)) => h / 2.0,
            (None, None) => unreachable!("a step was just run"),
        };
    }
    Ok(SearchOutcome {
        capacity_qps: low,
        low,
        high,
        steps,
        note,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::serve::tests::whole;
    use crate::load::serve::tests::FakeModel;
    use crate::load::serve::{drive, Batching, Objective};
    use crate::testing::clock::FakeClock;

    /// Passes at or below a known threshold.
    struct Threshold(f64);

    impl StepRunner for Threshold {
        fn run_step(&mut self, qps: f64) -> Result<bool> {
            Ok(qps <= self.0)
        }
    }

    fn plan(start: f64) -> SearchPlan {
        SearchPlan {
            start_qps: start,
            resolution: 0.02,
            floor_qps: 1.0,
            max_steps: 60,
            ceiling_qps: 1e9,
        }
    }

    #[test]
    fn a_search_stops_at_its_ceiling_with_a_note() -> Result<()> {
        let out = search(
            &mut Threshold(f64::MAX),
            SearchPlan {
                ceiling_qps: 1000.0,
                ..plan(100.0)
            },
        )?;
        let rates: Vec<f64> = out.steps.iter().map(|s| s.0).collect();
        assert_eq!(rates, [100.0, 200.0, 400.0, 800.0, 1000.0]);
        assert_eq!((out.capacity_qps, out.high), (Some(1000.0), None));
        assert!(out.note.unwrap().contains("no step may offer more"));
        Ok(())
    }

    #[test]
    fn the_search_brackets_then_bisects_to_its_resolution() -> Result<()> {
        for (threshold, start) in [(1234.0, 100.0), (1234.0, 50_000.0), (3.7, 1000.0), (1234.0, 1234.0)] {
            let out = search(&mut Threshold(threshold), plan(start))?;
            let (low, high) = (out.low.unwrap(), out.high.unwrap());
            assert!(
                low <= threshold && high > threshold,
                "{threshold} from {start}: [{low}, {high}]"
            );
            assert!(high / low - 1.0 <= 0.02, "{low} {high}");
            assert_eq!(out.capacity_qps, Some(low));
            assert!(out.steps.len() < 20, "{} steps", out.steps.len());
            assert_eq!(out.note, None);
        }
        let out = search(&mut Threshold(0.5), plan(100.0))?;
        assert_eq!(out.capacity_qps, None);
        assert!(out.note.unwrap().contains("no rate tried"));
        Ok(())
    }

    /// Steps of a fake model on a fake clock, as `migprof load --search` runs real ones.
    struct FakeSteps {
        fixed_ms: f64,
        per_sample_ms: f64,
        batching: Batching,
        objective: Objective,
    }

    impl StepRunner for FakeSteps {
        fn run_step(&mut self, qps: f64) -> Result<bool> {
            let timer = FakeClock::default();
            let mut model = FakeModel::new(&timer, self.fixed_ms, self.per_sample_ms);
            let arrivals = crate::load::arrival::schedule(crate::load::arrival::Arrival::Poisson, qps, 30_000, 11);
            let s = drive(
                &mut model,
                &timer,
                &mut whole(&arrivals),
                std::time::Duration::ZERO,
                self.batching,
                Some(self.objective),
            )?;
            let step = crate::load::step::Step::new(qps, s, Some(self.objective.p99))?;
            Ok(step.meets == Some(true))
        }
    }

    #[test]
    fn the_search_finds_a_known_model_s_capacity() -> Result<()> {
        use std::time::Duration;
        // 4 ms + 0.25 ms per sample, batches up to 32: at most 32 / 12 ms = 2,667 requests/s.
        let batching = Batching {
            max_batch: 32,
            max_delay: Duration::from_millis(2),
        };
        let loose = Objective {
            p99: Duration::from_millis(200),
            min_requests: 10_000,
        };
        let mut steps = FakeSteps {
            fixed_ms: 4.0,
            per_sample_ms: 0.25,
            batching,
            objective: loose,
        };
        let out = search(&mut steps, plan(500.0))?;
        let c = out.capacity_qps.unwrap();
        // A loose objective: close to the model's limit, never above it.
        assert!((2300.0..2667.0).contains(&c), "{c}");
        // A tight one costs capacity; one below a lone request's 4.25 ms meets nothing.
        steps.objective = Objective {
            p99: Duration::from_millis(15),
            ..loose
        };
        let tight = search(&mut steps, plan(500.0))?.capacity_qps.unwrap();
        assert!(tight < c * 0.98, "{tight} vs {c}");
        steps.objective = Objective {
            p99: Duration::from_millis(4),
            ..loose
        };
        assert_eq!(search(&mut steps, plan(500.0))?.capacity_qps, None);
        Ok(())
    }
}
