//! A step of scripted duration on a clock that only moves when told to.

use std::cell::Cell;
use std::rc::Rc;
use std::time::Duration;

use anyhow::Result;

use crate::run::measure::{Clock, Executor, LossScale};

#[derive(Clone, Default)]
pub struct FakeClock {
    now: Rc<Cell<Duration>>,
    /// Added on every read: models what reading the clock and bookkeeping cost.
    pub tick: Duration,
}

impl FakeClock {
    pub fn with_tick(tick: Duration) -> Self {
        Self {
            tick,
            ..Default::default()
        }
    }

    pub fn advance(&self, d: Duration) {
        self.now.set(self.now.get() + d);
    }
}

/// Sleeping on the fake clock moves it to the wake-up time: a load step's waits take no real time.
impl crate::load::serve::Timer for FakeClock {
    fn now(&self) -> Duration {
        Clock::now(self)
    }

    fn sleep_until(&self, t: Duration) {
        let now = self.now.get();
        if t > now {
            self.advance(t - now);
        }
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Duration {
        let t = self.now.get();
        self.now.set(t + self.tick);
        t
    }
}

/// Takes `durations[i % len]` for step i, and reports a loss that halves each step.
pub struct FakeStep {
    pub clock: FakeClock,
    pub durations: Vec<Duration>,
    pub steps: usize,
    pub train: bool,
    pub loss_reads: usize,
    /// What [`Executor::steps_to_steady`] answers (a workload replaying CUDA graphs: 2).
    pub steady_after: u64,
    /// Every k-th step (1-based) counts as skipped, as a mixed-precision step with an inf in its
    /// gradients; `None`: the executor counts no skipped steps.
    pub skip_every: Option<usize>,
}

impl FakeStep {
    pub fn new(clock: &FakeClock, durations_ms: &[f64]) -> Self {
        let durations = durations_ms
            .iter()
            .map(|&ms| Duration::from_secs_f64(ms / 1e3))
            .collect();
        Self {
            clock: clock.clone(),
            durations,
            steps: 0,
            train: false,
            loss_reads: 0,
            steady_after: 1,
            skip_every: None,
        }
    }
}

impl Executor for FakeStep {
    fn step(&mut self) -> Result<()> {
        self.clock.advance(self.durations[self.steps % self.durations.len()]);
        self.steps += 1;
        Ok(())
    }

    fn loss(&mut self) -> Result<Option<f32>> {
        self.loss_reads += 1;
        Ok(self.train.then(|| 0.5f32.powi(self.steps as i32)))
    }

    /// 2¹⁶ halved at each skipped step, as a dynamic loss scale that never grows back.
    fn loss_scale(&mut self) -> Result<Option<LossScale>> {
        Ok(self.skip_every.map(|k| {
            let skipped = (self.steps / k) as u64;
            LossScale {
                scale: 65536.0 / 2f64.powi(skipped as i32),
                skipped,
            }
        }))
    }

    fn steps_to_steady(&self) -> u64 {
        self.steady_after
    }
}
