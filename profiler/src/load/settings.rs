//! How a load job offers requests and batches them ([`LoadSettings`]), and the defaults that
//! `migprof load` and a sweep's `[[capacity]]` share; how a language model's serving job does
//! ([`ServeSettings`]).

use std::time::Duration;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::load::arrival::Arrival;
use crate::load::given::{Offered, PassGiven, ServeGiven};
use crate::load::lengths::LengthDist;
use crate::load::tokens::Slo;

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

impl LoadSettings {
    /// A load job's settings: what `offered` and `pass` give, `migprof load`'s defaults
    /// ([`DEFAULTS`]) for the rest, here and nowhere else; the arrivals seeded by `seed`.
    pub fn given(offered: &Offered, pass: &PassGiven, seed: u64) -> LoadSettings {
        let d = &DEFAULTS;
        LoadSettings {
            arrival: offered.arrival.unwrap_or(d.arrival),
            max_batch: pass.max_batch.unwrap_or(d.max_batch),
            max_delay_ms: pass.max_delay_ms.unwrap_or(d.max_delay_ms),
            warmup_secs: offered.warmup_secs.unwrap_or(d.warmup_secs),
            duration_secs: offered.duration_secs.unwrap_or(d.duration_secs),
            arrival_seed: seed,
            slo_p99_ms: pass.slo_p99_ms.or(d.slo_p99_ms),
            resolution: offered.resolution_pct.map_or(d.resolution, |r| r / 100.0),
            min_requests: pass.min_requests.unwrap_or(d.min_requests),
        }
    }

    /// Checks what no job could take, before any work, naming a bad setting as `keys` spells it.
    pub fn check(&self, keys: Keys) -> Result<()> {
        use crate::run::limits;
        let k = |key: &str| keys.name(key);
        limits::BATCH
            .check(&k("max_batch"), self.max_batch as u64)
            .map_err(anyhow::Error::msg)?;
        limits::milliseconds(&k("max_delay_ms"), self.max_delay_ms, false).map_err(anyhow::Error::msg)?;
        if let Some(slo) = self.slo_p99_ms {
            limits::milliseconds(&k("slo_p99_ms"), slo, true).map_err(anyhow::Error::msg)?;
        }
        limits::MIN_REQUESTS
            .check(&k("min_requests"), self.min_requests as u64)
            .map_err(anyhow::Error::msg)?;
        limits::seconds(&k("warmup_secs"), self.warmup_secs, false).map_err(anyhow::Error::msg)?;
        check_resolution(self.resolution, keys)?;
        Ok(())
    }
}

/// How a serving job offers requests and batches them; part of its cell's identity.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeSettings {
    /// Each request's prompt and output lengths, in tokens.
    #[serde(with = "length_text")]
    pub prompt: LengthDist,
    #[serde(with = "length_text")]
    pub output: LengthDist,
    /// Tokens one iteration processes at most (prefill pieces and decodes together).
    pub max_batched_tokens: u32,
    /// Sequences running at once at most.
    pub max_seqs: u32,
    pub chunked_prefill: bool,
    /// Tokens a KV block holds.
    pub kv_block_size: workloads::BlockSize,
    /// The share of the memory left after the weights and the workspace that the cache takes.
    pub kv_cache_fraction: f64,
    /// The cache's blocks as given, instead of sized from the memory.
    pub kv_blocks: Option<u32>,
    pub arrival: Arrival,
    pub arrival_seed: u64,
    /// Arrivals in the first seconds of a step are served, not measured.
    pub warmup_secs: f64,
    /// Seconds of arrivals a step offers.
    pub duration_secs: f64,
    /// Seconds a step waits after its last arrival for the requests to finish.
    pub drain_secs: f64,
    /// The objectives, ms: judge each step; a search needs both.
    pub slo_ttft_p99_ms: Option<f64>,
    pub slo_tpot_p99_ms: Option<f64>,
    /// A search stops once its bracket is within this (0.1: 10%), or after `max_steps` rates.
    pub resolution: f64,
    pub max_steps: usize,
}

/// The defaults of `migprof load` for language models.
pub const SERVE_DEFAULTS: ServeSettings = ServeSettings {
    prompt: LengthDist::Fixed(512),
    output: LengthDist::Fixed(128),
    max_batched_tokens: 2048,
    max_seqs: 256,
    chunked_prefill: true,
    kv_block_size: workloads::BlockSize::DEFAULT,
    kv_cache_fraction: 0.9,
    kv_blocks: None,
    arrival: Arrival::Poisson,
    arrival_seed: 0,
    warmup_secs: 1.0,
    duration_secs: 10.0,
    drain_secs: 30.0,
    slo_ttft_p99_ms: None,
    slo_tpot_p99_ms: None,
    resolution: 0.1,
    max_steps: 8,
};

