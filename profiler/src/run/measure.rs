//! The measuring loop: warm-up, then timed iterations of one step until a stop rule is met.
//!
//! It drives any step through [`Executor`] and reads time through [`Clock`], as hyperfine's executor
//! does, so tests can run it on a fake step and a fake clock and check every number exactly.

use std::time::{Duration, Instant};

use anyhow::Result;

/// A monotonic time source.
pub trait Clock {
    /// Time since an arbitrary, fixed origin.
    fn now(&self) -> Duration;
}

/// The real clock.
pub struct MonotonicClock(Instant);

impl MonotonicClock {
    pub fn new() -> Self {
        Self(Instant::now())
    }
}

impl Default for MonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl Clock for MonotonicClock {
    fn now(&self) -> Duration {
        self.0.elapsed()
    }
}

/// One step of a workload, as the loop sees it.
pub trait Executor {
    /// Runs one step and returns only once the device has finished it, so that the clock read right
    /// after it measures the step and not merely its launch.
    fn step(&mut self) -> Result<()>;
    /// The loss of the most recent step when training. Reading it may copy from the device, so the
    /// loop reads it outside the timed section and only for the first and last measured steps.
    fn loss(&mut self) -> Result<Option<f32>>;
    /// Where the workload trains with a dynamic loss scale (mixed precision): the scale now and the
    /// steps skipped so far (an inf or a nan in their gradients). Reading it may copy from the
    /// device: the loop reads it outside the timed section, before the first measured step and
    /// after the last.
    fn loss_scale(&mut self) -> Result<Option<LossScale>> {
        Ok(None)
    }
    /// Steps before the executor's steps are all alike (a CUDA graph is captured at the second): a
    /// warm-up by duration runs at least this many.
    fn steps_to_steady(&self) -> u64 {
        1
    }
    /// Work that starts a run of steps, done before a step outside its timed section: a language
    /// model's prefill before its decode steps. Returns how long it took, by `clock`, where it did
    /// any; the loop keeps those times apart from the steps'.
    fn begin(&mut self, clock: &dyn Clock) -> Result<Option<Duration>> {
        let _ = clock;
        Ok(None)
    }
    /// Steps of one run that is never cut short (a generation's decode steps, so that every measured
    /// one has its steps at every position), 1 for steps alike: warm-up and measuring end only
    /// after a whole number of runs, and the stop rule's interval takes whole runs as its batches.
    fn steps_per_run(&self) -> usize {
        1
    }
}

/// A dynamic loss scale as the loop reads it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LossScale {
    pub scale: f64,
    /// Steps skipped so far.
    pub skipped: u64,
}

/// How long to run before measuring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Warmup {
    Iterations(u64),
    /// Until this much time has passed and at least `min_iterations` (at least one) have run.
    Duration {
        min: Duration,
        min_iterations: u64,
    },
}

/// When to stop measuring.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Stop {
    /// Exactly this many measured iterations.
    Iterations(u64),
    /// Until this much measured time has passed and at least `min_iterations` have run.
    Duration { min: Duration, min_iterations: u64 },
    /// Until the throughput's 95% interval lies within ±`target` (relative) of it, once `min` has
    /// passed and `min_iterations` have run; at `max` whatever the interval (but never before
    /// `min_iterations`).
    Precision {
        target: f64,
        min: Duration,
        max: Duration,
        min_iterations: u64,
    },
}

/// Whether to stop after a step.
enum Reached {
    No,
    Yes,
    /// Stopped by a bound before the rule was met; says so.
    AtBound(String),
}

