//! What the measuring loop itself costs: the latency it records for a step that does nothing (the
//! floor of every latency migprof reports) and the wall time per iteration (what `wall_throughput`
//! loses to the harness). Run with `cargo bench -p migprof --bench harness_overhead`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use anyhow::Result;
use migprof::run::measure::{measure, Executor, MonotonicClock, Stop, Unobserved, Warmup};
use migprof::run::stats::LatencyStats;

/// A step that busy-waits for a fixed time (zero: returns at once).
struct Spin(Duration);

impl Executor for Spin {
    fn step(&mut self) -> Result<()> {
        let t = Instant::now();
        while t.elapsed() < self.0 {
            black_box(());
        }
        Ok(())
    }

    fn loss(&mut self) -> Result<Option<f32>> {
        Ok(None)
    }
}

fn main() -> Result<()> {
    println!(
        "{:>10} {:>10} {:>12} {:>12} {:>14}",
        "step", "iters", "p50 latency", "mean latency", "wall/iteration"
    );
    for (step, iters) in [
        (Duration::ZERO, 1_000_000u64),
        (Duration::from_micros(100), 20_000),
        (Duration::from_millis(1), 2_000),
    ] {
        let m = measure(
            &mut Spin(step),
            &MonotonicClock::new(),
            Warmup::Iterations(iters / 10),
            Stop::Iterations(iters),
            &mut Unobserved,
        )?;
        let s = LatencyStats::from_latencies(&m.latencies_ns)?;
        let wall_ns = m.elapsed.as_nanos() as f64 / iters as f64;
        println!(
            "{:>10} {:>10} {:>10} ns {:>10.0} ns {:>11.0} ns   (harness: {:+.0} ns/iteration beyond the step)",
            format!("{step:?}"),
            iters,
            s.p50_ns,
            s.mean_ns,
            wall_ns,
            wall_ns - s.mean_ns
        );
    }
    Ok(())
}
