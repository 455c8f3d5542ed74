//! What one load step measured, and whether it met its objective: the latency statistics over every
//! measured request (those cut short count at their age then: a lower bound), the p99's interval,
//! the achieved rate, the batch sizes and the queue.

use std::time::Duration;

use anyhow::Result;

use crate::gpu::sampler::{MetricSummary, Sample};
use crate::load::serve::{Ending, Served};
use crate::run::evidence::Evidence;
use crate::run::stats::LatencyStats;
use crate::run::uncertainty::{quantile_interval, Estimate};

#[derive(Debug, Clone)]
pub struct Step {
    /// The rate the schedule offered.
    pub offered_qps: f64,
    pub served: Served,
    /// Over served and unfinished requests alike.
    pub stats: LatencyStats,
    pub p99_interval: Estimate,
    /// Requests the model completed per second of the measured window (warm-up requests it was
    /// still working through included: the server's rate, not the measured requests').
    pub achieved_qps: f64,
    /// Whether the p99 met the objective; `None` without one.
    pub meets: Option<bool>,
    /// How the decision was made or why the numbers are bounds, when that needs saying.
    pub note: Option<String>,
    /// How long the model took per batch (copy, inference, sync), from the batcher's records.
    pub service: Service,
    /// What the GPU sampler saw over the step.
    pub evidence: Evidence,
    pub metrics: MetricSummary,
}

/// The model's time per batch over a step, and the batches that stalled.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Service {
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub max_ms: f64,
    /// Batches that took over [`STALL`] times the median of their size and 10 ms more: pauses of
    /// the model's step (the host, the driver, the GPU), not queueing; each holds every request
    /// behind it.
    pub stalled: usize,
}

/// A batch that takes this many times the median service time (and 10 ms more) stalled.
pub const STALL: f64 = 4.0;

impl Service {
    pub fn of(served: &Served) -> Service {
        // Each batch's size and time.
        let times: Vec<(usize, f64)> = served
            .batches
            .iter()
            .map(|b| (b.size, (b.done - b.dispatched).as_secs_f64() * 1e3))
            .collect();
        let mut ms: Vec<f64> = times.iter().map(|t| t.1).collect();
        if ms.is_empty() {
            return Service::default();
        }
        ms.sort_by(f64::total_cmp);
        let at = |q: f64| ms[((ms.len() - 1) as f64 * q).round() as usize];
        // A full batch takes longer than a single request: each batch is judged against the median
        // of its own size, or, for sizes too rare to have one, against the slowest typical size.
        let mut by_size: std::collections::BTreeMap<usize, Vec<f64>> = std::collections::BTreeMap::new();
        for &(size, m) in &times {
            by_size.entry(size).or_default().push(m);
        }
        let typical: std::collections::BTreeMap<usize, f64> = by_size
            .into_iter()
            .filter(|(_, v)| v.len() >= 5)
            .map(|(size, mut v)| {
                v.sort_by(f64::total_cmp);
                (size, v[v.len() / 2])
            })
            .collect();
        let slowest = typical.values().copied().fold(at(0.5), f64::max);
        let stalled = times
            .iter()
            .filter(|&&(size, m)| {
                let norm = typical.get(&size).copied().unwrap_or(slowest);
                m > STALL * norm && m > norm + 10.0
            })
            .count();
        Service {
            p50_ms: at(0.5),
            p99_ms: at(0.99),
            max_ms: ms[ms.len() - 1],
            stalled,
        }
    }
}

/// How far a step's numbers can be trusted, worst first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StepVerdict {
    /// Another process computed on the device.
    Shared,
    /// Clocks were slowed by something outside the step.
    Throttled,
    /// The model's step stalled: the p99 measures the stalls.
    Stalled,
    Ok,
}

impl StepVerdict {
    pub fn as_str(self) -> &'static str {
        match self {
            StepVerdict::Shared => "shared",
            StepVerdict::Throttled => "throttled",
            StepVerdict::Stalled => "stalled",
            StepVerdict::Ok => "ok",
        }
    }
}

