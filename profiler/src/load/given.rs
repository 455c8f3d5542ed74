//! The settings a load job is given, each declared once for both places it is given in: `migprof
//! load`'s flags (clap) and a sweep file's `[[capacity]]` keys (serde). A field's name is its key and
//! its flag's id; its flag is `--` and the key in kebab case unless its `#[arg]` says otherwise
//! (`--warmup` for `warmup_secs`). What was not given takes `migprof load`'s default where the
//! settings are made ([`super::settings`]), and the bounds are checked there too.
//!
//! Three groups: what every job takes ([`Offered`]), what a model served one forward pass per
//! request takes ([`PassGiven`]), what a language model served by the continuous batcher takes
//! ([`ServeGiven`]).

use clap::{ArgAction, Args, CommandFactory, Parser};
use serde::{Deserialize, Serialize};

use crate::load::arrival::Arrival;
use crate::load::lengths::LengthDist;
use crate::run::limits::{
    self, parse_block_size, parse_max_batch, parse_milliseconds, parse_percent, parse_seconds, parse_share,
};

/// How requests are offered, for every kind of model.
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
pub struct Offered {
    /// The arrival process (default poisson).
    #[arg(long, value_enum)]
    #[serde(default)]
    pub arrival: Option<Arrival>,
    /// Seconds of arrivals at the start of each step that are served and not measured (default 1).
    #[arg(long = "warmup", value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--warmup", s, false))]
    #[serde(default)]
    pub warmup_secs: Option<f64>,
    /// Seconds of measured arrivals per step (without --search; default 10); for a language model,
    /// the seconds of arrivals of every step, --warmup included (about qps × duration requests).
    #[arg(long = "duration", value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--duration", s, true))]
    #[serde(default)]
    pub duration_secs: Option<f64>,
    /// A search's resolution in percent of the rate (default 2; for a language model 10).
    #[arg(long = "resolution", value_name = "PCT", value_parser = parse_percent)]
    #[serde(default)]
    pub resolution_pct: Option<f64>,
}

/// How a model served one forward pass per request is batched and judged (image and encoder
/// models).
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
pub struct PassGiven {
    /// The batcher's largest batch (default 32; not for language models: see --max-seqs).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_max_batch)]
    #[serde(default)]
    pub max_batch: Option<usize>,
    /// The longest a batch waits for more requests once its first has arrived (and the model is
    /// free), ms (default 5; not for language models, whose batcher admits between iterations).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--max-delay-ms", s, false))]
    #[serde(default)]
    pub max_delay_ms: Option<f64>,
    /// The latency objective on p99, milliseconds: judges each step (meets_slo); --search needs it
    /// (not for language models: see --slo-ttft-p99-ms and --slo-tpot-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-p99-ms", s, true))]
    #[serde(default)]
    pub slo_p99_ms: Option<f64>,
    /// Measured requests a search step needs before its p99's interval may decide it (default
    /// 10,000; fewer make a p99 not worth much; not for language models).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::MIN_REQUESTS.parse("--min-requests", s).map(|v| v as usize))]
    #[serde(default)]
    pub min_requests: Option<usize>,
}

