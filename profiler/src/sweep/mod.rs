//! `migprof sweep`: a matrix of cells from a file ([`file`]), each cell run in a child process of its
//! own (the cell layer, [`crate::cell`], is the contract between them and runs it; [`child`] is the
//! sweep's side of a child, [`worker`] the child's), with a row for every cell however it ends.

pub mod child;
pub mod claim;
pub mod file;
pub mod plan;
pub mod progress;
pub mod schedule;
pub mod worker;
