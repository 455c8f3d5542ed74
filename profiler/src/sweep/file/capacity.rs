//! A sweep file's `[[capacity]]` tables: the highest rate each model serves on each target within
//! its objectives, the keys of each kind of model, their defaults (`migprof load`'s) and checks.

use anyhow::{bail, Result};
use serde::Deserialize;

use crate::cell::spec::DTYPES;
use crate::load::given::{given_keys, Offered, PassGiven, ServeGiven};
use crate::run::given::group_keys;

use super::keyed;
use crate::load::settings::{Keys, LoadSettings, ServeSettings};
use crate::run::limits;

/// A capacity search on every target that runs alone: a cell per target and model, `migprof load
/// --search` in its child. A model served one forward pass per request is searched within
/// `slo_p99_ms` (the `capacity` table); a language model, served by the continuous batcher, within
/// `slo_ttft_p99_ms` and `slo_tpot_p99_ms` (the `serve_capacity` table). A key that applies to one
/// kind is refused in a search that lists no model of that kind. A search runs several load steps:
/// give it a `timeout_secs` to match (a language model's search cut off goes on from its measured
/// steps when the sweep runs again; the other kind's starts over).
#[derive(Debug, Clone)]
pub struct CapacitySearch {
    pub models: Vec<String>,
    pub dtype: String,
    /// Tokens per sequence of token models (models served one forward pass per request).
    pub seq_len: Option<usize>,
    /// How requests are offered (`migprof load`'s `--arrival`, `--warmup`, `--duration`,
    /// `--resolution`).
    pub offered: Offered,
    /// Models served one forward pass per request.
    pub pass: PassGiven,
    /// Language models.
    pub serve: ServeGiven,
}

/// The keys of a search that are not load settings.
#[derive(Deserialize)]
struct Own {
    /// Read key by key, so required by the search's check (which names it) rather than here.
    #[serde(default)]
    models: Vec<String>,
    #[serde(default = "bf16")]
    dtype: String,
    #[serde(default)]
    seq_len: Option<usize>,
}

const OWN_KEYS: [&str; 3] = ["models", "dtype", "seq_len"];

/// Read key by key ([`keyed`]): each group of settings takes its own keys (declared once, in
/// [`crate::load::given`]), a bad value is named by its key at its line.
impl<'de> Deserialize<'de> for CapacitySearch {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let own_keys = OWN_KEYS.map(String::from).to_vec();
        let (offered, pass, serve) = (
            group_keys::<Offered>(),
            group_keys::<PassGiven>(),
            group_keys::<ServeGiven>(),
        );
        let own = |t: toml::Table| keyed::typed::<Own>(t).map(|_| ());
        let offered_read = |t: toml::Table| keyed::typed::<Offered>(t).map(|_| ());
        let pass_read = |t: toml::Table| keyed::typed::<PassGiven>(t).map(|_| ());
        let serve_read = |t: toml::Table| keyed::typed::<ServeGiven>(t).map(|_| ());
        let table = keyed::read(
            d,
            &[
                keyed::Group::new(own_keys.clone(), &own),
                keyed::Group::new(offered.clone(), &offered_read),
                keyed::Group::new(pass.clone(), &pass_read),
                keyed::Group::new(serve.clone(), &serve_read),
            ],
        )?;
        let own: Own = keyed::take(&table, &own_keys).map_err(D::Error::custom)?;
        Ok(CapacitySearch {
            models: own.models,
            dtype: own.dtype,
            seq_len: own.seq_len,
            offered: keyed::take(&table, &offered).map_err(D::Error::custom)?,
            pass: keyed::take(&table, &pass).map_err(D::Error::custom)?,
            serve: keyed::take(&table, &serve).map_err(D::Error::custom)?,
        })
    }
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
    /// The keys given that apply to one kind of model only, with that kind. A search's steps
    /// of a model served one pass per request hold `min_requests`, not `duration_secs`.
    fn kind_keys(&self) -> Vec<(String, Served)> {
        let pass = given_keys(&self.pass)
            .into_iter()
            .chain(self.seq_len.map(|_| "seq_len".to_string()));
        let serve = given_keys(&self.serve)
            .into_iter()
            .chain(self.offered.duration_secs.map(|_| "duration_secs".to_string()));
        pass.map(|k| (k, Served::Passes))
            .chain(serve.map(|k| (k, Served::Generation)))
            .collect()
    }

    /// The load settings of a model served one forward pass per request: `migprof load`'s defaults
    /// where a key is not given.
    pub fn load_settings(&self, seed: u64) -> LoadSettings {
        // A search's steps run until they hold `min_requests`.
        let offered = Offered {
            duration_secs: Some(0.0),
            ..self.offered.clone()
        };
        LoadSettings::given(&offered, &self.pass, seed)
    }

    /// The serving settings of a language model: `migprof load`'s defaults where a key is not given.
    pub fn serve_settings(&self, seed: u64) -> ServeSettings {
        ServeSettings::given(&self.offered, &self.serve, seed)
    }

    /// The models a search serves and its dtype: each one migprof runs.
    fn check_models(&self, at: &str) -> Result<()> {
        if self.models.is_empty() {
            bail!("{at}: no models: give at least one, e.g. models = [\"resnet50\"]");
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
        if kinds.contains(&Served::Passes) && !positive(self.pass.slo_p99_ms) {
            bail!(
                "{at}: slo_p99_ms: the p99 objective in milliseconds (above 0) is required for {}",
                Served::Passes.models()
            );
        }
        if kinds.contains(&Served::Generation)
            && !(positive(self.serve.slo_ttft_p99_ms) && positive(self.serve.slo_tpot_p99_ms))
        {
            bail!("{at}: slo_ttft_p99_ms and slo_tpot_p99_ms: both objectives in milliseconds (above 0) are required for language models");
        }
        if kinds.contains(&Served::Passes) {
            self.load_settings(seed)
                .check(Keys::SweepFile)
                .map_err(|e| anyhow::anyhow!("{at}: {e:#}"))?;
            if let Some(n) = self.seq_len {
                limits::TOKENS
                    .check("seq_len", n as u64)
                    .map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
            }
        }
        if kinds.contains(&Served::Generation) {
            let s = self.serve_settings(seed);
            s.check(true, Keys::SweepFile)
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
