//! Serving load: what a slice serves when requests arrive at random and a latency objective binds,
//! rather than what a closed loop at a fixed batch pushes through it.
//!
//! [`arrival`] draws the schedule, fixed by its seed whatever the model does (open loop), one arrival
//! at a time; [`serve`] runs the dynamic batcher in front of one model instance, holding only the
//! arrivals that wait, and measures each request from its scheduled arrival; [`step`] judges a step
//! against the objective, [`search`] finds the highest rate within it, [`job`] drives a real
//! model through all that with its [`settings`], and [`record`] writes the `load`, `load_batches` and
//! `capacity` tables.

pub mod arrival;
pub mod job;
pub mod record;
pub mod search;
pub mod serve;
pub mod settings;
pub mod step;
