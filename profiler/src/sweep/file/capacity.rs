//! A sweep file's `[[capacity]]` tables: the highest rate each model serves on each target within
//! its objectives, the keys of each kind of model, their defaults (`migprof load`'s) and checks.

use anyhow::{bail, Result};
use serde::Deserialize;

use crate::cell::spec::DTYPES;
use crate::load::lengths::LengthDist;
use crate::load::settings::{LoadGiven, LoadSettings, ServeGiven, ServeSettings};
use crate::run::limits;

/// A capacity search on every target that runs alone: a cell per target and model, `migprof load
/// --search` in its child. A model served one forward pass per request is searched within
/// `slo_p99_ms` (the `capacity` table); a language model, served by the continuous batcher, within
/// `slo_ttft_p99_ms` and `slo_tpot_p99_ms` (the `serve_capacity` table). A key that applies to one
/// kind is refused in a search that lists no model of that kind. A search runs several load steps:
/// give it a `timeout_secs` to match (a language model's search cut off goes on from its measured
/// steps when the sweep runs again; the other kind's starts over).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CapacitySearch {
    pub models: Vec<String>,
    #[serde(default = "bf16")]
    pub dtype: String,
    #[serde(default)]
    pub arrival: Option<crate::load::arrival::Arrival>,
    /// Percent: the search stops once its bracket is this narrow.
    #[serde(default)]
    pub resolution_pct: Option<f64>,
    #[serde(default)]
    pub warmup_secs: Option<f64>,
    // Models served one forward pass per request.
    #[serde(default)]
    pub seq_len: Option<usize>,
    #[serde(default)]
    pub slo_p99_ms: Option<f64>,
    #[serde(default)]
    pub max_batch: Option<usize>,
    #[serde(default)]
    pub max_delay_ms: Option<f64>,
    #[serde(default)]
    pub min_requests: Option<usize>,
    // Language models.
    #[serde(default)]
    pub slo_ttft_p99_ms: Option<f64>,
    #[serde(default)]
    pub slo_tpot_p99_ms: Option<f64>,
    #[serde(default, deserialize_with = "length")]
    pub prompt_len: Option<LengthDist>,
    #[serde(default, deserialize_with = "length")]
    pub output_len: Option<LengthDist>,
    #[serde(default)]
    pub max_batched_tokens: Option<u32>,
    #[serde(default)]
    pub max_seqs: Option<u32>,
    #[serde(default)]
    pub chunked_prefill: Option<bool>,
    #[serde(default)]
    pub kv_block_size: Option<workloads::BlockSize>,
    #[serde(default)]
    pub kv_cache_fraction: Option<f64>,
    #[serde(default)]
    pub kv_blocks: Option<u32>,
    #[serde(default)]
    pub duration_secs: Option<f64>,
    #[serde(default)]
    pub drain_secs: Option<f64>,
    #[serde(default)]
    pub max_steps: Option<usize>,
}

/// A length as `--prompt-len` takes it: a number of tokens, or a distribution's text.
fn length<'de, D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Option<LengthDist>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(i64),
        Fraction(f64),
        Text(String),
    }
    let text = match Raw::deserialize(d)? {
        Raw::Number(n) => n.to_string(),
        // Refused by the parse, which names the forms a length takes.
        Raw::Fraction(x) => x.to_string(),
        Raw::Text(t) => t,
    };
    text.parse().map(Some).map_err(serde::de::Error::custom)
}

/// How a capacity search serves a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Served {
    /// One forward pass per request, behind the dynamic batcher.
    Passes,
    /// Generation, by the continuous batcher.
    Generation,
}

impl Served {
    pub fn of(model: &str) -> Served {
        match workloads::lookup(model).is_ok_and(|(_, info)| info.family.is_decoder()) {
            true => Served::Generation,
            false => Served::Passes,
        }
    }

    fn models(self) -> &'static str {
        match self {
            Served::Passes => "models served one forward pass per request (image and encoder models)",
            Served::Generation => "language models",
        }
    }
}

impl CapacitySearch {
    /// The keys given that apply to one kind of model only, with that kind.
    fn kind_keys(&self) -> Vec<(&'static str, Served)> {
        use Served::{Generation, Passes};
        [
            ("seq_len", self.seq_len.is_some(), Passes),
            ("slo_p99_ms", self.slo_p99_ms.is_some(), Passes),
            ("max_batch", self.max_batch.is_some(), Passes),
            ("max_delay_ms", self.max_delay_ms.is_some(), Passes),
            ("min_requests", self.min_requests.is_some(), Passes),
            ("slo_ttft_p99_ms", self.slo_ttft_p99_ms.is_some(), Generation),
            ("slo_tpot_p99_ms", self.slo_tpot_p99_ms.is_some(), Generation),
            ("prompt_len", self.prompt_len.is_some(), Generation),
            ("output_len", self.output_len.is_some(), Generation),
            ("max_batched_tokens", self.max_batched_tokens.is_some(), Generation),
            ("max_seqs", self.max_seqs.is_some(), Generation),
            ("chunked_prefill", self.chunked_prefill.is_some(), Generation),
            ("kv_block_size", self.kv_block_size.is_some(), Generation),
            ("kv_cache_fraction", self.kv_cache_fraction.is_some(), Generation),
            ("kv_blocks", self.kv_blocks.is_some(), Generation),
            ("duration_secs", self.duration_secs.is_some(), Generation),
            ("drain_secs", self.drain_secs.is_some(), Generation),
            ("max_steps", self.max_steps.is_some(), Generation),
        ]
        .into_iter()
        .filter_map(|(key, given, kind)| given.then_some((key, kind)))
        .collect()
    }