impl Stop {
    /// Whether to stop after `latencies_ns`, measured in runs of `unit` steps (1: steps alike). With
    /// runs, the loop asks only at the end of one, so the interval is computed every time it asks.
    fn reached(&self, latencies_ns: &[u64], elapsed: Duration, unit: usize) -> Reached {
        let sparse = unit > 1;
        let iterations = latencies_ns.len() as u64;
        let done = match *self {
            Stop::Iterations(n) => iterations >= n,
            Stop::Duration { min, min_iterations } => iterations >= min_iterations.max(1) && elapsed >= min,
            Stop::Precision {
                target,
                min,
                max,
                min_iterations,
            } => {
                let ready = iterations >= min_iterations.max(1) && elapsed >= min;
                // The interval costs a pass over the samples: checked about 20 times per doubling.
                let check = ready && (sparse || iterations.is_multiple_of((iterations / 20).max(1)));
                let precision = if check || elapsed >= max {
                    crate::run::uncertainty::throughput_precision(latencies_ns, unit)
                } else {
                    None
                };
                if check && precision.is_some_and(|p| p <= target) {
                    return Reached::Yes;
                }
                // The bound never cuts a run below its minimum count, as --duration does not.
                if elapsed >= max && iterations >= min_iterations.max(1) {
                    let got = precision.map_or("no interval yet".to_string(), |p| format!("±{:.1}%", p * 100.0));
                    return Reached::AtBound(format!(
                        "stopped at the {:.0} s bound (--max-duration) with the throughput known to {got}, short of the ±{:.1}% asked for",
                        max.as_secs_f64(),
                        target * 100.0
                    ));
                }
                false
            }
        };
        if done {
            Reached::Yes
        } else {
            Reached::No
        }
    }
}

/// What one measurement produced.
#[derive(Debug, Clone, PartialEq)]
pub struct Measurement {
    pub warmup_iterations: u64,
    /// Latency of each measured step, in order, in nanoseconds.
    pub latencies_ns: Vec<u64>,
    /// Wall-clock time of the whole measured phase, harness included.
    pub elapsed: Duration,
    pub loss_first: Option<f32>,
    pub loss_last: Option<f32>,
    /// Why measuring stopped early, when a bound cut it short of its rule.
    pub stop_note: Option<String>,
    /// Why the workload's CUDA-graph captures were refused, one line per reason (empty when none
    /// was): the loop knows nothing of graphs, its caller fills this from the workload.
    pub graphs_refused: Vec<String>,
    /// Measured steps the workload skipped (an inf or a nan in a mixed-precision step's gradients);
    /// `None` where it neither skips nor counts.
    pub skipped_steps: Option<u64>,
    /// The dynamic loss scale after the last measured step; `None` without one.
    pub loss_scale: Option<f64>,
    /// What [`Executor::begin`] took before the measured steps it started (a language model's
    /// prefill of each measured generation), in order, in nanoseconds; empty where it did nothing.
    pub begin_ns: Vec<u64>,
    /// Bytes a language model's KV cache held at the end of a generation, the whole batch's: the loop
    /// knows nothing of caches, its caller fills this from the generator.
    pub kv_cache_bytes: Option<u64>,
}

/// What runs beside the measured phase (the GPU sampler, a profiler's capture range): started once
/// warm-up is over, right before the first measured step, and stopped right after the last, also
/// when a step fails.
pub trait Observer {
    /// Once warm-up is over, before `start`: where a concurrent group's members wait for each other.
    fn meet(&mut self) -> Result<()> {
        Ok(())
    }
    fn start(&mut self);
    fn stop(&mut self);
    /// After a measured phase that succeeded: whether to run another, unmeasured step to keep the
    /// device busy (a group member does until every member has measured). An error, or a step that
    /// fails while holding, ends the holding and never the run.
    fn hold(&mut self) -> Result<bool> {
        Ok(false)
    }
}

/// Nothing beside the measured phase.
pub struct Unobserved;

impl Observer for Unobserved {
    fn start(&mut self) {}
    fn stop(&mut self) {}
}

