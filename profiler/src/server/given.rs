//! A user's server and the requests it is sent, as given: declared once for both places it is
//! given in, `migprof load`'s flags (clap) and a sweep file's `[[servers]]` keys (serde). A field's
//! name is its key and its flag's id (`--header` gives `headers`, `--shape` gives `shapes`). What
//! was not given takes [`DEFAULTS`] in [`ServerGiven::resolve`], which checks every value before any
//! work: a bad one is named as the place it was given in spells it.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::builder::PossibleValuesParser;
use clap::Args;
use serde::{Deserialize, Serialize};

use super::endpoint::Endpoint;
use super::kserve::{Encoding, RequestOptions};
use super::openai::{Api, PromptForm};
use super::Protocol;
use crate::load::settings::Keys;
use crate::run::limits::{self, parse_seconds};

/// A server and its requests as given; `None` (or empty) where nothing was.
#[derive(Debug, Clone, Default, PartialEq, Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
#[command(next_help_heading = "A server of your own (--endpoint instead of --model)")]
pub struct ServerGiven {
    /// Load a running server at this base URL (http://HOST:PORT) instead of migprof's engine; with
    /// --server-cmd, the server migprof starts there.
    #[arg(long)]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub endpoint: Option<String>,
    /// The server's protocol: kserve (KServe v2 over HTTP: Triton, KServe, TorchServe, MLServer) or
    /// openai (streaming completions: vLLM, SGLang, TGI, llama.cpp, NIM). Default: kserve.
    #[arg(long, value_parser = PossibleValuesParser::new(Protocol::NAMES), requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub protocol: Option<String>,
    /// Start the server with this shell command first, pinned to --device as you would pin it (a GPU
    /// or MIG UUID in CUDA_VISIBLE_DEVICES; mps: as a client of migprof's MPS daemon); its whole
    /// process tree is stopped when migprof ends, however it ends. Its output is kept in
    /// servers/<id>/ under --out.
    #[arg(long, requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_cmd: Option<String>,
    /// With --server-cmd: how long the server may take to become ready, seconds (default 300).
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--server-timeout", s, true))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub server_timeout: Option<f64>,
    /// The model to load, as the server names it (default: the one model a Triton server has ready).
    #[arg(long, requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub served_model: Option<String>,
    /// A header every request carries, `Name: value` (an API key); repeat for more.
    #[arg(long = "header", value_name = "NAME: VALUE", requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub headers: Vec<String>,
    /// Requests always in flight, comma-separated: one step each (perf_analyzer's
    /// --concurrency-range), before the --qps steps.
    #[arg(long, value_delimiter = ',', requires = "endpoint", allow_negative_numbers = true, value_parser = |s: &str| limits::IN_FLIGHT.parse("--concurrency", s).map(|n| n as usize))]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub concurrency: Vec<usize>,
    /// Samples in each request, in the batch dimension of a model that batches (default 1).
    #[arg(long, requires = "endpoint", allow_negative_numbers = true, value_parser = |s: &str| limits::BATCH.parse("--batch", s).map(|n| n as usize))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub batch: Option<usize>,
    /// The sizes of an input's dimensions of any size, the batch dimension left out, as
    /// perf_analyzer's --shape: NAME:DIM,DIM (repeat for each input).
    #[arg(long = "shape", value_name = "NAME:DIMS", requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shapes: Vec<String>,
    /// The requests' tensors from a JSON file in perf_analyzer's --input-data form
    /// ({"data": [{"NAME": [values] or {"content": [values], "shape": [dims]}}, ...]}), each entry a
    /// request, sent in turn; inputs it leaves out are made as without it.
    #[arg(long, value_name = "FILE", requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input_data: Option<PathBuf>,
    /// How tensors travel: binary (KServe's binary extension, as perf_analyzer sends them) or json
    /// (default binary).
    #[arg(long, value_parser = PossibleValuesParser::new(Encoding::NAMES), requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub encoding: Option<String>,
    /// openai: the endpoint requests go to, completions (/v1/completions) or chat
    /// (/v1/chat/completions). Default: completions.
    #[arg(long, value_parser = PossibleValuesParser::new(Api::NAMES), requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub api: Option<String>,
    /// openai: prompts of token ids (exactly --prompt-len; vLLM, SGLang and llama.cpp take them on
    /// completions) or of text (words; the server's count is recorded). Default: ids for
    /// completions, text for chat.
    #[arg(long, value_parser = PossibleValuesParser::new(PromptForm::NAMES), requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prompt_form: Option<String>,
    /// openai: ask for at most --output-len tokens only, without min_tokens and ignore_eos (for a
    /// server that refuses fields it does not know); answers that stop early count as short.
    #[arg(long = "no-enforce-output", num_args = 0, default_missing_value = "false", action = clap::ArgAction::Set, requires = "endpoint")]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub enforce_output: Option<bool>,
    /// A request not answered within this many seconds fails (default 30; a streamed answer must
    /// end within it).
    #[arg(long, value_name = "SECS", allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--request-timeout", s, true))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub request_timeout: Option<f64>,
    /// At --qps: the most requests in flight (one client connection each); a request due while all
    /// are busy waits in the client, its latency counted from its arrival, and the step says so
    /// (default 256).
    #[arg(long, allow_negative_numbers = true, value_parser = |s: &str| limits::IN_FLIGHT.parse("--max-in-flight", s).map(|n| n as usize))]
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<usize>,
}

