//! Capacities estimated from closed-loop runs (`--closed-loop-estimates`), where no search measured
//! one: the highest throughput of a batch whose p99, doubled for the wait in the queue, is within
//! the objective; a user's program's rows (`migprof exec`) standing for the model they are named for.

use std::collections::btree_map::Entry;
use std::collections::BTreeMap;
use std::path::PathBuf;

use anyhow::Result;

use super::{memory_key, pick_memory_emulation, profile_of_row, Capacity, Source};
use crate::mps::MemoryEmulation;
use crate::results::parts::{number_column, read_table, text_column, Table};
use crate::run::subject::PROGRAM_FAMILY;

/// Per model and profile: the highest throughput among inference runs whose p99 doubled (a request
/// waits up to one batch in the queue, then its own) is within the objective.
pub(super) fn closed_loop_estimates(
    dirs: &[PathBuf],
    slo_ms: f64,
    dtype: Option<&str>,
    memory: Option<MemoryEmulation>,
    notes: &mut Vec<String>,
) -> Result<Vec<Capacity>> {
    let mut best: BTreeMap<(String, String, String, String), ClosedLoopEstimate> = BTreeMap::new();
    // A program named as a migprof model is what its user deploys: its rows stand for the model
    // where it has any, whatever migprof's engine measured.
    let mut passed_over = std::collections::BTreeSet::new();
    for dir in dirs {
        let df = read_table(dir, Table::Runs)?;
        let t = |c| text_column(&df, c);
        let (model, mode, status, dt) = (t("model")?, t("mode")?, t("status")?, t("dtype")?);
        let (emulated, mig, gpu, group) = (
            t("emulated_profile")?,
            t("mig_profile")?,
            t("gpu_name")?,
            t("concurrency_group")?,
        );
        let memory_of = t("memory_emulation")?;
        let family = t("family")?;
        let (p99, throughput, batch, pct) = (
            number_column(&df, "p99_ms")?,
            number_column(&df, "throughput")?,
            number_column(&df, "batch")?,
            number_column(&df, "mps_share_pct")?,
        );
        for i in 0..df.height() {
            let ok = status[i].as_deref().is_none_or(|s| s == "ok")
                && mode[i].as_deref() == Some("infer")
                && group[i].is_none();
            if !ok || dtype.is_some_and(|d| dt[i].as_deref() != Some(d)) {
                continue;
            }
            let (Some(p99), Some(x), Some(m)) = (p99[i], throughput[i], model[i].clone()) else {
                continue;
            };
            if 2.0 * p99 > slo_ms {
                continue;
            }
            let profile = profile_of_row(emulated[i].as_deref(), mig[i].as_deref(), gpu[i].as_deref(), pct[i]);
            let mem = memory_key(memory_of[i].as_deref(), pct[i].is_some());
            let program = family[i].as_deref() == Some(PROGRAM_FAMILY);
            let found = ClosedLoopEstimate {
                qps: x,
                batch: batch[i].unwrap_or(0.0) as i64,
                emulated: pct[i].is_some(),
                gpu: gpu[i].clone(),
                program,
            };
            if found.offer(&mut best, (m.clone(), profile, String::new(), mem)) {
                passed_over.insert(m);
            }
        }
    }
    for m in passed_over {
        notes.push(format!(
            "{m}: closed-loop estimates from your program's steps (migprof exec), not from migprof's engine, which measured it too"
        ));
    }
    Ok(pick_memory_emulation(best, memory, notes)
        .into_iter()
        .map(|((model, profile, _, _), e)| Capacity {
            model,
            profile,
            qps: e.qps,
            source: Source::ClosedLoop {
                emulated: e.emulated,
                batch: e.batch,
                program: e.program,
            },
            gpu: e.gpu,
            lengths: None,
        })
        .collect())
}

/// The best closed-loop row of a model on a profile so far.
struct ClosedLoopEstimate {
    qps: f64,
    batch: i64,
    emulated: bool,
    gpu: Option<String>,
    /// From the steps of the user's own program (`migprof exec`).
    program: bool,
}

impl ClosedLoopEstimate {
    /// Keeps `self` at `key` where it takes the place of what is there; whether a row of the other
    /// kind (program or engine) was there.
    fn offer(
        self,
        best: &mut BTreeMap<(String, String, String, String), ClosedLoopEstimate>,
        key: (String, String, String, String),
    ) -> bool {
        match best.entry(key) {
            Entry::Vacant(v) => {
                v.insert(self);
                false
            }
            Entry::Occupied(mut held) => {
                let other_kind = held.get().program != self.program;
                if self.takes_place_of(held.get()) {
                    held.insert(self);
                }
                other_kind
            }
        }
    }

    /// A program's rows stand for the model over migprof's engine's; of one kind, the higher
    /// throughput wins.
    fn takes_place_of(&self, held: &ClosedLoopEstimate) -> bool {
        match (held.program, self.program) {
            (true, false) => false,
            (false, true) => true,
            _ => self.qps > held.qps,
        }
    }
}
