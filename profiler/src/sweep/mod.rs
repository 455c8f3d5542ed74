//! `migprof sweep`: a matrix of cells from a file ([`file`]), each cell run in a child process of its
//! own (the cell layer, [`crate::cell`], is the contract between them and runs it; [`child`] is the
//! sweep's side of a child, [`worker`] the child's), with a row for every cell however it ends.

pub mod child;
pub mod claim;
pub mod file;
pub mod plan;
pub mod preview;
pub mod progress;
pub mod schedule;
pub mod worker;
pub mod written;

use std::path::PathBuf;

use self::plan::Filter;

/// How a sweep runs, as its flags made it: where its rows go, which cells run, how many at once.
#[derive(Debug, Clone)]
pub struct Options {
    pub out: PathBuf,
    pub dry_run: bool,
    /// Run every cell, done or not.
    pub force: bool,
    /// Run cells whose row says `oom` again.
    pub retry_oom: bool,
    pub only: Filter,
    /// Cells at once, each on a device of its own.
    pub jobs: usize,
    /// Draw a progress bar (stderr is a terminal).
    pub terminal: bool,
}
