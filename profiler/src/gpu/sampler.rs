//! A thread that reads the device's counters at a fixed interval while a run is measured, and the
//! summary of what it read. Counters come through [`MetricSource`] (NVML on a GPU, a script in tests);
//! a counter the device does not report is `None`, never 0.

use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, Result};

/// GPM activity over the time since an earlier GPM reading, in percent (Hopper and newer); a metric
/// NVML could not compute is `None`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Gpm {
    /// Graphics engine (GR) busy: MIGProfiler's "gract".
    pub graphics: Option<f64>,
    pub sm: Option<f64>,
    pub sm_occupancy: Option<f64>,
    pub tensor: Option<f64>,
    pub dram_bandwidth: Option<f64>,
    pub fp32: Option<f64>,
    pub fp16: Option<f64>,
}

/// One reading. Memory is the device's or the MIG slice's; power, energy, clocks, temperature and
/// throttle reasons are always the whole (parent) GPU's, since NVML has them for nothing smaller.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Sample {
    /// Since sampling started.
    pub t: Duration,
    pub fb_used_mib: Option<f64>,
    pub fb_total_mib: Option<f64>,
    pub gpu_power_w: Option<f64>,
    /// The parent GPU's total-energy counter, millijoules since the driver loaded.
    pub gpu_energy_mj: Option<u64>,
    pub gpu_sm_clock_mhz: Option<u32>,
    pub gpu_mem_clock_mhz: Option<u32>,
    pub gpu_temperature_c: Option<u32>,
    pub gpu_throttle_reasons: Option<u64>,
    /// NVML's utilisation rates; not reported for MIG devices.
    pub util_gpu_pct: Option<u32>,
    pub util_mem_pct: Option<u32>,
    pub gpm: Option<Gpm>,
    /// Every process with a compute context on the device or slice, as NVML lists them (this one
    /// included); `None` when the list could not be read.
    pub compute_processes: Option<Vec<GpuProcess>>,
}

/// A process NVML lists on a device.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct GpuProcess {
    /// As NVML reports it: in the host's PID namespace, which may not be this process's.
    pub pid: u32,
    /// The process's name where it can be read (`None` in another PID namespace).
    pub name: Option<String>,
    pub used_mib: Option<u64>,
}

/// Where readings come from.
pub trait MetricSource {
    /// One reading of every counter; `t` is filled in by the sampler.
    fn read(&mut self) -> Sample;
}

/// Runs a [`MetricSource`] until told to stop. Handed to the opener given to [`Sampler::start`], which
/// builds the source on the sampling thread (NVML handles borrow the NVML session that thread owns).
pub struct SampleLoop {
    interval: Duration,
    stop: mpsc::Receiver<()>,
}

impl SampleLoop {
    pub fn run(self, source: &mut dyn MetricSource) -> Vec<Sample> {
        let start = Instant::now();
        let mut samples = Vec::new();
        let mut next = start;
        loop {
            let mut s = source.read();
            s.t = start.elapsed();
            samples.push(s);
            next += self.interval;
            let wait = next.saturating_duration_since(Instant::now());
            match self.stop.recv_timeout(wait) {
                Err(RecvTimeoutError::Timeout) => continue,
                // Stopped: one last reading, so the energy and GPM windows reach the end of the run.
                Ok(()) | Err(RecvTimeoutError::Disconnected) => {
                    let mut s = source.read();
                    s.t = start.elapsed();
                    samples.push(s);
                    return samples;
                }
            }
        }
    }
}

pub struct Sampler {
    stop: mpsc::Sender<()>,
    thread: JoinHandle<Result<Vec<Sample>>>,
}

impl Sampler {
    /// Starts sampling every `interval` on a new thread; `open` builds the source there and runs the loop.
    pub fn start<F>(interval: Duration, open: F) -> Self
    where
        F: FnOnce(SampleLoop) -> Result<Vec<Sample>> + Send + 'static,
    {
        let (stop, rx) = mpsc::channel();
        let thread = std::thread::Builder::new()
            .name("migprof-sampler".into())
            .spawn(move || open(SampleLoop { interval, stop: rx }))
            .expect("spawning the sampler thread");
        Self { stop, thread }
    }

    /// Stops sampling and returns every reading in order.
    pub fn stop(self) -> Result<Vec<Sample>> {
        let _ = self.stop.send(());
        self.thread.join().map_err(|_| anyhow!("the sampler thread panicked"))?
    }
}

/// What a run's readings come to; `None` where no reading had the counter.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct MetricSummary {
    pub samples: usize,
    pub fb_used_mean_mib: Option<f64>,
    pub fb_used_max_mib: Option<f64>,
    pub gract_mean: Option<f64>,
    pub gract_std: Option<f64>,
    pub sm_util_mean: Option<f64>,
    pub tensor_mean: Option<f64>,
    pub dram_mean: Option<f64>,
    pub gpu_power_mean_w: Option<f64>,
    /// Whole-GPU energy over the measured window, from the energy counter's first and last readings.
    pub gpu_energy_j: Option<f64>,
    /// `gpu_energy_j` per sample processed.
    pub j_per_sample: Option<f64>,
}

impl MetricSummary {
    /// Whether any reading had a GPM value.
    pub fn has_gpm(&self) -> bool {
        [self.gract_mean, self.sm_util_mean, self.tensor_mean, self.dram_mean]
            .iter()
            .any(Option::is_some)
    }
}