impl ServeSettings {
    /// A serving job's settings: what `offered` and `serve` give, `migprof load`'s defaults
    /// ([`SERVE_DEFAULTS`]) for the rest, here and nowhere else; the arrivals seeded by `seed`.
    pub fn given(offered: &Offered, serve: &ServeGiven, seed: u64) -> ServeSettings {
        let d = &SERVE_DEFAULTS;
        ServeSettings {
            prompt: serve.prompt_len.unwrap_or(d.prompt),
            output: serve.output_len.unwrap_or(d.output),
            max_batched_tokens: serve.max_batched_tokens.unwrap_or(d.max_batched_tokens),
            max_seqs: serve.max_seqs.unwrap_or(d.max_seqs),
            chunked_prefill: serve.chunked_prefill.unwrap_or(d.chunked_prefill),
            kv_block_size: serve.kv_block_size.unwrap_or(d.kv_block_size),
            kv_cache_fraction: serve.kv_cache_fraction.unwrap_or(d.kv_cache_fraction),
            kv_blocks: serve.kv_blocks.or(d.kv_blocks),
            arrival: offered.arrival.unwrap_or(d.arrival),
            arrival_seed: seed,
            warmup_secs: offered.warmup_secs.unwrap_or(d.warmup_secs),
            duration_secs: offered.duration_secs.unwrap_or(d.duration_secs),
            drain_secs: serve.drain_secs.unwrap_or(d.drain_secs),
            slo_ttft_p99_ms: serve.slo_ttft_p99_ms.or(d.slo_ttft_p99_ms),
            slo_tpot_p99_ms: serve.slo_tpot_p99_ms.or(d.slo_tpot_p99_ms),
            resolution: offered.resolution_pct.map_or(d.resolution, |r| r / 100.0),
            max_steps: serve.max_steps.unwrap_or(d.max_steps),
        }
    }
}

mod length_text {
    use super::LengthDist;
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(d: &LengthDist, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&d.to_string())
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<LengthDist, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

impl ServeSettings {
    /// The fields that make a serving cell differ from another, for its id.
    pub fn identity(&self) -> String {
        let or_none = |v: Option<f64>| v.map_or("none".to_string(), |v| v.to_string());
        format!(
            "prompt {}/output {}/tokens {}/seqs {}/chunked {}/block {}/fraction {}/blocks {}/{}/seed {}/warmup {}s/{}s/drain {}s/ttft {}/tpot {}/res {}/steps {}",
            self.prompt,
            self.output,
            self.max_batched_tokens,
            self.max_seqs,
            self.chunked_prefill,
            self.kv_block_size,
            self.kv_cache_fraction,
            self.kv_blocks.map_or("sized".to_string(), |b| b.to_string()),
            self.arrival.as_str(),
            self.arrival_seed,
            self.warmup_secs,
            self.duration_secs,
            self.drain_secs,
            or_none(self.slo_ttft_p99_ms),
            or_none(self.slo_tpot_p99_ms),
            self.resolution,
            self.max_steps
        )
    }

    /// Both objectives, where both are given.
    pub fn slo(&self) -> Option<Slo> {
        let ms = |v: f64| Duration::from_secs_f64(v / 1e3);
        Some(Slo {
            ttft_p99: ms(self.slo_ttft_p99_ms?),
            tpot_p99: ms(self.slo_tpot_p99_ms?),
        })
    }

