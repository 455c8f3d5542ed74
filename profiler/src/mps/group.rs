//! The memory system of a concurrent group of memory-partitioned slices (`mps-mem:` members of a
//! sweep's `[[groups]]`): one neighbour for the whole group, which the sweep starts before the
//! members and stops after them.
//!
//! A member cannot start its own neighbour as a lone client does: that neighbour would stream on the
//! SMs of the other members. So the sweep puts one neighbour on the SMs none of the members has
//! (100 % less the members' shares together) and sets it so that a probe holding all the members'
//! SMs reads their memory slices' share of the GPU's bandwidth together (1g + 2g of an H100: 3/8),
//! the probe being a second neighbour process asked only for its copy bandwidth. Among themselves
//! the members share that bandwidth as MPS clients do, not each its own fixed slice as on real MIG.
//!
//! The members find the setting in [`FILE`] in the group's folder, named to them in [`ENV`]: each
//! then measures its own bandwidth beside the neighbour (it cannot measure itself alone: the
//! neighbour already streams) and records the group's calibration. Unlike a lone client's, the
//! group's neighbour cannot keep off its members' SMs (they start after it): MPS holds it to the
//! share of the SMs they lack instead, which can overlap theirs.

use std::path::Path;

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

use super::calibration::{self, BandwidthProbe, Load, Outcome};
use super::partition::{Calibrations, Neighbours, Partition, PartitionNeighbour};

/// The group's neighbour and its calibration, in the group's folder.
pub const FILE: &str = "memory-neighbour.json";
/// Names [`FILE`] to a member.
pub const ENV: &str = "MIGPROF_GROUP_MEMORY_NEIGHBOUR";

/// What the group's calibration found, as the members read it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupPartition {
    /// The GPU's copy bandwidth with every SM, GB/s.
    pub gpu_bandwidth_gbps: f64,
    /// The members' shares of the SMs, together, per cent.
    pub members_percent: u32,
    /// The members' memory slices over the GPU's, together.
    pub members_fraction: f64,
    /// The probe on all the members' SMs: alone, and beside the neighbour once set, GB/s.
    pub alone_bandwidth_gbps: f64,
    pub bandwidth_gbps: f64,
    /// How hard the neighbour streams; `None` where the members hold every SM.
    pub blocks: Option<u32>,
    pub pause_ns: Option<u32>,
    pub outcome: Outcome,
    pub cached: bool,
    pub neighbour_pid: Option<u32>,
    /// The SMs the neighbour ran on.
    pub neighbour_sms: Option<u32>,
}

impl GroupPartition {
    /// The members' memory share together, GB/s.
    pub fn share_gbps(&self) -> f64 {
        self.members_fraction * self.gpu_bandwidth_gbps
    }

    pub fn load(&self) -> Option<Load> {
        Some(Load {
            blocks: self.blocks?,
            pause_ns: self.pause_ns.unwrap_or(0),
        })
    }

    pub fn write(&self, dir: &Path) -> Result<std::path::PathBuf> {
        let path = dir.join(FILE);
        crate::files::write_atomically(&path, serde_json::to_string_pretty(self)?.as_bytes())?;
        Ok(path)
    }

    pub fn read(path: &Path) -> Result<GroupPartition> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        serde_json::from_str(&text).with_context(|| format!("reading {}", path.display()))
    }

    /// A member's record: its own share and its own bandwidth beside the neighbour, with the
    /// group's neighbour. Its outcome is its own where it is off its share: `reached` within it, the
    /// group's where the group missed in the same direction, else `shared_in_group`. Its bandwidth
    /// alone and its compute probe are not known (the neighbour was streaming when it opened its
    /// device).
    pub fn member(
        &self,
        memory_fraction: f64,
        bandwidth_gbps: f64,
        shared_sms: Option<u32>,
        clocks: (Option<u32>, Option<u64>),
    ) -> Partition {
        let share_gbps = memory_fraction * self.gpu_bandwidth_gbps;
        let outcome = if calibration::within(bandwidth_gbps, share_gbps) {
            Outcome::Reached
        } else {
            match (self.outcome, bandwidth_gbps > share_gbps) {
                (Outcome::NeighbourTooWeak, true) | (Outcome::ClientBelowShare, false) => self.outcome,
                _ => Outcome::SharedInGroup,
            }
        };
        Partition {
            gpu_bandwidth_gbps: self.gpu_bandwidth_gbps,
            share_gbps,
            alone_bandwidth_gbps: None,
            bandwidth_gbps,
            load: self.load(),
            outcome,
            cached: self.cached,
            neighbour_sms: self.neighbour_sms,
            shared_sms,
            compute_slowdown_pct: None,
            sm_clock_mhz: clocks.0,
            throttle_reasons: clocks.1,
            neighbour_pid: self.neighbour_pid,
        }
    }
}

