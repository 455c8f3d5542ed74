//! The GPUs of a machine and the MIG devices carved out of them, as NVML reports them: the data model
//! behind `migprof devices`, device selection, and the identity recorded with every run.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use crate::mig::mode::{on_off, MigMode};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Topology {
    /// The NVIDIA driver's version, e.g. "580.159.04".
    pub driver_version: Option<String>,
    pub gpus: Vec<Gpu>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// NVML's index (nvidia-smi's order).
    pub index: u32,
    pub uuid: String,
    pub name: String,
    pub memory_mib: u64,
    /// Streaming multiprocessors, when NVML reports them.
    #[serde(default)]
    pub sm_count: Option<u32>,
    /// `None` when the GPU does not support MIG.
    pub mig_mode: Option<MigMode>,
    #[serde(default)]
    pub mig_devices: Vec<MigDevice>,
}

/// A MIG device: one compute instance of one GPU instance, the unit CUDA can run on.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MigDevice {
    pub uuid: String,
    pub gpu_instance_id: u32,
    pub compute_instance_id: u32,
    /// As nvidia-smi names it: `3g.40gb`, `1g.10gb+me`, or `1c.3g.40gb` for a compute instance smaller
    /// than its GPU instance.
    pub profile: String,
    pub sm_count: u32,
    pub memory_mib: u64,
}

impl Topology {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the topology {}", path.display()))?;
        serde_json::from_str(&text)
            .with_context(|| format!("{} is not a topology (migprof devices --json)", path.display()))
    }

    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("a topology serialises")
    }

    /// The tree `migprof devices` prints.
    pub fn tree(&self) -> String {
        let mut out = String::new();
        let driver = self.driver_version.as_deref().unwrap_or("unknown");
        let _ = writeln!(out, "NVIDIA driver {driver}, {} GPU(s)", self.gpus.len());
        for g in &self.gpus {
            let mig = match g.mig_mode {
                None => "MIG not supported".to_string(),
                Some(m) if m.current == m.pending => format!("MIG {}", on_off(m.current)),
                Some(m) => format!("MIG {} (pending {} after reset)", on_off(m.current), on_off(m.pending)),
            };
            let _ = writeln!(
                out,
                "GPU {}: {} ({}) {} MiB, {mig}",
                g.index, g.name, g.uuid, g.memory_mib
            );
            for (i, m) in g.mig_devices.iter().enumerate() {
                let branch = if i + 1 == g.mig_devices.len() {
                    "└─"
                } else {
                    "├─"
                };
                let _ = writeln!(
                    out,
                    "  {branch} MIG {:<12} GI {:>2} CI {:>2}  {:>3} SMs  {:>6} MiB  ({})",
                    m.profile, m.gpu_instance_id, m.compute_instance_id, m.sm_count, m.memory_mib, m.uuid
                );
            }
        }
        out
    }

    /// One line per device that can be chosen, for error messages.
    pub fn choices(&self) -> String {
        let mut lines = Vec::new();
        for g in &self.gpus {
            let usable = if g.mig_mode.is_some_and(|m| m.current) {
                " (MIG on: pick a MIG device)"
            } else {
                ""
            };
            lines.push(format!("  {}  {}  {}{usable}", g.index, g.uuid, g.name));
            for m in &g.mig_devices {
                lines.push(format!(
                    "  {}  MIG {} on GPU {} (GI {}, CI {})",
                    m.uuid, m.profile, g.index, m.gpu_instance_id, m.compute_instance_id
                ));
            }
        }
        if lines.is_empty() {
            "  (no GPUs)".to_string()
        } else {
            lines.join("\n")
        }
    }
}
