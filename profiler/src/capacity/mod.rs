//! Capacity planning: from each model's capacity per MIG profile ([`source`]) to the fewest GPUs and
//! their layouts that serve a target load ([`solve`]), beside the plans users make by hand.

pub mod solve;
pub mod source;

use std::collections::BTreeMap;

use anyhow::{bail, Result};
use serde::{Deserialize, Serialize};

use crate::mig::profile::ProfileTable;
use solve::{FleetPlan, Layout, Problem, FULL};
use source::{Capacity, Gathered};

/// `model=requests/s` for `--demand`. The model may be any name: one of migprof's, or a user's whose
/// capacities come from a CSV ([`check_demand`] says which it must be).
pub fn parse_demand(s: &str) -> std::result::Result<(String, f64), String> {
    let (model, qps) = s
        .split_once('=')
        .ok_or_else(|| format!("a demand is model=requests/s (e.g. resnet50=20000); got `{s}`"))?;
    let model = model.trim();
    if model.is_empty() {
        return Err(format!("a demand names its model: model=requests/s; got `{s}`"));
    }
    // Rates this far apart keep the integer program's coefficients within its precision.
    match qps.trim().parse::<f64>() {
        Ok(q) if (1e-3..=1e12).contains(&q) => Ok((model.to_string(), q)),
        _ => Err(format!("{model}: `{qps}` is no rate from 0.001 to 10^12 requests/s")),
    }
}

/// Each model a demand names is one of migprof's models or one the capacities name (a user's own,
/// from a CSV); a name that is neither is refused, naming both lists.
pub fn check_demand(demand: &[(String, f64)], gathered: &Gathered) -> anyhow::Result<()> {
    let measured: std::collections::BTreeSet<&str> = gathered.capacities.iter().map(|c| c.model.as_str()).collect();
    for (model, _) in demand {
        if !workloads::model_names().contains(&model.as_str()) && !measured.contains(model.as_str()) {
            anyhow::bail!(
                "unknown model `{model}`: not one of migprof's ({}) and not in the capacities ({})",
                workloads::model_names().join(", "),
                if measured.is_empty() {
                    "none".to_string()
                } else {
                    measured.into_iter().collect::<Vec<_>>().join(", ")
                }
            );
        }
    }
    Ok(())
}

/// Above this many GPUs a plan is more likely a typo in a demand than a fleet.
pub const SANE_GPUS: u32 = 10_000;

/// A plan made by hand: each model on GPUs of its own, all cut (or not) one way.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandPlan {
    /// The GPUs it takes; null where it cannot be made for every model.
    pub gpus: Option<u32>,
    pub models: Vec<HandModel>,
    /// Models this plan cannot be made for (a whole GPU per model: no capacity of a whole GPU or of
    /// the profile spanning it was measured).
    #[serde(default)]
    pub unknown: Vec<String>,
}

impl HandPlan {
    fn of(models: Vec<HandModel>, unknown: Vec<String>) -> HandPlan {
        HandPlan {
            gpus: unknown.is_empty().then(|| models.iter().map(|m| m.gpus).sum()),
            models,
            unknown,
        }
    }