/// The measuring loop of every run: warms up, starts `observer`, measures until `stop`, stops it.
pub fn measure(
    exec: &mut dyn Executor,
    clock: &dyn Clock,
    warmup: Warmup,
    stop: Stop,
    observer: &mut dyn Observer,
) -> Result<Measurement> {
    let warmup_iterations = warm_up(exec, clock, warmup)?;
    observer.meet()?;
    observer.start();
    let measured = measure_steps(exec, clock, stop);
    observer.stop();
    let measured = measured?;
    // Holding keeps the device busy for others; nothing it meets may cost this run its measurement.
    while observer.hold().unwrap_or(false) {
        if exec.begin(clock).is_err() || exec.step().is_err() {
            break;
        }
    }
    Ok(Measurement {
        warmup_iterations,
        ..measured
    })
}

/// The measured phase alone.
fn measure_steps(exec: &mut dyn Executor, clock: &dyn Clock, stop: Stop) -> Result<Measurement> {
    let mut latencies_ns = Vec::new();
    let mut begin_ns = Vec::new();
    let mut loss_first = None;
    let unit = exec.steps_per_run();
    // Read before the clock starts: it may synchronise with the device.
    let scale_before = exec.loss_scale()?;
    let start = clock.now();
    let mut stop_note = None;
    let loss_last = loop {
        if let Some(begun) = exec.begin(clock)? {
            begin_ns.push(nanos(begun));
        }
        let t0 = clock.now();
        exec.step()?;
        let t1 = clock.now();
        latencies_ns.push(nanos(t1 - t0));
        if latencies_ns.len() == 1 {
            loss_first = exec.loss()?;
        }
        if !latencies_ns.len().is_multiple_of(unit) {
            continue;
        }
        match stop.reached(&latencies_ns, clock.now() - start, unit) {
            Reached::No => {}
            Reached::Yes => break exec.loss()?,
            Reached::AtBound(note) => {
                stop_note = Some(note);
                break exec.loss()?;
            }
        }
    };
    let elapsed = clock.now() - start;
    let scale_after = exec.loss_scale()?;
    let skipped_steps = match (scale_before, scale_after) {
        (Some(before), Some(after)) => Some(after.skipped.saturating_sub(before.skipped)),
        _ => None,
    };
    let loss_scale = scale_after.map(|s| s.scale);
    Ok(Measurement {
        warmup_iterations: 0,
        latencies_ns,
        elapsed,
        loss_first,
        loss_last,
        stop_note,
        graphs_refused: Vec::new(),
        skipped_steps,
        loss_scale,
        begin_ns,
        kv_cache_bytes: None,
    })
}

/// Runs steps until the warm-up rule is met; returns how many.
fn warm_up(exec: &mut dyn Executor, clock: &dyn Clock, warmup: Warmup) -> Result<u64> {
    let start = clock.now();
    let mut n = 0;
    loop {
        let done = match warmup {
            Warmup::Iterations(k) => n >= k,
            Warmup::Duration { min, min_iterations } => {
                n >= min_iterations.max(exec.steps_to_steady()).max(1) && clock.now() - start >= min
            }
        };
        if done && n.is_multiple_of(exec.steps_per_run() as u64) {
            return Ok(n);
        }
        exec.begin(clock)?;
        exec.step()?;
        n += 1;
    }
}

