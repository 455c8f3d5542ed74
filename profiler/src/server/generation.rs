//! A language model's server under load over the OpenAI protocol: each request's prompt and output
//! lengths drawn as migprof's own serving engine draws them, its answer streamed, and every token
//! timed from when the request was due (its scheduled arrival, or when its client was free), so that
//! TTFT, ITL, TPOT, E2E and goodput mean what they mean for migprof's engine
//! ([`crate::load::tokens`]) and the rows sit in the same `serve` tables.
//!
//! A chunk of a stream may carry several tokens (vLLM coalesces them under load): the tokens the
//! server counted are spread over the chunks that carried text, the first at the first chunk and
//! the last at the last, so TTFT, TPOT and E2E are exact and only ITL within a chunk is not; the
//! step says where chunks and tokens differed.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use super::drive::{late_note, reasons, tally, Client, Load, LATE};
use super::endpoint::Endpoint;
use super::openai::{Counted, Requests, Unserved};
use crate::load::generation_record::{ServerRequest, ServerStep};
use crate::load::lengths::{LengthDist, LengthSampler};
use crate::load::tokens::{GenerationServed, RequestRecord};

/// The requests of one step: the lengths of the n-th drawn in turn from the lengths' seed (every
/// step offers the same lengths in the same order), its prompt's tokens from the step's own prompt
/// seed and n. A server keeps the prompts it served in its prefix cache (vLLM's, SGLang's, each
/// llama.cpp slot's): a prompt served again skips its prefill, so no prompt of a step is one of an
/// earlier step's, or of an earlier job's against the same server.
pub struct Generation<'a> {
    requests: &'a Requests,
    prompt_seed: u64,
    lengths: Mutex<Lengths>,
}

struct Lengths {
    prompt: LengthSampler,
    output: LengthSampler,
    drawn: Vec<(u32, u32)>,
}

impl<'a> Generation<'a> {
    pub fn new(
        requests: &'a Requests,
        prompt: LengthDist,
        output: LengthDist,
        seed: u64,
        prompt_seed: u64,
    ) -> Generation<'a> {
        Generation {
            requests,
            prompt_seed,
            // As migprof's engine draws a step's lengths (`StepPlan::requests`).
            lengths: Mutex::new(Lengths {
                prompt: prompt.sampler(seed ^ 1),
                output: output.sampler(seed ^ 2),
                drawn: Vec::new(),
            }),
        }
    }

    /// The prompt and output lengths of the `n`-th request.
    fn lengths(&self, n: usize) -> (u32, u32) {
        let mut l = self.lengths.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        while l.drawn.len() <= n {
            let drawn = (l.prompt.draw(), l.output.draw());
            l.drawn.push(drawn);
        }
        l.drawn[n]
    }
}

/// One request as its client saw it, each time from the step's start.
#[derive(Debug, Clone, PartialEq)]
pub struct Generated {
    /// When it was due: its scheduled arrival, or when its client was free.
    pub due: Duration,
    pub started: Duration,
    /// When its stream had been read to the end (or had failed).
    pub done: Duration,
    /// Its lengths as drawn: the prompt's, and the tokens it asked for.
    pub prompt: u32,
    pub output: u32,
    pub answer: Result<Answer, Unserved>,
}

/// A streamed answer on the step's clock.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    /// When each chunk with text arrived.
    pub chunks: Vec<Duration>,
    /// The tokens received, as the server counted them where it did.
    pub tokens: u32,
    pub counted: Counted,
    /// The prompt's tokens as the server counted them, where it said.
    pub prompt_tokens: Option<u32>,
}

impl Client for Generation<'_> {
    type Sent = Generated;

    fn send(&self, endpoint: &Endpoint, agent: &ureq::Agent, t0: Instant, n: usize, due: Duration) -> Generated {
        let (prompt, output) = self.lengths(n);
        let seed = self.prompt_seed ^ (n as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let started = t0.elapsed();
        let answer = self
            .requests
            .send(endpoint, agent, prompt, output, seed)
            .map(|s| Answer {
                chunks: s.chunks.iter().map(|c| c.saturating_duration_since(t0)).collect(),
                tokens: s.tokens,
                counted: s.counted,
                prompt_tokens: s.prompt_tokens,
            });
        Generated {
            due,
            started,
            done: t0.elapsed(),
            prompt,
            output,
            answer,
        }
    }

    fn done(sent: &Generated) -> Duration {
        sent.done
    }
}

/// When each of `tokens` tokens came, from the times of the chunks that carried them: the first at
/// the first chunk, the last at the last, the rest spread evenly between (one per chunk where the
/// counts agree).
pub fn token_times(chunks: &[Duration], tokens: u32) -> Vec<Duration> {
    let (c, t) = (chunks.len(), tokens as usize);
    match (c, t) {
        (0, _) | (_, 0) => Vec::new(),
        (_, 1) => vec![chunks[0]],
        _ if c == t => chunks.to_vec(),
        _ => (0..t)
            .map(|i| chunks[((i * (c - 1)) as f64 / (t - 1) as f64).round() as usize])
            .collect(),
    }
}

