//! The continuous batcher of a language model's server: scheduling at every iteration, as vLLM's
//! and TensorRT-LLM's schedulers do, rather than a batch that runs to its end.
//!
//! Each iteration the scheduler decides what one forward pass of the model processes:
//! - one token of every running sequence that is decoding (decodes first: they hold the slice's
//!   latency objective per token, and their cache is already paid for);
//! - the next chunk of a prompt being prefilled;
//! - new prompts from the waiting queue, first come first served, while the iteration's token
//!   budget (`max_batched_tokens`) and the cache's free blocks allow. With chunked prefill a prompt
//!   longer than what is left of the budget is split across iterations; without, it waits for an
//!   iteration with room for all of it.
//!
//! The KV cache is blocks of `block_size` tokens. A sequence holds the blocks of the tokens whose
//! keys and values are cached; a new block is taken when a token crosses into one, and a finished
//! sequence returns its blocks. When a decoding sequence needs a block and none is free, the most
//! recently admitted running sequence is preempted: its blocks are freed and it goes back to the
//! front of the queue, to be prefilled again over its prompt and the tokens it has generated
//! (recompute), after which it goes on from where it was. Nothing is ever over-committed.
//!
//! The scheduler only counts: the engine that runs an [`Iteration`] (a real decoder, or a model of
//! known step time in the tests) and the clock are the caller's.

use std::collections::VecDeque;

use anyhow::{bail, Result};

/// What the scheduler may hand one iteration, and the cache it manages.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Budget {
    /// Tokens a KV block holds.
    pub block_size: workloads::BlockSize,
    /// Blocks of the cache.
    pub blocks: u32,
    /// Tokens one iteration processes at most: prefill chunks and decodes together.
    pub max_batched_tokens: u32,
    /// Sequences running at once at most (the engine's largest batch).
    pub max_seqs: u32,
    /// Whether a prompt may be prefilled over several iterations.
    pub chunked_prefill: bool,
    /// The most tokens a sequence may hold: the model's positions.
    pub max_model_len: u32,
}

impl Budget {
    /// The most tokens the cache holds.
    pub fn capacity(&self) -> u64 {
        self.blocks as u64 * self.block_size.get() as u64
    }

    fn blocks_for(&self, tokens: u32) -> u32 {
        tokens.div_ceil(self.block_size.get() as u32)
    }
}

/// A request as the server receives it: its prompt's tokens and how many it generates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    pub id: usize,
    pub prompt: u32,
    pub output: u32,
}

/// A piece of a sequence's prefill in one iteration: tokens `start..start + len` of what it
/// prefills (its prompt, or after a preemption its prompt and the tokens it had generated).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub id: usize,
    pub start: u32,
    pub len: u32,
    /// Whether the chunk ends the prefill, so that the iteration gives the sequence a token.
    pub last: bool,
}

/// What one forward pass processes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Iteration {
    pub prefills: Vec<Chunk>,
    /// Sequences that decode one token each.
    pub decodes: Vec<usize>,
    /// Sequences preempted while this iteration was planned: their blocks are free before it runs
    /// (the engine drops what it cached of them, and prefills them again when they are admitted).
    pub preempted: Vec<usize>,
}

impl Iteration {
    /// Tokens the pass processes.
    pub fn tokens(&self) -> u32 {
        self.prefills.iter().map(|c| c.len).sum::<u32>() + self.decodes.len() as u32
    }

    pub fn is_empty(&self) -> bool {
        self.prefills.is_empty() && self.decodes.is_empty()
    }

    /// Sequences in the pass.
    pub fn batch(&self) -> usize {
        self.prefills.len() + self.decodes.len()
    }
}

/// A token out of an iteration.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Token {
    pub id: usize,
    /// Which of the request's tokens, from 1.
    pub index: u32,
    /// Whether it was the request's last.
    pub last: bool,
}

#[derive(Debug, Clone)]
struct Seq {
    req: Request,
    /// Tokens whose keys and values are cached.
    cached: u32,
    /// Tokens to prefill before the next token comes out: the prompt, or after a preemption the
    /// prompt and the generated tokens.
    target: u32,
    /// Tokens generated so far.
    generated: u32,
    /// Blocks held.
    blocks: u32,
}

impl Seq {
    fn prefilling(&self) -> bool {
        self.cached < self.target
    }
}

/// The continuous batcher's state: waiting requests, running sequences and the cache's blocks.
#[derive(Debug, Clone)]
pub struct Scheduler {
    budget: Budget,
    waiting: VecDeque<Seq>,
    /// In order of admission.
    running: Vec<Seq>,
    free: u32,
    preemptions: u64,
    /// Sequences preempted since the last plan was handed out.
    preempted: Vec<usize>,
}