/// How a language model is served: its requests' lengths, the continuous batcher, the paged KV
/// cache and the two objectives.
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
#[command(next_help_heading = "Language models (served by a continuous batcher)")]
pub struct ServeGiven {
    /// Each request's prompt length in tokens: N, uniform:MIN-MAX or lognormal:MEAN,SPREAD (default
    /// 512).
    #[arg(long, value_name = "LEN")]
    #[serde(default, with = "length")]
    pub prompt_len: Option<LengthDist>,
    /// Each request's output length in tokens, as --prompt-len (default 128).
    #[arg(long, value_name = "LEN")]
    #[serde(default, with = "length")]
    pub output_len: Option<LengthDist>,
    /// Tokens one iteration processes at most, prefill pieces and decodes together (default 2048).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::TOKENS.parse("--max-batched-tokens", s).map(|v| v as u32))]
    #[serde(default)]
    pub max_batched_tokens: Option<u32>,
    /// Sequences running at once at most (default 256).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::SEQUENCES.parse("--max-seqs", s).map(|v| v as u32))]
    #[serde(default)]
    pub max_seqs: Option<u32>,
    /// Prefill each prompt in one iteration, waiting for one with room for all of it, instead of in
    /// pieces across iterations.
    #[arg(long = "no-chunked-prefill", num_args = 0, default_missing_value = "false", action = ArgAction::Set)]
    #[serde(default)]
    pub chunked_prefill: Option<bool>,
    /// Tokens a KV block holds, 1 to 4096 (default 16).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_block_size)]
    #[serde(default)]
    pub kv_block_size: Option<workloads::BlockSize>,
    /// The share of the target's memory left after the weights and the workspace that the KV cache
    /// takes (default 0.9).
    #[arg(long, allow_negative_numbers = true, value_parser = parse_share)]
    #[serde(default)]
    pub kv_cache_fraction: Option<f64>,
    /// The KV cache's blocks, instead of sizing it from the target's memory.
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::BLOCKS.parse("--kv-blocks", s).map(|v| v as u32))]
    #[serde(default)]
    pub kv_blocks: Option<u32>,
    /// Seconds a step waits after its last arrival for its requests to finish (default 30).
    #[arg(long = "drain", value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--drain", s, false))]
    #[serde(default)]
    pub drain_secs: Option<f64>,
    /// The objective on the time to the first token's p99, ms (with --slo-tpot-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-ttft-p99-ms", s, true), requires = "slo_tpot_p99_ms")]
    #[serde(default)]
    pub slo_ttft_p99_ms: Option<f64>,
    /// The objective on the time per output token's p99, ms (with --slo-ttft-p99-ms).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| parse_milliseconds("--slo-tpot-p99-ms", s, true), requires = "slo_ttft_p99_ms")]
    #[serde(default)]
    pub slo_tpot_p99_ms: Option<f64>,
    /// The most rates a search measures (default 8).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::SEARCH_STEPS.parse("--max-steps", s).map(|v| v as usize))]
    #[serde(default)]
    pub max_steps: Option<usize>,
}

/// The keys of [`ServeGiven`] that set migprof's continuous batcher and its KV cache, not the
/// requests or how they are judged: a user's server batches and caches as it is configured.
pub const BATCHER_KEYS: [&str; 6] = [
    "max_batched_tokens",
    "max_seqs",
    "chunked_prefill",
    "kv_block_size",
    "kv_cache_fraction",
    "kv_blocks",
];

/// The three groups on one command line: what names each setting's flag.
#[derive(Parser)]
struct AllGiven {
    #[command(flatten)]
    offered: Offered,
    #[command(flatten)]
    pass: PassGiven,
    #[command(flatten)]
    serve: ServeGiven,
}

/// The flag of the setting whose sweep-file key is `key` (`--warmup` for `warmup_secs`); `None` for
/// a key that is no load setting.
pub fn flag(key: &str) -> Option<String> {
    AllGiven::command()
        .get_arguments()
        .find(|a| a.get_id() == key)
        .and_then(|a| a.get_long())
        .map(|long| format!("--{long}"))
}

/// The keys of the settings given in `group`, in its order. (TOML's form, which leaves out what
/// was not given and keeps a value that is not a number, `nan`, as given: JSON's would make it null.)
pub fn given_keys<T: Serialize>(group: &T) -> Vec<String> {
    let Ok(toml::Value::Table(map)) = toml::Value::try_from(group) else {
        return Vec::new();
    };
    AllGiven::command()
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .filter(|id| map.contains_key(id))
        .collect()
}

/// A length as `--prompt-len` takes it: a number of tokens, or a distribution's text; written as its
/// text.
mod length {
    use serde::{Deserialize, Deserializer, Serializer};

    use crate::load::lengths::LengthDist;

