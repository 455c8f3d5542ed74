//! A user's inference server measured on a target (`migprof load --endpoint`): one migprof did not
//! write, reached over its own protocol.
//!
//! [`endpoint`] is where it answers and the headers it needs; [`kserve`] speaks KServe v2 (Triton,
//! KServe's runtimes): the model's metadata, a request of its inputs, each answer checked against
//! its outputs; [`drive`] loads it, at a fixed concurrency or at open-loop rates, and times every
//! request from when it was due; [`launch`] starts a server command pinned to the target, waits
//! until it is ready, and stops its whole process tree however migprof ends; [`job`] runs the steps
//! (rates, concurrencies, a capacity search) beside the GPU sampler and writes each as a `load`
//! row naming the server; [`measure`] does all of it from start to stop. [`given`] declares the
//! settings once for `migprof load`'s flags and a sweep file's `[[servers]]`; [`input_data`] reads
//! a user's tensors.
//!
//! A language model's server speaks OpenAI's protocol instead: [`openai`] reads its model and
//! streams a request of a drawn length, [`generation`] times every token of every request as
//! migprof's own serving engine's are timed, and [`generation_job`] runs the steps and the
//! two-objective search and writes the `serve` rows.

pub mod drive;
pub mod endpoint;
pub mod generation;
pub mod generation_job;
pub mod given;
pub mod input_data;
pub mod job;
pub mod kserve;
pub mod launch;
pub mod measure;
pub mod openai;

use std::time::Instant;

use endpoint::Endpoint;

/// One request a protocol sends again and again, and how each answer is checked.
pub trait Exchange: Send + Sync {
    /// Sends the request on `agent` (one client's connection) and checks the answer: when the
    /// answer had been read whole, or what was wrong with it.
    fn exchange(&self, endpoint: &Endpoint, agent: &ureq::Agent) -> Result<Instant, String>;

    /// Samples one request holds.
    fn batch(&self) -> usize;
}

/// The protocols migprof speaks to a server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// KServe v2 over HTTP/REST (Triton, KServe, TorchServe, Seldon MLServer).
    Kserve,
    /// OpenAI's completions over HTTP with server-sent events (vLLM, SGLang, TGI, llama.cpp, NIM).
    Openai,
}

impl Protocol {
    pub const NAMES: [&'static str; 2] = ["kserve", "openai"];

    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Kserve => "kserve",
            Protocol::Openai => "openai",
        }
    }

    /// The path that answers 200 once the model can be served.
    pub fn ready_path(self, model: Option<&str>) -> String {
        match (self, model) {
            (Protocol::Kserve, Some(m)) => format!("/v2/models/{m}/ready"),
            (Protocol::Kserve, None) => "/v2/health/ready".to_string(),
            // Every OpenAI-compatible server lists its models once it serves them (llama.cpp's
            // answers 503 while it loads).
            (Protocol::Openai, _) => "/v1/models".to_string(),
        }
    }
}

impl std::str::FromStr for Protocol {
    type Err = String;

    fn from_str(s: &str) -> Result<Protocol, String> {
        match s {
            "kserve" => Ok(Protocol::Kserve),
            "openai" => Ok(Protocol::Openai),
            other => Err(format!(
                "protocol `{other}`; valid protocols: {}",
                Protocol::NAMES.join(", ")
            )),
        }
    }
}