impl Scheduler {
    pub fn new(budget: Budget) -> Result<Scheduler> {
        if budget.blocks == 0 || budget.max_batched_tokens == 0 || budget.max_seqs == 0 || budget.max_model_len == 0 {
            bail!("a continuous batcher needs at least one block, a token budget and a batch above zero: {budget:?}")
        }
        // Every running sequence's decode fits one iteration, so none waits behind the others.
        if budget.max_seqs > budget.max_batched_tokens {
            bail!(
                "a continuous batcher of {} sequences needs a token budget of at least {} (one decode each), not {}",
                budget.max_seqs,
                budget.max_seqs,
                budget.max_batched_tokens
            )
        }
        Ok(Scheduler {
            budget,
            waiting: VecDeque::new(),
            running: Vec::new(),
            free: budget.blocks,
            preemptions: 0,
            preempted: Vec::new(),
        })
    }

    /// Queues a request. One that could never be served is refused: a sequence whose prompt and
    /// output exceed the whole cache, or, without chunked prefill, a prompt over the iteration's
    /// token budget.
    pub fn add(&mut self, req: Request) -> Result<()> {
        if req.prompt == 0 || req.output == 0 {
            bail!("request {}: a prompt and an output of at least one token each", req.id)
        }
        // Its last token is not fed back, so it needs no slot.
        let need = req.prompt as u64 + req.output as u64 - 1;
        if need > self.budget.max_model_len as u64 {
            bail!(
                "request {}: {} prompt + {} output tokens need {need} positions; the model has {}",
                req.id,
                req.prompt,
                req.output,
                self.budget.max_model_len
            )
        }
        if need > self.budget.capacity() {
            bail!(
                "request {}: {} prompt + {} output tokens need {need} cache slots; the cache holds {} ({} blocks of {})",
                req.id,
                req.prompt,
                req.output,
                self.budget.capacity(),
                self.budget.blocks,
                self.budget.block_size
            )
        }
        // A recomputed sequence prefills its generated tokens too (all but the last): at most need,
        // which without chunking must fit one iteration (vLLM asks the same of its budget against
        // the model's whole length).
        if !self.budget.chunked_prefill && need > self.budget.max_batched_tokens as u64 {
            bail!(
                "request {}: without chunked prefill a prompt (with what a preemption makes it recompute, up to {need} tokens) must fit one iteration's {} tokens",
                req.id,
                self.budget.max_batched_tokens
            )
        }
        self.waiting.push_back(Seq {
            req,
            cached: 0,
            target: req.prompt,
            generated: 0,
            blocks: 0,
        });
        Ok(())
    }

    /// Requests waiting to be admitted (preempted ones included).
    pub fn waiting(&self) -> usize {
        self.waiting.len()
    }

    /// Sequences admitted and not finished.
    pub fn running(&self) -> usize {
        self.running.len()
    }

    /// Blocks in use.
    pub fn blocks_used(&self) -> u32 {
        self.budget.blocks - self.free
    }

    pub fn budget(&self) -> Budget {
        self.budget
    }

    /// Preemptions so far.
    pub fn preemptions(&self) -> u64 {
        self.preemptions
    }

    pub fn is_idle(&self) -> bool {
        self.waiting.is_empty() && self.running.is_empty()
    }

    /// Takes blocks so that `seq` holds those of `tokens` cached tokens; false (and nothing taken)
    /// where they are not free.
    fn reserve(free: &mut u32, budget: &Budget, seq: &mut Seq, tokens: u32) -> bool {
        let need = budget.blocks_for(tokens).saturating_sub(seq.blocks);
        if need > *free {
            return false;
        }
        *free -= need;
        seq.blocks += need;
        true
    }

    /// Moves the most recently admitted running sequence back to the front of the queue, its blocks
    /// freed, to prefill its prompt and generated tokens again.
    fn preempt_last(&mut self) {
        let mut seq = self.running.pop().expect("a running sequence to preempt");
        self.free += seq.blocks;
        seq.blocks = 0;
        seq.cached = 0;
        seq.target = seq.req.prompt + seq.generated;
        self.preemptions += 1;
        self.preempted.push(seq.req.id);
        self.waiting.push_front(seq);
    }

    /// The next iteration's work; empty only when nothing waits or runs. Where the running
    /// sequences are all part-way through prefills that the free blocks cannot take further, the
    /// latest admitted is preempted until one can go on: the first admitted always fits alone.
    pub fn plan(&mut self) -> Iteration {
        loop {
            let mut it = self.plan_once();
            if !it.is_empty() || self.running.len() <= 1 {
                it.preempted = std::mem::take(&mut self.preempted);
                return it;
            }
            self.preempt_last();
        }
    }