    /// Checks what no run could take, before any work: a bad setting names what it may be, as
    /// `keys` spells it (a flag of `migprof load`, or a key of a sweep file's `[[capacity]]`).
    pub fn check(&self, search: bool, keys: Keys) -> Result<()> {
        let k = |key: &str| keys.name(key);
        use crate::run::limits::{self, BLOCKS, SEARCH_STEPS, SEQUENCES, TOKENS};
        let bounded = [
            (TOKENS, "max_batched_tokens", self.max_batched_tokens as u64),
            (SEQUENCES, "max_seqs", self.max_seqs as u64),
            (BLOCKS, "kv_blocks", self.kv_blocks.unwrap_or(1) as u64),
            (SEARCH_STEPS, "max_steps", self.max_steps.max(1) as u64),
        ];
        for (limit, key, value) in bounded {
            limit.check(&k(key), value).map_err(anyhow::Error::msg)?;
        }
        for (key, v) in [
            ("slo_ttft_p99_ms", self.slo_ttft_p99_ms),
            ("slo_tpot_p99_ms", self.slo_tpot_p99_ms),
        ] {
            if let Some(v) = v {
                limits::milliseconds(&k(key), v, true).map_err(anyhow::Error::msg)?;
            }
        }
        // (Zero sequences or blocks are refused by their bounds above; a block size is one by its type.)
        if self.max_batched_tokens < self.max_seqs {
            bail!(
                "{} {} must be at least {} {} (one decode of each running sequence)",
                k("max_batched_tokens"),
                self.max_batched_tokens,
                k("max_seqs"),
                self.max_seqs
            )
        }
        if !(self.kv_cache_fraction > 0.0 && self.kv_cache_fraction <= 1.0) {
            bail!(
                "{} {} must be within (0, 1]",
                k("kv_cache_fraction"),
                self.kv_cache_fraction
            )
        }
        // A day bounds every span: a search's longest time is worked out from them.
        let seconds = |v: f64| v.is_finite() && (0.0..=86_400.0).contains(&v);
        for (key, v) in [
            ("warmup_secs", self.warmup_secs),
            ("duration_secs", self.duration_secs),
            ("drain_secs", self.drain_secs),
        ] {
            if !seconds(v) {
                bail!("{} {v}: expected seconds from 0 to a day (86400)", k(key))
            }
        }
        if self.warmup_secs >= self.duration_secs {
            bail!(
                "{} {} s must be shorter than {} {} s: the warm-up is part of each step",
                k("warmup_secs"),
                self.warmup_secs,
                k("duration_secs"),
                self.duration_secs
            )
        }
        if search && self.slo().is_none() {
            bail!(
                "a search for a language model needs both objectives: {} and {}",
                k("slo_ttft_p99_ms"),
                k("slo_tpot_p99_ms")
            )
        }
        check_resolution(self.resolution, keys)?;
        if search && self.max_steps == 0 {
            bail!("{} must be at least 1", k("max_steps"))
        }
        Ok(())
    }
}

/// A search's resolution, a fraction: above 0 and below 1, said as the percentage it was given as.
fn check_resolution(resolution: f64, keys: Keys) -> Result<()> {
    if !(resolution > 0.0 && resolution < 1.0) {
        bail!(
            "{} {}: expected a percentage above 0 and below 100",
            keys.name("resolution_pct"),
            percent(resolution)
        )
    }
    Ok(())
}

/// A fraction as the percentage it was given as (the division by 100 undone without its
/// rounding's noise: 100.7, not 100.70000000000002).
fn percent(fraction: f64) -> f64 {
    (fraction * 1e8).round() / 1e6
}

/// How a setting is named where it was given, for errors.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Keys {
    /// `migprof load`'s flags: `--max-seqs`.
    Flags,
    /// A sweep file's keys: `max_seqs`.
    SweepFile,
}

impl Keys {
    /// `key` as a sweep file writes it, named as `self` spells it.
    pub fn name(self, key: &str) -> String {
        match (self, key) {
            (Keys::SweepFile, _) => key.to_string(),
            (Keys::Flags, _) => super::given::flag(key).unwrap_or_else(|| format!("--{}", key.replace('_', "-"))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn what_is_not_given_takes_load_s_defaults_and_what_is_given_stays() {
        let none = Offered::default();
        assert_eq!(LoadSettings::given(&none, &PassGiven::default(), 0), DEFAULTS);
        assert_eq!(ServeSettings::given(&none, &ServeGiven::default(), 0), SERVE_DEFAULTS);
        let searched = Offered {
            duration_secs: Some(0.0),
            ..Offered::default()
        };
        let pass = PassGiven {
            max_batch: Some(8),
            ..PassGiven::default()
        };
        let load = LoadSettings::given(&searched, &pass, 7);
        assert_eq!((load.max_batch, load.duration_secs, load.arrival_seed), (8, 0.0, 7));
        assert_eq!(load.min_requests, DEFAULTS.min_requests);
        let five = Offered {
            resolution_pct: Some(5.0),
            ..Offered::default()
        };
        let serve = ServeGiven {
            chunked_prefill: Some(false),
            kv_blocks: Some(100),
            ..ServeGiven::default()
        };
        let serve = ServeSettings::given(&five, &serve, 3);
        assert_eq!(
            (
                serve.chunked_prefill,
                serve.kv_blocks,
                serve.resolution,
                serve.arrival_seed
            ),
            (false, Some(100), 0.05, 3)
        );
        assert_eq!(serve.max_seqs, SERVE_DEFAULTS.max_seqs);
    }

    #[test]
    fn a_percentage_is_said_as_it_was_given() {
        assert_eq!(percent(100.7 / 100.0), 100.7);
        assert_eq!(percent(0.02), 2.0);
    }

    #[test]
    fn keys_are_named_as_each_surface_spells_them() {
        assert_eq!(Keys::Flags.name("warmup_secs"), "--warmup");
        assert_eq!(Keys::Flags.name("resolution_pct"), "--resolution");
        assert_eq!(Keys::Flags.name("kv_blocks"), "--kv-blocks");
        assert_eq!(Keys::SweepFile.name("kv_blocks"), "kv_blocks");
    }
}