pub fn summarize(samples: &[Sample], samples_processed: u64) -> MetricSummary {
    let values = |f: &dyn Fn(&Sample) -> Option<f64>| samples.iter().filter_map(f).collect::<Vec<f64>>();
    let fb = values(&|s| s.fb_used_mib);
    let gract = values(&|s| s.gpm.and_then(|g| g.graphics));
    let energy_j = match (
        samples.iter().find_map(|s| s.gpu_energy_mj),
        samples.iter().rev().find_map(|s| s.gpu_energy_mj),
    ) {
        (Some(first), Some(last)) if samples.len() > 1 => Some(last.saturating_sub(first) as f64 / 1e3),
        _ => None,
    };
    MetricSummary {
        samples: samples.len(),
        fb_used_mean_mib: mean(&fb),
        fb_used_max_mib: fb.iter().cloned().reduce(f64::max),
        gract_mean: mean(&gract),
        gract_std: std(&gract),
        sm_util_mean: mean(&values(&|s| s.gpm.and_then(|g| g.sm))),
        tensor_mean: mean(&values(&|s| s.gpm.and_then(|g| g.tensor))),
        dram_mean: mean(&values(&|s| s.gpm.and_then(|g| g.dram_bandwidth))),
        gpu_power_mean_w: mean(&values(&|s| s.gpu_power_w)),
        gpu_energy_j: energy_j,
        j_per_sample: energy_j
            .filter(|_| samples_processed > 0)
            .map(|e| e / samples_processed as f64),
    }
}

fn mean(v: &[f64]) -> Option<f64> {
    (!v.is_empty()).then(|| v.iter().sum::<f64>() / v.len() as f64)
}

/// Population standard deviation: the readings are the whole window, not a sample of it.
fn std(v: &[f64]) -> Option<f64> {
    let m = mean(v)?;
    Some((v.iter().map(|x| (x - m).powi(2)).sum::<f64>() / v.len() as f64).sqrt())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Readings from a script: the i-th read returns `script[min(i, len-1)]`.
    pub struct Scripted {
        pub script: Vec<Sample>,
        pub reads: usize,
    }

    impl MetricSource for Scripted {
        fn read(&mut self) -> Sample {
            let s = self.script[self.reads.min(self.script.len() - 1)].clone();
            self.reads += 1;
            s
        }
    }

    fn reading(fb: f64, gract: f64, power: f64, energy_mj: u64) -> Sample {
        Sample {
            fb_used_mib: Some(fb),
            gpu_power_w: Some(power),
            gpu_energy_mj: Some(energy_mj),
            gpm: Some(Gpm {
                graphics: Some(gract),
                sm: Some(gract / 2.0),
                tensor: Some(10.0),
                dram_bandwidth: Some(30.0),
                ..Default::default()
            }),
            ..Default::default()
        }
    }

    #[test]
    fn summary_of_scripted_readings() {
        let samples = vec![
            reading(1000.0, 80.0, 300.0, 50_000),
            reading(3000.0, 100.0, 500.0, 250_000),
        ];
        let s = summarize(&samples, 400);
        assert_eq!(s.samples, 2);
        assert_eq!((s.fb_used_mean_mib, s.fb_used_max_mib), (Some(2000.0), Some(3000.0)));
        assert_eq!((s.gract_mean, s.gract_std), (Some(90.0), Some(10.0)));
        assert_eq!(
            (s.sm_util_mean, s.tensor_mean, s.dram_mean),
            (Some(45.0), Some(10.0), Some(30.0))
        );
        assert_eq!(s.gpu_power_mean_w, Some(400.0));
        // 200 J over the window, 400 samples processed.
        assert_eq!((s.gpu_energy_j, s.j_per_sample), (Some(200.0), Some(0.5)));
    }

    #[test]
    fn counters_a_device_lacks_stay_none_not_zero() {
        // A MIG slice: memory, no utilisation rates, no GPM reading yet in the first sample.
        let first = Sample {
            fb_used_mib: Some(10.0),
            ..Default::default()
        };
        let s = summarize(&[first.clone(), first], 10);
        assert_eq!(s.fb_used_mean_mib, Some(10.0));
        assert_eq!(
            (
                s.gract_mean,
                s.gract_std,
                s.gpu_power_mean_w,
                s.gpu_energy_j,
                s.j_per_sample
            ),
            (None, None, None, None, None)
        );
    }

    #[test]
    fn the_thread_samples_at_the_interval_and_once_more_at_stop() {
        let sampler = Sampler::start(Duration::from_millis(20), |lp| {
            let mut src = Scripted {
                script: vec![reading(1.0, 50.0, 100.0, 0)],
                reads: 0,
            };
            Ok(lp.run(&mut src))
        });
        std::thread::sleep(Duration::from_millis(110));
        let samples = sampler.stop().unwrap();
        // Readings at 0, 20, ..., 100 ms (6) and the final one; scheduling may add or drop one.
        assert!((6..=8).contains(&samples.len()), "{} samples", samples.len());
        assert!(samples.windows(2).all(|w| w[0].t <= w[1].t));
        assert!(samples.last().unwrap().t >= Duration::from_millis(100));
    }

    #[test]
    fn an_opener_that_fails_reports_its_error() {
        let sampler = Sampler::start(Duration::from_millis(10), |_| Err(anyhow!("NVML went away")));
        assert_eq!(sampler.stop().unwrap_err().to_string(), "NVML went away");
    }
}
