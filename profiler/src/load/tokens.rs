//! A language model served under open-loop load: requests arrive on a schedule fixed in advance,
//! each with its prompt and output lengths, and a continuous batcher ([`super::continuous`]) hands
//! one iteration at a time to the model. Every token's time is kept, so that each request's
//! objectives are measured as vLLM's benchmark measures them:
//!
//! - **TTFT**, from the request's *scheduled* arrival to its first token (a slow server shows as a
//!   longer wait, never as a lower offered rate);
//! - **ITL**, each gap between two tokens of a request;
//! - **TPOT** = (E2E − TTFT) ÷ (output tokens − 1), for requests of two tokens or more;
//! - **E2E**, from the scheduled arrival to the last token;
//! - **goodput**, the requests per second that met both objectives (TTFT and TPOT).
//!
//! The loop reads time and sleeps through [`Timer`] and runs iterations through [`Engine`], so that
//! tests drive it on a fake clock with a model of known step time.

use std::time::Duration;

use anyhow::{bail, Result};

use super::continuous::{Iteration, Request, Scheduler};
use super::serve::Timer;
use crate::run::uncertainty::{quantile_interval, Estimate};

/// One model instance behind the continuous batcher.
pub trait Engine {
    /// Runs one iteration (its prefill chunks and decodes, after dropping what it held of the
    /// sequences the iteration preempted) and returns once its tokens are out.
    fn run(&mut self, it: &Iteration) -> Result<()>;
    /// Sequence `id` produced its last token: what the engine holds of it can go.
    fn finished(&mut self, _id: usize) {}
    /// Drops every sequence: a new schedule starts, its requests numbered from 0 again.
    fn reset(&mut self) {}
}

/// What a request saw.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestRecord {
    /// Its scheduled arrival, from the schedule's start.
    pub arrival: Duration,
    pub prompt: u32,
    pub output: u32,
    /// When each of its tokens came out, in order.
    pub tokens: Vec<Duration>,
    /// Why the batcher refused it (it could never fit the cache), if it did.
    pub refused: Option<String>,
}

impl RequestRecord {
    pub fn finished(&self) -> bool {
        self.tokens.len() == self.output as usize
    }

    /// Time to the first token.
    pub fn ttft(&self) -> Option<Duration> {
        Some(self.tokens.first()?.saturating_sub(self.arrival))
    }

    /// Scheduled arrival to the last token, once finished.
    pub fn e2e(&self) -> Option<Duration> {
        match self.finished() {
            true => Some(self.tokens.last()?.saturating_sub(self.arrival)),
            false => None,
        }
    }

    /// Time per output token after the first, once finished with two tokens or more.
    pub fn tpot(&self) -> Option<Duration> {
        let n = self.tokens.len();
        if !self.finished() || n < 2 {
            return None;
        }
        Some((self.tokens[n - 1] - self.tokens[0]) / (n as u32 - 1))
    }

    /// The gaps between its consecutive tokens.
    pub fn itls(&self) -> impl Iterator<Item = Duration> + '_ {
        self.tokens.windows(2).map(|w| w[1] - w[0])
    }
}

/// One iteration as it ran.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct IterationRecord {
    pub start: Duration,
    pub end: Duration,
    /// Sequences in it, tokens it processed, and of those the prefills'.
    pub batch: u32,
    pub tokens: u32,
    pub prefill_tokens: u32,
    /// KV blocks in use while it ran (those of sequences it finished included), and the requests
    /// in the server then: admitted, and waiting.
    pub blocks_used: u32,
    pub running: u32,
    pub waiting: u32,
}

/// A step's requests and iterations.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationServed {
    /// In order of arrival; the n-th request had id n.
    pub requests: Vec<RequestRecord>,
    pub iterations: Vec<IterationRecord>,
    pub preemptions: u64,
    /// The cache's blocks.
    pub blocks: u32,
    /// When the loop stopped.
    pub end: Duration,
}

