//! The OpenAI-compatible protocol of language-model servers (vLLM, SGLang, TGI, llama.cpp's server,
//! NIM): the models a server serves (`GET /v1/models`), a streaming request of a prompt of a given
//! length for a given number of output tokens (`/v1/completions` or `/v1/chat/completions` with
//! `stream: true`), and its answer read as server-sent events as they arrive — when each chunk
//! with text came, and the token counts the server reports (`usage`).
//!
//! A request asks for exactly its output length where the server offers the means (`max_tokens`,
//! and `min_tokens` with `ignore_eos`, which vLLM, SGLang and llama.cpp's server take) and is
//! greedy (`temperature` 0, as vLLM's benchmark sends it); what came back is checked against the
//! server's own count, so that a server that stopped early shows as short, never as faster.

use std::io::{BufRead, BufReader, Read};
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{json, Value};

use super::endpoint::Endpoint;

/// Which endpoint requests go to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Api {
    /// `/v1/completions`: a prompt of text or of token ids.
    Completions,
    /// `/v1/chat/completions`: one user message of text, wrapped in the model's chat template.
    Chat,
}

impl Api {
    pub const NAMES: [&'static str; 2] = ["completions", "chat"];

    pub fn as_str(self) -> &'static str {
        match self {
            Api::Completions => "completions",
            Api::Chat => "chat",
        }
    }

    pub fn path(self) -> &'static str {
        match self {
            Api::Completions => "/v1/completions",
            Api::Chat => "/v1/chat/completions",
        }
    }
}

impl std::str::FromStr for Api {
    type Err = String;

    fn from_str(s: &str) -> Result<Api, String> {
        match s {
            "completions" => Ok(Api::Completions),
            "chat" => Ok(Api::Chat),
            other => Err(format!("api `{other}`; valid: {}", Api::NAMES.join(", "))),
        }
    }
}

/// How a prompt of a given length is made.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptForm {
    /// Token ids, drawn at random: exactly the length drawn (`/v1/completions` of vLLM, SGLang,
    /// llama.cpp's server; no chat endpoint takes them).
    Ids,
    /// Words, one token each in common tokenizers: the length the server counts (its `usage`) is
    /// the one recorded.
    Text,
}

impl PromptForm {
    pub const NAMES: [&'static str; 2] = ["ids", "text"];

    pub fn as_str(self) -> &'static str {
        match self {
            PromptForm::Ids => "ids",
            PromptForm::Text => "text",
        }
    }
}

impl std::str::FromStr for PromptForm {
    type Err = String;

    fn from_str(s: &str) -> Result<PromptForm, String> {
        match s {
            "ids" => Ok(PromptForm::Ids),
            "text" => Ok(PromptForm::Text),
            other => Err(format!(
                "prompt form `{other}`; valid: {}",
                PromptForm::NAMES.join(", ")
            )),
        }
    }
}

/// The model a server serves, as `GET /v1/models` describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Served {
    pub model: String,
    /// Who serves it, as the server says (`vllm`, `llamacpp`, `sglang`); the rows' engine.
    pub owned_by: Option<String>,
    /// The vocabulary's size, where the server says it (llama.cpp's `meta.n_vocab`).
    pub vocab: Option<u32>,
}

impl Served {
    /// The server's name for the rows: who owns the model, or the protocol's name.
    pub fn engine(&self) -> String {
        self.owned_by
            .clone()
            .filter(|o| !o.trim().is_empty())
            .unwrap_or_else(|| "openai-compatible".to_string())
    }
}

