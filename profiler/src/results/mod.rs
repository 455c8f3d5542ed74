//! Results: the record of a finished run ([`record`]), its latency statistics ([`stats`]) and verdict
//! ([`verdict`]), and what is made of it — the Parquet store ([`store`]), the SVG plots ([`plot`]) and
//! the terminal summary ([`summary`]).

pub mod check;
pub mod compare;
pub mod evidence;
pub mod merge;
pub mod plot;
pub mod record;
pub mod stats;
pub mod store;
pub mod summary;
pub mod uncertainty;
pub mod verdict;

pub use record::{Run, RunContext};