/// Hands the scheduler every request that has arrived by `now`, each recorded (with the reason
/// where the scheduler refused it).
fn admit_arrived(
    scheduler: &mut Scheduler,
    requests: &[(Duration, u32, u32)],
    records: &mut Vec<RequestRecord>,
    now: Duration,
) {
    while let Some(&(arrival, prompt, output)) = requests.get(records.len()).filter(|r| r.0 <= now) {
        let id = records.len();
        let refused = scheduler
            .add(Request { id, prompt, output })
            .err()
            .map(|e| e.to_string());
        records.push(RequestRecord {
            arrival,
            prompt,
            output,
            tokens: Vec::with_capacity(output as usize),
            refused,
        });
    }
}

/// Serves `requests` (arrival, prompt tokens, output tokens; arrivals ascending) through
/// `scheduler` on `engine` until every one is finished or `limit` passes. Every request is in the
/// record: one the batcher refuses (it could never fit) with why, and those not done by the limit
/// (arrived or not) unfinished.
pub fn drive(
    timer: &impl Timer,
    engine: &mut impl Engine,
    mut scheduler: Scheduler,
    requests: &[(Duration, u32, u32)],
    limit: Duration,
) -> Result<GenerationServed> {
    if requests.windows(2).any(|w| w[1].0 < w[0].0) {
        bail!("a schedule's arrivals are in order")
    }
    engine.reset();
    let mut records: Vec<RequestRecord> = Vec::with_capacity(requests.len());
    let mut iterations = Vec::new();
    loop {
        let now = timer.now();
        admit_arrived(&mut scheduler, requests, &mut records, now);
        if now >= limit {
            break;
        }
        if scheduler.is_idle() {
            match requests.get(records.len()) {
                Some(&(next, ..)) => {
                    timer.sleep_until(next.min(limit));
                    continue;
                }
                None => break,
            }
        }
        let it = scheduler.plan();
        let (blocks_used, running, waiting) = (
            scheduler.blocks_used(),
            scheduler.running() as u32,
            scheduler.waiting() as u32,
        );
        if it.is_empty() {
            bail!(
                "the continuous batcher planned nothing with {} waiting and {} running",
                scheduler.waiting(),
                scheduler.running()
            )
        }
        let start = timer.now();
        engine.run(&it)?;
        let end = timer.now();
        for t in scheduler.complete(&it) {
            records[t.id].tokens.push(end);
            if t.last {
                engine.finished(t.id);
            }
        }
        iterations.push(IterationRecord {
            start,
            end,
            batch: it.batch() as u32,
            tokens: it.tokens(),
            prefill_tokens: it.prefills.iter().map(|c| c.len).sum(),
            blocks_used,
            running,
            waiting,
        });
    }
    // What had not arrived by the limit is unfinished too.
    for &(arrival, prompt, output) in &requests[records.len()..] {
        records.push(RequestRecord {
            arrival,
            prompt,
            output,
            tokens: Vec::new(),
            refused: None,
        });
    }
    Ok(GenerationServed {
        requests: records,
        iterations,
        preemptions: scheduler.preemptions(),
        blocks: scheduler.budget().blocks,
        end: timer.now(),
    })
}

/// The two objectives a request must meet to count towards goodput.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Slo {
    pub ttft_p99: Duration,
    pub tpot_p99: Duration,
}

/// A latency's percentiles in ms with their intervals.
#[derive(Debug, Clone, PartialEq)]
pub struct Percentiles {
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p99_interval: Estimate,
}

impl Percentiles {
    fn of(mut ms: Vec<f64>) -> Option<Percentiles> {
        if ms.is_empty() {
            return None;
        }
        ms.sort_by(f64::total_cmp);
        // Between the two nearest ranks, as numpy's percentile (vLLM's benchmark) interpolates.
        let at = |q: f64| {
            let rank = q * (ms.len() - 1) as f64;
            let (lo, hi) = (rank.floor() as usize, rank.ceil() as usize);
            ms[lo] + (ms[hi] - ms[lo]) * (rank - lo as f64)
        };
        Some(Percentiles {
            p50_ms: at(0.5),
            p90_ms: at(0.9),
            p99_ms: at(0.99),
            p99_interval: quantile_interval(&ms, 0.99),
        })
    }
}