/// What a server's settings are when not given.
pub struct ServerDefaults {
    pub protocol: Protocol,
    pub server_timeout_secs: f64,
    pub batch: usize,
    pub encoding: Encoding,
    pub request_timeout_secs: f64,
    pub max_in_flight: usize,
}

pub const DEFAULTS: ServerDefaults = ServerDefaults {
    protocol: Protocol::Kserve,
    server_timeout_secs: 300.0,
    batch: 1,
    encoding: Encoding::Binary,
    request_timeout_secs: 30.0,
    max_in_flight: 256,
};

/// A server's settings, resolved and checked.
#[derive(Debug, Clone)]
pub struct ServerSettings {
    pub endpoint: Endpoint,
    pub protocol: Protocol,
    /// The shell command that starts it, where migprof starts it.
    pub command: Option<String>,
    pub server_timeout: Duration,
    pub served_model: Option<String>,
    pub concurrency: Vec<usize>,
    pub request: RequestOptions,
    /// How an OpenAI-compatible server is asked.
    pub openai: OpenaiOptions,
    pub max_in_flight: usize,
}

/// How an OpenAI-compatible server is asked.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OpenaiOptions {
    pub api: Api,
    pub form: PromptForm,
    /// Ask for exactly the output length (`min_tokens`, `ignore_eos`).
    pub enforce_output: bool,
}