    /// In words: the GPUs it takes, or which models it could not be made for.
    pub fn describe_gpus(&self) -> String {
        match self.gpus {
            Some(g) => format!("{g} GPU(s)"),
            None => format!(
                "cannot be made (no capacity of a whole GPU or of the profile spanning it for {})",
                self.unknown.join(", ")
            ),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct HandModel {
    pub model: String,
    pub profile: String,
    pub instances: u32,
    pub gpus: u32,
}

/// The objectives a plan's capacities were measured within: p99 latency for models served one
/// forward pass per request, TTFT and TPOT p99 for language models.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Objectives {
    pub p99_ms: Option<f64>,
    pub serving: Option<source::ServingSlo>,
}

impl Objectives {
    pub fn p99(ms: f64) -> Objectives {
        Objectives {
            p99_ms: Some(ms),
            serving: None,
        }
    }

    /// In words, for the plan's first line.
    pub fn describe(&self) -> String {
        let mut parts = Vec::new();
        if let Some(ms) = self.p99_ms {
            parts.push(format!("p99 {ms} ms"));
        }
        if let Some(s) = self.serving {
            parts.push(format!(
                "language models TTFT p99 {} ms and TPOT p99 {} ms",
                s.ttft_p99_ms, s.tpot_p99_ms
            ));
        }
        parts.join("; ")
    }
}

/// Everything `migprof capacity` says.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    pub gpu: String,
    /// The p99 objective of the capacities of models served one forward pass per request; null
    /// where the plan has none.
    pub slo_p99_ms: Option<f64>,
    /// The objectives of language models' capacities; null where the plan has none.
    #[serde(default)]
    pub slo_ttft_p99_ms: Option<f64>,
    #[serde(default)]
    pub slo_tpot_p99_ms: Option<f64>,
    pub headroom: f64,
    pub gpus: u32,
    pub layouts: Vec<LayoutCount>,
    pub instances: Vec<InstanceCount>,
    pub unused_instances: u32,
    pub spare: Vec<Spare>,
    pub capacities: Vec<CapacityLine>,
    /// Any capacity came from MPS-emulated slices.
    pub emulated: bool,
    pub whole_gpu_per_model: HandPlan,
    pub one_profile_per_model: HandPlan,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct LayoutCount {
    pub profiles: Vec<String>,
    pub mig_enabled: bool,
    pub count: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct InstanceCount {
    pub model: String,
    pub profile: String,
    pub count: u32,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Spare {
    pub model: String,
    pub demand_qps: f64,
    pub serves_qps: f64,
    pub spare_qps: f64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CapacityLine {
    pub model: String,
    pub profile: String,
    pub qps: f64,
    pub usable_qps: f64,
    pub source: String,
    pub emulated: bool,
    /// A language model's requests' lengths the capacity holds for (plans made before say none).
    #[serde(default)]
    pub lengths: Option<String>,
}

/// The plan for `demand` on GPUs of `table`, each instance loaded to `headroom` of its capacity.
pub fn plan(
    table: &ProfileTable,
    gathered: &Gathered,
    demand: &[(String, f64)],
    objectives: Objectives,
    headroom: f64,
) -> Result<Report> {
    let mut notes = gathered.notes.clone();
    // A language model whose weights, workspace and one request's cache exceed a profile's memory
    // is not placed there, whatever capacity was given for it, and the plan says so.
    let mut too_small: std::collections::BTreeSet<(String, String)> = Default::default();
    for (model, need) in gathered
        .needs_mib
        .iter()
        .filter(|(m, _)| demand.iter().any(|(d, _)| d == *m))
    {
        let small: Vec<&crate::mig::profile::MigProfile> = table
            .profiles
            .iter()
            .filter(|p| p.memory_gib * 1024.0 < *need)
            .collect();
        if !small.is_empty() {
            notes.push(format!(
                "{model} needs {need:.0} MiB (its weights, workspace and the KV cache of one request of its mean lengths): not placed on {}",
                small
                    .iter()
                    .map(|p| format!("{} ({:.0} MiB)", p.name, p.memory_gib * 1024.0))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        too_small.extend(small.iter().map(|p| (model.clone(), p.name.clone())));
    }
    let known: Vec<&str> = table.profiles.iter().map(|p| p.name.as_str()).collect();
    let mut usable: BTreeMap<(String, String), f64> = BTreeMap::new();
    let mut used: Vec<&Capacity> = Vec::new();
    let mut foreign = std::collections::BTreeSet::new();
    for c in &gathered.capacities {
        if !demand.iter().any(|(m, _)| *m == c.model) {
            continue;
        }
        if c.profile != FULL && !known.contains(&c.profile.as_str()) {
            foreign.insert(c.profile.clone());
            continue;
        }
        if c.qps > 0.0 && !too_small.contains(&(c.model.clone(), c.profile.clone())) {
            usable.insert((c.model.clone(), c.profile.clone()), c.qps * headroom);
        }
        used.push(c);
    }
    if !foreign.is_empty() {
        notes.push(format!(
            "ignored capacities for profiles the {} does not have: {} (measured on another GPU?)",
            table.product,
            foreign.into_iter().collect::<Vec<_>>().join(", ")
        ));
    }
    if let Some(other) = used
        .iter()
        .filter_map(|c| c.gpu.as_deref())
        .find(|g| *g != table.product)
    {
        notes.push(format!("capacities were measured on a {other}, the plan is for the {}: the same profile names may not mean the same speed", table.product));
    }
    for (m, _) in demand {
        if usable.keys().any(|(um, _)| um == m) {
            continue;
        }
        let mine: Vec<&Capacity> = gathered.capacities.iter().filter(|c| c.model == *m).collect();
        if mine.is_empty() {
            let have: std::collections::BTreeSet<&str> = gathered.capacities.iter().map(|c| c.model.as_str()).collect();
            // What the sources found instead (other objectives, other GPUs) says where to look.
            let found = match gathered.notes.is_empty() {
                true => String::new(),
                false => format!(" ({})", gathered.notes.join("; ")),
            };
            bail!(
                "no capacity for {m}: the capacities given are for {}{found}",
                if have.is_empty() {
                    "no model".to_string()
                } else {
                    have.into_iter().collect::<Vec<_>>().join(", ")
                }
            );
        }
        let (here, elsewhere): (Vec<&&Capacity>, Vec<&&Capacity>) = mine
            .iter()
            .partition(|c| c.profile == FULL || known.contains(&c.profile.as_str()));
        let mut why = Vec::new();
        if !elsewhere.is_empty() {
            why.push(format!(
                "its capacities on {} are for no profile of this GPU (its profiles: {}, and {FULL} for a whole GPU with MIG off)",
                elsewhere
                    .iter()
                    .map(|c| c.profile.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                known.join(", ")
            ));
        }
        if !here.is_empty() {
            why.push(format!(
                "on {} no rate met the objective (capacity 0)",
                here.iter().map(|c| c.profile.as_str()).collect::<Vec<_>>().join(", ")
            ));
        }
        bail!(
            "no usable capacity for {m} on the {}: {}",
            table.product,
            why.join("; ")
        );
    }
    let unserved: Vec<&str> = known
        .iter()
        .copied()
        .filter(|p| !usable.keys().any(|(_, up)| up == p))
        .collect();
    if !unserved.is_empty() {
        notes.push(format!(
            "no capacity on {}: instances of them serve nothing in these plans",
            unserved.join(", ")
        ));
    }
    let mut layouts: Vec<Layout> = crate::mig::plan::maximal_layouts(table)
        .into_iter()
        .map(|profiles| Layout { profiles })
        .collect();
    if usable.keys().any(|(_, p)| p == FULL) {
        layouts.push(Layout {
            profiles: vec![FULL.to_string()],
        });
    }
    let problem = Problem {
        layouts,
        demand: demand.to_vec(),
        usable,
    };
    let fleet = solve::solve(&problem)?;
    let emulated = used.iter().any(|c| c.source.emulated());
    if emulated {
        let partitioned = used
            .iter()
            .any(|c| matches!(c.source, source::Source::Measured { partitioned: true, .. }));
        notes.push(if partitioned {
            "some capacities come from MPS-emulated slices: memory-partitioned ones (mps-mem:) are the lower bound of the real slice (its share of the bandwidth, less than its L2), those alone (mps:) the upper bound; confirm on real MIG before buying"
                .into()
        } else {
            "some capacities come from MPS-emulated slices: MPS caps SMs and memory but shares L2 and memory bandwidth, so small slices look faster than real MIG slices; confirm on real MIG before buying"
                .into()
        });
    }
    if used
        .iter()
        .any(|c| matches!(c.source, source::Source::ClosedLoop { .. }))
    {
        notes.push(
            "some capacities are closed-loop estimates, not measured under load: plan with them only as a first guess"
                .into(),
        );
    }
    Ok(Report {
        gpu: table.gpu.clone(),
        slo_p99_ms: objectives.p99_ms,
        slo_ttft_p99_ms: objectives.serving.map(|s| s.ttft_p99_ms),
        slo_tpot_p99_ms: objectives.serving.map(|s| s.tpot_p99_ms),
        headroom,
        gpus: fleet.gpus,
        layouts: fleet
            .layouts
            .iter()
            .map(|(l, n)| LayoutCount {
                profiles: l.profiles.clone(),
                mig_enabled: l.mig_enabled(),
                count: *n,
            })
            .collect(),
        instances: fleet
            .instances
            .iter()
            .map(|(m, p, n)| InstanceCount {
                model: m.clone(),
                profile: p.clone(),
                count: *n,
            })
            .collect(),
        unused_instances: fleet.unused,
        spare: spare_lines(&fleet, &problem),
        capacities: used
            .iter()
            .map(|c| CapacityLine {
                model: c.model.clone(),
                profile: c.profile.clone(),
                qps: c.qps,
                usable_qps: c.qps * headroom,
                source: c.source.describe(),
                emulated: c.source.emulated(),
                lengths: c.lengths.clone(),
            })
            .collect(),
        emulated,
        whole_gpu_per_model: whole_gpu(table, &problem)?,
        one_profile_per_model: one_profile(table, &problem)?,
        notes,
    })
}

fn spare_lines(fleet: &FleetPlan, problem: &Problem) -> Vec<Spare> {
    fleet
        .spare(problem)
        .into_iter()
        .zip(&problem.demand)
        .map(|((model, spare), (_, d))| Spare {
            model,
            demand_qps: *d,
            serves_qps: d + spare,
            spare_qps: spare,
        })
        .collect()
}

/// Each model on whole GPUs of its own: MIG off where its whole-GPU capacity is known, else one
/// instance per GPU of the profile spanning the GPU (7g); a model with neither cannot be planned so.
fn whole_gpu(table: &ProfileTable, problem: &Problem) -> Result<HandPlan> {
    let mut models = Vec::new();
    let mut unknown = Vec::new();
    // Without MIG's capacity of a whole GPU, the profile that takes all of it stands in for it (7g
    // on an H100); a smaller one alone on a GPU is no whole GPU.
    let whole = table.profiles.iter().map(|p| p.compute_slices).max().unwrap_or(0);
    for (m, d) in &problem.demand {
        let usable = |p: &str| problem.usable.get(&(m.clone(), p.to_string())).copied();
        if !problem.usable.keys().any(|(um, _)| um == m) {
            bail!("no capacity for {m}");
        }
        let largest = table
            .profiles
            .iter()
            .filter(|p| p.compute_slices == whole && usable(&p.name).is_some())
            .max_by_key(|p| p.memory_slices);
        let (profile, cap) = match (usable(FULL), largest) {
            (Some(c), _) => (FULL.to_string(), c),
            (None, Some(p)) => (p.name.clone(), usable(&p.name).expect("filtered")),
            (None, None) => {
                unknown.push(m.clone());
                continue;
            }
        };
        let instances = (d / cap).ceil() as u32;
        models.push(HandModel {
            model: m.clone(),
            profile,
            instances,
            gpus: instances,
        });
    }
    Ok(HandPlan::of(models, unknown))
}

/// Each model on GPUs of its own, all cut into as many instances of one profile as fit: the best
/// profile per model.
fn one_profile(table: &ProfileTable, problem: &Problem) -> Result<HandPlan> {
    let mut models = Vec::new();
    for (m, d) in &problem.demand {
        // The best so far and its instance slots left empty.
        let mut best: Option<(HandModel, u32)> = None;
        for ((um, p), cap) in &problem.usable {
            if um != m {
                continue;
            }
            let per_gpu = if p == FULL { 1 } else { homogeneous_count(table, p) };
            if per_gpu == 0 {
                continue;
            }
            let instances = (d / cap).ceil() as u32;
            let gpus = instances.div_ceil(per_gpu);
            let empty = gpus * per_gpu - instances;
            if best
                .as_ref()
                .is_none_or(|(b, b_empty)| (gpus, empty) < (b.gpus, *b_empty))
            {
                best = Some((
                    HandModel {
                        model: m.clone(),
                        profile: p.clone(),
                        instances,
                        gpus,
                    },
                    empty,
                ));
            }
        }
        models.push(
            best.map(|(b, _)| b)
                .ok_or_else(|| anyhow::anyhow!("no capacity for {m}"))?,
        );
    }
    Ok(HandPlan::of(models, Vec::new()))
}

/// How many instances of `profile` alone fit one GPU.
fn homogeneous_count(table: &ProfileTable, profile: &str) -> u32 {
    let mut n = 0;
    while crate::mig::plan::plan(table, &vec![profile; n as usize + 1]).is_ok() {
        n += 1;
    }
    n
}

impl Report {
    /// The objectives the plan's capacities were measured within.
    pub fn objectives(&self) -> Objectives {
        Objectives {
            p99_ms: self.slo_p99_ms,
            serving: self
                .slo_ttft_p99_ms
                .zip(self.slo_tpot_p99_ms)
                .map(|(ttft_p99_ms, tpot_p99_ms)| source::ServingSlo {
                    ttft_p99_ms,
                    tpot_p99_ms,
                }),
        }
    }

    pub fn to_text(&self) -> String {
        use std::fmt::Write as _;
        let mut o = String::new();
        let _ = writeln!(
            o,
            "Capacities within {} (planned at {:.0}% of each):",
            self.objectives().describe(),
            self.headroom * 100.0
        );
        for c in &self.capacities {
            let lengths = c.lengths.as_ref().map(|l| format!("; {l}")).unwrap_or_default();
            let _ = writeln!(
                o,
                "  {:<12} {:<12} {:>10.1} requests/s  ({}{lengths})",
                c.model, c.profile, c.qps, c.source
            );
        }
        let _ = writeln!(
            o,
            "\nPlan: {} GPU(s) ({}), solved exactly as an integer program",
            self.gpus, self.gpu
        );
        for l in &self.layouts {
            let layout = Layout {
                profiles: l.profiles.clone(),
            };
            let _ = writeln!(o, "  {} × {}", l.count, layout.describe());
        }
        let _ = writeln!(o, "Instances:");
        for i in &self.instances {
            let _ = writeln!(o, "  {:<12} {:<12} × {}", i.model, i.profile, i.count);
        }
        if self.unused_instances > 0 {
            let _ = writeln!(o, "  {} instance(s) serve nothing", self.unused_instances);
        }
        let _ = writeln!(o, "Spare capacity:");
        for s in &self.spare {
            let _ = writeln!(
                o,
                "  {:<12} demand {:>10.1}, serves {:>10.1} requests/s (+{:.1})",
                s.model, s.demand_qps, s.serves_qps, s.spare_qps
            );
        }
        self.by_hand(&mut o);
        for n in &self.notes {
            let _ = writeln!(o, "note: {n}");
        }
        o
    }

    /// The plans made by hand beside this one, and what this one saves.
    fn by_hand(&self, o: &mut String) {
        use std::fmt::Write as _;
        let _ = writeln!(o, "\nBy hand, for comparison:");
        for (name, hand) in [
            ("a whole GPU per model", &self.whole_gpu_per_model),
            ("one profile per model", &self.one_profile_per_model),
        ] {
            let detail: Vec<String> = hand
                .models
                .iter()
                .map(|m| {
                    format!(
                        "{}: {} instance(s) of {} on {} GPU(s)",
                        m.model,
                        m.instances,
                        if m.profile == FULL { "a whole GPU" } else { &m.profile },
                        m.gpus
                    )
                })
                .collect();
            let detail = if hand.gpus.is_some() {
                format!(" ({})", detail.join("; "))
            } else {
                String::new()
            };
            let _ = writeln!(o, "  {name}: {}{detail}", hand.describe_gpus());
        }
        let best_hand = [&self.whole_gpu_per_model, &self.one_profile_per_model]
            .into_iter()
            .filter_map(|h| h.gpus)
            .min()
            .unwrap_or(0);
        if best_hand > self.gpus {
            let _ = writeln!(
                o,
                "  the plan saves {} GPU(s) ({:.0}%)",
                best_hand - self.gpus,
                100.0 * (best_hand - self.gpus) as f64 / best_hand as f64
            );
        }
    }

    /// The plan's layouts as a mig-parted file, one named config per distinct layout.
    pub fn mig_parted(&self) -> crate::mig::config::MigPartedFile {
        use crate::mig::config::{DeviceConfig, Devices, MigPartedFile};
        let mut configs = BTreeMap::new();
        for (i, l) in self.layouts.iter().enumerate() {
            let mut devices = BTreeMap::new();
            if l.mig_enabled {
                for p in &l.profiles {
                    *devices.entry(p.clone()).or_insert(0u32) += 1;
                }
            }
            let entry = DeviceConfig {
                devices: Devices::Word("all".into()),
                device_filter: None,
                mig_enabled: l.mig_enabled,
                mig_devices: devices,
            };
            configs.insert(format!("migprof-plan-{}", i + 1), vec![entry]);
        }
        MigPartedFile {
            version: "v1".into(),
            mig_configs: configs,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use source::Source;

    fn measured(model: &str, profile: &str, qps: f64, emulated: bool) -> Capacity {
        Capacity {
            model: model.into(),
            profile: profile.into(),
            qps,
            source: Source::Measured {
                emulated,
                partitioned: false,
            },
            gpu: None,
            lengths: None,
        }
    }

    #[test]
    fn a_language_model_and_an_encoder_are_planned_together_and_small_profiles_left_out() -> Result<()> {
        let table = crate::mig::profile::table("h100-80gb")?;
        let gathered = Gathered {
            capacities: vec![
                // A capacity given where the model cannot fit is not planned with.
                measured("llama_3_1_8b", "1g.10gb", 5.0, true),
                measured("llama_3_1_8b", "3g.40gb", 12.0, true),
                measured("llama_3_1_8b", "7g.80gb", 30.0, true),
                measured("bert_base", "1g.10gb", 300.0, true),
                measured("bert_base", "3g.40gb", 1000.0, true),
            ],
            notes: Vec::new(),
            needs_mib: [("llama_3_1_8b".to_string(), 16_000.0)].into(),
        };
        let objectives = Objectives {
            p99_ms: Some(50.0),
            serving: Some(source::ServingSlo {
                ttft_p99_ms: 500.0,
                tpot_p99_ms: 50.0,
            }),
        };
        let demand = [("llama_3_1_8b".to_string(), 20.0), ("bert_base".to_string(), 500.0)];
        let r = plan(&table, &gathered, &demand, objectives, 0.8)?;
        // One integer program for both: every model's demand served, on one fleet.
        for s in &r.spare {
            assert!(s.serves_qps >= s.demand_qps, "{s:?}");
        }
        assert!(r.instances.iter().any(|i| i.model == "llama_3_1_8b"));
        assert!(!r
            .instances
            .iter()
            .any(|i| i.model == "llama_3_1_8b" && i.profile == "1g.10gb"));
        assert!(r.instances.iter().any(|i| i.model == "bert_base"));
        let note = r
            .notes
            .iter()
            .find(|n| n.contains("llama_3_1_8b needs 16000 MiB"))
            .expect("the note");
        assert!(note.contains("1g.10gb") && !note.contains("3g.40gb"), "{note}");
        assert_eq!(
            (r.slo_p99_ms, r.slo_ttft_p99_ms, r.slo_tpot_p99_ms),
            (Some(50.0), Some(500.0), Some(50.0))
        );
        assert!(r
            .to_text()
            .contains("p99 50 ms; language models TTFT p99 500 ms and TPOT p99 50 ms"));
        // A plan kept before language models had objectives reads as it was.
        let json = serde_json::to_string(&r)?.replace(",\"slo_ttft_p99_ms\":500.0,\"slo_tpot_p99_ms\":50.0", "");
        let old: Report = serde_json::from_str(&json)?;
        assert_eq!((old.slo_p99_ms, old.slo_ttft_p99_ms), (Some(50.0), None));
        Ok(())
    }

    #[test]
    fn without_a_whole_gpus_capacity_the_whole_gpu_hand_plan_says_it_is_unknown() -> Result<()> {
        let table = crate::mig::profile::table("h100-80gb")?;
        let gathered = Gathered {
            capacities: vec![
                measured("bert_base", "1g.10gb", 300.0, true),
                measured("bert_base", "3g.40gb", 1000.0, true),
            ],
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let demand = vec![("bert_base".to_string(), 3000.0)];
        let r = plan(&table, &gathered, &demand, Objectives::p99(50.0), 0.8)?;
        // A 3g alone on a GPU is no whole GPU: the hand plan of whole GPUs cannot be made.
        assert_eq!(r.whole_gpu_per_model.unknown, ["bert_base"]);
        assert_eq!(r.whole_gpu_per_model.gpus, None);
        let text = r.to_text();
        assert!(
            text.contains("a whole GPU per model: cannot be made (no capacity of a whole GPU or of the profile spanning it for bert_base)"),
            "{text}"
        );
        assert!(text.contains("one profile per model: 2 GPU(s)"), "{text}");
        // A plan kept before reads its hand plans' counts.
        let json = serde_json::to_string(&r)?;
        let back: Report = serde_json::from_str(&json)?;
        assert_eq!(back.one_profile_per_model.gpus, Some(2));
        // With 7g measured, it stands in for the whole GPU.
        let mut with_7g = gathered;
        with_7g.capacities.push(measured("bert_base", "7g.80gb", 2400.0, true));
        let r = plan(&table, &with_7g, &demand, Objectives::p99(50.0), 0.8)?;
        assert_eq!(r.whole_gpu_per_model.gpus, Some(2));
        assert_eq!(r.whole_gpu_per_model.models[0].profile, "7g.80gb");
        Ok(())
    }

    #[test]
    fn the_plan_beats_the_hand_plans_and_says_what_it_used() -> Result<()> {
        let table = crate::mig::profile::table("h100-80gb")?;
        // ResNet-50 scales sublinearly with the slice, BERT about linearly.
        let gathered = Gathered {
            capacities: vec![
                measured("resnet50", "1g.10gb", 900.0, true),
                measured("resnet50", "3g.40gb", 2200.0, true),
                measured("resnet50", "7g.80gb", 4000.0, true),
                measured("bert_base", "1g.10gb", 300.0, true),
                measured("bert_base", "3g.40gb", 1000.0, true),
                measured("bert_base", "7g.80gb", 2400.0, true),
                measured("vit_b_16", "1g.10gb", 10.0, true),
                measured("resnet50", "1g.18gb", 10.0, true),
            ],
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let demand = vec![("resnet50".to_string(), 20_000.0), ("bert_base".to_string(), 3000.0)];
        let r = plan(&table, &gathered, &demand, Objectives::p99(50.0), 0.8)?;
        // resnet50: 720 per 1g at 80%: 28 1g instances = 4 GPUs of 7; bert: 3000 / 1920 = 2 7g... the
        // integer program finds the fewest; the hand plans take more.
        assert!(
            r.gpus < r.whole_gpu_per_model.gpus.unwrap() && r.gpus <= r.one_profile_per_model.gpus.unwrap(),
            "{}",
            r.to_text()
        );
        assert!(r.emulated);
        assert!(r.notes.iter().any(|n| n.contains("MPS-emulated")));
        assert!(r.notes.iter().any(|n| n.contains("1g.18gb")), "{:?}", r.notes);
        assert!(r
            .notes
            .iter()
            .any(|n| n.contains("no capacity on") && n.contains("2g.20gb")));
        assert!(
            r.capacities.iter().all(|c| c.model != "vit_b_16"),
            "models without demand are left out"
        );
        for s in &r.spare {
            assert!(s.spare_qps >= 0.0);
        }
        let yaml = r.mig_parted().to_yaml()?;
        let back = crate::mig::config::MigPartedFile::parse(&yaml)?;
        assert_eq!(back.mig_configs.len(), r.layouts.len());
        let json = serde_json::to_value(&r)?;
        assert_eq!(json["gpus"], r.gpus);
        assert!(json["layouts"][0]["profiles"].is_array() && json["instances"][0]["model"].is_string());
        // One profile per model: resnet50 on 1g (28 instances / 7 = 4 GPUs), bert on 7g (2 GPUs).
        assert_eq!(r.one_profile_per_model.gpus, Some(6));
        assert_eq!(r.whole_gpu_per_model.gpus, Some(7 + 2));
        Ok(())
    }

    #[test]
    fn demands_name_the_valid_models_and_a_missing_capacity_says_which() {
        assert!(parse_demand("resnet50=20000").is_ok());
        assert_eq!(
            parse_demand("llama-8b=200"),
            Ok(("llama-8b".to_string(), 200.0)),
            "a user's model"
        );
        assert!(parse_demand("=1").unwrap_err().contains("names its model"));
        let none = Gathered {
            capacities: Vec::new(),
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let e = check_demand(&[("resnet49".into(), 1.0)], &none)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("unknown model `resnet49`") && e.contains("resnet50") && e.contains("(none)"),
            "{e}"
        );
        assert!(parse_demand("resnet50").unwrap_err().contains("model=requests/s"));
        assert!(parse_demand("resnet50=-3").unwrap_err().contains("from 0.001 to 10^12"));
        let table = crate::mig::profile::table("h100-80gb").unwrap();
        let gathered = Gathered {
            capacities: vec![measured("resnet50", "1g.10gb", 900.0, false)],
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let e = plan(
            &table,
            &gathered,
            &[("bert_base".into(), 10.0)],
            Objectives::p99(50.0),
            0.8,
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains("no capacity for bert_base") && e.contains("resnet50"), "{e}");
        let cpu = Gathered {
            capacities: vec![measured("resnet50", "cpu", 900.0, false)],
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let e = plan(&table, &cpu, &[("resnet50".into(), 10.0)], Objectives::p99(50.0), 0.8)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("capacities on cpu are for no profile of this GPU")
                && e.contains("3g.40gb")
                && e.contains("and full for a whole GPU with MIG off"),
            "{e}"
        );
        let zero = Gathered {
            capacities: vec![measured("resnet50", "1g.10gb", 0.0, false)],
            notes: Vec::new(),
            needs_mib: Default::default(),
        };
        let e = plan(&table, &zero, &[("resnet50".into(), 10.0)], Objectives::p99(50.0), 0.8)
            .unwrap_err()
            .to_string();
        assert!(e.contains("no rate met the objective"), "{e}");
    }
}