/// The model `wanted` (or the only one) of those the server lists; an error naming them otherwise.
pub fn discover(endpoint: &Endpoint, wanted: Option<&str>) -> Result<Served> {
    #[derive(Deserialize)]
    struct Meta {
        n_vocab: Option<u32>,
    }
    #[derive(Deserialize)]
    struct Entry {
        id: String,
        owned_by: Option<String>,
        meta: Option<Meta>,
    }
    #[derive(Deserialize)]
    struct List {
        data: Vec<Entry>,
    }
    let what = "GET /v1/models (the models the server serves)";
    let answer = endpoint
        .get(&endpoint.agent(), "/v1/models")
        .map_err(|e| anyhow!("{what}: {}", e.0))?;
    if answer.status != 200 {
        bail!("{what}: HTTP {}: {}", answer.status, answer.text(300));
    }
    let list: List = serde_json::from_slice(&answer.body)
        .with_context(|| format!("{what}: not the OpenAI answer expected: {}", answer.text(300)))?;
    let names = || list.data.iter().map(|e| e.id.as_str()).collect::<Vec<_>>().join(", ");
    let entry = match wanted {
        Some(w) => list.data.iter().find(|e| e.id == w).ok_or_else(|| {
            anyhow!(
                "the server serves no model `{w}`; it serves: {}",
                if list.data.is_empty() {
                    "none".to_string()
                } else {
                    names()
                }
            )
        })?,
        None => match list.data.as_slice() {
            [one] => one,
            [] => bail!("{what}: the server lists no model"),
            _ => bail!(
                "the server serves {} models: say which with --served-model (served_model in a sweep file): {}",
                list.data.len(),
                names()
            ),
        },
    };
    Ok(Served {
        model: entry.id.clone(),
        owned_by: entry.owned_by.clone(),
        vocab: entry.meta.as_ref().and_then(|m| m.n_vocab),
    })
}

/// Token ids of a prompt are drawn below this, or below the vocabulary where the server says it is
/// smaller: ordinary tokens in every vocabulary migprof has met (their special tokens come later).
pub const PROMPT_IDS_BELOW: u32 = 1000;

/// Words of a text prompt: four letters and a space, one token each in the tokenizers of Llama,
/// Qwen and GPT, and one 5-byte chunk each in llama.cpp's test tokenizer.
const WORDS: [&str; 32] = [
    "time", "year", "good", "work", "life", "hand", "part", "case", "week", "area", "fact", "home", "side", "book",
    "line", "name", "game", "city", "team", "door", "face", "head", "room", "mind", "body", "kind", "form", "word",
    "food", "note", "town", "road",
];

/// The requests of one job: where they go, how their prompts are made, and whether the output
/// length is enforced.
#[derive(Debug, Clone, PartialEq)]
pub struct Requests {
    pub api: Api,
    pub form: PromptForm,
    pub model: String,
    /// Token ids are drawn in `0..vocab`.
    pub vocab: u32,
    /// Ask for exactly the output length (`min_tokens` and `ignore_eos` besides `max_tokens`); off
    /// for a server that refuses fields it does not know.
    pub enforce_length: bool,
}

/// Why a request was not served.
#[derive(Debug, Clone, PartialEq)]
pub enum Unserved {
    /// The server refused it (a 4xx other than 408 and 429: a prompt longer than its context, a
    /// field it does not take), with what it said.
    Refused(String),
    /// No answer, an error answer, or a stream that broke off or made no sense.
    Failed(String),
}

impl Unserved {
    pub fn reason(&self) -> &str {
        match self {
            Unserved::Refused(r) | Unserved::Failed(r) => r,
        }
    }
}

/// How the tokens a request received were counted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counted {
    /// The server's `usage.completion_tokens`.
    Usage,
    /// llama.cpp's `timings.predicted_n`, where no usage came.
    Timings,
    /// One per chunk with text: the server reported no count.
    Chunks,
}

impl Counted {
    pub fn as_str(self) -> &'static str {
        match self {
            Counted::Usage => "usage",
            Counted::Timings => "timings",
            Counted::Chunks => "chunks",
        }
    }
}

/// A streamed answer as it arrived.
#[derive(Debug, Clone, PartialEq)]
pub struct Streamed {
    /// When each chunk that carried text arrived (role-only, empty and usage chunks are not
    /// tokens).
    pub chunks: Vec<Instant>,
    /// The tokens received and how they were counted.
    pub tokens: u32,
    pub counted: Counted,
    /// The prompt's tokens as the server counted them, where it said.
    pub prompt_tokens: Option<u32>,
    pub finish_reason: Option<String>,
}

