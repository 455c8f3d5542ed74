//! The `samples` and `metrics` tables: a run's measured iterations and its sampler readings.

use anyhow::Result;
use polars::prelude::*;

use crate::results::parts::{col, SCHEMA_VERSION};
use crate::run::Run;

/// The `metrics` table: every sampler reading of one run.
pub(super) fn metrics_frame(run: &Run) -> Result<DataFrame> {
    let m = &run.metrics;
    let f = |g: fn(&crate::gpu::sampler::Sample) -> Option<f64>| m.iter().map(g).collect::<Vec<Option<f64>>>();
    let u = |g: fn(&crate::gpu::sampler::Sample) -> Option<u32>| {
        m.iter().map(|s| g(s).map(i64::from)).collect::<Vec<Option<i64>>>()
    };
    let gpm = |g: fn(&crate::gpu::sampler::Gpm) -> Option<f64>| {
        m.iter()
            .map(|s| s.gpm.as_ref().and_then(g))
            .collect::<Vec<Option<f64>>>()
    };
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION; m.len()]),
        Column::new("run_id".into(), vec![run.run_id.as_str(); m.len()]),
        col("t_ms", m.iter().map(|s| s.t.as_secs_f64() * 1e3).collect::<Vec<f64>>()),
        col("fb_used_mib", f(|s| s.fb_used_mib)),
        col("fb_total_mib", f(|s| s.fb_total_mib)),
        col("gpu_power_w", f(|s| s.gpu_power_w)),
        col(
            "gpu_energy_mj",
            m.iter()
                .map(|s| s.gpu_energy_mj.map(|e| e as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col("gpu_sm_clock_mhz", u(|s| s.gpu_sm_clock_mhz)),
        col("gpu_mem_clock_mhz", u(|s| s.gpu_mem_clock_mhz)),
        col("gpu_temperature_c", u(|s| s.gpu_temperature_c)),
        col(
            "gpu_throttle_reasons",
            m.iter()
                .map(|s| s.gpu_throttle_reasons.map(|r| r as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col(
            "compute_processes",
            m.iter()
                .map(|s| s.compute_processes.as_ref().map(|p| p.len() as i64))
                .collect::<Vec<Option<i64>>>(),
        ),
        col("util_gpu_pct", u(|s| s.util_gpu_pct)),
        col("util_mem_pct", u(|s| s.util_mem_pct)),
        col("gract", gpm(|g| g.graphics)),
        col("sm_util", gpm(|g| g.sm)),
        col("sm_occupancy", gpm(|g| g.sm_occupancy)),
        col("tensor_util", gpm(|g| g.tensor)),
        col("dram_bw_util", gpm(|g| g.dram_bandwidth)),
        col("fp32_util", gpm(|g| g.fp32)),
        col("fp16_util", gpm(|g| g.fp16)),
    ];
    Ok(DataFrame::new(m.len(), columns)?)
}

/// The `samples` table: every measured iteration of one run.
/// A generation's rows are its decode steps (`phase` `decode`) and its prefills (`prefill`,
/// `iteration` the generation's index); other runs' are their steps (`step`).
pub(super) fn samples_frame(run: &Run) -> Result<DataFrame> {
    let steps = &run.measurement.latencies_ns;
    let prefills = &run.measurement.begin_ns;
    let step_phase = if run.generation.is_some() { "decode" } else { "step" };
    let n = steps.len() + prefills.len();
    let columns = vec![
        Column::new("schema_version".into(), vec![SCHEMA_VERSION; n]),
        Column::new("run_id".into(), vec![run.run_id.as_str(); n]),
        Column::new(
            "iteration".into(),
            (0..steps.len() as i64)
                .chain(0..prefills.len() as i64)
                .collect::<Vec<i64>>(),
        ),
        Column::new(
            "latency_ns".into(),
            steps.iter().chain(prefills).map(|&l| l as i64).collect::<Vec<i64>>(),
        ),
        Column::new(
            "phase".into(),
            std::iter::repeat_n(step_phase, steps.len())
                .chain(std::iter::repeat_n("prefill", prefills.len()))
                .collect::<Vec<&str>>(),
        ),
    ];
    Ok(DataFrame::new(n, columns)?)
}