    fn plan_once(&mut self) -> Iteration {
        let budget = self.budget;
        let preempted_before = self.preemptions;
        let mut it = Iteration::default();
        let mut left = budget.max_batched_tokens;
        // Decodes first, in order of admission; a block short preempts from the back.
        let mut i = 0;
        while i < self.running.len() && left > 0 {
            if self.running[i].prefilling() {
                i += 1;
                continue;
            }
            let tokens = self.running[i].cached + 1;
            let mut placed = Self::reserve(&mut self.free, &budget, &mut self.running[i], tokens);
            while !placed && self.running.len() > i + 1 {
                self.preempt_last();
                placed = Self::reserve(&mut self.free, &budget, &mut self.running[i], tokens);
            }
            if !placed {
                // No one admitted later is left to preempt: this one goes back itself.
                self.preempt_last();
                break;
            }
            it.decodes.push(self.running[i].req.id);
            left -= 1;
            i += 1;
        }
        // Prompts part-way through their prefill, then new ones.
        for seq in self.running.iter_mut().filter(|s| s.prefilling()) {
            if left == 0 {
                break;
            }
            if let Some(chunk) = Self::chunk(&mut self.free, &budget, seq, left) {
                left -= chunk.len;
                it.prefills.push(chunk);
            }
        }
        // No new prompts in an iteration that had to preempt, as vLLM's scheduler does: the
        // sequence just sent back would be admitted again into the blocks it gave up, and preempted
        // again at the next block a decode needs.
        while left > 0 && (self.running.len() as u32) < budget.max_seqs && self.preemptions == preempted_before {
            let Some(seq) = self.waiting.front_mut() else { break };
            let Some(chunk) = Self::chunk(&mut self.free, &budget, seq, left) else {
                break;
            };
            left -= chunk.len;
            it.prefills.push(chunk);
            let seq = self.waiting.pop_front().expect("the front was there");
            self.running.push(seq);
        }
        it
    }

    /// The next piece of `seq`'s prefill within `left` tokens and the free blocks, its blocks
    /// taken; None where nothing of it fits (or, without chunked prefill, not all of it).
    fn chunk(free: &mut u32, budget: &Budget, seq: &mut Seq, left: u32) -> Option<Chunk> {
        let rest = seq.target - seq.cached;
        let mut len = match budget.chunked_prefill {
            true => rest.min(left),
            false if rest <= left => rest,
            false => return None,
        };
        if budget.chunked_prefill {
            // As much as the free blocks hold.
            let room = (seq.blocks + *free) as u64 * budget.block_size.get() as u64 - seq.cached as u64;
            len = len.min(room.min(u32::MAX as u64) as u32);
        }
        if len == 0 || !Self::reserve(free, budget, seq, seq.cached + len) {
            return None;
        }
        Some(Chunk {
            id: seq.req.id,
            start: seq.cached,
            len,
            last: seq.cached + len == seq.target,
        })
    }

