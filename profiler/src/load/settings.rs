//! How a load job offers requests and batches them ([`LoadSettings`]), and the defaults that
//! `migprof load` and a sweep's `[[capacity]]` share.

use serde::{Deserialize, Serialize};

use crate::load::arrival::Arrival;

/// The defaults of `migprof load` and of a sweep's `[[capacity]]`.
pub const DEFAULTS: LoadSettings = LoadSettings {
    arrival: Arrival::Poisson,
    max_batch: 32,
    max_delay_ms: 5.0,
    warmup_secs: 1.0,
    duration_secs: 10.0,
    arrival_seed: 0,
    slo_p99_ms: None,
    resolution: 0.02,
    min_requests: 10_000,
};

/// How a load job offers requests and batches them; part of its cell's identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoadSettings {
    pub arrival: Arrival,
    pub max_batch: usize,
    pub max_delay_ms: f64,
    /// Arrivals in the first seconds of a step are served, not measured.
    pub warmup_secs: f64,
    /// Seconds of measured arrivals per step at a fixed rate.
    pub duration_secs: f64,
    /// Seeds the arrival schedule (the model's weights and inputs have the run's seed).
    pub arrival_seed: u64,
    /// A search's objective on p99, ms; `None`: steps at the rates given.
    pub slo_p99_ms: Option<f64>,
    /// A search stops once its bracket is within this (0.02: 2%).
    pub resolution: f64,
    /// Measured requests a search step needs before its p99 may decide it.
    pub min_requests: usize,
}

impl LoadSettings {
    /// The fields that make a load cell differ from a plain one, for its id.
    pub fn identity(&self) -> String {
        format!(
            "{}/{}/{}ms/warmup {}s/{}s/seed {}/slo {}/res {}/min {}",
            self.arrival.as_str(),
            self.max_batch,
            self.max_delay_ms,
            self.warmup_secs,
            self.duration_secs,
            self.arrival_seed,
            self.slo_p99_ms.map_or("none".into(), |s| s.to_string()),
            self.resolution,
            self.min_requests
        )
    }
}