impl Step {
    /// A step with no GPU readings (a CPU, or a test).
    pub fn new(offered_qps: f64, served: Served, objective: Option<Duration>) -> Result<Step> {
        Self::with_evidence(
            offered_qps,
            served,
            objective,
            Evidence::none(crate::run::evidence::Sampling::NotAGpu),
            &[],
        )
    }

    pub fn with_evidence(
        offered_qps: f64,
        served: Served,
        objective: Option<Duration>,
        evidence: Evidence,
        readings: &[Sample],
    ) -> Result<Step> {
        let all: Vec<u64> = served
            .latencies_ns
            .iter()
            .chain(&served.unfinished_ns)
            .copied()
            .collect();
        anyhow::ensure!(
            !all.is_empty(),
            "the step measured no request: lengthen it or lower the warm-up"
        );
        let stats = LatencyStats::from_latencies(&all)?;
        let ms: Vec<f64> = all.iter().map(|&l| l as f64 / 1e6).collect();
        let p99_interval = quantile_interval(&ms, 0.99);
        let window = served.window.as_secs_f64();
        let last_done = served.batches.last().map_or(Duration::ZERO, |b| b.done);
        let start = last_done.saturating_sub(served.window);
        let completed: usize = served.batches.iter().filter(|b| b.done >= start).map(|b| b.size).sum();
        let achieved_qps = if window > 0.0 { completed as f64 / window } else { 0.0 };
        let mut notes = Vec::new();
        if !served.unfinished_ns.is_empty() {
            notes.push(format!(
                "{} measured request(s) were still queued when the step stopped; each counts at its age then, so the percentiles are lower bounds",
                served.unfinished_ns.len()
            ));
        }
        if served.ending == Ending::Backlog {
            notes.push("the queue outlived the schedule: the model cannot keep up with this rate".to_string());
        }
        // Latency's growth over the step (s/s), carried on over the horizon: a queue that grows will
        // cross any objective; a step too short to show it must not pass.
        let growth = crate::load::serve::growth(&served.arrivals, &served.latencies_ns);
        let meets = objective.map(|slo| meets_objective(slo, &served, &stats, &p99_interval, growth, &mut notes));
        let service = Service::of(&served);
        if service.stalled > 0 && served.round_trips {
            notes.push(format!(
                "{} request(s) stalled (over {STALL}× the median round trip {:.2} ms, up to {:.1} ms): the server paused",
                service.stalled, service.p50_ms, service.max_ms
            ));
        } else if service.stalled > 0 {
            notes.push(format!(
                "{} batch(es) stalled (over {STALL}× the median {:.2} ms, up to {:.1} ms): the model's step paused, and every request queued behind it waited",
                service.stalled, service.p50_ms, service.max_ms
            ));
        }
        if let Some(e) = evidence.describe() {
            notes.push(e);
        }
        let note = (!notes.is_empty()).then(|| notes.join("; "));
        let metrics = crate::gpu::sampler::summarize(readings, served.latencies_ns.len() as u64);
        Ok(Step {
            offered_qps,
            served,
            stats,
            p99_interval,
            achieved_qps,
            meets,
            note,
            service,
            evidence,
            metrics,
        })
    }

    pub fn verdict(&self) -> StepVerdict {
        if self.evidence.shared() {
            StepVerdict::Shared
        } else if self.evidence.throttled() {
            StepVerdict::Throttled
        } else if self.service.stalled > 0 {
            StepVerdict::Stalled
        } else {
            StepVerdict::Ok
        }
    }

    /// How many batches of each size, index 0 for size 1.
    pub fn batch_size_counts(&self, max_batch: usize) -> Vec<u32> {
        let mut counts = vec![0u32; max_batch];
        for b in &self.served.batches {
            counts[b.size.clamp(1, max_batch) - 1] += 1;
        }
        counts
    }

    pub fn mean_batch(&self) -> f64 {
        let b = &self.served.batches;
        if b.is_empty() {
            0.0
        } else {
            b.iter().map(|b| b.size as f64).sum::<f64>() / b.len() as f64
        }
    }

    /// Requests waiting when each batch left: mean and most.
    pub fn queue_at_dispatch(&self) -> (f64, usize) {
        let b = &self.served.batches;
        let max = b.iter().map(|b| b.queued).max().unwrap_or(0);
        let mean = if b.is_empty() {
            0.0
        } else {
            b.iter().map(|b| b.queued as f64).sum::<f64>() / b.len() as f64
        };
        (mean, max)
    }