impl Requests {
    /// The prompt of a request: `tokens` ids or words, drawn from `seed` (each request its own, so
    /// that no server's prefix cache serves one request's prompt from another's).
    pub fn prompt(&self, tokens: u32, seed: u64) -> Value {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        match self.form {
            PromptForm::Ids => Value::from(
                (0..tokens)
                    .map(|_| rng.random_range(0..self.vocab.max(1)))
                    .collect::<Vec<u32>>(),
            ),
            PromptForm::Text => Value::from(
                (0..tokens)
                    .map(|_| WORDS[rng.random_range(0..WORDS.len())])
                    .collect::<Vec<&str>>()
                    .join(" "),
            ),
        }
    }

    /// The body of a request of a `prompt_tokens` prompt for `output_tokens` tokens.
    pub fn body(&self, prompt_tokens: u32, output_tokens: u32, seed: u64) -> Value {
        let prompt = self.prompt(prompt_tokens, seed);
        let mut body = json!({
            "model": self.model,
            "max_tokens": output_tokens,
            "temperature": 0.0,
            "stream": true,
            "stream_options": {"include_usage": true},
        });
        match self.api {
            Api::Completions => body["prompt"] = prompt,
            Api::Chat => body["messages"] = json!([{"role": "user", "content": prompt}]),
        }
        if self.enforce_length {
            body["min_tokens"] = json!(output_tokens);
            body["ignore_eos"] = json!(true);
        }
        body
    }

    /// Sends a request and reads its stream to the end.
    pub fn send(
        &self,
        endpoint: &Endpoint,
        agent: &ureq::Agent,
        prompt_tokens: u32,
        output_tokens: u32,
        seed: u64,
    ) -> Result<Streamed, Unserved> {
        let body = self.body(prompt_tokens, output_tokens, seed).to_string();
        let headers = [
            ("Content-Type", "application/json".to_string()),
            ("Accept", "text/event-stream".to_string()),
        ];
        let (status, reader) = endpoint
            .post_streaming(agent, self.api.path(), &headers, body.as_bytes())
            .map_err(|e| Unserved::Failed(e.0))?;
        if status != 200 {
            let mut said = Vec::new();
            let _ = reader.take(4096).read_to_end(&mut said);
            let said = String::from_utf8_lossy(&said);
            let said: String = said.trim().chars().take(300).collect();
            let why = format!("HTTP {status}: {said}");
            return Err(match status {
                400..=499 if status != 408 && status != 429 => Unserved::Refused(why),
                _ => Unserved::Failed(why),
            });
        }
        read_stream(BufReader::new(reader), self.api).map_err(Unserved::Failed)
    }
}

/// What the events of a stream said so far.
#[derive(Default)]
struct Reading {
    chunks: Vec<Instant>,
    usage_tokens: Option<u32>,
    timings_tokens: Option<u32>,
    prompt_tokens: Option<u32>,
    finish_reason: Option<String>,
    done: bool,
}

/// Reads a stream of server-sent events to its `[DONE]`: each `data:` event a chunk of JSON;
/// comments (`:` keep-alives) and other fields skipped. A chunk that is not JSON, an error event,
/// a stream that ends or breaks before `[DONE]`, or one without any text is a failed request, said
/// in words.
pub fn read_stream(reader: impl BufRead, api: Api) -> Result<Streamed, String> {
    let mut r = Reading::default();
    let mut data: Option<String> = None;
    let mut lines = reader.split(b'\n');
    while !r.done {
        let line = match lines.next() {
            None => break,
            Some(Err(e)) => {
                return Err(format!(
                    "the stream broke off after {} chunk(s) with text: {e}",
                    r.chunks.len()
                ))
            }
            Some(Ok(line)) => line,
        };
        let line = String::from_utf8_lossy(&line);
        let line = line.strip_suffix('\r').unwrap_or(&line);
        if line.is_empty() {
            if let Some(event) = data.take() {
                r.event(&event, api)?;
            }
            continue;
        }
        if line.starts_with(':') {
            continue;
        }
        let (field, value) = line.split_once(':').unwrap_or((line, ""));
        if field == "data" {
            let value = value.strip_prefix(' ').unwrap_or(value);
            match data.as_mut() {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_string()),
            }
        }
    }
    if let Some(event) = data.take().filter(|_| !r.done) {
        r.event(&event, api)?;
    }
    if !r.done {
        return Err(format!(
            "the stream ended without [DONE] after {} chunk(s) with text: the server closed it",
            r.chunks.len()
        ));
    }
    if r.chunks.is_empty() {
        return Err(format!(
            "no chunk carried text (finish_reason {})",
            r.finish_reason.as_deref().unwrap_or("none")
        ));
    }
    let (tokens, counted) = match (r.usage_tokens, r.timings_tokens) {
        (Some(n), _) => (n, Counted::Usage),
        (None, Some(n)) => (n, Counted::Timings),
        (None, None) => (r.chunks.len() as u32, Counted::Chunks),
    };
    Ok(Streamed {
        chunks: r.chunks,
        tokens,
        counted,
        prompt_tokens: r.prompt_tokens,
        finish_reason: r.finish_reason,
    })
}

