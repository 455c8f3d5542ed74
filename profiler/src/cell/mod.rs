//! A cell: one measurement of one workload on one target, as `run`, `load` and a sweep's child each
//! make it. [`spec`] is its contract (the JSON a sweep, an emulated slice and a cluster's task hand a
//! child) and its identity; [`runner`] runs it: the one preflight, the one naming of its rows and the
//! one row of a cell that failed.

pub mod runner;
pub mod spec;

pub use spec::{CellSpec, Job, Purpose, CELL_SPEC_VERSION};