impl ServerGiven {
    /// The settings, defaults applied and every value checked (named as `keys` spells it); `seed`
    /// seeds the generated inputs.
    pub fn resolve(&self, seed: u64, keys: Keys) -> Result<ServerSettings> {
        let k = |key: &str| name(keys, key);
        let Some(url) = self.endpoint.as_deref() else {
            bail!(
                "{}: give the server's base URL, e.g. http://127.0.0.1:8000",
                k("endpoint")
            );
        };
        let d = &DEFAULTS;
        let seconds = |key: &str, given: Option<f64>, default: f64| -> Result<Duration> {
            let s = given.unwrap_or(default);
            limits::seconds(&k(key), s, true).map_err(anyhow::Error::msg)?;
            Ok(Duration::from_secs_f64(s))
        };
        for h in &self.headers {
            super::endpoint::header(h).map_err(|e| anyhow::anyhow!("{}: {e}", k("headers")))?;
        }
        let endpoint = Endpoint::new(
            url,
            &self.headers,
            seconds("request_timeout", self.request_timeout, d.request_timeout_secs)?,
        )
        .map_err(|e| anyhow::anyhow!("{}: {e}", k("endpoint")))?;
        let protocol = match &self.protocol {
            Some(p) => p.parse().map_err(|e| anyhow::anyhow!("{}: {e}", k("protocol")))?,
            None => d.protocol,
        };
        let encoding = match &self.encoding {
            Some(e) => e.parse().map_err(|e| anyhow::anyhow!("{}: {e}", k("encoding")))?,
            None => d.encoding,
        };
        for &n in &self.concurrency {
            limits::IN_FLIGHT
                .check(&k("concurrency"), n as u64)
                .map_err(anyhow::Error::msg)?;
        }
        let batch = self.batch.unwrap_or(d.batch);
        limits::BATCH
            .check(&k("batch"), batch as u64)
            .map_err(anyhow::Error::msg)?;
        let max_in_flight = self.max_in_flight.unwrap_or(d.max_in_flight);
        limits::IN_FLIGHT
            .check(&k("max_in_flight"), max_in_flight as u64)
            .map_err(anyhow::Error::msg)?;
        if let Some(cmd) = self.server_cmd.as_deref().filter(|c| c.trim().is_empty()) {
            bail!(
                "{} {cmd:?}: the command is empty; give the shell command that starts the server",
                k("server_cmd")
            );
        }
        self.one_protocol(protocol, keys)?;
        let openai = self.openai(keys)?;
        let input_data = match &self.input_data {
            Some(path) => Some(super::input_data::InputData::read(path).with_context(|| k("input_data"))?),
            None => None,
        };
        Ok(ServerSettings {
            endpoint,
            protocol,
            command: self.server_cmd.clone(),
            server_timeout: seconds("server_timeout", self.server_timeout, d.server_timeout_secs)?,
            served_model: self.served_model.clone(),
            concurrency: self.concurrency.clone(),
            request: RequestOptions {
                batch,
                shapes: shapes(&self.shapes, &k("shapes"))?,
                encoding,
                seed,
                input_data,
            },
            openai,
            max_in_flight,
        })
    }

    /// How an OpenAI-compatible server is asked: the endpoint, the prompts' form (ids where they
    /// can be), the output's length enforced unless said otherwise.
    fn openai(&self, keys: Keys) -> Result<OpenaiOptions> {
        let k = |key: &str| name(keys, key);
        let api = match &self.api {
            Some(a) => a.parse().map_err(|e| anyhow::anyhow!("{}: {e}", k("api")))?,
            None => Api::Completions,
        };
        let form = match (&self.prompt_form, api) {
            (Some(f), _) => f.parse().map_err(|e| anyhow::anyhow!("{}: {e}", k("prompt_form")))?,
            (None, Api::Completions) => PromptForm::Ids,
            (None, Api::Chat) => PromptForm::Text,
        };
        if (api, form) == (Api::Chat, PromptForm::Ids) {
            bail!(
                "{} ids: a chat message is text; no server takes token ids there (use {} completions for prompts of ids)",
                k("prompt_form"),
                k("api")
            );
        }
        Ok(OpenaiOptions {
            api,
            form,
            enforce_output: self.enforce_output.unwrap_or(true),
        })
    }

    /// Refuses the settings of the other protocol, named as `keys` spells them.
    fn one_protocol(&self, protocol: Protocol, keys: Keys) -> Result<()> {
        let kserve = [
            ("batch", self.batch.is_some()),
            ("shapes", !self.shapes.is_empty()),
            ("input_data", self.input_data.is_some()),
            ("encoding", self.encoding.is_some()),
        ];
        let openai = [
            ("api", self.api.is_some()),
            ("prompt_form", self.prompt_form.is_some()),
            ("enforce_output", self.enforce_output.is_some()),
        ];
        let (foreign, theirs) = match protocol {
            Protocol::Kserve => (&openai[..], "openai"),
            Protocol::Openai => (&kserve[..], "kserve"),
        };
        let given: Vec<String> = foreign
            .iter()
            .filter(|(_, g)| *g)
            .map(|(key, _)| name(keys, key))
            .collect();
        if !given.is_empty() {
            bail!(
                "{} appl{} to the {theirs} protocol, not to {} ({})",
                given.join(", "),
                if given.len() == 1 { "ies" } else { "y" },
                protocol.as_str(),
                name(keys, "protocol")
            );
        }
        Ok(())
    }
}