    pub fn serialize<S: Serializer>(d: &Option<LengthDist>, s: S) -> Result<S::Ok, S::Error> {
        match d {
            Some(d) => s.serialize_str(&d.to_string()),
            None => s.serialize_none(),
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<LengthDist>, D::Error> {
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
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every setting's key, in the groups' order.
    const KEYS: &[&str] = &[
        "arrival",
        "warmup_secs",
        "duration_secs",
        "resolution_pct",
        "max_batch",
        "max_delay_ms",
        "slo_p99_ms",
        "min_requests",
        "prompt_len",
        "output_len",
        "max_batched_tokens",
        "max_seqs",
        "chunked_prefill",
        "kv_block_size",
        "kv_cache_fraction",
        "kv_blocks",
        "drain_secs",
        "slo_ttft_p99_ms",
        "slo_tpot_p99_ms",
        "max_steps",
    ];

    /// Every setting given, as a sweep file writes it.
    const EVERY_KEY: &str = r#"
        arrival = "constant"
        warmup_secs = 2
        duration_secs = 20.5
        resolution_pct = 5
        max_batch = 8
        max_delay_ms = 2
        slo_p99_ms = 50
        min_requests = 2000
        prompt_len = "uniform:100-200"
        output_len = 64
        max_batched_tokens = 4096
        max_seqs = 64
        chunked_prefill = false
        kv_block_size = 32
        kv_cache_fraction = 0.5
        kv_blocks = 1000
        drain_secs = 10
        slo_ttft_p99_ms = 500
        slo_tpot_p99_ms = 50
        max_steps = 4
    "#;

    fn every_key() -> (Offered, PassGiven, ServeGiven) {
        let t: toml::Table = toml::from_str(EVERY_KEY).unwrap();
        let group = |keys: &[&str]| {
            toml::Value::Table(
                t.iter()
                    .filter(|(k, _)| keys.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect(),
            )
        };
        (
            group(&KEYS[..4]).try_into().unwrap(),
            group(&KEYS[4..8]).try_into().unwrap(),
            group(&KEYS[8..]).try_into().unwrap(),
        )
    }

    /// Each field is a key and a flag, named alike: a setting added to a group is in both places
    /// at once, and a rename on one side alone fails here.
    #[test]
    fn every_setting_is_a_key_and_a_flag_of_the_same_name() {
        let (offered, pass, serve) = every_key();
        let keys: Vec<String> = [given_keys(&offered), given_keys(&pass), given_keys(&serve)].concat();
        assert_eq!(keys, KEYS, "every key of the file given");
        let ids: Vec<String> = AllGiven::command()
            .get_arguments()
            .map(|a| a.get_id().to_string())
            .collect();
        assert_eq!(ids, KEYS, "the flags' ids are the keys, in the same order");
        assert_eq!(flag("warmup_secs").as_deref(), Some("--warmup"));
        assert_eq!(flag("chunked_prefill").as_deref(), Some("--no-chunked-prefill"));
        assert_eq!(flag("max_seqs").as_deref(), Some("--max-seqs"));
        assert_eq!(flag("models"), None);
    }

    /// The same settings given as flags read as they do from the file.
    #[test]
    fn flags_and_keys_give_the_same_settings() {
        let argv = "x --arrival constant --warmup 2 --duration 20.5 --resolution 5 --max-batch 8 --max-delay-ms 2 \
                    --slo-p99-ms 50 --min-requests 2000 --prompt-len uniform:100-200 --output-len 64 \
                    --max-batched-tokens 4096 --max-seqs 64 --no-chunked-prefill --kv-block-size 32 \
                    --kv-cache-fraction 0.5 --kv-blocks 1000 --drain 10 --slo-ttft-p99-ms 500 \
                    --slo-tpot-p99-ms 50 --max-steps 4";
        let flags = AllGiven::try_parse_from(argv.split_whitespace()).unwrap();
        let (offered, pass, serve) = every_key();
        assert_eq!((flags.offered, flags.pass, flags.serve), (offered, pass, serve));
        let none = AllGiven::try_parse_from(["x"]).unwrap();
        assert_eq!(none.serve.chunked_prefill, None, "no flag, no setting");
        assert!(given_keys(&none.serve).is_empty());
    }

    /// A value that is no number is a value given: its kind's checks refuse it, where reading it
    /// as not given would let it pass unseen.
    #[test]
    fn a_value_that_is_not_a_number_counts_as_given() {
        let pass: PassGiven = toml::from_str("slo_p99_ms = nan\nmax_delay_ms = inf").unwrap();
        assert_eq!(given_keys(&pass), ["max_delay_ms", "slo_p99_ms"]);
        let serve: ServeGiven = toml::from_str("kv_cache_fraction = nan").unwrap();
        assert_eq!(given_keys(&serve), ["kv_cache_fraction"]);
    }

    #[test]
    fn a_bad_value_is_refused_on_both_sides_by_name() {
        let e = AllGiven::try_parse_from(["x", "--kv-block-size", "5000"])
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("--kv-block-size"), "{e}");
        let e = toml::from_str::<ServeGiven>("kv_block_size = 5000")
            .unwrap_err()
            .to_string();
        assert!(e.contains("4096"), "{e}");
        let e = toml::from_str::<ServeGiven>("prompt_len = \"often\"")
            .unwrap_err()
            .to_string();
        assert!(e.contains("uniform"), "{e}");
    }
}