/// What a step of generation load measured over the requests that arrived after `warmup`.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerationSummary {
    /// Requests that arrived in the window, of those the finished and the refused (which could
    /// never fit the cache).
    pub requests: usize,
    pub finished: usize,
    pub refused: usize,
    /// The window: from the warm-up's end to the last measured request's last token (or the loop's
    /// end where one did not finish).
    pub window: Duration,
    pub ttft: Option<Percentiles>,
    pub tpot: Option<Percentiles>,
    pub itl: Option<Percentiles>,
    pub e2e: Option<Percentiles>,
    /// Finished requests and their output tokens per second of the window.
    pub request_rate: f64,
    pub output_token_rate: f64,
    /// Finished requests per second that met both objectives (a request of one token meets the
    /// TPOT objective).
    pub goodput: Option<f64>,
    /// The cache's share in use, averaged over the window's time (idle time counts as empty), and
    /// its most.
    pub kv_occupancy_mean: f64,
    pub kv_occupancy_max: f64,
    /// Sequences per iteration, averaged over iterations, and the most.
    pub batch_mean: f64,
    pub batch_max: u32,
    pub preemptions: u64,
    /// How fast TTFT grows with arrival time over the finished measured requests, seconds per second
    /// beyond twice its error ([`super::serve::growth`]; 0 with fewer than 100 requests): a queue
    /// that grows slowly passes a short step, and this carries it on.
    pub ttft_growth: f64,
}

impl GenerationSummary {
    /// TTFT's growth carried on over [`super::serve::GROWTH_HORIZON`], ms.
    pub fn ttft_growth_over_horizon_ms(&self) -> f64 {
        self.ttft_growth * super::serve::GROWTH_HORIZON.as_secs_f64() * 1e3
    }

    pub fn of(served: &GenerationServed, warmup: Duration, slo: Option<Slo>) -> GenerationSummary {
        let measured: Vec<&RequestRecord> = served.requests.iter().filter(|r| r.arrival >= warmup).collect();
        let done: Vec<&RequestRecord> = measured.iter().copied().filter(|r| r.finished()).collect();
        let end = match done.len() == measured.len() {
            true => done
                .iter()
                .filter_map(|r| r.tokens.last().copied())
                .max()
                .unwrap_or(served.end),
            false => served.end,
        };
        let window = end.saturating_sub(warmup);
        let secs = window.as_secs_f64().max(f64::MIN_POSITIVE);
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        // Over the finished requests, as vLLM's benchmark counts them; a step with unfinished ones
        // does not meet its objectives whatever its percentiles (`GenerationLoad::meets`).
        let ttft = Percentiles::of(done.iter().filter_map(|r| r.ttft()).map(ms).collect());
        let tpot = Percentiles::of(done.iter().filter_map(|r| r.tpot()).map(ms).collect());
        let itl = Percentiles::of(done.iter().flat_map(|r| r.itls()).map(ms).collect());
        let e2e = Percentiles::of(done.iter().filter_map(|r| r.e2e()).map(ms).collect());
        let goodput = slo.map(|s| {
            let good = done
                .iter()
                .filter(|r| r.ttft().is_some_and(|t| t <= s.ttft_p99) && r.tpot().is_none_or(|t| t <= s.tpot_p99))
                .count();
            good as f64 / secs
        });
        // Occupancy weighted by each iteration's time within the window; between iterations the
        // server was idle, its cache empty.
        let (mut weighted, mut most) = (0.0, 0f64);
        let its: Vec<&IterationRecord> = served
            .iterations
            .iter()
            .filter(|i| i.end > warmup && i.start < end)
            .collect();
        for i in &its {
            let t = (i.end.min(end).saturating_sub(i.start.max(warmup))).as_secs_f64();
            let share = i.blocks_used as f64 / served.blocks.max(1) as f64;
            weighted += share * t;
            most = most.max(share);
        }
        let (arrivals, ttfts): (Vec<Duration>, Vec<u64>) = done
            .iter()
            .filter_map(|r| Some((r.arrival, r.ttft()?.as_nanos() as u64)))
            .unzip();
        GenerationSummary {
            ttft_growth: super::serve::growth(&arrivals, &ttfts),
            requests: measured.len(),
            finished: done.len(),
            refused: measured.iter().filter(|r| r.refused.is_some()).count(),
            window,
            ttft,
            tpot,
            itl,
            e2e,
            request_rate: done.len() as f64 / secs,
            output_token_rate: done.iter().map(|r| r.output as f64).sum::<f64>() / secs,
            goodput,
            kv_occupancy_mean: weighted / secs,
            kv_occupancy_max: most,
            batch_mean: match its.len() {
                0 => 0.0,
                n => its.iter().map(|i| i.batch as f64).sum::<f64>() / n as f64,
            },
            batch_max: its.iter().map(|i| i.batch).max().unwrap_or(0),
            preemptions: served.preemptions,
        }
    }
}

