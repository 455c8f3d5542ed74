//! What is made of finished runs: the Parquet part store ([`parts`]), the runs tables ([`runs`]) and their checks ([`check`]), merges of
//! folders ([`merge`]), comparisons of two groups of runs ([`compare`]), the SVG plots ([`plot`]) and
//! the terminal summary ([`summary`]).

pub mod check;
pub mod compare;
pub mod merge;
pub mod parts;
pub mod plot;
pub mod runs;
pub mod summary;
