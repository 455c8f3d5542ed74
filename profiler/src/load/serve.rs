//! The serving loop of a load step: requests arrive on a schedule fixed in advance, wait in a queue,
//! and a dynamic batcher hands the oldest of them, up to `max_batch`, to one model instance (one
//! batch in flight). Each request's latency runs from its *scheduled* arrival to its batch's
//! completion, so a slow model shows as growing latencies and never as a lower offered rate (no
//! coordinated omission).
//!
//! The loop is single-threaded: arrival times are known in advance, so "which requests have arrived"
//! is a lookup in the schedule at the current time, and nothing the model does can delay an arrival.
//! It reads time and sleeps through [`Timer`] and serves through [`Server`], so tests run it on a fake
//! clock and a model of known latency.

use std::collections::VecDeque;
use std::time::Duration;

use anyhow::Result;

use crate::run::measure::{nanos, Clock, MonotonicClock};
use crate::run::uncertainty::quantile_interval;

/// Time as the loop sees it.
pub trait Timer {
    /// Time since a fixed origin.
    fn now(&self) -> Duration;
    /// Returns at `t` (on the same origin), or at once when that has passed.
    fn sleep_until(&self, t: Duration);
}

/// The real clock: sleeps through long waits, spins through the last fraction of a millisecond so
/// that a batch leaves when its delay is over and not a scheduler tick later.
impl Timer for MonotonicClock {
    fn now(&self) -> Duration {
        Clock::now(self)
    }

    fn sleep_until(&self, t: Duration) {
        const SPIN: Duration = Duration::from_micros(200);
        loop {
            let now = Clock::now(self);
            if now >= t {
                return;
            }
            let left = t - now;
            if left > SPIN {
                std::thread::sleep(left - SPIN);
            } else {
                std::hint::spin_loop();
            }
        }
    }
}

/// One model instance behind the batcher.
pub trait Server {
    /// Serves a batch of `n` requests: copies their inputs to the device, runs the model and returns
    /// once the outputs are ready.
    fn serve(&mut self, n: usize) -> Result<()>;
}

/// The dynamic batcher's bounds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Batching {
    /// At most this many requests per batch.
    pub max_batch: usize,
    /// A batch leaves once it is full, or once its oldest request has waited this long (and the
    /// model is free): the longest a request waits for others.
    pub max_delay: Duration,
}

/// What may end a step before its schedule does: a latency objective on p99.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Objective {
    pub p99: Duration,
    /// Measured requests before the p99's interval may end the step as within the objective.
    pub min_requests: usize,
}

/// One batch as the batcher handed it out.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchRecord {
    /// When it left the queue and when it was done, from the schedule's start.
    pub dispatched: Duration,
    pub done: Duration,
    pub size: usize,
    /// Requests waiting when it left, itself included.
    pub queued: usize,
}

/// How a step ended.
#[derive(Debug, Clone, PartialEq)]
pub enum Ending {
    /// Every scheduled request was served.
    Schedule,
    /// The p99's interval lay within the objective: no more requests were sent; the queue was
    /// served.
    Within,
    /// More requests were over the objective than a p99 within it allows, or the p99's interval lay
    /// above it: the step stopped at once.
    Over(String),
    /// The schedule was over and the queue still held requests after as long again as the measured
    /// window: the model cannot keep up with the rate.
    Backlog,
}

/// What a step served.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    /// Latency of every measured request served (arrival at or after the warm-up), in completion
    /// order, nanoseconds.
    pub latencies_ns: Vec<u64>,
    /// Each served request's scheduled arrival, in the same order.
    pub arrivals: Vec<Duration>,
    /// Measured requests still queued when the step stopped: their age then (a lower bound of
    /// their latency).
    pub unfinished_ns: Vec<u64>,
    /// Measured requests the schedule held (those never sent when a step was cut are not counted).
    pub offered: usize,
    /// From the end of the warm-up to the last measured arrival that was sent.
    pub offered_span: Duration,
    /// From the end of the warm-up to the last completion.
    pub window: Duration,
    pub batches: Vec<BatchRecord>,
    pub ending: Ending,
    /// Each batch is one request's round trip to a server of the user's own (whose batches
    /// migprof does not see), not a batch of migprof's batcher.
    pub round_trips: bool,
}