/// What one step of generation load offers and how it is judged: seeded arrivals at a rate for
/// `duration`, each request's lengths drawn from `prompt` and `output`, served through a fresh
/// batcher of `budget` (the cache empties between steps), given `drain` after the last arrival to
/// finish. A step meets the objectives when every measured request finished and the p99s of TTFT and
/// TPOT are within them.
#[derive(Debug, Clone)]
pub struct StepPlan {
    pub budget: super::continuous::Budget,
    pub arrival: super::arrival::Arrival,
    pub prompt: super::lengths::LengthDist,
    pub output: super::lengths::LengthDist,
    /// Arrivals are offered for this long; those of the first `warmup` are not measured.
    pub duration: Duration,
    pub warmup: Duration,
    pub drain: Duration,
    /// The objectives a step is judged by (none: it is measured, not judged).
    pub slo: Option<Slo>,
    /// Seeds the arrivals and the lengths: every rate offers the same requests, sooner or later.
    pub seed: u64,
}

/// Whether a step's summary meets both objectives (none without objectives): every measured request
/// finished, and the p99s are within them, TTFT's also once its growth over the step is carried on
/// for [`super::serve::GROWTH_HORIZON`] (as `load`'s steps are judged).
pub fn meets(slo: Option<Slo>, s: &GenerationSummary) -> Option<bool> {
    let slo = slo?;
    let ms = |d: Duration| d.as_secs_f64() * 1e3;
    Some(
        s.finished == s.requests
            && s.requests > 0
            && s.ttft
                .as_ref()
                .is_some_and(|p| p.p99_ms + s.ttft_growth_over_horizon_ms() <= ms(slo.ttft_p99))
            && s.tpot.as_ref().is_none_or(|p| p.p99_ms <= ms(slo.tpot_p99)),
    )
}

impl StepPlan {
    /// Whether a step's summary meets both objectives: [`meets`].
    pub fn meets(&self, s: &GenerationSummary) -> Option<bool> {
        meets(self.slo, s)
    }

    /// The requests a step at `qps` offers (arrival from `start`, prompt tokens, output tokens).
    pub fn requests(&self, qps: f64, start: Duration) -> Vec<(Duration, u32, u32)> {
        let count = (qps * self.duration.as_secs_f64()).ceil().max(1.0) as usize;
        let (mut prompt, mut output) = (self.prompt.sampler(self.seed ^ 1), self.output.sampler(self.seed ^ 2));
        super::arrival::schedule(self.arrival, qps, count, self.seed)
            .into_iter()
            .map(|t| (start + t, prompt.draw(), output.draw()))
            .collect()
    }

