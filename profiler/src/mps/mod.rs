//! Slices emulated with NVIDIA's Multi-Process Service, for GPUs whose MIG is off or absent: a target
//! `mps:3g.40gb` runs as an MPS client holding the profile's share of the SMs and its memory as a
//! pinned limit, under migprof's own control daemon ([`daemon`]). What the client got is measured
//! (`gpu::reach`) and recorded beside the share asked for. MPS partitions neither the L2 cache nor
//! memory bandwidth, so an emulated small slice runs faster than the real one: rows, tables and
//! plots say `mps` wherever an emulated slice appears, and emulation is never mixed with MIG
//! silently.

pub mod calibration;
pub mod client;
pub mod daemon;
pub mod group;
pub mod neighbour;
pub mod partition;
pub mod processes;
pub mod share;

use std::fmt;

use anyhow::{bail, Result};

use crate::gpu::{Gpu, Selected, Topology};
use crate::mig::ProfileTable;
pub use share::{Share, ShareSpec};

/// Which bound of an emulated slice to plan with, and why: said by `compare`, the report and
/// `capacity` wherever both bounds appear.
pub const PLAN_WITH: &str = "An emulated slice is a range. Alone (mps:) it reaches all of the GPU's memory bandwidth and L2, more than a real slice owns: the upper bound. Memory-partitioned (mps-mem:) a neighbour on the other SMs takes the bandwidth the profile does not own, as far as it can (where it cannot, the rows say how far the client stayed above its share), and also evicts the L2 a real slice keeps to itself: the lower bound. The real slice lies between: plan with the memory-partitioned bound, since a plan from the upper bound under-provisions.";

/// Whether an emulated slice has the GPU's memory system to itself or a partitioned share of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum MemoryEmulation {
    /// `mps:`: the client alone on the GPU, reaching all of its L2 and bandwidth (the upper bound of
    /// the real slice).
    Alone,
    /// `mps-mem:`: beside the client, a streaming neighbour on the SMs it does not have holds its
    /// bandwidth to the profile's share ([`partition`]; the lower bound).
    Partitioned,
}

impl MemoryEmulation {
    /// As rows and `--memory-emulation` name them.
    pub fn as_str(self) -> &'static str {
        match self {
            MemoryEmulation::Alone => "alone",
            MemoryEmulation::Partitioned => "partitioned",
        }
    }

    /// The device prefix of the mode: `mps:` or `mps-mem:`.
    pub fn prefix(self) -> &'static str {
        match self {
            MemoryEmulation::Alone => "mps:",
            MemoryEmulation::Partitioned => "mps-mem:",
        }
    }
}

/// An MPS target as `--device` names it: `mps:<profile or percent>` (the client alone) or
/// `mps-mem:<profile or percent>` (its memory bandwidth partitioned), optionally `@<GPU>` (an index
/// or `GPU-<uuid>`; the first GPU otherwise).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MpsTarget {
    pub share: ShareSpec,
    pub gpu: Option<String>,
    pub memory: MemoryEmulation,
}

/// Whether a device string names an emulated slice (`mps:` or `mps-mem:`).
pub fn is_emulated(device: &str) -> bool {
    device.starts_with("mps:") || device.starts_with("mps-mem:")
}

impl MpsTarget {
    /// A device string that starts with `mps:` or `mps-mem:`; `None` for any other.
    pub fn parse_device(s: &str) -> Option<Result<MpsTarget>> {
        let (memory, rest) = if let Some(rest) = s.strip_prefix("mps-mem:") {
            (MemoryEmulation::Partitioned, rest)
        } else {
            (MemoryEmulation::Alone, s.strip_prefix("mps:")?)
        };
        // The share's errors name the `mps:` form; they name the one the user wrote.
        Some(
            MpsTarget::parse(rest)
                .map(|t| MpsTarget { memory, ..t })
                .map_err(|e| anyhow::anyhow!("{}", format!("{e:#}").replace("mps:", memory.prefix()))),
        )
    }

    /// What follows `mps:` (the client alone; [`parse_device`](Self::parse_device) reads the prefix).
    pub fn parse(rest: &str) -> Result<MpsTarget> {
        let (share, gpu) = match rest.split_once('@') {
            Some((s, g)) if !g.is_empty() => (s, Some(g.to_string())),
            Some(_) => bail!("`mps:{rest}`: name a GPU after `@` (an index or GPU-<uuid>)"),
            None => (rest, None),
        };
        if let Some(g) = &gpu {
            if g.parse::<u32>().is_err() && !g.starts_with("GPU-") {
                bail!("`mps:{rest}`: `{g}` is not a GPU index or GPU-<uuid>; an emulated slice runs on a whole GPU")
            }
        }
        Ok(MpsTarget {
            share: ShareSpec::parse(share)?,
            gpu,
            memory: MemoryEmulation::Alone,
        })
    }
}