/// A started neighbour used only for its copy probe: the stand-in for the members' SMs.
struct Stand<'a, R: PartitionNeighbour>(&'a mut R);

impl<R: PartitionNeighbour> BandwidthProbe for Stand<'_, R> {
    fn bandwidth_gbps(&mut self) -> Result<f64> {
        super::partition::median_of_three(|| self.0.copy_gbps())
    }
}

/// Partitions the memory system for members holding `members` (each its share of the SMs, per
/// cent, and its memory fraction): the record the members read, and the neighbour, which must
/// stream until the last member has measured.
pub fn partition_group<N: Neighbours>(
    members: &[(u32, f64)],
    neighbours: &mut N,
    calibrations: &Calibrations,
    log: &mut dyn FnMut(String),
) -> Result<(GroupPartition, Option<N::Running>)> {
    let members_percent: u32 = members.iter().map(|m| m.0).sum();
    let members_fraction: f64 = members.iter().map(|m| m.1).sum::<f64>().min(1.0);
    let (own, gpu_bandwidth_gbps) = calibrations.cached(neighbours)?;
    let share_gbps = members_fraction * gpu_bandwidth_gbps;
    let mut stand_in = neighbours.start_confined(members_percent.min(100))?;
    let alone_bandwidth_gbps = Stand(&mut stand_in).bandwidth_gbps()?;
    let mut record = GroupPartition {
        gpu_bandwidth_gbps,
        members_percent,
        members_fraction,
        alone_bandwidth_gbps,
        bandwidth_gbps: alone_bandwidth_gbps,
        blocks: None,
        pause_ns: None,
        outcome: Outcome::NoSpareSms,
        cached: false,
        neighbour_pid: None,
        neighbour_sms: None,
    };
    if members_percent >= 100 {
        stand_in.stop()?;
        return Ok((record, None));
    }
    let mut neighbour = neighbours.start_confined(100 - members_percent)?;
    let setting = {
        let mut probe = Stand(&mut stand_in);
        let cached = match &own {
            Some(entry) => super::partition::still_holds(entry, &mut neighbour, &mut probe, share_gbps, log)?,
            None => None,
        };
        match cached {
            Some(s) => {
                record.cached = true;
                s
            }
            None => {
                let s = calibration::calibrate(&mut neighbour, &mut probe, share_gbps)?;
                super::partition::keep(calibrations, gpu_bandwidth_gbps, &s, log);
                s
            }
        }
    };
    log(format!(
        "the group's memory-system neighbour on {}% of the SMs: {}; its members' SMs read {:.0} GB/s of their {share_gbps:.0} GB/s share together ({})",
        100 - members_percent,
        setting.load,
        setting.bandwidth_gbps,
        setting.outcome.as_str()
    ));
    stand_in.stop()?;
    record.bandwidth_gbps = setting.bandwidth_gbps;
    record.blocks = Some(setting.load.blocks);
    record.pause_ns = Some(setting.load.pause_ns);
    record.outcome = setting.outcome;
    record.neighbour_sms = Some(neighbour.sms()?.len() as u32);
    record.neighbour_pid = neighbour.pid();
    Ok((record, Some(neighbour)))
}