pub(crate) fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::clock::{FakeClock, FakeStep};

    #[test]
    fn skipped_steps_are_counted_over_the_measured_steps_alone() -> Result<()> {
        let clock = FakeClock::default();
        let mut step = FakeStep::new(&clock, &[1.0]);
        step.skip_every = Some(4);
        // Steps 1-5 warm up (step 4 skipped), 6-15 are measured (8 and 12 skipped).
        let m = measure(
            &mut step,
            &clock,
            Warmup::Iterations(5),
            Stop::Iterations(10),
            &mut Unobserved,
        )?;
        assert_eq!(m.skipped_steps, Some(2));
        // The scale after the last measured step (15: three skips in all), not after any later one.
        assert_eq!(m.loss_scale, Some(65536.0 / 8.0));
        // An executor that counts nothing says nothing, not zero.
        let mut plain = FakeStep::new(&clock, &[1.0]);
        let m = measure(
            &mut plain,
            &clock,
            Warmup::Iterations(1),
            Stop::Iterations(3),
            &mut Unobserved,
        )?;
        assert_eq!((m.skipped_steps, m.loss_scale), (None, None));
        Ok(())
    }

    #[test]
    fn fixed_iterations_record_each_step_latency_in_order() -> Result<()> {
        let clock = FakeClock::default();
        let mut step = FakeStep::new(&clock, &[1.0, 3.0]);
        let m = measure(
            &mut step,
            &clock,
            Warmup::Iterations(3),
            Stop::Iterations(4),
            &mut Unobserved,
        )?;
        assert_eq!(m.warmup_iterations, 3);
        // Warm-up took steps 0..3 (1, 3, 1 ms), so measuring starts on a 3 ms step.
        assert_eq!(m.latencies_ns, vec![3_000_000, 1_000_000, 3_000_000, 1_000_000]);
        assert_eq!(m.elapsed, Duration::from_millis(8));
        assert_eq!(step.steps, 7);
        Ok(())
    }

    #[test]
    fn duration_stop_waits_for_both_time_and_minimum_iterations() -> Result<()> {
        let clock = FakeClock::default();
        let mut step = FakeStep::new(&clock, &[2.0]);
        let stop = Stop::Duration {
            min: Duration::from_millis(9),
            min_iterations: 3,
        };
        let m = measure(&mut step, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        assert_eq!(m.latencies_ns.len(), 5, "9 ms of 2 ms steps needs 5");

        let stop = Stop::Duration {
            min: Duration::from_millis(1),
            min_iterations: 7,
        };
        let m = measure(&mut step, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        assert_eq!(m.latencies_ns.len(), 7, "the minimum count wins over a short duration");
        Ok(())
    }

    #[test]
    fn duration_warmup_runs_until_both_time_and_count_are_reached() -> Result<()> {
        let clock = FakeClock::default();
        let mut step = FakeStep::new(&clock, &[4.0]);
        let warmup = |ms, min_iterations| Warmup::Duration {
            min: Duration::from_millis(ms),
            min_iterations,
        };
        let m = measure(&mut step, &clock, warmup(10, 1), Stop::Iterations(1), &mut Unobserved)?;
        assert_eq!(m.warmup_iterations, 3);
        let m = measure(&mut step, &clock, warmup(0, 0), Stop::Iterations(1), &mut Unobserved)?;
        assert_eq!(m.warmup_iterations, 1);
        let m = measure(&mut step, &clock, warmup(10, 5), Stop::Iterations(1), &mut Unobserved)?;
        assert_eq!(m.warmup_iterations, 5, "the minimum count wins over a short duration");
        Ok(())
    }

    #[test]
    fn a_warmup_by_duration_covers_the_steps_before_an_executor_is_steady() -> Result<()> {
        let clock = FakeClock::default();
        // A workload replaying CUDA graphs: its second step captures, so both belong to the warm-up.
        let mut step = FakeStep {
            steady_after: 2,
            ..FakeStep::new(&clock, &[4.0])
        };
        let m = measure(
            &mut step,
            &clock,
            Warmup::Duration {
                min: Duration::ZERO,
                min_iterations: 1,
            },
            Stop::Iterations(1),
            &mut Unobserved,
        )?;
        assert_eq!(m.warmup_iterations, 2);
        // A count given by the user is what runs, steady or not.
        let m = measure(
            &mut step,
            &clock,
            Warmup::Iterations(1),
            Stop::Iterations(1),
            &mut Unobserved,
        )?;
        assert_eq!(m.warmup_iterations, 1);
        Ok(())
    }

    /// A generation on the fake clock: a 5 ms prefill begins every run of `steps` 1 ms decode steps.
    struct FakeGeneration {
        clock: FakeClock,
        steps: usize,
        done: usize,
        prefills: usize,
    }

    impl Executor for FakeGeneration {
        fn step(&mut self) -> Result<()> {
            self.clock.advance(Duration::from_millis(1));
            self.done += 1;
            Ok(())
        }

        fn loss(&mut self) -> Result<Option<f32>> {
            Ok(None)
        }

        fn begin(&mut self, clock: &dyn Clock) -> Result<Option<Duration>> {
            if !self.done.is_multiple_of(self.steps) {
                return Ok(None);
            }
            let t0 = clock.now();
            self.clock.advance(Duration::from_millis(5));
            self.prefills += 1;
            Ok(Some(clock.now() - t0))
        }

        fn steps_per_run(&self) -> usize {
            self.steps
        }
    }

    #[test]
    fn generations_are_measured_whole_with_their_prefills_kept_apart() -> Result<()> {
        let clock = FakeClock::default();
        let mut g = FakeGeneration {
            clock: clock.clone(),
            steps: 4,
            done: 0,
            prefills: 0,
        };
        // A warm-up of 3 steps and a stop at 6 both end at the end of a generation.
        let m = measure(
            &mut g,
            &clock,
            Warmup::Iterations(3),
            Stop::Iterations(6),
            &mut Unobserved,
        )?;
        assert_eq!(m.warmup_iterations, 4);
        assert_eq!(m.latencies_ns, vec![1_000_000; 8]);
        assert_eq!(
            m.begin_ns,
            vec![5_000_000; 2],
            "one prefill per measured generation, none of warm-up's"
        );
        assert_eq!(g.prefills, 3);
        // The wall time holds the prefills; the steps' latencies do not.
        assert_eq!(m.elapsed, Duration::from_millis(18));
        // A precision stop is asked at each generation's end, not at counts that never are one.
        let stop = Stop::Precision {
            target: 0.01,
            min: Duration::ZERO,
            max: Duration::from_secs(60),
            min_iterations: 10,
        };
        let m = measure(&mut g, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        assert_eq!(m.latencies_ns.len(), 12, "the first generation end at or past 10 steps");
        Ok(())
    }

    #[test]
    fn clock_cost_shows_in_wall_time_not_in_latencies() -> Result<()> {
        // Every clock read costs 10 us: a latency spans one read, the wall time every read.
        let clock = FakeClock::with_tick(Duration::from_micros(10));
        let mut step = FakeStep::new(&clock, &[1.0]);
        let m = measure(
            &mut step,
            &clock,
            Warmup::Iterations(0),
            Stop::Iterations(10),
            &mut Unobserved,
        )?;
        assert!(m.latencies_ns.iter().all(|&l| l == 1_010_000), "{:?}", m.latencies_ns);
        // Each iteration reads the clock three times (t0, t1, the stop check) around its 1 ms step,
        // and the final elapsed read is one more tick: 10 ms + 31 ticks.
        assert_eq!(m.elapsed, Duration::from_micros(10_000 + 31 * 10));
        Ok(())
    }

    #[test]
    fn loss_is_read_for_the_first_and_last_measured_step_only() -> Result<()> {
        let clock = FakeClock::default();
        let mut step = FakeStep::new(&clock, &[1.0]);
        step.train = true;
        let m = measure(
            &mut step,
            &clock,
            Warmup::Iterations(2),
            Stop::Iterations(5),
            &mut Unobserved,
        )?;
        assert_eq!(step.loss_reads, 2);
        assert_eq!(m.loss_first, Some(0.5f32.powi(3)));
        assert_eq!(m.loss_last, Some(0.5f32.powi(7)));
        Ok(())
    }

    #[test]
    fn the_observer_spans_exactly_the_measured_steps_even_when_one_fails() -> Result<()> {
        struct Counting(std::rc::Rc<std::cell::Cell<usize>>, Vec<(&'static str, usize)>);
        impl Observer for Counting {
            fn start(&mut self) {
                self.1.push(("start", self.0.get()));
            }
            fn stop(&mut self) {
                self.1.push(("stop", self.0.get()));
            }
        }
        struct Counted(std::rc::Rc<std::cell::Cell<usize>>, usize);
        impl Executor for Counted {
            fn step(&mut self) -> Result<()> {
                self.0.set(self.0.get() + 1);
                anyhow::ensure!(self.0.get() <= self.1, "step {} failed", self.0.get());
                Ok(())
            }
            fn loss(&mut self) -> Result<Option<f32>> {
                Ok(None)
            }
        }
        let steps = std::rc::Rc::new(std::cell::Cell::new(0));
        let mut observer = Counting(steps.clone(), Vec::new());
        measure(
            &mut Counted(steps.clone(), usize::MAX),
            &FakeClock::default(),
            Warmup::Iterations(3),
            Stop::Iterations(5),
            &mut observer,
        )?;
        assert_eq!(
            observer.1,
            vec![("start", 3), ("stop", 8)],
            "after the 3 warm-up steps, right after the 5 measured"
        );
        steps.set(0);
        let mut observer = Counting(steps.clone(), Vec::new());
        let err = measure(
            &mut Counted(steps.clone(), 4),
            &FakeClock::default(),
            Warmup::Iterations(2),
            Stop::Iterations(5),
            &mut observer,
        );
        assert!(err.is_err());
        assert_eq!(
            observer.1,
            vec![("start", 2), ("stop", 5)],
            "stopped after the failing step"
        );
        Ok(())
    }

    #[test]
    fn precision_stops_once_the_interval_is_tight_or_at_the_bound_saying_so() -> Result<()> {
        // Steps spread over 1..3 ms in no period a batch could line up with (97 values, repeated):
        // the throughput's interval shrinks as 1/√n; ±5% takes on the order of a hundred steps.
        let clock = FakeClock::default();
        let durations: Vec<f64> = (0..97u64)
            .map(|i| 1.0 + 2.0 * ((i * 37 + 11) % 97) as f64 / 96.0)
            .collect();
        let mut step = FakeStep::new(&clock, &durations);
        let stop = Stop::Precision {
            target: 0.05,
            min: Duration::ZERO,
            max: Duration::from_secs(60),
            min_iterations: 10,
        };
        let m = measure(&mut step, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        let n = m.latencies_ns.len();
        assert!(
            crate::run::uncertainty::throughput_precision(&m.latencies_ns, 1).unwrap() <= 0.05,
            "{n}"
        );
        assert!((50..1000).contains(&n), "{n} steps");
        assert_eq!(m.stop_note, None);
        // A bound of 50 ms of 2 ms steps stops at about 25 steps, short of ±1%, and says so.
        let stop = Stop::Precision {
            target: 0.01,
            min: Duration::ZERO,
            max: Duration::from_millis(50),
            min_iterations: 10,
        };
        let m = measure(&mut step, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        assert!((24..=26).contains(&m.latencies_ns.len()), "{}", m.latencies_ns.len());
        let note = m.stop_note.unwrap();
        assert!(
            note.contains("0 s bound (--max-duration)") && note.contains("short of the ±1.0%"),
            "{note}"
        );
        // The bound never stops a run short of its minimum count.
        let stop = Stop::Precision {
            target: 0.01,
            min: Duration::ZERO,
            max: Duration::from_millis(5),
            min_iterations: 10,
        };
        let m = measure(&mut step, &clock, Warmup::Iterations(0), stop, &mut Unobserved)?;
        assert_eq!(m.latencies_ns.len(), 10);
        Ok(())
    }

    #[test]
    fn a_failing_step_is_an_error() {
        struct Broken;
        impl Executor for Broken {
            fn step(&mut self) -> Result<()> {
                anyhow::bail!("out of memory")
            }
            fn loss(&mut self) -> Result<Option<f32>> {
                Ok(None)
            }
        }
        let err = measure(
            &mut Broken,
            &MonotonicClock::new(),
            Warmup::Iterations(0),
            Stop::Iterations(1),
            &mut Unobserved,
        )
        .unwrap_err();
        assert_eq!(err.to_string(), "out of memory");
    }
}
