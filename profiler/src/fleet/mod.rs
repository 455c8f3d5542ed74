//! Fleet runs: a sweep's cells handed to the engines platform teams already run — Slurm job arrays
//! ([`slurm`]) and Kubernetes indexed Jobs ([`k8s`]) — each cell run by `migprof cell` on the device
//! the scheduler assigned ([`request`]), into a shared results folder whose atomic parts keep
//! concurrent writers apart. migprof schedules nothing itself; `migprof merge` joins folders written
//! apart.

pub mod k8s;
pub mod request;
pub mod slurm;

use anyhow::{bail, Result};

use crate::cell::CellSpec;
use crate::sweep::file::{BatchSize, SweepFile};
use crate::sweep::Options;

/// The sweep's cells for a cluster, each with whether it is done: every target a request a
/// scheduler can serve; no `max` batches and no concurrent groups, which need one machine.
pub fn cluster_cells(file: &SweepFile, opts: &Options) -> Result<Vec<(CellSpec, bool)>> {
    for t in &file.targets {
        request::Request::of(t)?;
    }
    if let Some(g) = file.groups.first() {
        bail!("[[groups]] `{}`: a concurrent group runs its members on one machine at once; run it with the local backend", g.label);
    }
    if let Some(s) = file.servers.first() {
        bail!(
            "[[servers]] `{}`: a server's cells answer at one endpoint, one at a time, which tasks a cluster places on any node cannot keep; run it with the local backend",
            s.model()
        );
    }
    let cells = crate::sweep::preview::plan(file, opts)?;
    if let Some((c, _)) = cells.iter().find(|(c, _)| c.batch == BatchSize::Max) {
        bail!(
            "{}: batch \"max\" is searched for by probing one device; on a cluster give batch sizes",
            c.spec.target
        );
    }
    Ok(cells.into_iter().map(|(c, done)| (c.spec, done)).collect())
}

/// A label as a file or job name: letters, digits, `-` and `.`; anything else becomes `-`.
pub fn slug(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '.' || c == '-' {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect()
}
