//! Published throughputs of real MIG slices (`data/mig/reference.json`): what the report draws beside
//! emulated slices so that a reader sees where real slices of another GPU landed. None was measured
//! here; each point carries its source and setting, and its share of SMs comes from the GPU's profile
//! table.

use anyhow::{bail, Context, Result};
use serde::Deserialize;

const REFERENCE: &str = include_str!("../../../data/mig/reference.json");

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    #[allow(dead_code)]
    about: String,
    points: Vec<Published>,
}

/// One point as the file writes it.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Published {
    /// A GPU of `mig::GPUS`.
    gpu: String,
    profile: String,
    /// `full` (the whole GPU) or a profile of the same GPU.
    baseline: String,
    /// The whole GPU's SMs, for a `full` baseline (no profile has them).
    baseline_sms: Option<u32>,
    model: String,
    mode: String,
    batch: Option<u32>,
    relative_throughput: f64,
    setting: String,
    source: String,
}

/// A published slice's throughput relative to its baseline, at its share of the baseline's SMs.
#[derive(Debug, Clone, PartialEq)]
pub struct ReferencePoint {
    /// The GPU's product name, e.g. `NVIDIA A100-SXM4-80GB`.
    pub product: String,
    pub profile: String,
    /// What the throughput is relative to: `the whole GPU` or a profile.
    pub baseline: String,
    pub model: String,
    pub mode: String,
    pub batch: Option<u32>,
    pub sm_share: f64,
    pub relative_throughput: f64,
    pub setting: String,
    pub source: String,
}

/// Every published point, with its share of SMs.
pub fn points() -> Result<Vec<ReferencePoint>> {
    let file: File = serde_json::from_str(REFERENCE).context("data/mig/reference.json")?;
    file.points
        .into_iter()
        .map(|p| {
            let table = crate::mig::table(&p.gpu)?;
            let sms = table.profile(&p.profile)?.sm_count;
            let (baseline, baseline_sms) = match (p.baseline.as_str(), p.baseline_sms) {
                ("full", Some(n)) => ("the whole GPU".to_string(), n),
                ("full", None) => bail!("{} {}: a `full` baseline needs baseline_sms", p.gpu, p.profile),
                (profile, _) => (profile.to_string(), table.profile(profile)?.sm_count),
            };
            Ok(ReferencePoint {
                product: table.product.clone(),
                profile: p.profile,
                baseline,
                model: p.model,
                mode: p.mode,
                batch: p.batch,
                sm_share: f64::from(sms) / f64::from(baseline_sms),
                relative_throughput: p.relative_throughput,
                setting: p.setting,
                source: p.source,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_point_reads_with_its_source_and_its_share_from_the_profile_table() -> Result<()> {
        let points = points()?;
        assert_eq!(points.len(), 3);
        // A100 80GB: a 1g.10gb slice has 14 of the GPU's 108 SMs, and of the 98 of a 7g.80gb.
        let share = |model: &str, baseline: &str| {
            points
                .iter()
                .find(|p| p.model == model && p.baseline == baseline)
                .map(|p| (p.sm_share, p.relative_throughput))
                .unwrap()
        };
        assert_eq!(share("resnet50", "the whole GPU"), (14.0 / 108.0, 0.133));
        assert_eq!(share("bert_large", "the whole GPU"), (14.0 / 108.0, 0.139));
        assert_eq!(share("resnet50", "7g.80gb"), (14.0 / 98.0, 0.172));
        for p in &points {
            assert!(
                p.product.contains("A100") && !p.source.is_empty() && !p.setting.is_empty(),
                "{p:?}"
            );
            assert!(workloads::lookup(&p.model).is_ok(), "{}: not a migprof model", p.model);
        }
        Ok(())
    }
}
