//! Serving load: what a slice serves when requests arrive at random and a latency objective binds,
//! rather than what a closed loop at a fixed batch pushes through it.
//!
//! [`arrival`] draws the schedule, fixed by its seed whatever the model does (open loop), one arrival
//! at a time; [`serve`] runs the dynamic batcher in front of one model instance, holding only the
//! arrivals that wait, and measures each request from its scheduled arrival; [`step`] judges a step
//! against the objective, [`search`] finds the highest rate within it, [`job`] drives a real
//! model through all that with its [`settings`], and [`record`] writes the `load`, `load_batches` and
//! `capacity` tables.
//!
//! For a language model, what a slice serves is decided by a continuous batcher instead:
//! [`lengths`] draws each request's prompt and output lengths, [`continuous`] schedules every
//! iteration (decodes, prefill chunks, admission by free KV blocks, preemption by recompute), and
//! [`tokens`] serves a schedule through it and measures TTFT, ITL, TPOT, E2E and goodput;
//! [`generation`] drives a real model over its paged KV cache through all that, and
//! [`generation_record`] writes the `serve`, `serve_requests`, `serve_iterations` and
//! `serve_capacity` tables.

pub mod arrival;
pub mod continuous;
pub mod generation;
pub mod generation_record;
pub mod given;
pub mod job;
pub mod lengths;
pub mod record;
pub mod search;
pub mod serve;
pub mod settings;
pub mod step;
pub mod tokens;