/// Refuses load settings a server of `protocol` does not take, named as `keys` spells them: `pass`
/// and `serve` are the keys given of [`crate::load::given::PassGiven`] and
/// [`crate::load::given::ServeGiven`]. A server batches and caches as it is configured; a KServe
/// server is judged by one p99 objective, a language model's by TTFT and TPOT.
pub fn refuse_foreign(protocol: Protocol, pass: &[String], serve: &[String], keys: Keys) -> Result<()> {
    use crate::load::given::BATCHER_KEYS as ENGINE;
    let batcher = |k: &String| k == "max_batch" || k == "max_delay_ms";
    let (foreign, why): (Vec<&String>, &str) = match protocol {
        Protocol::Kserve => match pass.iter().find(|k| batcher(k)) {
            Some(_) => (pass.iter().filter(|k| batcher(k)).collect(), "migprof's batcher's: a server batches as it is configured"),
            None => (serve.iter().collect(), "for language models (--protocol openai), not a KServe server"),
        },
        Protocol::Openai => match serve.iter().find(|k| ENGINE.contains(&k.as_str())) {
            Some(_) => (
                serve.iter().filter(|k| ENGINE.contains(&k.as_str())).collect(),
                "migprof's continuous batcher's and cache's: a server batches and caches as it is configured",
            ),
            None => (
                pass.iter().collect(),
                "for models served one pass per request: a language model's server is judged by TTFT and TPOT (--slo-ttft-p99-ms, --slo-tpot-p99-ms)",
            ),
        },
    };
    if !foreign.is_empty() {
        let names: Vec<String> = foreign.iter().map(|k| keys.name(k)).collect();
        bail!(
            "{} {} {why}",
            names.join(", "),
            if names.len() == 1 { "is" } else { "are" }
        );
    }
    Ok(())
}

/// What every server job must say of its steps: at least one concurrency, rate or search, and a
/// search's objective; named as `keys` spells the settings.
pub fn check_steps(
    concurrency: &[usize],
    rates: &[f64],
    search: bool,
    protocol: Protocol,
    objective_given: bool,
    keys: Keys,
) -> Result<()> {
    let (c, q, s) = match keys {
        Keys::Flags => ("--concurrency 1,2,4", "--qps 10,20", "--search"),
        Keys::SweepFile => ("concurrency = [1, 2, 4]", "qps = [10, 20]", "search = true"),
    };
    let slo = match protocol {
        Protocol::Kserve => keys.name("slo_p99_ms"),
        Protocol::Openai => format!("{} and {}", keys.name("slo_ttft_p99_ms"), keys.name("slo_tpot_p99_ms")),
    };
    if concurrency.is_empty() && rates.is_empty() && !search {
        bail!("say how to load the server: concurrencies ({c}), rates ({q}), or a search ({s}) within its objective ({slo})");
    }
    if search && !objective_given {
        bail!("{s}: a capacity search needs the objective it searches within: {slo}");
    }
    Ok(())
}

/// `key` named as `keys` spells it: a sweep file's key, or its flag (`--header` for `headers`).
pub fn name(keys: Keys, key: &str) -> String {
    use clap::CommandFactory;
    #[derive(clap::Parser)]
    struct Flags {
        #[command(flatten)]
        server: ServerGiven,
    }
    let flag = Flags::command()
        .get_arguments()
        .find(|a| a.get_id() == key)
        .and_then(|a| a.get_long())
        .map(|long| format!("--{long}"));
    match (keys, flag) {
        (Keys::Flags, Some(flag)) => flag,
        _ => keys.name(key),
    }
}