impl fmt::Display for MpsTarget {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}{}", self.memory.prefix(), self.share)?;
        if let Some(g) = &self.gpu {
            write!(f, "@{g}")?;
        }
        Ok(())
    }
}

/// What a row records of an emulated slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Emulation {
    pub share: Share,
    /// SMs the client's kernels ran on, measured; `None` where it could not be measured.
    pub measured_sms: Option<u32>,
    /// Device memory the client could allocate under its limit, MiB (in 256 MiB steps).
    pub measured_memory_mib: Option<u64>,
    /// The memory-system neighbour and its calibration, for `mps-mem:`; `None` for `mps:`.
    pub partition: Option<partition::Partition>,
}

impl Emulation {
    pub fn memory(&self) -> MemoryEmulation {
        if self.partition.is_some() {
            MemoryEmulation::Partitioned
        } else {
            MemoryEmulation::Alone
        }
    }

    /// Why the client's measured reach does not match the profile, if it does not: fewer SMs than the
    /// profile, or more than one TPC (2 SMs) beyond it; more memory allocated than the limit.
    pub fn mismatch(&self) -> Option<String> {
        let mut why = Vec::new();
        let want = self.share.profile_sms;
        // A bare percentage has no profile to match: its measured SMs are simply what it got.
        if let Some(sms) = self
            .measured_sms
            .filter(|&s| self.share.profile.is_some() && (s < want || s > want + 2))
        {
            why.push(format!("ran on {sms} SMs (expected {want} to {})", want + 2));
        }
        if let (Some(got), Some(limit)) = (self.measured_memory_mib, self.share.memory_limit_mib) {
            if got > limit {
                why.push(format!("allocated {got} MiB past its {limit} MiB limit"));
            }
        }
        (!why.is_empty()).then(|| {
            format!(
                "the MPS client for {} {}: the emulation does not match the profile",
                self.share.describe(),
                why.join(" and ")
            )
        })
    }
}

/// The GPU and share of `target`: a whole GPU with MIG off (with MIG on, its slices are real: run on
/// them instead).
pub fn resolve(
    topology: &Topology,
    target: &MpsTarget,
    table: impl FnOnce(&Gpu) -> Result<ProfileTable>,
) -> Result<(Selected, Share)> {
    let id = target.gpu.as_deref().unwrap_or("first");
    let selected = crate::gpu::select(topology, id).map_err(|e| {
        if topology.gpus.iter().any(|g| g.mig_mode.is_some_and(|m| m.current)) {
            anyhow::anyhow!("`{target}`: MPS emulates slices on GPUs with MIG off; this GPU has MIG on, so run on its real MIG devices instead ({e:#})")
        } else {
            e
        }
    })?;
    let total = selected
        .gpu
        .sm_count
        .ok_or_else(|| anyhow::anyhow!("`{target}`: NVML reports no SM count for {}", selected.gpu.name))?;
    let share = Share::resolve(&target.share, total, &table(&selected.gpu)?)?;
    Ok((selected, share))
}

/// Starts migprof's MPS daemon for the GPU of `target`, once the target resolves: the GPU, the share
/// its clients get, the daemon. `run` and `sweep` both start theirs here.
pub fn start_daemon(target: &MpsTarget) -> Result<(Selected, Share, daemon::Daemon)> {
    let topology = crate::gpu::discover().map_err(|e| anyhow::anyhow!("`{target}`: {e:#}"))?;
    let (selected, share) = resolve(&topology, target, profile_table)?;
    let started = daemon::Daemon::start(
        &daemon::control_program()?,
        &daemon::base_dir(),
        &selected.gpu.uuid,
        &processes::Proc,
    )?;
    Ok((selected, share, started))
}

