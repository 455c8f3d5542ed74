//! What the report's sections share: a row's workload and target, the quantities drawn against
//! batch, the runs drawn in detail, and the cell a comparison pairs across targets.

use std::collections::{BTreeMap, BTreeSet};

use crate::report::data::Row;
use crate::report::page::fmt;

/// What a target is, as a row says.
pub(super) fn target_row(r: &Row) -> Vec<String> {
    let profile = match (r.s("mig_profile"), r.s("emulated_profile"), r.s("emulation")) {
        (p, _, _) if !p.is_empty() => format!("MIG {p}"),
        (_, p, "mps") if !p.is_empty() => format!("{p} emulated (MPS, {}% of SMs)", fmt(r.n("mps_share_pct"), 0)),
        (_, _, "mps") => format!("MPS, {}% of SMs", fmt(r.n("mps_share_pct"), 0)),
        _ => "whole device".into(),
    };
    vec![
        r.s("target").into(),
        r.s("device_name").into(),
        r.s("device_kind").into(),
        profile,
        fmt(r.n("sm_count"), 0),
        fmt(r.n("device_memory_mib"), 0),
    ]
}

/// A workload as sections group runs: model, mode, precision, sequence length.
pub(super) type Workload = (String, String, String, String);

/// The workload of a row. Its precision is the dtype, and for bf16 and f16 training on the
/// half-precision weights themselves (`master_weights` none) says so: another workload than the
/// default training over f32 masters.
pub(super) fn workload(r: &Row) -> Workload {
    let precision = match r.s("master_weights") {
        "none" => format!("{} without master weights", r.s("dtype")),
        _ => r.s("dtype").to_string(),
    };
    (r.s("model").into(), r.s("mode").into(), precision, r.lengths())
}

/// Whether `reading` of run `r` is the whole GPU's while the run had a part of it: power on any
/// slice (NVML reads it for the GPU only), and on an emulated slice also the GPM activity and the
/// device memory, which count every process on the GPU (`gpm_scope` gpu).
pub(super) fn whole_gpu_reading(r: &Row, reading: &str) -> bool {
    match r.s("device_kind") {
        "mig" => reading == "gpu_power_w",
        "mps" => matches!(
            reading,
            "gract" | "sm_occupancy" | "tensor_util" | "fb_used_mib" | "gpu_power_w"
        ),
        _ => false,
    }
}

/// What a chart says under a series marked `(whole GPU)`.
pub(super) const WHOLE_GPU_NOTE: &str = "(whole GPU): the reading is the whole GPU's, not the slice's: NVML reads power for the GPU only, and an emulated slice's GPM activity and device memory count every process on the GPU (gpm_scope gpu), so a 1g client that fills its 16 SMs shows a few per cent; beside a memory-partitioned slice (mps-mem:) they also count its neighbour's streaming.";

/// A quantity drawn against batch, per target.
pub(super) struct Metric {
    pub(super) id: &'static str,
    pub(super) title: &'static str,
    pub(super) unit: &'static str,
    pub(super) value: fn(&Row) -> Option<f64>,
    pub(super) whisker: fn(&Row) -> Option<(f64, f64)>,
    /// The sampler's reading it summarises, where it is one (see [`whole_gpu_reading`]).
    pub(super) reading: Option<&'static str>,
}

pub(super) const METRICS: [Metric; 4] = [
    Metric {
        id: "throughput",
        title: "Throughput (95% interval)",
        unit: "samples/s",
        value: |r| r.n("throughput"),
        whisker: |r| r.n("throughput_ci_low").zip(r.n("throughput_ci_high")),
        reading: None,
    },
    Metric {
        id: "latency",
        title: "Latency per step, p50 (whisker p90 to p99)",
        unit: "ms",
        value: |r| r.n("p50_ms"),
        whisker: |r| r.n("p90_ms").zip(r.n("p99_ms")),
        reading: None,
    },
    Metric {
        id: "memory",
        title: "Device memory used, most in the run",
        unit: "MiB",
        value: |r| r.n("fb_used_max_mib"),
        whisker: |_| None,
        reading: Some("fb_used_mib"),
    },
    Metric {
        id: "gract",
        title: "Graphics engine (GR) activity, mean",
        unit: "%",
        value: |r| r.n("gract_mean"),
        whisker: |_| None,
        reading: Some("gract"),
    },
];

/// A generation's time to first token, drawn beside its decode steps.
pub(super) const TTFT: Metric = Metric {
    id: "ttft",
    title: "Time to first token (the prefill), p50 (whisker p50 to p99)",
    unit: "ms",
    value: |r| r.n("ttft_p50_ms"),
    whisker: |r| r.n("ttft_p50_ms").zip(r.n("ttft_p99_ms")),
    reading: None,
};

/// How a generation's rows name what `m` draws: its throughput is decoded tokens per second and
/// its step a decode step. Title and unit.
pub(super) fn generation_words(m: &Metric) -> (&'static str, &'static str) {
    match m.id {
        "throughput" => ("Decode throughput (95% interval)", "tokens/s"),
        "latency" => ("Latency per decode step, p50 (whisker p90 to p99)", "ms"),
        _ => (m.title, m.unit),
    }
}

/// Each target's latest run at its largest batch (or at `batch`), per workload: the runs whose
/// latency distribution and sampler readings the report draws.
pub fn detailed_runs(rows: &[Row], batch: Option<usize>) -> BTreeSet<String> {
    largest(rows, batch)
        .into_values()
        .map(|r| r.s("run_id").to_string())
        .collect()
}

/// Per (workload, target): the latest alone run at the largest batch, or at `batch` where given.
pub(super) fn largest(rows: &[Row], batch: Option<usize>) -> BTreeMap<(Workload, String), &Row> {
    let mut out: BTreeMap<(Workload, String), &Row> = BTreeMap::new();
    for r in rows
        .iter()
        .filter(|r| r.is_alone() && batch.is_none_or(|b| r.n("batch") == Some(b as f64)))
    {
        let k = (workload(r), r.s("target").to_string());
        let better = out.get(&k).is_none_or(|old| {
            (r.n("batch"), r.s("run_id")).partial_cmp(&(old.n("batch"), old.s("run_id")))
                == Some(std::cmp::Ordering::Greater)
        });
        if better {
            out.insert(k, r);
        }
    }
    out
}

/// A cell as the scaling chart pairs it across targets: model, mode, dtype, sequence length, master
/// weights (bf16 and f16 training over f32 masters and without them are different cells) and batch.
pub(super) type CellKey = (String, String, String, String, String, i64);

/// The [`CellKey`] of a row.
pub(super) fn key(r: &Row) -> CellKey {
    (
        r.s("model").into(),
        r.s("mode").into(),
        r.s("dtype").into(),
        r.lengths(),
        r.s("master_weights").into(),
        r.n("batch").unwrap_or(0.0) as i64,
    )
}