/// `NAME:DIM,DIM` each, as a map; `key` names the setting in an error.
fn shapes(given: &[String], key: &str) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for g in given {
        let parsed = g.rsplit_once(':').and_then(|(name, dims)| {
            let dims: Option<Vec<usize>> = dims
                .split(',')
                .map(|d| d.trim().parse().ok().filter(|&d: &usize| d > 0))
                .collect();
            Some((name.trim().to_string(), dims?))
        });
        match parsed {
            Some((name, dims)) if !name.is_empty() && !dims.is_empty() => {
                if out.insert(name.clone(), dims).is_some() {
                    bail!("{key} {name} is given twice");
                }
            }
            _ => bail!("{key} {g:?}: give it as NAME:DIM,DIM with positive sizes, e.g. input_ids:128"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn given(url: &str) -> ServerGiven {
        ServerGiven {
            endpoint: Some(url.into()),
            ..ServerGiven::default()
        }
    }

    #[test]
    fn defaults_fill_what_was_not_given() {
        let s = given("http://127.0.0.1:8000").resolve(7, Keys::Flags).unwrap();
        assert_eq!(s.protocol, Protocol::Kserve);
        assert_eq!(s.request.batch, 1);
        assert_eq!(s.request.encoding, Encoding::Binary);
        assert_eq!(s.request.seed, 7);
        assert_eq!(s.max_in_flight, 256);
        assert_eq!(s.server_timeout, Duration::from_secs(300));
        assert_eq!(s.endpoint.request_timeout, Duration::from_secs(30));
    }

    #[test]
    fn bad_values_are_named_where_they_were_given() {
        let e = |g: ServerGiven, keys: Keys| format!("{:#}", g.resolve(0, keys).unwrap_err());
        let mut g = given("http://h:1");
        g.batch = Some(0);
        assert!(
            e(g.clone(), Keys::SweepFile).contains("batch"),
            "{}",
            e(g, Keys::SweepFile)
        );
        let mut g = given("http://h:1");
        g.concurrency = vec![0];
        assert!(e(g.clone(), Keys::Flags).contains("--concurrency"));
        assert!(e(g, Keys::SweepFile).contains("concurrency"));
        let mut g = given("http://h:1");
        g.encoding = Some("xml".into());
        assert!(e(g, Keys::SweepFile).contains("binary, json"));
        let mut g = given("http://h:1");
        g.server_cmd = Some("  ".into());
        assert!(e(g, Keys::SweepFile).contains("empty"));
        let mut g = given("http://h:1");
        g.request_timeout = Some(0.0);
        assert!(e(g, Keys::Flags).contains("--request-timeout"));
        let e = format!("{:#}", ServerGiven::default().resolve(0, Keys::SweepFile).unwrap_err());
        assert!(e.contains("endpoint") && e.contains("http://"), "{e}");
    }

    #[test]
    fn keys_are_named_by_their_flags() {
        assert_eq!(name(Keys::Flags, "headers"), "--header");
        assert_eq!(name(Keys::Flags, "shapes"), "--shape");
        assert_eq!(name(Keys::Flags, "server_cmd"), "--server-cmd");
        assert_eq!(name(Keys::SweepFile, "shapes"), "shapes");
    }

    #[test]
    fn shapes_are_read_and_bad_ones_named() {
        let m = shapes(&["input_ids:128".into(), "pixels:3,224,224".into()], "--shape").unwrap();
        assert_eq!(m["input_ids"], vec![128]);
        assert_eq!(m["pixels"], vec![3, 224, 224]);
        for bad in ["x", "x:", ":3", "x:0", "x:a"] {
            assert!(
                shapes(&[bad.into()], "--shape")
                    .unwrap_err()
                    .to_string()
                    .contains("NAME:DIM"),
                "{bad}"
            );
        }
        assert!(shapes(&["a:1".into(), "a:2".into()], "shapes")
            .unwrap_err()
            .to_string()
            .contains("shapes a is given twice"));
    }

    #[test]
    fn a_sweep_file_entry_reads_the_same_keys() {
        let g: ServerGiven = toml::from_str(
            "endpoint = \"http://127.0.0.1:8000\"\nserver_cmd = \"python3 serve.py\"\nconcurrency = [1, 2]\nbatch = 8\nheaders = [\"Authorization: Bearer x\"]\nshapes = [\"input_ids:128\"]",
        )
        .unwrap();
        assert_eq!(g.concurrency, vec![1, 2]);
        assert_eq!(g.batch, Some(8));
        assert!(toml::from_str::<ServerGiven>("endpoint = \"http://h:1\"\nbatches = [8]").is_err());
    }
}