/// The MIG profile table of `gpu`: NVML's (it answers with MIG off too), else the checked-in table of
/// the same product.
pub fn profile_table(gpu: &Gpu) -> Result<ProfileTable> {
    match crate::gpu::nvml::profile_table(gpu.index) {
        Ok(t) => Ok(t),
        Err(live) => crate::mig::GPUS
            .iter()
            .filter_map(|(name, _)| crate::mig::table(name).ok())
            .find(|t| t.product == gpu.name)
            .ok_or_else(|| {
                anyhow::anyhow!(
                    "no MIG profile table for {} ({live:#}); use mps:<percent>% instead",
                    gpu.name
                )
            }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn h100(mig_on: bool) -> Topology {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/topologies/h100_3g_2g_1g_1g.json"
        ))
        .unwrap();
        let mut t: Topology = serde_json::from_str(&text).unwrap();
        if !mig_on {
            for g in &mut t.gpus {
                g.mig_mode = g.mig_mode.map(|_| crate::mig::mode::MigMode {
                    current: false,
                    pending: false,
                });
                g.mig_devices.clear();
            }
        }
        t
    }

    #[test]
    fn targets_parse_and_print_back() {
        for s in ["3g.40gb", "45%", "1g.10gb@1", "7g.80gb@GPU-ab12"] {
            assert_eq!(MpsTarget::parse(s).unwrap().to_string(), format!("mps:{s}"));
        }
        let mem = MpsTarget::parse_device("mps-mem:1g.10gb@1").unwrap().unwrap();
        assert_eq!(
            (mem.memory, mem.to_string().as_str()),
            (MemoryEmulation::Partitioned, "mps-mem:1g.10gb@1")
        );
        assert!(MpsTarget::parse_device("cuda").is_none());
        let e = MpsTarget::parse_device("mps-mem:lots")
            .unwrap()
            .unwrap_err()
            .to_string();
        assert!(e.contains("`mps-mem:lots`") && e.contains("after `mps-mem:`"), "{e}");
        for (bad, says) in [
            ("3g.40gb@", "name a GPU"),
            ("3g.40gb@MIG-1", "runs on a whole GPU"),
            ("lots", "after `mps:`"),
        ] {
            let e = MpsTarget::parse(bad).unwrap_err().to_string();
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn a_profile_resolves_on_a_recorded_gpu_with_mig_off_and_is_refused_with_mig_on() {
        let table = |_: &Gpu| crate::mig::table("h100-80gb");
        let target = MpsTarget::parse("3g.40gb").unwrap();
        let (sel, share) = resolve(&h100(false), &target, table).unwrap();
        assert!(sel.mig.is_none());
        assert_eq!((share.percent, share.profile_sms), (46, 60));
        let e = resolve(&h100(true), &target, table).unwrap_err().to_string();
        assert!(e.contains("MPS emulates slices on GPUs with MIG off"), "{e}");
    }

    #[test]
    fn the_measured_reach_is_checked_against_the_profile() {
        let share = Share {
            profile: Some("3g.40gb".into()),
            percent: 46,
            profile_sms: 60,
            memory_limit_mib: Some(40448),
            memory_fraction: 0.125,
        };
        let at = |sms| {
            Emulation {
                share: share.clone(),
                measured_sms: Some(sms),
                measured_memory_mib: None,
                partition: None,
            }
            .mismatch()
        };
        assert_eq!((at(60), at(62)), (None, None));
        assert_eq!(at(58).unwrap(), "the MPS client for 3g.40gb (46% of SMs) ran on 58 SMs (expected 60 to 62): the emulation does not match the profile");
        assert!(at(64).is_some());
        let memory = |mib| {
            Emulation {
                share: share.clone(),
                measured_sms: Some(60),
                measured_memory_mib: Some(mib),
                partition: None,
            }
            .mismatch()
        };
        assert_eq!(memory(40448 - 256), None);
        assert!(
            memory(41472)
                .unwrap()
                .contains("allocated 41472 MiB past its 40448 MiB limit"),
            "{:?}",
            memory(41472)
        );
        assert_eq!(
            Emulation {
                share: share.clone(),
                measured_sms: None,
                measured_memory_mib: None,
                partition: None,
            }
            .mismatch(),
            None
        );
        // mps:45% on an H100 ran on 58 SMs: MPS rounds its share down to whole TPCs; nothing to match.
        let bare = Share {
            profile: None,
            percent: 45,
            profile_sms: 60,
            memory_limit_mib: None,
            memory_fraction: 0.125,
        };
        assert_eq!(
            Emulation {
                share: bare,
                measured_sms: Some(58),
                measured_memory_mib: None,
                partition: None,
            }
            .mismatch(),
            None
        );
    }
}