/// A step's requests, in the order they were due, and its bounds.
pub struct GeneratedStep {
    pub requests: Vec<Generated>,
    /// Requests due before this are warm-up.
    pub warmup: Duration,
    /// Requests were due until this; tokens after `end + drain` do not count (the request is
    /// unfinished, as migprof's engine leaves one at its step's limit).
    pub end: Duration,
    pub drain: Duration,
}

/// What a step's client saw beyond the served requests.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientSummary {
    pub measured: usize,
    pub failed: usize,
    pub failures: Vec<(String, usize)>,
    pub short: usize,
    /// Measured requests whose chunks with text were not one per token.
    pub coalesced: usize,
    pub late: usize,
    pub counted: String,
}

impl GeneratedStep {
    pub fn new(mut requests: Vec<Generated>, warmup: Duration, end: Duration, drain: Duration) -> GeneratedStep {
        requests.sort_by_key(|r| r.due);
        GeneratedStep {
            requests,
            warmup,
            end,
            drain,
        }
    }

    fn measured(&self) -> impl Iterator<Item = &Generated> {
        self.requests.iter().filter(|r| r.due >= self.warmup)
    }

    /// The step as migprof's engine's steps are kept (every request with its tokens' times; no
    /// iterations, which only the server knows), and each request's own columns.
    pub fn served(&self) -> (GenerationServed, Vec<ServerRequest>) {
        let limit = self.end + self.drain;
        let (records, details) = self
            .requests
            .iter()
            .map(|r| match &r.answer {
                Ok(a) => {
                    let mut tokens = token_times(&a.chunks, a.tokens);
                    tokens.retain(|&t| t <= limit);
                    (
                        RequestRecord {
                            arrival: r.due,
                            prompt: a.prompt_tokens.unwrap_or(r.prompt),
                            // A short answer finished with what it got: its own length.
                            output: a.tokens.min(r.output),
                            tokens,
                            refused: None,
                        },
                        ServerRequest {
                            short: a.tokens < r.output,
                            failure: None,
                            chunks: a.chunks.len() as u32,
                        },
                    )
                }
                Err(why) => (
                    RequestRecord {
                        arrival: r.due,
                        prompt: r.prompt,
                        output: r.output,
                        tokens: Vec::new(),
                        refused: match why {
                            Unserved::Refused(w) => Some(w.clone()),
                            Unserved::Failed(_) => None,
                        },
                    },
                    ServerRequest {
                        short: false,
                        failure: match why {
                            Unserved::Failed(w) => Some(w.clone()),
                            Unserved::Refused(_) => None,
                        },
                        chunks: 0,
                    },
                ),
            })
            .unzip();
        let end = self.requests.iter().map(|r| r.done).max().unwrap_or(self.end);
        (
            GenerationServed {
                requests: records,
                iterations: Vec::new(),
                preemptions: 0,
                blocks: 0,
                end: end.min(limit),
            },
            details,
        )
    }

    /// The client's side: failures, short and coalesced answers, lateness, how tokens were counted.
    pub fn client(&self) -> ClientSummary {
        let (failed, failures) = tally(self.measured().filter_map(|r| match &r.answer {
            Err(Unserved::Failed(why)) => Some(why.as_str()),
            _ => None,
        }));
        let answers: Vec<(&Generated, &Answer)> = self
            .measured()
            .filter_map(|r| r.answer.as_ref().ok().map(|a| (r, a)))
            .collect();
        let mut counted: Vec<&str> = answers.iter().map(|(_, a)| a.counted.as_str()).collect();
        counted.sort_unstable();
        counted.dedup();
        ClientSummary {
            measured: self.measured().count(),
            failed,
            failures,
            short: answers.iter().filter(|(r, a)| a.tokens < r.output).count(),
            coalesced: answers
                .iter()
                .filter(|(_, a)| a.chunks.len() != a.tokens as usize)
                .count(),
            late: self
                .measured()
                .filter(|r| r.started.saturating_sub(r.due) > LATE)
                .count(),
            counted: counted.join("+"),
        }
    }
}

impl ClientSummary {
    /// The row's columns of the client's side, with the server's processes' presence.
    pub fn row(&self, load: &Load, on_target: Option<bool>, requests: Vec<ServerRequest>) -> ServerStep {
        ServerStep {
            concurrency: load.concurrency(),
            failed: self.failed,
            failures: reasons(&self.failures),
            short: self.short,
            counted: self.counted.clone(),
            late: self.late,
            on_target,
            requests,
        }
    }