    /// Serves a step at `qps` on `engine`: what every request and iteration saw, and the summary
    /// of the measured window (from `warmup` after the step's start).
    pub fn serve(
        &self,
        timer: &impl Timer,
        engine: &mut impl Engine,
        qps: f64,
    ) -> Result<(GenerationServed, GenerationSummary, Duration)> {
        if self.warmup >= self.duration {
            bail!(
                "a step of {:.1} s with a warm-up of {:.1} s measures nothing: the warm-up is part of the step",
                self.duration.as_secs_f64(),
                self.warmup.as_secs_f64()
            )
        }
        let start = timer.now();
        let requests = self.requests(qps, start);
        let limit = start + self.duration + self.drain;
        let served = drive(timer, engine, Scheduler::new(self.budget)?, &requests, limit)?;
        let summary = GenerationSummary::of(&served, start + self.warmup, self.slo);
        if summary.requests == 0 {
            bail!(
                "{qps:.2} requests/s for {:.1} s brought no request after the {:.1} s warm-up: a step this slow needs to be longer",
                self.duration.as_secs_f64(),
                self.warmup.as_secs_f64()
            )
        }
        Ok((served, summary, start))
    }
}

/// Steps of generation load for [`super::search::search`], each as its [`StepPlan`] says; every step
/// run is kept with its rate and what it measured.
pub struct GenerationLoad<'a, T: Timer, E: Engine> {
    pub timer: &'a T,
    pub engine: &'a mut E,
    pub plan: StepPlan,
    pub steps: Vec<(f64, GenerationSummary)>,
}