    /// Records that `it` ran: caches grow, tokens come out, finished sequences return their blocks.
    pub fn complete(&mut self, it: &Iteration) -> Vec<Token> {
        let mut out = Vec::with_capacity(it.batch());
        let mut emit = |seq: &mut Seq| {
            seq.generated += 1;
            out.push(Token {
                id: seq.req.id,
                index: seq.generated,
                last: seq.generated == seq.req.output,
            });
        };
        for c in &it.prefills {
            let Some(seq) = self.running.iter_mut().find(|s| s.req.id == c.id) else {
                continue;
            };
            seq.cached += c.len;
            if c.last {
                emit(seq);
            }
        }
        for id in &it.decodes {
            let Some(seq) = self.running.iter_mut().find(|s| s.req.id == *id) else {
                continue;
            };
            seq.cached += 1;
            emit(seq);
        }
        let free = &mut self.free;
        self.running.retain(|s| {
            let done = s.generated == s.req.output;
            if done {
                *free += s.blocks;
            }
            !done
        });
        out
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn budget(blocks: u32, max_batched_tokens: u32, chunked_prefill: bool) -> Budget {
        Budget {
            block_size: workloads::BlockSize::DEFAULT,
            blocks,
            max_batched_tokens,
            max_seqs: 64,
            chunked_prefill,
            max_model_len: 1 << 20,
        }
    }

    /// Runs the scheduler until every request is done, checking after each iteration that the
    /// cache is never over-committed and the budget never exceeded. Returns each request's tokens in
    /// the order they came out, and the iterations.
    fn run(mut s: Scheduler, requests: &[Request]) -> (HashMap<usize, Vec<u32>>, Vec<Iteration>) {
        for r in requests {
            s.add(*r).unwrap();
        }
        let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut iterations = Vec::new();
        while !s.is_idle() {
            let it = s.plan();
            assert!(
                !it.is_empty(),
                "stuck with {} waiting, {} running",
                s.waiting(),
                s.running()
            );
            assert!(it.tokens() <= s.budget().max_batched_tokens);
            assert!(it.batch() <= s.budget().max_seqs as usize);
            let held: u32 = s.running.iter().map(|q| q.blocks).sum();
            assert_eq!(held + s.free, s.budget().blocks, "blocks lost or double-counted");
            for q in &s.running {
                assert!(
                    q.blocks >= s.budget().blocks_for(q.cached),
                    "a cache without its blocks"
                );
            }
            // What the iteration says was preempted is back in the queue, holding nothing.
            for id in &it.preempted {
                assert!(s.running.iter().all(|q| q.req.id != *id));
                assert!(s
                    .waiting
                    .iter()
                    .any(|q| q.req.id == *id && q.blocks == 0 && q.cached == 0));
            }
            for t in s.complete(&it) {
                tokens.entry(t.id).or_default().push(t.index);
            }
            iterations.push(it);
            assert!(iterations.len() < 100_000);
        }
        assert_eq!(s.blocks_used(), 0, "finished sequences return their blocks");
        let told: usize = iterations.iter().map(|it| it.preempted.len()).sum();
        assert_eq!(
            told as u64,
            s.preemptions(),
            "every preemption is told to the engine once"
        );
        (tokens, iterations)
    }

    fn every_token_once_in_order(tokens: &HashMap<usize, Vec<u32>>, requests: &[Request]) {
        for r in requests {
            let got = &tokens[&r.id];
            assert_eq!(got, &(1..=r.output).collect::<Vec<_>>(), "request {}", r.id);
        }
    }

    #[test]
    fn every_token_of_every_request_comes_out_once_and_in_order() {
        let requests: Vec<Request> = (0..40)
            .map(|id| Request {
                id,
                prompt: 1 + (id as u32 * 37) % 300,
                output: 1 + (id as u32 * 11) % 50,
            })
            .collect();
        for chunked in [true, false] {
            let (tokens, iterations) = run(Scheduler::new(budget(400, 512, chunked)).unwrap(), &requests);
            every_token_once_in_order(&tokens, &requests);
            // Decodes of many sequences share iterations.
            assert!(iterations.iter().any(|it| it.decodes.len() > 10), "chunked {chunked}");
        }
    }

    #[test]
    fn chunked_prefill_splits_a_long_prompt_and_decodes_go_on_beside_it() {
        let requests = [
            Request {
                id: 0,
                prompt: 20,
                output: 30,
            },
            Request {
                id: 1,
                prompt: 1000,
                output: 2,
            },
        ];
        let (tokens, iterations) = run(Scheduler::new(budget(200, 256, true)).unwrap(), &requests);
        every_token_once_in_order(&tokens, &requests);
        let chunks: Vec<&Chunk> = iterations
            .iter()
            .flat_map(|it| &it.prefills)
            .filter(|c| c.id == 1)
            .collect();
        assert_eq!(chunks.iter().map(|c| c.len).sum::<u32>(), 1000);
        assert!(chunks.len() >= 4, "{chunks:?}");
        assert_eq!(chunks.iter().filter(|c| c.last).count(), 1);
        // Request 0 decodes in the iterations that prefill request 1's chunks.
        assert!(iterations
            .iter()
            .any(|it| it.decodes.contains(&0) && it.prefills.iter().any(|c| c.id == 1)));
        // Without chunking the same prompt is refused: it never fits an iteration of 256.
        let mut s = Scheduler::new(budget(200, 256, false)).unwrap();
        let e = s.add(requests[1]).unwrap_err().to_string();
        assert!(e.contains("without chunked prefill") && e.contains("256"), "{e}");
    }

    #[test]
    fn a_full_cache_preempts_the_latest_sequence_which_recomputes_and_finishes() {
        // 10 blocks of 16 = 160 slots; four sequences of 30 + 40 need 69 slots (5 blocks) each.
        let requests: Vec<Request> = (0..4)
            .map(|id| Request {
                id,
                prompt: 30,
                output: 40,
            })
            .collect();
        let mut s = Scheduler::new(budget(10, 4096, true)).unwrap();
        for r in &requests {
            s.add(*r).unwrap();
        }
        let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut recomputed = Vec::new();
        while !s.is_idle() {
            let it = s.plan();
            assert!(!it.is_empty());
            assert!(s.blocks_used() <= 10);
            // A recompute prefills the prompt and what was generated: more than the prompt.
            recomputed.extend(
                it.prefills
                    .iter()
                    .filter(|c| c.last && c.start + c.len > 30)
                    .map(|c| c.id),
            );
            for t in s.complete(&it) {
                tokens.entry(t.id).or_default().push(t.index);
            }
        }
        assert!(s.preemptions() > 0);
        assert!(!recomputed.is_empty());
        every_token_once_in_order(&tokens, &requests);
        // The first admitted is never the one preempted while later ones run.
        assert!(!recomputed.contains(&0), "{recomputed:?}");
    }

    #[test]
    fn a_preempted_sequence_is_not_admitted_again_in_the_iteration_that_preempted_it() {
        // 6 blocks of 16 = 96 slots. Two sequences of 40 + 30 decode until the second's next block
        // is not there: the later is preempted, and not admitted again in that iteration.
        let requests = [
            Request {
                id: 0,
                prompt: 40,
                output: 30,
            },
            Request {
                id: 1,
                prompt: 40,
                output: 30,
            },
        ];
        let mut s = Scheduler::new(budget(6, 4096, true)).unwrap();
        for r in &requests {
            s.add(*r).unwrap();
        }
        let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
        let mut preempting = 0;
        while !s.is_idle() {
            let before = s.preemptions();
            let it = s.plan();
            if s.preemptions() > before {
                preempting += 1;
                assert!(
                    it.prefills.is_empty(),
                    "a preempting iteration admitted {:?}",
                    it.prefills
                );
            }
            for t in s.complete(&it) {
                tokens.entry(t.id).or_default().push(t.index);
            }
        }
        assert!(preempting > 0);
        every_token_once_in_order(&tokens, &requests);
    }

    #[test]
    fn admission_is_first_come_first_served_even_where_a_later_request_would_fit() {
        // 4 blocks; the first request holds 3 once prefilled. The second needs 3 and waits; the
        // third needs 1, which is free, and waits behind the second all the same.
        let requests = [
            Request {
                id: 0,
                prompt: 40,
                output: 5,
            },
            Request {
                id: 1,
                prompt: 40,
                output: 5,
            },
            Request {
                id: 2,
                prompt: 8,
                output: 5,
            },
        ];
        let mut s = Scheduler::new(budget(4, 4096, false)).unwrap();
        for r in &requests {
            s.add(*r).unwrap();
        }
        let mut admitted = Vec::new();
        let mut tokens: HashMap<usize, Vec<u32>> = HashMap::new();
        while !s.is_idle() {
            let it = s.plan();
            admitted.extend(it.prefills.iter().map(|c| c.id));
            if admitted == [0] {
                assert!(s.blocks_used() < 4, "a block is free for the third request");
            }
            for t in s.complete(&it) {
                tokens.entry(t.id).or_default().push(t.index);
            }
        }
        assert_eq!(admitted, [0, 1, 2]);
        every_token_once_in_order(&tokens, &requests);
    }

    #[test]
    fn requests_that_could_never_run_are_refused_naming_the_cache() {
        let mut s = Scheduler::new(budget(4, 4096, true)).unwrap();
        // 64 slots: 40 + 25 - 1 = 64 fits; 40 + 26 - 1 does not.
        s.add(Request {
            id: 0,
            prompt: 40,
            output: 25,
        })
        .unwrap();
        let e = s
            .add(Request {
                id: 1,
                prompt: 40,
                output: 26,
            })
            .unwrap_err()
            .to_string();
        assert!(e.contains("65 cache slots") && e.contains("4 blocks of 16"), "{e}");
        assert!(s
            .add(Request {
                id: 2,
                prompt: 0,
                output: 3
            })
            .is_err());
        assert!(Scheduler::new(Budget {
            blocks: 0,
            ..budget(4, 64, true)
        })
        .is_err());
        // Past the model's positions, whatever the cache holds.
        let mut s = Scheduler::new(Budget {
            max_model_len: 50,
            ..budget(4, 4096, true)
        })
        .unwrap();
        let long = Request {
            id: 3,
            prompt: 40,
            output: 12,
        };
        let e = s.add(long).unwrap_err().to_string();
        assert!(e.contains("51 positions; the model has 50"), "{e}");
        s.add(Request { output: 11, ..long }).unwrap();
    }
}