    /// One line for the terminal.
    pub fn describe(&self) -> String {
        let ms = |ns: u64| ns as f64 / 1e6;
        let (q_mean, q_max) = self.queue_at_dispatch();
        let mut line = format!(
            "offered {:.1}/s, served {:.1}/s, {} measured request(s){}: p50 {:.2} ms, p99 {:.2} ms{}, mean batch {:.1}, queue {:.1} (max {q_max})",
            self.offered_qps,
            self.achieved_qps,
            self.served.latencies_ns.len(),
            match self.served.unfinished_ns.len() {
                0 => String::new(),
                n => format!(" + {n} still queued"),
            },
            ms(self.stats.p50_ns),
            ms(self.stats.p99_ns),
            match &self.p99_interval {
                Ok(i) => format!(" [{:.2}, {:.2}]", i.low, i.high),
                Err(why) => format!(" (no interval: {why})"),
            },
            self.mean_batch(),
            q_mean
        );
        line.push_str(&format!(
            ", batch time p50 {:.2} ms (max {:.1})",
            self.service.p50_ms, self.service.max_ms
        ));
        if let Some(m) = self.meets {
            line.push_str(if m {
                ", within the objective"
            } else {
                ", over the objective"
            });
        }
        if self.verdict() != StepVerdict::Ok {
            line.push_str(&format!(" [{}]", self.verdict().as_str()));
        }
        line
    }
}