impl<T: Timer, E: Engine> super::search::StepRunner for GenerationLoad<'_, T, E> {
    fn run_step(&mut self, qps: f64) -> Result<bool> {
        let (_, summary, _) = self.plan.serve(self.timer, self.engine, qps)?;
        let met = self.plan.meets(&summary).unwrap_or(false);
        self.steps.push((qps, summary));
        Ok(met)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::arrival::{schedule, Arrival};
    use crate::load::continuous::Budget;
    use crate::load::lengths::LengthDist;
    use crate::testing::clock::FakeClock;

    /// A model whose iteration takes `fixed + per_token × tokens`, and that checks it is told what a
    /// real one needs: a sequence starts with a prefill from its first token, decodes only while it
    /// holds a cache, and is dropped when preempted or finished.
    struct FakeEngine {
        clock: FakeClock,
        fixed: Duration,
        per_token: Duration,
        held: std::collections::HashSet<usize>,
    }

    impl Engine for FakeEngine {
        fn run(&mut self, it: &Iteration) -> Result<()> {
            for id in &it.preempted {
                assert!(self.held.remove(id), "{id} preempted without a cache");
            }
            for c in &it.prefills {
                assert_eq!(c.start == 0, self.held.insert(c.id), "{c:?}");
            }
            for id in &it.decodes {
                assert!(self.held.contains(id), "{id} decodes without a cache");
            }
            self.clock.advance(self.fixed + self.per_token * it.tokens());
            Ok(())
        }

        fn finished(&mut self, id: usize) {
            assert!(self.held.remove(&id), "{id} finished without a cache");
        }
    }

    fn engine(clock: &FakeClock, fixed_ms: f64, per_token_us: f64) -> FakeEngine {
        FakeEngine {
            clock: clock.clone(),
            fixed: Duration::from_secs_f64(fixed_ms / 1e3),
            per_token: Duration::from_secs_f64(per_token_us / 1e6),
            held: Default::default(),
        }
    }

    /// Serves `requests` on a fresh fake clock through a cache of `blocks` blocks of 16, each
    /// iteration `fixed_ms + per_token_us × tokens`, for at most `limit_s`.
    fn serve(
        requests: &[(Duration, u32, u32)],
        blocks: u32,
        (fixed_ms, per_token_us): (f64, f64),
        limit_s: u64,
    ) -> Result<GenerationServed> {
        let clock = FakeClock::default();
        drive(
            &clock,
            &mut engine(&clock, fixed_ms, per_token_us),
            Scheduler::new(budget(blocks))?,
            requests,
            Duration::from_secs(limit_s),
        )
    }

    fn budget(blocks: u32) -> Budget {
        Budget {
            block_size: workloads::BlockSize::DEFAULT,
            blocks,
            max_batched_tokens: 2048,
            max_seqs: 256,
            chunked_prefill: true,
            max_model_len: 1 << 20,
        }
    }

    /// `n` requests at `rate` a second (Poisson), lengths from the given distributions.
    fn offered(rate: f64, n: usize, prompt: LengthDist, output: LengthDist) -> Vec<(Duration, u32, u32)> {
        let (mut p, mut o) = (prompt.sampler(1), output.sampler(2));
        schedule(Arrival::Poisson, rate, n, 3)
            .into_iter()
            .map(|t| (t, p.draw(), o.draw()))
            .collect()
    }

    #[test]
    fn the_objectives_are_measured_as_vllm_defines_them() {
        let r = RequestRecord {
            arrival: Duration::from_millis(100),
            prompt: 10,
            output: 4,
            tokens: [130, 140, 160, 190].map(Duration::from_millis).to_vec(),
            refused: None,
        };
        assert_eq!(r.ttft(), Some(Duration::from_millis(30)));
        assert_eq!(r.e2e(), Some(Duration::from_millis(90)));
        // (E2E − TTFT) ÷ (4 − 1) = 60 ÷ 3.
        assert_eq!(r.tpot(), Some(Duration::from_millis(20)));
        assert_eq!(r.itls().collect::<Vec<_>>(), [10, 20, 30].map(Duration::from_millis));
        let unfinished = RequestRecord {
            tokens: r.tokens[..2].to_vec(),
            ..r.clone()
        };
        assert_eq!((unfinished.e2e(), unfinished.tpot()), (None, None));
        let one = RequestRecord {
            output: 1,
            tokens: r.tokens[..1].to_vec(),
            ..r
        };
        assert_eq!((one.e2e(), one.tpot()), (Some(Duration::from_millis(30)), None));
        // Percentiles between ranks, as numpy's: 1..=100 has its median at 50.5, its p99 at 99.01.
        let p = Percentiles::of((1..=100).map(f64::from).collect()).unwrap();
        assert!(
            (p.p50_ms - 50.5).abs() < 1e-9 && (p.p99_ms - 99.01).abs() < 1e-9,
            "{p:?}"
        );
    }

    #[test]
    fn a_light_load_is_served_at_the_model_s_speed_and_every_token_comes_out() {
        // 2 requests a second of 200 + 50 tokens; an iteration takes 2 ms + 1 µs a token: each
        // request prefills alone (2.2 ms) and decodes its 49 steps at about 2 ms.
        let requests = offered(2.0, 40, LengthDist::Fixed(200), LengthDist::Fixed(50));
        let served = serve(&requests, 1000, (2.0, 1.0), 1000).unwrap();
        assert!(served.requests.iter().all(|r| r.finished() && r.tokens.len() == 50));
        let s = GenerationSummary::of(&served, Duration::ZERO, None);
        let (ttft, tpot) = (s.ttft.unwrap(), s.tpot.unwrap());
        assert!((2.0..2.6).contains(&ttft.p50_ms), "{ttft:?}");
        assert!((1.99..2.3).contains(&tpot.p50_ms), "{tpot:?}");
        assert_eq!(s.preemptions, 0);
        assert!(s.kv_occupancy_max > 0.0 && s.kv_occupancy_max <= 1.0);
    }

    #[test]
    fn little_s_law_holds_between_the_rate_the_concurrency_and_the_latency() {
        // L = λW: the time-average of requests in the system against the offered rate times the
        // mean time a request spends in it, over a long step of lognormal lengths.
        let rate = 20.0;
        let requests = offered(
            rate,
            3000,
            LengthDist::Lognormal {
                mean: 300.0,
                spread: 0.6,
            },
            LengthDist::Lognormal {
                mean: 60.0,
                spread: 0.5,
            },
        );
        let served = serve(&requests, 4000, (3.0, 2.0), 100_000).unwrap();
        assert!(served.requests.iter().all(|r| r.finished()));
        let w: Vec<f64> = served.requests.iter().map(|r| r.e2e().unwrap().as_secs_f64()).collect();
        let n = w.len() as f64;
        let mean_w = w.iter().sum::<f64>() / n;
        // L as the server saw it: the requests admitted or waiting during each iteration, weighted
        // by its time, over the step from the first arrival to the last token (idle time counts
        // as empty). Requests that arrive during an iteration are counted from the next.
        let first = served.requests[0].arrival;
        let last = served.iterations.last().unwrap().end;
        let area: f64 = served
            .iterations
            .iter()
            .map(|i| (i.running + i.waiting) as f64 * (i.end - i.start).as_secs_f64())
            .sum();
        let l = area / (last - first).as_secs_f64();
        // 95 % interval of λW: the mean time's standard error, and the Poisson count's 1/√n in λ.
        let sd_w = (w.iter().map(|x| (x - mean_w).powi(2)).sum::<f64>() / (n - 1.0)).sqrt();
        let rel = ((sd_w / mean_w).powi(2) / n + 1.0 / n).sqrt();
        let expected = rate * mean_w;
        assert!(
            (l - expected).abs() <= 1.96 * rel * expected,
            "L = {l:.3}, λW = {expected:.3} ± {:.3}",
            1.96 * rel * expected
        );
        assert!(l > 0.3, "the step has requests in flight together: L = {l}");
    }

    #[test]
    fn an_overloaded_cache_preempts_and_goodput_counts_only_requests_within_both_objectives() {
        // A cache of 40 blocks (640 tokens) for requests of 200 + 100: at most three at once, and
        // growing decodes preempt. A rate far above what the model serves makes waits grow.
        let requests = offered(50.0, 200, LengthDist::Fixed(200), LengthDist::Fixed(100));
        let served = serve(&requests, 40, (5.0, 2.0), 10_000).unwrap();
        assert!(served.preemptions > 0);
        assert!(
            served.requests.iter().all(|r| r.finished()),
            "a preempted request finishes"
        );
        let loose = Slo {
            ttft_p99: Duration::from_secs(10_000),
            tpot_p99: Duration::from_secs(10),
        };
        let tight = Slo {
            ttft_p99: Duration::from_millis(500),
            ..loose
        };
        let (all, some) = (
            GenerationSummary::of(&served, Duration::ZERO, Some(loose)),
            GenerationSummary::of(&served, Duration::ZERO, Some(tight)),
        );
        assert!((all.goodput.unwrap() - all.request_rate).abs() < 1e-9);
        assert!(some.goodput.unwrap() < all.goodput.unwrap() / 2.0, "{some:?}");
        assert!(all.kv_occupancy_max > 0.9, "{}", all.kv_occupancy_max);
        assert!(all.ttft.unwrap().p99_ms > 1000.0);
    }

    #[test]
    fn the_search_finds_the_highest_rate_within_both_objectives_of_a_model_of_known_step_time() {
        // Every iteration takes 10 ms. A request of 200 + 50 tokens stays about 50 iterations
        // (0.5 s), and at most 256 sequences run at once: at most 256 / 0.5 = 512 requests/s keep
        // up (the 2,048 tokens an iteration would allow 822), and beyond that the queue, and the
        // time to the first token, grow without bound. A decode runs every iteration: 10 ms a
        // token, within 25.
        let clock = FakeClock::default();
        let mut engine = engine(&clock, 10.0, 0.0);
        let slo = Slo {
            ttft_p99: Duration::from_millis(300),
            tpot_p99: Duration::from_millis(25),
        };
        let mut load = GenerationLoad {
            timer: &clock,
            engine: &mut engine,
            plan: StepPlan {
                budget: budget(100_000),
                arrival: crate::load::arrival::Arrival::Poisson,
                prompt: LengthDist::Fixed(200),
                output: LengthDist::Fixed(50),
                duration: Duration::from_secs(20),
                warmup: Duration::from_secs(2),
                drain: Duration::from_secs(20),
                slo: Some(slo),
                seed: 9,
            },
            steps: Vec::new(),
        };
        let plan = crate::load::search::SearchPlan {
            start_qps: 100.0,
            resolution: 0.05,
            floor_qps: 1.0,
            max_steps: 12,
            ceiling_qps: f64::MAX,
        };
        let out = crate::load::search::search(&mut load, plan).unwrap();
        let capacity = out.capacity_qps.unwrap();
        assert!(
            (0.85 * 512.0..=1.1 * 512.0).contains(&capacity),
            "{capacity} from {:?}",
            out.steps
        );
        // The steps the search judged say why: the passing ones within both objectives, and the
        // failing ones past the TTFT objective.
        for (qps, s) in &load.steps {
            let ttft = s.ttft.as_ref().unwrap().p99_ms;
            assert_eq!(
                *qps <= capacity,
                ttft <= 300.0 && s.finished == s.requests,
                "{qps}: {ttft}"
            );
            assert!(s.tpot.as_ref().unwrap().p99_ms <= 25.0);
        }
    }

    #[test]
    fn a_queue_that_grows_slowly_fails_the_objective_a_short_step_would_pass() {
        // An iteration of 10 ms serves at most 256 / 0.5 s = 512 requests/s of 200 + 50 tokens
        // (one decode per iteration). At 560 a second the waiting queue grows by about 48 a
        // second: within a 10 s step TTFT stays under a generous objective, but carried on for a
        // minute it would not.
        let clock = FakeClock::default();
        let mut engine = engine(&clock, 10.0, 0.0);
        let plan = StepPlan {
            budget: budget(100_000),
            arrival: crate::load::arrival::Arrival::Constant,
            prompt: LengthDist::Fixed(200),
            output: LengthDist::Fixed(50),
            duration: Duration::from_secs(10),
            warmup: Duration::from_secs(1),
            drain: Duration::from_secs(30),
            slo: Some(Slo {
                ttft_p99: Duration::from_secs(5),
                tpot_p99: Duration::from_millis(100),
            }),
            seed: 4,
        };
        let (_, over, _) = plan.serve(&clock, &mut engine, 560.0).unwrap();
        assert!(over.ttft.as_ref().unwrap().p99_ms < 5000.0, "{over:?}");
        assert!(over.ttft_growth > 0.02, "{}", over.ttft_growth);
        assert_eq!(plan.meets(&over), Some(false));
        let (_, under, _) = plan.serve(&clock, &mut engine, 400.0).unwrap();
        assert!(under.ttft_growth < 1e-3, "{}", under.ttft_growth);
        assert_eq!(plan.meets(&under), Some(true));
    }

    #[test]
    fn a_step_that_runs_past_its_limit_stops_and_keeps_what_was_unfinished() {
        let requests = offered(100.0, 500, LengthDist::Fixed(100), LengthDist::Fixed(200));
        let served = serve(&requests, 2000, (5.0, 1.0), 2).unwrap();
        assert!(served.end >= Duration::from_secs(2) && served.end < Duration::from_secs(3));
        assert!(served.requests.iter().any(|r| !r.finished()));
        let s = GenerationSummary::of(&served, Duration::ZERO, None);
        assert!(s.finished < s.requests);
        // A request that could never fit the cache is refused and kept; the rest are served.
        let mut with_giant = offered(5.0, 10, LengthDist::Fixed(100), LengthDist::Fixed(20));
        with_giant[3].1 = 1_000_000;
        let served = serve(&with_giant, 100, (5.0, 1.0), 1000).unwrap();
        let giant = &served.requests[3];
        assert!(giant.refused.as_deref().is_some_and(|e| e.contains("cache slots")) && giant.tokens.is_empty());
        assert_eq!(served.requests.iter().filter(|r| r.finished()).count(), 9);
        assert_eq!(GenerationSummary::of(&served, Duration::ZERO, None).refused, 1);
        // Arrivals out of order are refused.
        let backwards = [(Duration::from_secs(2), 5, 5), (Duration::from_secs(1), 5, 5)];
        let e = serve(&backwards, 10, (1.0, 1.0), 10).unwrap_err();
        assert!(e.to_string().contains("in order"));
    }
}