impl Reading {
    fn event(&mut self, data: &str, api: Api) -> Result<(), String> {
        let at = Instant::now();
        if data.trim() == "[DONE]" {
            self.done = true;
            return Ok(());
        }
        let chunk: Value = serde_json::from_str(data).map_err(|_| {
            let shown: String = data.chars().take(120).collect();
            format!(
                "a chunk that is not JSON after {} chunk(s) with text: {shown:?}",
                self.chunks.len()
            )
        })?;
        if let Some(error) = chunk.get("error") {
            let said = error
                .get("message")
                .and_then(Value::as_str)
                .map_or_else(|| error.to_string(), str::to_string);
            return Err(format!(
                "the server's error after {} chunk(s) with text: {said}",
                self.chunks.len()
            ));
        }
        let count = |v: &Value, key: &str| v.get(key).and_then(Value::as_u64).map(|n| n as u32);
        if let Some(usage) = chunk.get("usage").filter(|u| u.is_object()) {
            self.usage_tokens = count(usage, "completion_tokens").or(self.usage_tokens);
            self.prompt_tokens = count(usage, "prompt_tokens").or(self.prompt_tokens);
        }
        if let Some(timings) = chunk.get("timings") {
            self.timings_tokens = count(timings, "predicted_n").or(self.timings_tokens);
        }
        let Some(choice) = chunk.get("choices").and_then(|c| c.get(0)) else {
            return Ok(());
        };
        let text = match api {
            Api::Completions => choice.get("text"),
            Api::Chat => choice.get("delta").and_then(|d| d.get("content")),
        };
        if text.and_then(Value::as_str).is_some_and(|t| !t.is_empty()) {
            self.chunks.push(at);
        }
        if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
            self.finish_reason = Some(reason.to_string());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(stream: &str, api: Api) -> Result<Streamed, String> {
        read_stream(stream.as_bytes(), api)
    }

    #[test]
    fn a_completion_stream_counts_its_text_chunks_and_takes_the_servers_count() {
        let s = "data: {\"choices\":[{\"text\":\"a\",\"finish_reason\":null}]}\n\n\
                 : ping\n\n\
                 data: {\"choices\":[{\"text\":\"\",\"finish_reason\":null}]}\r\n\r\n\
                 data: {\"choices\":[{\"text\":\"b\",\"finish_reason\":null}]}\n\n\
                 data: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}],\"usage\":{\"prompt_tokens\":7,\"completion_tokens\":3}}\n\n\
                 data: [DONE]\n\n";
        let got = read(s, Api::Completions).unwrap();
        assert_eq!(got.chunks.len(), 2);
        assert_eq!((got.tokens, got.counted), (3, Counted::Usage));
        assert_eq!(got.prompt_tokens, Some(7));
        assert_eq!(got.finish_reason.as_deref(), Some("length"));
    }

    #[test]
    fn a_chat_stream_skips_the_role_chunk_and_reads_usage_from_a_chunk_without_choices() {
        let s = "data: {\"choices\":[{\"delta\":{\"role\":\"assistant\",\"content\":\"\"}}]}\n\n\
                 data: {\"choices\":[{\"delta\":{\"content\":\"hi\"}}]}\n\n\
                 data: {\"choices\":[{\"delta\":{},\"finish_reason\":\"stop\"}]}\n\n\
                 data: {\"choices\":[],\"usage\":{\"prompt_tokens\":12,\"completion_tokens\":1}}\n\n\
                 data: [DONE]\n\n";
        let got = read(s, Api::Chat).unwrap();
        assert_eq!(got.chunks.len(), 1);
        assert_eq!((got.tokens, got.prompt_tokens), (1, Some(12)));
        // The same stream read as completions has no text.
        assert!(read(s, Api::Completions).unwrap_err().contains("no chunk carried text"));
    }

    #[test]
    fn without_usage_the_count_falls_back_to_timings_then_to_chunks() {
        let timings = "data: {\"choices\":[{\"text\":\"ab\"}]}\n\ndata: {\"choices\":[{\"text\":\"\",\"finish_reason\":\"length\"}],\"timings\":{\"predicted_n\":2}}\n\ndata: [DONE]\n\n";
        let got = read(timings, Api::Completions).unwrap();
        assert_eq!((got.chunks.len(), got.tokens, got.counted), (1, 2, Counted::Timings));
        let bare =
            "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\ndata: [DONE]\n\n";
        let got = read(bare, Api::Completions).unwrap();
        assert_eq!((got.tokens, got.counted), (2, Counted::Chunks));
    }

    #[test]
    fn broken_streams_are_failures_said_in_words() {
        let cut = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"text\":\"b\"}]}\n\n";
        assert!(read(cut, Api::Completions)
            .unwrap_err()
            .contains("ended without [DONE] after 2"));
        let malformed = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"choices\":[{\"te\n\ndata: [DONE]\n\n";
        let e = read(malformed, Api::Completions).unwrap_err();
        assert!(e.contains("not JSON after 1 chunk"), "{e}");
        let error = "data: {\"choices\":[{\"text\":\"a\"}]}\n\ndata: {\"error\":{\"message\":\"out of memory\"}}\n\n";
        assert!(read(error, Api::Completions)
            .unwrap_err()
            .contains("error after 1 chunk(s) with text: out of memory"));
        assert!(read("", Api::Chat).unwrap_err().contains("without [DONE] after 0"));
    }

    #[test]
    fn an_event_of_several_data_lines_is_one_chunk() {
        let s = "data: {\"choices\":\ndata: [{\"text\":\"a\"}]}\n\ndata: [DONE]";
        assert_eq!(read(s, Api::Completions).unwrap().chunks.len(), 1);
    }

    #[test]
    fn bodies_ask_for_the_length_and_prompts_are_the_length_drawn() {
        let mut r = Requests {
            api: Api::Completions,
            form: PromptForm::Ids,
            model: "m".into(),
            vocab: 256,
            enforce_length: true,
        };
        let b = r.body(5, 9, 1);
        assert_eq!(b["prompt"].as_array().unwrap().len(), 5);
        assert!(b["prompt"]
            .as_array()
            .unwrap()
            .iter()
            .all(|id| id.as_u64().unwrap() < 256));
        assert_eq!((b["max_tokens"].as_u64(), b["min_tokens"].as_u64()), (Some(9), Some(9)));
        assert_eq!(b["ignore_eos"], json!(true));
        assert_eq!(b["stream"], json!(true));
        assert_ne!(r.prompt(5, 1), r.prompt(5, 2), "each request its own prompt");
        r.api = Api::Chat;
        r.form = PromptForm::Text;
        r.enforce_length = false;
        let b = r.body(4, 3, 0);
        let text = b["messages"][0]["content"].as_str().unwrap();
        assert_eq!(text.split(' ').count(), 4);
        assert!(b.get("min_tokens").is_none() && b.get("ignore_eos").is_none());
        assert!("xml".parse::<Api>().unwrap_err().contains("completions, chat"));
        assert!("x".parse::<PromptForm>().unwrap_err().contains("ids, text"));
    }
}
