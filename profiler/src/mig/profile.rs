//! GPU-instance profiles of the GPUs migprof knows, from the tables checked in under data/mig/tables:
//! the H100 and H200 recorded with `nvidia-smi mig -lgip` / `-lgipp` on the lent GPUs, the A100s and
//! the A30 transcribed from published listings (no such GPU was lent). Each file names its source.

use anyhow::{anyhow, Context, Result};
use serde::Deserialize;

/// A GPU-instance profile: how much of the GPU one instance takes and where it may start.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct MigProfile {
    /// `3g.40gb`, `1g.10gb+me`.
    pub name: String,
    /// NVML's profile id (`nvidia-smi mig -cgi` takes it).
    pub id: u32,
    pub compute_slices: u32,
    /// The span of a placement, in memory slices.
    pub memory_slices: u32,
    pub memory_gib: f64,
    pub sm_count: u32,
    /// How many instances of this profile the GPU can hold at once.
    pub max_instances: u32,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
    /// Memory slices an instance may start at.
    pub placements: Vec<u32>,
}

#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ProfileTable {
    /// The name `--gpu` takes: `h100-80gb`.
    pub gpu: String,
    pub product: String,
    pub source: String,
    pub compute_slices: u32,
    pub memory_slices: u32,
    pub profiles: Vec<MigProfile>,
}

/// The checked-in tables, by `--gpu` name.
pub const GPUS: &[(&str, &str)] = &[
    ("a100-40gb", include_str!("../../../data/mig/tables/a100-40gb.json")),
    ("a100-80gb", include_str!("../../../data/mig/tables/a100-80gb.json")),
    ("a30-24gb", include_str!("../../../data/mig/tables/a30-24gb.json")),
    ("h100-80gb", include_str!("../../../data/mig/tables/h100-80gb.json")),
    ("h200-141gb", include_str!("../../../data/mig/tables/h200-141gb.json")),
];

/// The table of a known GPU, or an error naming the known ones.
pub fn table(gpu: &str) -> Result<ProfileTable> {
    let (_, json) = GPUS.iter().find(|(name, _)| *name == gpu).ok_or_else(|| {
        anyhow!(
            "no MIG profile table for `{gpu}`; known GPUs: {}",
            GPUS.iter().map(|(n, _)| *n).collect::<Vec<_>>().join(", ")
        )
    })?;
    serde_json::from_str(json).with_context(|| format!("the checked-in table of {gpu}"))
}

impl ProfileTable {
    pub fn profile(&self, name: &str) -> Result<&MigProfile> {
        self.profiles.iter().find(|p| p.name == name).ok_or_else(|| {
            let names: Vec<&str> = self.profiles.iter().map(|p| p.name.as_str()).collect();
            anyhow!(
                "`{name}` is not a MIG profile of the {}; its profiles: {}",
                self.product,
                names.join(", ")
            )
        })
    }

    /// The profile NVML calls `id` (what a GPU instance reports as its profile).
    pub fn by_id(&self, id: u32) -> Option<&MigProfile> {
        self.profiles.iter().find(|p| p.id == id)
    }

    /// The table as `nvidia-smi mig -lgip` shows it, with each profile's placements.
    pub fn render(&self) -> String {
        let mut out = format!(
            "{} ({}; {} compute slices, {} memory slices)\n",
            self.product, self.gpu, self.compute_slices, self.memory_slices
        );
        out += &format!(
            "{:<12} {:>3} {:>9} {:>8} {:>4} {:>3} {:>3} {:>3} {:>4} {:>3}  {}\n",
            "profile",
            "id",
            "instances",
            "GiB",
            "SMs",
            "CE",
            "DEC",
            "ENC",
            "JPEG",
            "OFA",
            "placements (start:size in memory slices)"
        );
        for p in &self.profiles {
            let starts: Vec<String> = p.placements.iter().map(|s| s.to_string()).collect();
            out += &format!(
                "{:<12} {:>3} {:>9} {:>8.2} {:>4} {:>3} {:>3} {:>3} {:>4} {:>3}  {{{}}}:{}\n",
                p.name,
                p.id,
                p.max_instances,
                p.memory_gib,
                p.sm_count,
                p.copy_engines,
                p.decoders,
                p.encoders,
                p.jpegs,
                p.ofas,
                starts.join(","),
                p.memory_slices
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_checked_in_table_parses_and_is_consistent() {
        for (gpu, _) in GPUS {
            let t = table(gpu).unwrap();
            assert_eq!(&t.gpu, gpu);
            for p in &t.profiles {
                assert!(
                    p.name.starts_with(&format!("{}g.", p.compute_slices)),
                    "{gpu} {}",
                    p.name
                );
                assert!(!p.placements.is_empty() && p.max_instances >= 1, "{gpu} {}", p.name);
                for s in &p.placements {
                    assert!(s + p.memory_slices <= t.memory_slices, "{gpu} {} starts at {s}", p.name);
                }
            }
        }
    }

    #[test]
    fn the_recorded_h100_table() {
        let t = table("h100-80gb").unwrap();
        let p = t.profile("3g.40gb").unwrap();
        assert_eq!(
            (p.id, p.sm_count, p.memory_slices, p.placements.clone(), p.max_instances),
            (9, 60, 4, vec![0, 4], 2)
        );
        assert_eq!(t.profile("7g.80gb").unwrap().sm_count, 132);
        let err = t.profile("3g.20gb").unwrap_err().to_string();
        assert!(err.contains("1g.10gb+me") && err.contains("7g.80gb"), "{err}");
        assert!(table("a100-41gb")
            .unwrap_err()
            .to_string()
            .contains("a100-40gb, a100-80gb, a30-24gb, h100-80gb, h200-141gb"));
    }

    #[test]
    fn the_transcribed_a100_and_a30_tables() {
        let a100 = table("a100-40gb").unwrap();
        let p = a100.profile("1g.10gb").unwrap();
        assert_eq!(
            (p.id, p.memory_slices, p.placements.clone(), p.max_instances),
            (15, 2, vec![0, 2, 4, 6], 4)
        );
        assert_eq!(a100.profile("7g.40gb").unwrap().sm_count, 98);
        assert_eq!(table("a100-80gb").unwrap().profile("3g.40gb").unwrap().id, 9);
        let a30 = table("a30-24gb").unwrap();
        assert_eq!((a30.compute_slices, a30.memory_slices), (4, 4));
        assert_eq!(a30.profile("2g.12gb+me").unwrap().placements, vec![0, 2]);
    }

    #[test]
    fn rendering_lists_every_profile_with_placements() {
        let text = table("h200-141gb").unwrap().render();
        assert!(
            text.lines()
                .any(|l| l.starts_with("1g.18gb ") && l.contains("{0,1,2,3,4,5,6}:1")),
            "{text}"
        );
        assert!(
            text.lines().any(|l| l.starts_with("7g.141gb") && l.contains("{0}:8")),
            "{text}"
        );
    }
}