    /// The load settings of a model served one forward pass per request: `migprof load`'s defaults
    /// where a key is not given.
    pub fn load_settings(&self, seed: u64) -> LoadSettings {
        LoadGiven {
            arrival: self.arrival,
            max_batch: self.max_batch,
            max_delay_ms: self.max_delay_ms,
            warmup_secs: self.warmup_secs,
            // A search's steps run until they hold `min_requests`.
            duration_secs: Some(0.0),
            slo_p99_ms: self.slo_p99_ms,
            resolution: self.resolution_pct.map(|r| r / 100.0),
            min_requests: self.min_requests,
        }
        .settings(seed)
    }

    /// The serving settings of a language model: `migprof load`'s defaults where a key is not given.
    pub fn serve_settings(&self, seed: u64) -> ServeSettings {
        ServeGiven {
            prompt: self.prompt_len,
            output: self.output_len,
            max_batched_tokens: self.max_batched_tokens,
            max_seqs: self.max_seqs,
            chunked_prefill: self.chunked_prefill,
            kv_block_size: self.kv_block_size,
            kv_cache_fraction: self.kv_cache_fraction,
            kv_blocks: self.kv_blocks,
            arrival: self.arrival,
            warmup_secs: self.warmup_secs,
            duration_secs: self.duration_secs,
            drain_secs: self.drain_secs,
            slo_ttft_p99_ms: self.slo_ttft_p99_ms,
            slo_tpot_p99_ms: self.slo_tpot_p99_ms,
            resolution: self.resolution_pct.map(|r| r / 100.0),
            max_steps: self.max_steps,
        }
        .settings(seed)
    }

    /// The models a search serves and its dtype: each one migprof runs.
    fn check_models(&self, at: &str) -> Result<()> {
        if self.models.is_empty() {
            bail!("{at}: models is empty");
        }
        for model in &self.models {
            // A folder is read here, so that one that is not a language model's is said now.
            workloads::check_name(model)
                .map_err(anyhow::Error::msg)
                .and_then(|()| workloads::lookup(model).map(drop).map_err(anyhow::Error::from))
                .map_err(|e| anyhow::anyhow!("{at}: models: {e:#}"))?;
        }
        if !DTYPES.contains(&self.dtype.as_str()) {
            bail!(
                "{at}: dtype: unknown dtype `{}`; valid dtypes: {}",
                self.dtype,
                DTYPES.join(", ")
            );
        }
        Ok(())
    }

    /// Its models and dtype, then what its keys must hold for the kinds of model it lists.
    pub(super) fn check(&self, at: &str, seed: u64) -> Result<()> {
        self.check_models(at)?;
        let kinds: Vec<Served> = self.models.iter().map(|m| Served::of(m)).collect();
        for (key, kind) in self.kind_keys() {
            if !kinds.contains(&kind) {
                bail!(
                    "{at}: {key} applies to {}, and models lists none ({})",
                    kind.models(),
                    self.models.join(", ")
                );
            }
        }
        let positive = |v: Option<f64>| v.is_some_and(|v| v > 0.0 && v.is_finite());
        if kinds.contains(&Served::Passes) && !positive(self.slo_p99_ms) {
            bail!(
                "{at}: slo_p99_ms: the p99 objective in milliseconds (above 0) is required for {}",
                Served::Passes.models()
            );
        }
        if kinds.contains(&Served::Generation) && !(positive(self.slo_ttft_p99_ms) && positive(self.slo_tpot_p99_ms)) {
            bail!("{at}: slo_ttft_p99_ms and slo_tpot_p99_ms: both objectives in milliseconds (above 0) are required for language models");
        }
        if let Some(r) = self.resolution_pct.filter(|r| !(*r > 0.0 && *r < 100.0)) {
            bail!("{at}: resolution_pct = {r}: expected a percentage above 0 and below 100");
        }
        if let Some(w) = self.warmup_secs {
            limits::seconds(&format!("{at}: warmup_secs"), w, false).map_err(anyhow::Error::msg)?;
        }
        if kinds.contains(&Served::Passes) {
            let l = self.load_settings(seed);
            let refused = |e: String| anyhow::anyhow!("{at}: {e}");
            limits::BATCH.check("max_batch", l.max_batch as u64).map_err(refused)?;
            limits::milliseconds("max_delay_ms", l.max_delay_ms, false).map_err(refused)?;
            if let Some(slo) = l.slo_p99_ms {
                limits::milliseconds("slo_p99_ms", slo, true).map_err(refused)?;
            }
            limits::MIN_REQUESTS
                .check("min_requests", l.min_requests as u64)
                .map_err(refused)?;
            if let Some(n) = self.seq_len {
                limits::TOKENS.check("seq_len", n as u64).map_err(refused)?;
            }
        }
        if kinds.contains(&Served::Generation) {
            let s = self.serve_settings(seed);
            s.check(true, crate::load::settings::Keys::SweepFile)
                .map_err(|e| anyhow::anyhow!("{at}: {e:#}"))?;
            // A request of the lengths' means must fit the model, or every step refuses its requests.
            let mean = s.prompt.mean() + s.output.mean();
            for model in self.models.iter().filter(|m| Served::of(m) == Served::Generation) {
                if let Ok((_, info)) = workloads::lookup(model) {
                    if let workloads::InputShape::Prompt { max_positions, .. } = info.input {
                        if mean > max_positions as f64 {
                            bail!(
                                "{at}: prompt_len {} and output_len {} make requests of {mean:.0} tokens on average; {model} holds {max_positions} positions",
                                s.prompt,
                                s.output
                            );
                        }
                    }
                }
            }
        }
        Ok(())
    }
}

/// A search's dtype where none is given.
fn bf16() -> String {
    "bf16".into()
}