/// Whether a step met the objective `slo`, the reason added to `notes` where it is not plain: a
/// step stopped early or outlived by its queue fails; one whose latency grows (`growth`, s/s) fails
/// where carried on over the horizon it would pass the objective; else p99's interval decides, or
/// the estimate where the interval holds the objective or there is none.
fn meets_objective(
    slo: Duration,
    served: &Served,
    stats: &LatencyStats,
    p99_interval: &crate::run::uncertainty::Estimate,
    growth: f64,
    notes: &mut Vec<String>,
) -> bool {
    let growth_ms = growth * crate::load::serve::GROWTH_HORIZON.as_secs_f64() * 1e3;
    let slo_ms = slo.as_secs_f64() * 1e3;
    let p99_ms = stats.p99_ns as f64 / 1e6;
    match (&served.ending, &p99_interval) {
        (Ending::Over(why), _) => {
            notes.push(format!("stopped early: {why}"));
            false
        }
        (Ending::Backlog, _) => false,
        (_, _) if growth_ms > 0.0 && p99_ms + growth_ms > slo_ms => {
            notes.push(format!(
                    "latency grew {:.2} ms per second of the step: at this rate the queue grows, and p99 {p99_ms:.2} ms would pass the objective within {} s",
                    growth * 1e3,
                    crate::load::serve::GROWTH_HORIZON.as_secs()
                ));
            false
        }
        (_, Ok(i)) if i.high <= slo_ms => true,
        (_, Ok(i)) if i.low > slo_ms => false,
        (_, Ok(i)) => {
            notes.push(format!(
                    "p99's 95% interval [{:.2}, {:.2}] ms holds the {slo_ms:.1} ms objective: decided on the estimate {p99_ms:.2} ms",
                    i.low, i.high
                ));
            p99_ms <= slo_ms
        }
        (_, Err(why)) => {
            notes.push(format!(
                "no interval for p99 ({why}): decided on the estimate {p99_ms:.2} ms"
            ));
            p99_ms <= slo_ms
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::serve::BatchRecord;

    fn served(latencies_ms: &[f64], ending: Ending) -> Served {
        let latencies_ns: Vec<u64> = latencies_ms.iter().map(|&m| (m * 1e6) as u64).collect();
        Served {
            offered: latencies_ns.len(),
            offered_span: Duration::from_secs(1),
            window: Duration::from_secs(2),
            batches: vec![BatchRecord {
                dispatched: Duration::ZERO,
                done: Duration::ZERO,
                size: 3,
                queued: 5,
            }],
            arrivals: (0..latencies_ns.len())
                .map(|i| Duration::from_micros(i as u64 * 500))
                .collect(),
            latencies_ns,
            unfinished_ns: Vec::new(),
            ending,
            round_trips: false,
        }
    }

    #[test]
    fn the_objective_is_met_only_when_the_interval_says_so_or_the_estimate_decides_with_a_note() -> Result<()> {
        // 2,000 requests at 1..=10 ms: p99 ≈ 9.9 ms with a tight interval.
        let lat: Vec<f64> = (0..2000)
            .map(|i| 1.0 + 9.0 * ((i * 7919) % 2000) as f64 / 1999.0)
            .collect();
        let ms = |m: f64| Duration::from_secs_f64(m / 1e3);
        let s = Step::new(1000.0, served(&lat, Ending::Schedule), Some(ms(20.0)))?;
        assert_eq!((s.meets, s.note.clone()), (Some(true), None));
        // One batch of 3 completed in the 2 s window.
        assert_eq!(s.achieved_qps, 1.5);
        assert_eq!(
            Step::new(1000.0, served(&lat, Ending::Schedule), Some(ms(5.0)))?.meets,
            Some(false)
        );
        let near = Step::new(1000.0, served(&lat, Ending::Schedule), Some(ms(9.9)))?;
        assert!(
            near.note.as_deref().unwrap_or("").contains("decided on the estimate"),
            "{:?} {:?}",
            near.note,
            near.p99_interval
        );
        let over = Step::new(1000.0, served(&lat, Ending::Over("many".into())), Some(ms(20.0)))?;
        assert_eq!(over.meets, Some(false));
        assert_eq!(Step::new(1000.0, served(&lat, Ending::Schedule), None)?.meets, None);
        assert_eq!(s.batch_size_counts(4), vec![0, 0, 1, 0]);
        assert_eq!(s.verdict(), StepVerdict::Ok);
        assert_eq!(s.queue_at_dispatch(), (5.0, 5));
        Ok(())
    }

    #[test]
    fn batches_far_slower_than_the_median_are_stalls_and_say_so() -> Result<()> {
        let mut sv = served(&[1.0; 200], Ending::Schedule);
        let ms = |m: f64| Duration::from_secs_f64(m / 1e3);
        sv.batches = (0..100)
            .map(|i| {
                let took = if i % 50 == 7 {
                    40.0
                } else if i % 10 == 3 {
                    9.0
                } else {
                    4.0
                };
                BatchRecord {
                    dispatched: ms(10.0 * i as f64),
                    done: ms(10.0 * i as f64 + took),
                    size: 2,
                    queued: 2,
                }
            })
            .collect();
        let s = Step::new(100.0, sv, Some(ms(50.0)))?;
        // 9 ms is slow, not a stall (under 4× the 4 ms median); 40 ms twice is.
        assert_eq!(
            s.service,
            Service {
                p50_ms: 4.0,
                p99_ms: 40.0,
                max_ms: 40.0,
                stalled: 2
            }
        );
        assert_eq!(s.verdict(), StepVerdict::Stalled);
        assert!(s.note.unwrap().contains("2 batch(es) stalled"));
        Ok(())
    }

    #[test]
    fn a_server_s_stalls_are_named_as_its_requests_not_migprof_s_batches() -> Result<()> {
        let lat: Vec<f64> = (0..100).map(|i| if i % 50 == 7 { 52.0 } else { 2.0 }).collect();
        let mut sv = served(&lat, Ending::Schedule);
        sv.batches = lat
            .iter()
            .enumerate()
            .map(|(i, &l)| BatchRecord {
                dispatched: Duration::from_millis(i as u64 * 3),
                done: Duration::from_millis(i as u64 * 3) + Duration::from_secs_f64(l / 1e3),
                size: 1,
                queued: 1,
            })
            .collect();
        let note = |round_trips: bool| -> Result<String> {
            let mut sv = sv.clone();
            sv.round_trips = round_trips;
            Ok(Step::new(100.0, sv, None)?.note.unwrap_or_default())
        };
        assert!(
            note(true)?.contains("2 request(s) stalled (over 4× the median round trip 2.00 ms"),
            "{}",
            note(true)?
        );
        assert!(note(false)?.contains("2 batch(es) stalled"), "{}", note(false)?);
        Ok(())
    }
}