/// A step's arrivals, drawn as the step reaches them and let go once served: a step holds the requests
/// that have arrived and wait (and the next batch's worth), never its whole schedule.
pub struct Schedule<'a> {
    draw: Box<dyn Iterator<Item = Duration> + 'a>,
    len: usize,
    /// The index of `held[0]` in the schedule.
    first: usize,
    held: VecDeque<Duration>,
    /// The most arrivals held at once.
    most_held: usize,
}

impl<'a> Schedule<'a> {
    /// The first `len` arrivals `draw` gives (offsets from the step's start, ascending).
    pub fn new(draw: impl Iterator<Item = Duration> + 'a, len: usize) -> Schedule<'a> {
        Schedule {
            draw: Box::new(draw.take(len)),
            len,
            first: 0,
            held: VecDeque::new(),
            most_held: 0,
        }
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Draws until arrival `i` is held (or the schedule ends).
    fn draw_to(&mut self, i: usize) {
        while self.first + self.held.len() <= i {
            match self.draw.next() {
                Some(a) => {
                    self.held.push_back(a);
                    self.most_held = self.most_held.max(self.held.len());
                }
                None => {
                    self.len = self.first + self.held.len();
                    break;
                }
            }
        }
    }

    /// Arrival `i`, which must not have been let go.
    fn at(&mut self, i: usize) -> Duration {
        self.draw_to(i);
        self.held[i - self.first]
    }

    /// The index of the first arrival from `from` (up to `end`) later than `t`: as many have arrived
    /// by `t`. Draws until an arrival later than `t` (or arrival `end`) is held.
    fn arrived_by(&mut self, from: usize, end: usize, t: Duration) -> usize {
        while self.first + self.held.len() < end.min(self.len) && self.held.back().is_none_or(|&b| b <= t) {
            let before = self.held.len();
            self.draw_to(self.first + before);
            if self.held.len() == before {
                break;
            }
        }
        let held_end = self.first + self.held.len();
        // Held arrivals ascend: those up to `t` are a prefix.
        (self.first + self.held.partition_point(|&a| a <= t))
            .min(end)
            .min(held_end)
            .max(from)
    }

    /// Arrivals `from..to`, copied.
    fn range(&mut self, from: usize, to: usize) -> Vec<Duration> {
        if to > from {
            self.draw_to(to - 1);
        }
        (from..to).map(|i| self.held[i - self.first]).collect()
    }

    /// The most arrivals the schedule held at once: what a step's memory of its schedule came to.
    pub fn most_held(&self) -> usize {
        self.most_held
    }

    /// Lets go of the arrivals before `i`.
    fn release_before(&mut self, i: usize) {
        while self.first < i && !self.held.is_empty() {
            self.held.pop_front();
            self.first += 1;
        }
    }
}

/// Runs one step: serves the `arrivals` (offsets from now, ascending) through `server`; requests that
/// arrive before `warmup` are served and not measured.
pub fn drive(
    server: &mut dyn Server,
    timer: &dyn Timer,
    arrivals: &mut Schedule,
    warmup: Duration,
    batching: Batching,
    objective: Option<Objective>,
) -> Result<Served> {
    anyhow::ensure!(batching.max_batch >= 1, "the batcher needs a max batch of at least 1");
    let origin = timer.now();
    let at = |t: Duration| origin + t;
    // The warm-up's arrivals are those before `warmup`: drawn once here, let go as served.
    let first_measured = {
        let mut i = 0;
        while i < arrivals.len() && arrivals.at(i) < warmup {
            i += 1;
        }
        i
    };
    let planned = arrivals.len() - first_measured;
    // Over the objective by more than this many requests, the step's p99 is over it whatever the
    // rest do (the p99 is the value of rank ⌈0.99 n⌉).
    let allowed_over = planned - (planned as f64 * 0.99).ceil() as usize;
    let mut end = arrivals.len();
    let mut next = 0;
    let mut latencies_ns = Vec::with_capacity(planned);
    let mut measured_arrivals = Vec::with_capacity(planned);
    let mut batches = Vec::new();
    let mut over = 0usize;
    let mut next_check = objective.map_or(usize::MAX, |o| o.min_requests.max(1));
    let mut ending = Ending::Schedule;
    let mut unfinished_ns = Vec::new();
    // The last arrival sent, once the step has sent any.
    let mut last_sent: Option<Duration> = None;
    while next < end {
        let now = timer.now() - origin;
        let arrived = arrivals.arrived_by(next, end, now);
        if arrived == next {
            timer.sleep_until(at(arrivals.at(next)));
            continue;
        }
        if arrived == end {
            let last = arrivals.at(end - 1);
            if now > last + (last.saturating_sub(warmup)).max(Duration::from_secs(1)) {
                unfinished_ns = ages(&arrivals.range(next, end), warmup, now);
                last_sent = Some(last);
                ending = Ending::Backlog;
                break;
            }
        }
        let queued = arrived - next;
        let oldest = arrivals.at(next);
        let ready = queued >= batching.max_batch || now >= oldest + batching.max_delay || arrived == end;
        if !ready {
            // Until the delay is over or the request that fills the batch arrives.
            let mut wake = oldest + batching.max_delay;
            let fill = next + batching.max_batch - 1;
            if fill < end && fill < arrivals.len() {
                wake = wake.min(arrivals.at(fill));
            }
            timer.sleep_until(at(wake));
            continue;
        }
        let size = queued.min(batching.max_batch);
        server.serve(size)?;
        let done = timer.now() - origin;
        for a in arrivals.range(next, next + size) {
            if a >= warmup {
                let latency = done - a;
                latencies_ns.push(nanos(latency));
                measured_arrivals.push(a);
                if objective.is_some_and(|o| latency > o.p99) {
                    over += 1;
                }
            }
            last_sent = Some(a);
        }
        batches.push(BatchRecord {
            dispatched: now,
            done,
            size,
            queued,
        });
        next += size;
        arrivals.release_before(next);
        let Some(objective) = objective else { continue };
        // Requests still waiting that are already older than the objective count as over it.
        let waiting_end = arrivals.arrived_by(next, end, done);
        let waiting = arrivals.range(next, waiting_end);
        let waiting_over = waiting
            .iter()
            .filter(|&&a| a >= warmup && a + objective.p99 < done)
            .count();
        if over + waiting_over > allowed_over {
            ending = Ending::Over(format!(
                "{} of the step's {planned} planned requests were already over the {:.1} ms objective, more than the {allowed_over} a p99 within it allows",
                over + waiting_over,
                objective.p99.as_secs_f64() * 1e3
            ));
            unfinished_ns = ages(&waiting, warmup, done);
            // Nothing after this was sent.
            end = next + waiting.len();
            last_sent = waiting.last().copied().or(last_sent);
            break;
        }
        if latencies_ns.len() >= next_check && end == arrivals.len() {
            next_check = next_check + next_check / 4;
            let ms: Vec<f64> = latencies_ns.iter().map(|&l| l as f64 / 1e6).collect();
            let objective_ms = objective.p99.as_secs_f64() * 1e3;
            // A rate a little above what the model serves looks fine for a while: the queue grows
            // slowly. Latency's growth, carried on over the horizon, must stay within too.
            let growth_ms = growth(&measured_arrivals, &latencies_ns) * 1e3 * GROWTH_HORIZON.as_secs_f64();
            if let Ok(i) = quantile_interval(&ms, 0.99) {
                if i.high + growth_ms <= objective_ms {
                    // Send nothing more; serve what has arrived.
                    end = next + waiting.len();
                    ending = Ending::Within;
                } else if i.low > objective_ms {
                    ending = Ending::Over(format!(
                        "p99's 95% interval [{:.2}, {:.2}] ms after {} requests lies above the {objective_ms:.1} ms objective",
                        i.low,
                        i.high,
                        ms.len()
                    ));
                    unfinished_ns = ages(&waiting, warmup, done);
                    end = next + waiting.len();
                    last_sent = waiting.last().copied().or(last_sent);
                    break;
                }
            }
        }
    }
    // The measured requests sent: the schedule's, up to where the step stopped sending.
    let offered = end.max(first_measured) - first_measured;
    let last_done = batches.last().map_or(warmup, |b| b.done);
    Ok(Served {
        offered,
        offered_span: match (offered, last_sent) {
            (0, _) | (_, None) => Duration::ZERO,
            (_, Some(l)) => l.saturating_sub(warmup),
        },
        window: last_done.saturating_sub(warmup),
        latencies_ns,
        arrivals: measured_arrivals,
        unfinished_ns,
        batches,
        ending,
        round_trips: false,
    })
}

/// How long a rate must be sustainable: latency's growth over a step, carried on this long, must stay
/// within the objective. A rate a few percent above what the model serves grows its queue by that
/// few percent of a second each second: invisible in a 10-second step, 60 s carries it past
/// any objective worth having, while the slope a stable queue shows stays near zero.
pub const GROWTH_HORIZON: Duration = Duration::from_secs(60);

/// How fast latency grows with arrival time (seconds per second), counting only growth beyond twice
/// its standard error: the slope of latency against arrival time, less two errors, at least 0. About
/// 0 when the model keeps up; the rate's excess over what it serves, as a share of that, when not.
///
/// Latencies behind a queue are correlated (a burst delays everyone after it), so the slope is fitted
/// to the means of 20 consecutive groups of requests, whose errors are far closer to independent than
/// the requests' own; with fewer than 100 requests it says 0.
pub fn growth(arrivals: &[Duration], latencies_ns: &[u64]) -> f64 {
    const GROUPS: usize = 20;
    let n = arrivals.len().min(latencies_ns.len());
    if n < 5 * GROUPS {
        return 0.0;
    }
    // Requests in order of arrival (they are served in that order, so this is the order served).
    let mut pairs: Vec<(f64, f64)> = (0..n)
        .map(|i| (arrivals[i].as_secs_f64(), latencies_ns[i] as f64 / 1e9))
        .collect();
    pairs.sort_by(|a, b| a.0.total_cmp(&b.0));
    let points: Vec<(f64, f64)> = (0..GROUPS)
        .map(|g| {
            let part = &pairs[g * n / GROUPS..(g + 1) * n / GROUPS];
            let k = part.len() as f64;
            (
                part.iter().map(|p| p.0).sum::<f64>() / k,
                part.iter().map(|p| p.1).sum::<f64>() / k,
            )
        })
        .collect();
    let m = points.len() as f64;
    let (mt, ml) = (
        points.iter().map(|p| p.0).sum::<f64>() / m,
        points.iter().map(|p| p.1).sum::<f64>() / m,
    );
    let sxx: f64 = points.iter().map(|p| (p.0 - mt).powi(2)).sum();
    if sxx <= 0.0 {
        return 0.0;
    }
    let slope = points.iter().map(|p| (p.0 - mt) * (p.1 - ml)).sum::<f64>() / sxx;
    let residual: f64 = points.iter().map(|p| (p.1 - ml - slope * (p.0 - mt)).powi(2)).sum();
    let se = (residual / (m - 2.0) / sxx).sqrt();
    (slope - 2.0 * se).max(0.0)
}

/// The age at `now` of each measured request of `waiting`.
fn ages(waiting: &[Duration], warmup: Duration, now: Duration) -> Vec<u64> {
    waiting
        .iter()
        .filter(|&&a| a >= warmup)
        .map(|&a| nanos(now.saturating_sub(a)))
        .collect()
}

#[cfg(test)]
pub(crate) mod tests {
    use crate::testing::clock::FakeClock;

    use super::*;
    use crate::load::arrival::{schedule, Arrival};

    /// A schedule drawn whole beforehand, as the tests' arrivals are.
    pub(crate) fn whole(arrivals: &[Duration]) -> Schedule<'_> {
        Schedule::new(arrivals.iter().copied(), arrivals.len())
    }

    /// A model whose batch of n takes `fixed + per_sample × n`, and stalls once for `stall` at the
    /// batch numbered `stall_at`.
    pub struct FakeModel {
        pub timer: FakeClock,
        pub fixed: Duration,
        pub per_sample: Duration,
        pub stall_at: Option<(usize, Duration)>,
        pub batches: usize,
    }

    impl FakeModel {
        pub fn new(timer: &FakeClock, fixed_ms: f64, per_sample_ms: f64) -> Self {
            let ms = |m: f64| Duration::from_secs_f64(m / 1e3);
            Self {
                timer: timer.clone(),
                fixed: ms(fixed_ms),
                per_sample: ms(per_sample_ms),
                stall_at: None,
                batches: 0,
            }
        }
    }

    impl Server for FakeModel {
        fn serve(&mut self, n: usize) -> Result<()> {
            let mut took = self.fixed + self.per_sample * n as u32;
            if let Some((at, stall)) = self.stall_at {
                if at == self.batches {
                    took += stall;
                }
            }
            self.batches += 1;
            self.timer.advance(took);
            Ok(())
        }
    }

    fn ms(m: f64) -> Duration {
        Duration::from_secs_f64(m / 1e3)
    }

    #[test]
    fn an_idle_model_serves_each_request_alone_at_its_own_latency() -> Result<()> {
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 1.0, 0.0);
        let arrivals = schedule(Arrival::Constant, 100.0, 200, 0);
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            ms(500.0),
            Batching {
                max_batch: 8,
                max_delay: Duration::ZERO,
            },
            None,
        )?;
        assert_eq!(s.offered, 150);
        assert_eq!(s.latencies_ns.len(), 150);
        assert!(
            s.latencies_ns.iter().all(|&l| l == 1_000_000),
            "{:?}",
            &s.latencies_ns[..3]
        );
        assert!(s.batches.iter().all(|b| b.size == 1 && b.queued == 1));
        assert_eq!(s.ending, Ending::Schedule);
        Ok(())
    }

    #[test]
    fn the_batcher_never_exceeds_its_bounds() -> Result<()> {
        // Poisson at 2,000/s into a model of 2 ms + 0.1 ms per sample: batches form.
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 2.0, 0.1);
        let arrivals = schedule(Arrival::Poisson, 2000.0, 20_000, 3);
        let batching = Batching {
            max_batch: 16,
            max_delay: ms(3.0),
        };
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            Duration::ZERO,
            batching,
            None,
        )?;
        assert_eq!(s.latencies_ns.len(), 20_000, "every request served once");
        assert!(s
            .batches
            .iter()
            .all(|b| (1..=16).contains(&b.size) && b.size <= b.queued));
        assert!(s.batches.iter().any(|b| b.size == 16) && s.batches.iter().any(|b| b.size < 16));
        // A batch that left short of full left because its oldest request had waited the delay (or
        // the model had been busy past it): never earlier.
        let mut first = 0;
        for b in &s.batches {
            let oldest = arrivals[first];
            if b.size < 16 && first + b.size < arrivals.len() {
                assert!(
                    b.dispatched >= oldest + batching.max_delay,
                    "left early at {:?}, oldest {oldest:?}",
                    b.dispatched
                );
            }
            // Nobody waits for others past the delay while the model is free.
            let previous_done = s
                .batches
                .iter()
                .map(|x| x.done)
                .filter(|&d| d <= b.dispatched)
                .max()
                .unwrap_or_default();
            assert!(
                b.dispatched <= (oldest + batching.max_delay).max(previous_done),
                "held too long"
            );
            first += b.size;
        }
        Ok(())
    }

    #[test]
    fn a_stalled_model_makes_latencies_grow_never_the_offered_rate_fall() -> Result<()> {
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 1.0, 0.0);
        // A 1 s stall at the 100th batch: about 0.1 s into 1,000/s constant arrivals (one per batch until then).
        model.stall_at = Some((100, Duration::from_secs(1)));
        let arrivals = schedule(Arrival::Constant, 1000.0, 5000, 0);
        let batching = Batching {
            max_batch: 64,
            max_delay: Duration::ZERO,
        };
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            Duration::ZERO,
            batching,
            None,
        )?;
        assert_eq!(s.offered, 5000, "every scheduled request was offered");
        assert_eq!(s.latencies_ns.len(), 5000);
        assert!(
            (s.offered as f64 / s.offered_span.as_secs_f64() - 1000.0).abs() < 1.0,
            "the offered rate is the schedule's"
        );
        // The request that arrived as the stall began waited it out.
        let worst = *s.latencies_ns.iter().max().unwrap();
        assert!(worst >= 1_000_000_000, "{worst}");
        // About 1,000 requests arrived during the stall, each waiting for its end.
        let slow = s.latencies_ns.iter().filter(|&&l| l > 100_000_000).count();
        assert!((850..=1000).contains(&slow), "{slow}");
        Ok(())
    }

    #[test]
    fn a_step_ends_once_its_p99_is_certainly_over_or_within() -> Result<()> {
        let timer = FakeClock::default();
        // 5 ms per sample at 1,000/s: the model cannot keep up; the queue and latencies grow.
        let mut model = FakeModel::new(&timer, 0.0, 5.0);
        let arrivals = schedule(Arrival::Poisson, 1000.0, 50_000, 1);
        let objective = Objective {
            p99: ms(50.0),
            min_requests: 10_000,
        };
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            Duration::ZERO,
            Batching {
                max_batch: 1,
                max_delay: Duration::ZERO,
            },
            Some(objective),
        )?;
        assert!(matches!(s.ending, Ending::Over(_)), "{:?}", s.ending);
        assert!(
            s.latencies_ns.len() < 1000,
            "stopped after {} of 50,000",
            s.latencies_ns.len()
        );
        assert!(!s.unfinished_ns.is_empty());
        // 1 ms per request at 200/s: far inside 50 ms; stops after the minimum count, queue served.
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 1.0, 0.0);
        let arrivals = schedule(Arrival::Poisson, 200.0, 50_000, 1);
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            Duration::ZERO,
            Batching {
                max_batch: 1,
                max_delay: Duration::ZERO,
            },
            Some(objective),
        )?;
        assert_eq!(s.ending, Ending::Within);
        assert!(
            (10_000..10_005).contains(&s.latencies_ns.len()),
            "{}",
            s.latencies_ns.len()
        );
        assert!(s.unfinished_ns.is_empty());
        Ok(())
    }

    #[test]
    fn a_backlog_that_outlives_the_schedule_is_cut_and_reported() -> Result<()> {
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 0.0, 10.0);
        let arrivals = schedule(Arrival::Constant, 1000.0, 3000, 0);
        let s = drive(
            &mut model,
            &timer,
            &mut whole(&arrivals),
            Duration::ZERO,
            Batching {
                max_batch: 1,
                max_delay: Duration::ZERO,
            },
            None,
        )?;
        assert_eq!(s.ending, Ending::Backlog);
        assert_eq!(s.latencies_ns.len() + s.unfinished_ns.len(), 3000);
        assert!(s.unfinished_ns.iter().all(|&a| a > 0));
        Ok(())
    }

    #[test]
    fn a_step_holds_only_the_arrivals_that_wait() -> Result<()> {
        // 20,000 requests at 1,000/s into a model that keeps up: a step of 20 s holds a handful.
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 1.0, 0.01);
        let mut lazy = Schedule::new(crate::load::arrival::arrivals(Arrival::Constant, 1000.0, 0), 20_000);
        let batching = Batching {
            max_batch: 8,
            max_delay: Duration::from_millis(2),
        };
        let s = drive(&mut model, &timer, &mut lazy, Duration::ZERO, batching, None)?;
        assert_eq!(s.latencies_ns.len(), 20_000);
        assert!(lazy.most_held() <= 16, "held {} arrivals at once", lazy.most_held());
        // The same step from the schedule drawn whole: the same latencies.
        let timer = FakeClock::default();
        let mut model = FakeModel::new(&timer, 1.0, 0.01);
        let drawn = schedule(Arrival::Constant, 1000.0, 20_000, 0);
        let again = drive(&mut model, &timer, &mut whole(&drawn), Duration::ZERO, batching, None)?;
        assert_eq!(again.latencies_ns, s.latencies_ns);
        Ok(())
    }
}