    /// What needs saying of the client's side.
    pub fn notes(&self, load: &Load, enforced: bool) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(r) = reasons(&self.failures) {
            notes.push(format!(
                "{} of {} measured request(s) failed and did not finish: {r}",
                self.failed, self.measured
            ));
        }
        if self.short > 0 {
            notes.push(format!(
                "{} measured request(s) came back with fewer tokens than they asked for{}; each counts with the tokens it got",
                self.short,
                if enforced {
                    " although asked for exactly their length (min_tokens, ignore_eos): the server does not honour them"
                } else {
                    " (the length was not enforced)"
                }
            ));
        }
        if self.coalesced > 0 {
            notes.push(format!(
                "{} measured request(s) had chunks of several tokens: their tokens are spread over their chunks, so ITL within a chunk is estimated (TTFT, TPOT and E2E are not)",
                self.coalesced
            ));
        }
        if self.counted.contains("chunks") {
            notes.push(
                "the server reported no token count for some answers: their tokens are counted as chunks with text"
                    .to_string(),
            );
        }
        notes.extend(late_note(load, self.late));
        notes
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(v: u64) -> Duration {
        Duration::from_millis(v)
    }

    #[test]
    fn tokens_spread_over_their_chunks_keep_the_first_and_the_last() {
        let chunks = [ms(10), ms(20), ms(40)];
        assert_eq!(token_times(&chunks, 3), chunks.to_vec());
        let five = token_times(&chunks, 5);
        assert_eq!(five.len(), 5);
        assert_eq!((five[0], five[4]), (ms(10), ms(40)));
        let two = token_times(&chunks, 2);
        assert_eq!(two, vec![ms(10), ms(40)]);
        assert_eq!(token_times(&chunks, 1), vec![ms(10)]);
        assert!(token_times(&[], 4).is_empty());
    }

    fn answered(due: u64, asked: u32, chunks: &[u64], tokens: u32) -> Generated {
        Generated {
            due: ms(due),
            started: ms(due),
            done: ms(*chunks.last().unwrap_or(&due)),
            prompt: 8,
            output: asked,
            answer: Ok(Answer {
                chunks: chunks.iter().map(|&c| ms(c)).collect(),
                tokens,
                counted: Counted::Usage,
                prompt_tokens: Some(9),
            }),
        }
    }

    #[test]
    fn a_step_keeps_short_failed_and_refused_requests_apart() {
        let failed = Generated {
            answer: Err(Unserved::Failed("the stream broke off".into())),
            ..answered(1200, 3, &[], 0)
        };
        let refused = Generated {
            answer: Err(Unserved::Refused("HTTP 400: too long".into())),
            ..answered(1300, 3, &[], 0)
        };
        let step = GeneratedStep::new(
            vec![
                answered(1100, 3, &[1110, 1120, 1130], 3),
                refused,
                failed,
                answered(500, 3, &[510, 520, 530], 3),
                answered(1400, 3, &[1410, 1420], 2),
            ],
            ms(1000),
            ms(2000),
            ms(1000),
        );
        let (served, details) = step.served();
        assert_eq!(served.requests[0].arrival, ms(500), "in the order they were due");
        let summary = crate::load::tokens::GenerationSummary::of(&served, ms(1000), None);
        // The full and the short one finished; the failed and the refused did not.
        assert_eq!((summary.requests, summary.finished, summary.refused), (4, 2, 1));
        assert_eq!(served.requests[1].prompt, 9, "the server's count of the prompt");
        assert_eq!(served.requests[4].output, 2);
        assert!(details[4].short && !details[1].short);
        assert_eq!(details[2].failure.as_deref(), Some("the stream broke off"));
        assert_eq!(served.requests[3].refused.as_deref(), Some("HTTP 400: too long"));
        let client = step.client();
        assert_eq!(
            (client.measured, client.failed, client.short, client.coalesced),
            (4, 1, 1, 0)
        );
        let notes = client.notes(&Load::Concurrency(2), true).join("; ");
        assert!(notes.contains("1 of 4 measured request(s) failed"), "{notes}");
        assert!(notes.contains("does not honour"), "{notes}");
    }

    #[test]
    fn tokens_after_the_drain_leave_a_request_unfinished() {
        let step = GeneratedStep::new(vec![answered(100, 3, &[200, 300, 5000], 3)], ms(0), ms(1000), ms(1000));
        let (served, _) = step.served();
        assert_eq!(served.requests[0].tokens.len(), 2);
        assert!(!served.requests[0].finished());
    }

    #[test]
    fn the_nth_request_has_the_same_lengths_at_every_step() {
        let r = Requests {
            api: super::super::openai::Api::Completions,
            form: super::super::openai::PromptForm::Ids,
            model: "m".into(),
            vocab: 10,
            enforce_length: true,
        };
        let d = LengthDist::Uniform { min: 1, max: 1000 };
        let a = Generation::new(&r, d, d, 5, 1);
        let b = Generation::new(&r, d, d, 5, 2);
        let later: Vec<_> = (0..20).rev().map(|n| a.lengths(n)).collect();
        let first: Vec<_> = (0..20).rev().map(|n| b.lengths(n)).collect();
        assert_eq!(later, first);
        assert_ne!(a.lengths(0), a.lengths(1));
    }
}