/// Starts the neighbour of a group's memory-partitioned members `targets`, all on one GPU, under its
/// daemon at `pipe_dir`: this migprof (`exe`) again, calibrated against a stand-in for the members
/// and kept in the calibration cache under the group's members; the record is written to `dir`
/// ([`FILE`]) for the members to read. Returns the record's path and the neighbour (none where the
/// members hold every SM).
pub fn start_shared(
    targets: &[super::MpsTarget],
    exe: &Path,
    pipe_dir: &Path,
    dir: &Path,
    log: &mut dyn FnMut(String),
) -> Result<(std::path::PathBuf, Option<super::neighbour::NeighbourProcess>)> {
    let topology = crate::gpu::discover()?;
    let mut gpu = None;
    let mut members = Vec::new();
    let mut names = Vec::new();
    for t in targets {
        let (selected, share) = super::resolve(&topology, t, super::profile_table)?;
        if gpu
            .as_ref()
            .is_some_and(|g: &crate::gpu::Selected| g.gpu.uuid != selected.gpu.uuid)
        {
            anyhow::bail!("the memory-partitioned members of a group share one neighbour, so they must be on one GPU: `{t}` is not on the first member's")
        }
        members.push((share.percent, share.memory_fraction));
        names.push(share.profile.clone().unwrap_or_else(|| format!("{}%", share.percent)));
        gpu = Some(selected);
    }
    let selected = gpu.ok_or_else(|| anyhow::anyhow!("a memory-partitioned group needs a member"))?;
    let gpu_sms = selected
        .gpu
        .sm_count
        .ok_or_else(|| anyhow::anyhow!("NVML reports no SM count for {}", selected.gpu.name))?;
    let mut spawner = super::neighbour::Spawner {
        exe: exe.to_path_buf(),
        gpu_uuid: selected.gpu.uuid.clone(),
        gpu_sms,
        pipe_dir: pipe_dir.to_path_buf(),
    };
    let cache = calibration::Cache::default_location();
    let calibrations = Calibrations {
        cache: &cache,
        key: calibration::Key {
            gpu_uuid: selected.gpu.uuid.clone(),
            driver: topology.driver_version.clone().unwrap_or_default(),
            share: share_key(&names),
        },
        recalibrate: calibration::recalibrate_token(),
    };
    let (record, neighbour) = partition_group(&members, &mut spawner, &calibrations, log).map_err(|e| {
        anyhow::anyhow!(
            "partitioning the memory system of the group {}: {e:#}",
            names.join(" + ")
        )
    })?;
    if let Some(w) = record.outcome.warning(record.bandwidth_gbps, record.share_gbps()) {
        log(format!("warning: the group's {w}"));
    }
    Ok((record.write(dir)?, neighbour))
}

/// The calibration cache's name for a group's share: its members' profiles (or percentages) joined.
pub fn share_key(members: &[String]) -> String {
    let mut names = members.to_vec();
    names.sort();
    format!("group {}", names.join("+"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mps::calibration::{Cache, Key, Neighbour};
    use std::cell::RefCell;
    use std::collections::BTreeSet;
    use std::rc::Rc;

    /// One GPU: a process on `p` % of the SMs reads `min(p / 100 × 2,700, 2,700 × 0.9)` GB/s alone,
    /// less what the streaming neighbour takes (1,600 with 100 blocks or more, in proportion below).
    #[derive(Default)]
    struct Gpu {
        started: Vec<u32>,
        stopped: usize,
        load: Option<Load>,
    }

    struct Process {
        gpu: Rc<RefCell<Gpu>>,
        percent: u32,
    }

    impl Neighbour for Process {
        fn max_blocks(&self) -> u32 {
            8 * 132 * self.percent / 100
        }
        fn set_load(&mut self, load: Load) -> Result<()> {
            self.gpu.borrow_mut().load = Some(load);
            Ok(())
        }
    }

    impl PartitionNeighbour for Process {
        fn sms(&mut self) -> Result<BTreeSet<u32>> {
            Ok((0..132 * self.percent / 100).collect())
        }
        fn pid(&self) -> Option<u32> {
            Some(900 + self.percent)
        }
        fn copy_gbps(&mut self) -> Result<f64> {
            let alone = (f64::from(self.percent) / 100.0 * 2700.0 * 2.0).min(2700.0 * 0.9);
            let take = self
                .gpu
                .borrow()
                .load
                .map_or(0.0, |l| 1600.0 * f64::from(l.blocks.min(100)) / 100.0);
            Ok(alone - take)
        }
        fn stop(self) -> Result<()> {
            self.gpu.borrow_mut().stopped += 1;
            Ok(())
        }
        fn avoid(&mut self, _: &BTreeSet<u32>) -> Result<()> {
            unreachable!("a group's neighbour cannot know its members' SMs before they start")
        }
        fn busy_sms(&mut self) -> Result<BTreeSet<u32>> {
            unreachable!("a group's neighbour cannot know its members' SMs before they start")
        }
    }

    struct Starter(Rc<RefCell<Gpu>>);

    impl Neighbours for Starter {
        type Running = Process;
        fn start(&mut self) -> Result<Process> {
            unreachable!("a group's processes are held to their shares by MPS")
        }
        fn start_confined(&mut self, percent: u32) -> Result<Process> {
            self.0.borrow_mut().started.push(percent);
            Ok(Process {
                gpu: self.0.clone(),
                percent,
            })
        }
        fn gpu_bandwidth_gbps(&mut self) -> Result<f64> {
            Ok(2700.0)
        }
    }

    fn calibrations(cache: &Cache) -> Calibrations<'_> {
        Calibrations {
            cache,
            key: Key {
                gpu_uuid: "GPU-1".into(),
                driver: "580.159.04".into(),
                share: share_key(&["2g.20gb".into(), "1g.10gb".into()]),
            },
            recalibrate: None,
        }
    }

    #[test]
    fn a_1g_and_a_2g_share_one_neighbour_set_to_their_three_eighths() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        let gpu = Rc::new(RefCell::new(Gpu::default()));
        let mut said = Vec::new();
        let (record, neighbour) = partition_group(
            &[(13, 0.125), (25, 0.25)],
            &mut Starter(gpu.clone()),
            &calibrations(&cache),
            &mut |s| said.push(s),
        )
        .unwrap();
        // The stand-in on the members' 38 %, then the neighbour on the other 62 %.
        assert_eq!(gpu.borrow().started, [38, 62]);
        assert_eq!(gpu.borrow().stopped, 1, "the stand-in stops; the neighbour streams on");
        assert_eq!(record.outcome, Outcome::Reached);
        assert!((record.share_gbps() - 1012.5).abs() < 1e-9);
        assert!(calibration::within(record.bandwidth_gbps, 1012.5), "{record:?}");
        assert_eq!((record.members_percent, record.neighbour_pid), (38, Some(962)));
        assert!(
            record.blocks.is_some() && said[0].contains("members' SMs read"),
            "{said:?}"
        );
        assert!(neighbour.is_some());
        // Kept under the group's own key, and written for the members.
        assert_eq!(
            cache.lookup(&calibrations(&cache).key, None).0.unwrap().blocks,
            record.blocks
        );
        let path = record.write(dir.path()).unwrap();
        assert_eq!(GroupPartition::read(&path).unwrap(), record);
        // A member's row: its own share and bandwidth, the group's neighbour, its own outcome.
        let member = record.member(0.125, 330.0, Some(0), (Some(1980), Some(0)));
        assert_eq!(member.outcome, Outcome::Reached);
        let above = record.member(0.125, 405.0, None, (None, None));
        assert_eq!(above.outcome, Outcome::SharedInGroup);
        assert!(
            above.warnings()[0].contains("405 GB/s against its share of 338 GB/s"),
            "{:?}",
            above.warnings()
        );
        assert!((member.share_gbps - 337.5).abs() < 1e-9);
        assert_eq!((member.alone_bandwidth_gbps, member.compute_slowdown_pct), (None, None));
        assert_eq!((member.load, member.neighbour_pid), (record.load(), Some(962)));
        // The next group of the same members takes the setting from the cache after a probe.
        let (again, _) = partition_group(
            &[(13, 0.125), (25, 0.25)],
            &mut Starter(Rc::new(RefCell::new(Gpu::default()))),
            &calibrations(&cache),
            &mut |_| {},
        )
        .unwrap();
        assert!(again.cached && again.blocks == record.blocks, "{again:?}");
    }

    #[test]
    fn members_holding_every_sm_have_no_neighbour() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        let gpu = Rc::new(RefCell::new(Gpu::default()));
        let (record, neighbour) = partition_group(
            &[(46, 0.5), (54, 0.5)],
            &mut Starter(gpu.clone()),
            &calibrations(&cache),
            &mut |_| {},
        )
        .unwrap();
        assert!(neighbour.is_none());
        assert_eq!((record.outcome, record.load()), (Outcome::NoSpareSms, None));
        assert_eq!((gpu.borrow().started.clone(), gpu.borrow().stopped), (vec![100], 1));
    }

    #[test]
    fn share_keys_do_not_depend_on_the_members_order() {
        assert_eq!(
            share_key(&["2g.20gb".into(), "1g.10gb".into()]),
            share_key(&["1g.10gb".into(), "2g.20gb".into()])
        );
        assert_eq!(
            share_key(&["1g.10gb".into(), "1g.10gb".into()]),
            "group 1g.10gb+1g.10gb"
        );
    }
}
