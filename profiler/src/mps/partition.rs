//! A memory-partitioned emulated slice (`mps-mem:`): what the client does, once its device is open,
//! to get its profile's share of the GPU's memory system rather than all of it, and what a row
//! records of it.
//!
//! 1. Alone, the client times a kernel bound by its SMs alone (the compute probe).
//! 2. The GPU's copy bandwidth with every SM is known from the cache, or measured by a neighbour
//!    started with all the SMs for the purpose. The share is the profile's memory slices over the
//!    GPU's (1g of an H100: 1/8) of it.
//! 3. A neighbour starts on the SMs the client does not have (100 % less the client's share) and is
//!    set so that the client's copy probe reads the share within ±10 %: the cached setting when it
//!    still holds, else a calibration ([`calibration`](super::calibration)).
//!    It keeps off the client's SMs: MPS on the lent machines cannot pin SMs, and each MPS client
//!    numbers the SMs its own way (`%smid` 0..15 in a 1g client are other ids in its neighbour), so
//!    the neighbour finds them as the SMs it cannot place blocks on while the client fills its own.
//! 4. While both run: the client's SMs found that way again and the SMs the neighbour streamed on
//!    (none may be both), the compute probe again (it must be within 3 % of alone, or the neighbour
//!    is taking the client's SMs), the clocks and throttle reasons.
//!
//! A target with every SM (7g) has nowhere to put a neighbour: partitioned equals alone, and the row
//! says so (`no_spare_sms`).

use std::collections::BTreeSet;

use anyhow::Result;

use super::calibration::{self, BandwidthProbe, Cache, Entry, Key, Load, Neighbour, Outcome};

/// The compute probe may slow by at most this share beside the neighbour.
pub const COMPUTE_TOLERANCE: f64 = 0.03;
/// How long each of a client's bandwidth readings beside a neighbour lasts, ms: many of the
/// neighbour's launches, each of which MPS places on the SMs anew.
pub const PROBE_WINDOW_MS: f64 = 40.0;

/// What a row records of a memory-partitioned slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Partition {
    /// The GPU's copy bandwidth with every SM, GB/s.
    pub gpu_bandwidth_gbps: f64,
    /// The bandwidth the slice should read: its memory fraction of the GPU's, GB/s.
    pub share_gbps: f64,
    /// The client's copy bandwidth alone, before the neighbour started, GB/s; `None` for a member
    /// of a group, whose neighbour was streaming before it started.
    pub alone_bandwidth_gbps: Option<f64>,
    /// The client's copy bandwidth beside the neighbour once everything else was measured, GB/s
    /// (alone where there is no neighbour).
    pub bandwidth_gbps: f64,
    /// How hard the neighbour streams; `None` without a neighbour.
    pub load: Option<Load>,
    pub outcome: Outcome,
    /// The setting came from the cache (and was checked by one probe).
    pub cached: bool,
    /// SMs the neighbour ran on, and how many of them the client filled (both in the neighbour's
    /// numbering of the SMs).
    pub neighbour_sms: Option<u32>,
    pub shared_sms: Option<u32>,
    /// How much slower the compute probe ran beside the neighbour than alone, per cent.
    pub compute_slowdown_pct: Option<f64>,
    /// The GPU's SM clock and throttle reasons while both ran.
    pub sm_clock_mhz: Option<u32>,
    pub throttle_reasons: Option<u64>,
    /// The neighbour's pid, expected on the GPU beside the client.
    pub neighbour_pid: Option<u32>,
}

impl Partition {
    /// What the user must know about this slice's partitioning; empty when it is as asked.
    pub fn warnings(&self) -> Vec<String> {
        let mut w: Vec<String> = self
            .outcome
            .warning(self.bandwidth_gbps, self.share_gbps)
            .into_iter()
            .collect();
        if let Some(pct) = self.compute_slowdown_pct.filter(|p| *p > COMPUTE_TOLERANCE * 100.0) {
            w.push(format!(
                "the client's compute-bound probe ran {pct:.1}% slower beside the memory-system neighbour (more than {:.0}%): the neighbour competes for the client's SMs{}",
                COMPUTE_TOLERANCE * 100.0,
                self.shared_sms
                    .filter(|&n| n > 0)
                    .map(|n| format!(" ({n} SMs ran both)"))
                    .unwrap_or_default()
            ));
        }
        w
    }
}

/// What the client measures of itself.
pub trait ClientProbe: BandwidthProbe {
    /// The time of a kernel bound by the SMs alone, ms.
    fn compute_ms(&mut self) -> Result<f64>;
    /// Runs `during` while a kernel of the client's fills every SM it has (every thread slot), and
    /// returns what `during` found.
    fn while_filling(&mut self, during: &mut dyn FnMut() -> Result<BTreeSet<u32>>) -> Result<BTreeSet<u32>>;
}

/// A neighbour as the partition needs it: settable, able to say where it ran and to probe the
/// bandwidth of its own SMs (a group's stand-in for its members is a neighbour asked only that).
pub trait PartitionNeighbour: Neighbour {
    /// The SMs its last launch streamed on, in its numbering.
    fn sms(&mut self) -> Result<BTreeSet<u32>>;
    /// The SMs it cannot place blocks on now (another process fills them), in its numbering.
    fn busy_sms(&mut self) -> Result<BTreeSet<u32>>;
    fn pid(&self) -> Option<u32>;
    /// A copy probe on its SMs, GB/s.
    fn copy_gbps(&mut self) -> Result<f64>;
    /// Keeps its streaming off `sms` (the client's).
    fn avoid(&mut self, sms: &BTreeSet<u32>) -> Result<()>;
    /// Stops it and waits for it to go.
    fn stop(self) -> Result<()>
    where
        Self: Sized;
}

/// Starts neighbours: with a share of the SMs for streaming, or with every SM to measure the GPU.
pub trait Neighbours {
    type Running: PartitionNeighbour;
    /// A neighbour whose blocks MPS may place on any SM: it keeps off the client's SMs itself
    /// ([`PartitionNeighbour::avoid`]).
    fn start(&mut self) -> Result<Self::Running>;
    /// A process held to `percent` of the SMs by MPS, as a client is.
    fn start_confined(&mut self, percent: u32) -> Result<Self::Running>;
    /// The GPU's copy bandwidth with every SM, GB/s.
    fn gpu_bandwidth_gbps(&mut self) -> Result<f64>;
}

/// Where the partition's setting is kept, and what identifies it.
pub struct Calibrations<'a> {
    pub cache: &'a Cache,
    pub key: Key,
    /// `--recalibrate`'s token, if asked.
    pub recalibrate: Option<String>,
}

impl Calibrations<'_> {
    /// The cached setting of this key that `--recalibrate` lets stand, if any, and the GPU's copy
    /// bandwidth: that entry's, else another share's on the same GPU and driver, else measured by a
    /// neighbour given every SM.
    pub fn cached<N: Neighbours>(&self, neighbours: &mut N) -> Result<(Option<Entry>, f64)> {
        let (own, known) = self.cache.lookup(&self.key, self.recalibrate.as_deref());
        let gpu_bandwidth_gbps = match known {
            Some(b) => b,
            None => neighbours.gpu_bandwidth_gbps()?,
        };
        Ok((own, gpu_bandwidth_gbps))
    }
}

/// Calibrates the neighbour afresh, says what it found and keeps it for the next client.
fn calibrate_anew(
    neighbour: &mut dyn calibration::Neighbour,
    probe: &mut dyn ClientProbe,
    share_gbps: f64,
    calibrations: &Calibrations,
    gpu_bandwidth_gbps: f64,
    log: &mut dyn FnMut(String),
) -> Result<calibration::Setting> {
    let s = calibration::calibrate(neighbour, probe, share_gbps)?;
    log(format!(
        "memory-system neighbour on the SMs the client lacks: {}, the client reads {:.0} GB/s of a {share_gbps:.0} GB/s share ({}, {} settings tried)",
        s.load,
        s.bandwidth_gbps,
        s.outcome.as_str(),
        s.tries
    ));
    keep(calibrations, gpu_bandwidth_gbps, &s, log);
    Ok(s)
}

/// The record of a client that holds every SM: no neighbour could run beside it.
fn no_spare_sms(
    gpu_bandwidth_gbps: f64,
    share_gbps: f64,
    alone_bandwidth_gbps: f64,
    sm_clock_mhz: Option<u32>,
    throttle_reasons: Option<u64>,
) -> Partition {
    Partition {
        gpu_bandwidth_gbps,
        share_gbps,
        alone_bandwidth_gbps: Some(alone_bandwidth_gbps),
        bandwidth_gbps: alone_bandwidth_gbps,
        load: None,
        outcome: Outcome::NoSpareSms,
        cached: false,
        neighbour_sms: None,
        shared_sms: None,
        compute_slowdown_pct: None,
        sm_clock_mhz,
        throttle_reasons,
        neighbour_pid: None,
    }
}

/// Partitions the memory system of a client holding `percent` of the SMs and `memory_fraction` of
/// the memory: returns the record and the neighbour, which must run as long as the client measures.
/// `clocks` reads the GPU's SM clock and throttle reasons.
pub fn partition<N: Neighbours>(
    percent: u32,
    memory_fraction: f64,
    probe: &mut dyn ClientProbe,
    neighbours: &mut N,
    calibrations: &Calibrations,
    clocks: &mut dyn FnMut() -> (Option<u32>, Option<u64>),
    log: &mut dyn FnMut(String),
) -> Result<(Partition, Option<N::Running>)> {
    let compute_alone = compute_ms(probe)?;
    let alone_bandwidth_gbps = probe.bandwidth_gbps()?;
    let (own, gpu_bandwidth_gbps) = calibrations.cached(neighbours)?;
    let share_gbps = memory_fraction * gpu_bandwidth_gbps;
    if percent >= 100 {
        let (sm_clock_mhz, throttle_reasons) = clocks();
        return Ok((
            no_spare_sms(
                gpu_bandwidth_gbps,
                share_gbps,
                alone_bandwidth_gbps,
                sm_clock_mhz,
                throttle_reasons,
            ),
            None,
        ));
    }
    let mut neighbour = neighbours.start()?;
    // MPS places either process's blocks on any SM; the neighbour's blocks that land on the
    // client's SMs end at once, so that the client finds them free.
    let client_sms = probe.while_filling(&mut || neighbour.busy_sms())?;
    neighbour.avoid(&client_sms)?;
    let mut setting = match &own {
        Some(entry) => still_holds(entry, &mut neighbour, probe, share_gbps, log)?,
        None => None,
    };
    let cached = setting.is_some();
    // A setting read once can drift by the time the run starts: it is read again after the other
    // probes, and calibrated once more when it no longer holds.
    for attempt in 0..2 {
        let s = match setting {
            Some(s) => s,
            None => calibrate_anew(&mut neighbour, probe, share_gbps, calibrations, gpu_bandwidth_gbps, log)?,
        };
        // While both run: where each computes, and whether the client still has its SMs to itself.
        let neighbour_sms = neighbour.sms()?;
        let client_sms = probe.while_filling(&mut || neighbour.busy_sms())?;
        let compute_beside = compute_ms(probe)?;
        let bandwidth_gbps = probe.bandwidth_gbps()?;
        let drifted = s.outcome == Outcome::Reached && !calibration::within(bandwidth_gbps, share_gbps);
        if drifted && attempt == 0 {
            log(format!(
                "the client read {bandwidth_gbps:.0} GB/s after the setting was found ({:.0} GB/s then, share {share_gbps:.0}); calibrating again",
                s.bandwidth_gbps
            ));
            setting = None;
            continue;
        }
        let (sm_clock_mhz, throttle_reasons) = clocks();
        let partition = Partition {
            gpu_bandwidth_gbps,
            share_gbps,
            alone_bandwidth_gbps: Some(alone_bandwidth_gbps),
            bandwidth_gbps,
            load: Some(s.load),
            outcome: if drifted { Outcome::NotConverged } else { s.outcome },
            cached: cached && attempt == 0,
            neighbour_sms: Some(neighbour_sms.len() as u32),
            shared_sms: Some(client_sms.intersection(&neighbour_sms).count() as u32),
            compute_slowdown_pct: Some((compute_beside / compute_alone - 1.0) * 100.0),
            sm_clock_mhz,
            throttle_reasons,
            neighbour_pid: neighbour.pid(),
        };
        return Ok((partition, Some(neighbour)));
    }
    unreachable!("the second attempt returns")
}

/// The median of three compute probes: one alone and one beside the neighbour are compared, and a
/// single launch set varies by more than the 3 % that matters.
fn compute_ms(probe: &mut dyn ClientProbe) -> Result<f64> {
    median_of_three(|| probe.compute_ms())
}

/// The median of three readings: beside a neighbour whose blocks MPS places anew at each of its
/// launches, one reading varies more than alone.
pub fn median_of_three(mut read: impl FnMut() -> Result<f64>) -> Result<f64> {
    let mut reads = [read()?, read()?, read()?];
    reads.sort_by(f64::total_cmp);
    Ok(reads[1])
}

/// The cached setting, checked by one probe: it stands when it still gives what it gave (within the
/// band, or on the same side of it when the share was out of reach); `None` when it does not.
pub(super) fn still_holds(
    entry: &Entry,
    neighbour: &mut dyn Neighbour,
    probe: &mut dyn BandwidthProbe,
    share_gbps: f64,
    log: &mut dyn FnMut(String),
) -> Result<Option<calibration::Setting>> {
    let load = entry.load(neighbour.max_blocks());
    neighbour.set_load(load)?;
    let got = probe.bandwidth_gbps()?;
    let band = (
        share_gbps * (1.0 - calibration::TOLERANCE),
        share_gbps * (1.0 + calibration::TOLERANCE),
    );
    let holds = match entry.outcome {
        Outcome::Reached | Outcome::NotConverged => calibration::within(got, share_gbps),
        Outcome::NeighbourTooWeak => got > band.1,
        Outcome::ClientBelowShare => got < band.0,
        Outcome::NoSpareSms | Outcome::SharedInGroup => false,
    };
    if !holds {
        log(format!(
            "the cached memory-system setting ({load}) gave {got:.0} GB/s against a share of {share_gbps:.0} GB/s; calibrating again"
        ));
        return Ok(None);
    }
    Ok(Some(calibration::Setting {
        load,
        bandwidth_gbps: got,
        outcome: if entry.outcome == Outcome::NotConverged {
            Outcome::Reached
        } else {
            entry.outcome
        },
        tries: 1,
    }))
}

/// Keeps a calibration in the cache; a cache that cannot be written is said, never fatal.
pub(super) fn keep(
    calibrations: &Calibrations,
    gpu_bandwidth_gbps: f64,
    s: &calibration::Setting,
    log: &mut dyn FnMut(String),
) {
    let cache = calibrations.cache;
    if let Err(e) = cache.put(Entry {
        key: calibrations.key.clone(),
        gpu_bandwidth_gbps,
        blocks: Some(s.load.blocks),
        pause_ns: s.load.pause_ns,
        outcome: s.outcome,
        bandwidth_gbps: s.bandwidth_gbps,
        calibrated_at: crate::provenance::now().to_rfc3339(),
        token: calibrations.recalibrate.clone(),
    }) {
        log(format!(
            "could not keep the calibration in {}: {e:#}",
            cache.path().display()
        ));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;
    use std::rc::Rc;

    /// One GPU shared by the fake client and neighbours: the client reads `alone` less what a
    /// streaming neighbour of 696 blocks takes (`take` with 64 blocks or more, in proportion below,
    /// divided by `1 + pause / 200 ns`); its compute probe slows by `overlap_slowdown` when both run.
    struct Gpu {
        alone: f64,
        take: f64,
        load: Option<Load>,
        started: usize,
        avoided: BTreeSet<u32>,
        gpu_probes: usize,
        overlap_slowdown: f64,
        /// The client's kernel fills its SMs (116..132 in the neighbour's numbering).
        filling: bool,
    }

    type Shared = Rc<RefCell<Gpu>>;

    struct Client(Shared);
    struct FakeNeighbour(Shared);
    struct Starter(Shared);

    impl BandwidthProbe for Client {
        fn bandwidth_gbps(&mut self) -> Result<f64> {
            let g = self.0.borrow();
            Ok(match g.load {
                Some(l) => {
                    g.alone - g.take * f64::from(l.blocks.min(64)) / 64.0 / (1.0 + f64::from(l.pause_ns) / 200.0)
                }
                None => g.alone,
            })
        }
    }

    impl ClientProbe for Client {
        fn compute_ms(&mut self) -> Result<f64> {
            let g = self.0.borrow();
            Ok(if g.load.is_some() {
                2.0 * (1.0 + g.overlap_slowdown)
            } else {
                2.0
            })
        }
        fn while_filling(&mut self, during: &mut dyn FnMut() -> Result<BTreeSet<u32>>) -> Result<BTreeSet<u32>> {
            self.0.borrow_mut().filling = true;
            let found = during();
            self.0.borrow_mut().filling = false;
            found
        }
    }

    impl Neighbour for FakeNeighbour {
        fn max_blocks(&self) -> u32 {
            696
        }
        fn set_load(&mut self, load: Load) -> Result<()> {
            self.0.borrow_mut().load = Some(load);
            Ok(())
        }
    }

    impl PartitionNeighbour for FakeNeighbour {
        /// Two of the client's SMs among those it streamed on.
        fn sms(&mut self) -> Result<BTreeSet<u32>> {
            Ok((0..118).collect())
        }
        fn busy_sms(&mut self) -> Result<BTreeSet<u32>> {
            Ok(if self.0.borrow().filling {
                (116..132).collect()
            } else {
                BTreeSet::new()
            })
        }
        fn pid(&self) -> Option<u32> {
            Some(4242)
        }
        fn copy_gbps(&mut self) -> Result<f64> {
            Ok(2400.0)
        }
        fn avoid(&mut self, sms: &BTreeSet<u32>) -> Result<()> {
            self.0.borrow_mut().avoided = sms.clone();
            Ok(())
        }
        fn stop(self) -> Result<()> {
            Ok(())
        }
    }

    impl Neighbours for Starter {
        type Running = FakeNeighbour;
        fn start(&mut self) -> Result<FakeNeighbour> {
            self.0.borrow_mut().started += 1;
            Ok(FakeNeighbour(self.0.clone()))
        }
        fn start_confined(&mut self, _: u32) -> Result<FakeNeighbour> {
            unreachable!("a lone client's neighbour keeps off its SMs itself")
        }
        fn gpu_bandwidth_gbps(&mut self) -> Result<f64> {
            self.0.borrow_mut().gpu_probes += 1;
            Ok(2984.0)
        }
    }

    fn gpu(alone: f64, take: f64) -> Shared {
        Rc::new(RefCell::new(Gpu {
            alone,
            take,
            load: None,
            started: 0,
            avoided: BTreeSet::new(),
            gpu_probes: 0,
            overlap_slowdown: 0.01,
            filling: false,
        }))
    }

    fn key(share: &str) -> Key {
        Key {
            gpu_uuid: "GPU-1".into(),
            driver: "580.159.04".into(),
            share: share.into(),
        }
    }

    fn run(
        g: &Shared,
        percent: u32,
        fraction: f64,
        cache: &Cache,
        recalibrate: Option<&str>,
    ) -> (Partition, Vec<String>) {
        let mut said = Vec::new();
        let calibrations = Calibrations {
            cache,
            key: key(&format!("{percent}")),
            recalibrate: recalibrate.map(str::to_string),
        };
        let (p, running) = partition(
            percent,
            fraction,
            &mut Client(g.clone()),
            &mut Starter(g.clone()),
            &calibrations,
            &mut || (Some(1980), Some(0x4)),
            &mut |s| said.push(s),
        )
        .unwrap();
        assert_eq!(running.is_some(), percent < 100);
        (p, said)
    }

    #[test]
    fn a_1g_is_held_to_its_share_and_the_setting_is_cached_and_checked() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        let g = gpu(1300.0, 1100.0);
        let (p, said) = run(&g, 13, 1.0 / 8.0, &cache, None);
        assert_eq!(g.borrow().started, 1);
        assert_eq!(
            g.borrow().avoided,
            (116..132).collect(),
            "the neighbour keeps off the SMs the client fills, as the neighbour numbers them"
        );
        assert_eq!(p.outcome, Outcome::Reached);
        assert!(!p.cached);
        assert!((p.share_gbps - 373.0).abs() < 1e-9);
        assert_eq!(p.alone_bandwidth_gbps, Some(1300.0));
        assert_eq!((p.neighbour_sms, p.shared_sms), (Some(118), Some(2)));
        assert!((p.compute_slowdown_pct.unwrap() - 1.0).abs() < 1e-9);
        assert_eq!(
            (p.sm_clock_mhz, p.throttle_reasons, p.neighbour_pid),
            (Some(1980), Some(0x4), Some(4242))
        );
        assert!(said[0].contains("the client reads"), "{said:?}");
        assert!(p.warnings().is_empty());
        let entry = cache.lookup(&key("13"), None).0.unwrap();
        assert_eq!(Some(entry.load(696)), p.load);

        // The next client takes the cached setting after one probe, and the GPU's bandwidth too.
        let g2 = gpu(1300.0, 1100.0);
        let (again, said) = run(&g2, 13, 1.0 / 8.0, &cache, None);
        assert!(again.cached && said.is_empty(), "{said:?}");
        assert_eq!((again.load, g2.borrow().gpu_probes), (p.load, 0));

        // A setting that no longer holds (the GPU changed under it) is calibrated again.
        let g3 = gpu(1300.0, 600.0);
        let (changed, said) = run(&g3, 13, 1.0 / 8.0, &cache, None);
        assert!(!changed.cached && said[0].contains("calibrating again"), "{said:?}");

        // --recalibrate: fresh, and measured again, but a setting this same command made stands.
        let g4 = gpu(1300.0, 1100.0);
        let (fresh, _) = run(&g4, 13, 1.0 / 8.0, &cache, Some("tok"));
        assert!(!fresh.cached);
        assert_eq!(g4.borrow().gpu_probes, 1);
        let (same, _) = run(&gpu(1300.0, 1100.0), 13, 1.0 / 8.0, &cache, Some("tok"));
        assert!(same.cached);
    }

    #[test]
    fn a_setting_that_drifts_before_the_run_is_calibrated_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        // The neighbour takes less once it has run a while: the first setting leaves the client
        // above its share by the time the probes are done.
        struct Drifting(Shared);
        impl BandwidthProbe for Drifting {
            fn bandwidth_gbps(&mut self) -> Result<f64> {
                Client(self.0.clone()).bandwidth_gbps()
            }
        }
        impl ClientProbe for Drifting {
            fn compute_ms(&mut self) -> Result<f64> {
                // The probes after calibration: by now the neighbour takes less.
                if self.0.borrow().load.is_some() {
                    self.0.borrow_mut().take = 900.0;
                }
                Client(self.0.clone()).compute_ms()
            }
            fn while_filling(&mut self, during: &mut dyn FnMut() -> Result<BTreeSet<u32>>) -> Result<BTreeSet<u32>> {
                Client(self.0.clone()).while_filling(during)
            }
        }
        let g = gpu(1300.0, 1100.0);
        let mut said = Vec::new();
        let (p, _) = partition(
            13,
            1.0 / 8.0,
            &mut Drifting(g.clone()),
            &mut Starter(g.clone()),
            &Calibrations {
                cache: &cache,
                key: key("13"),
                recalibrate: None,
            },
            &mut || (None, None),
            &mut |s| said.push(s),
        )
        .unwrap();
        assert!(said.iter().any(|s| s.contains("calibrating again")), "{said:?}");
        assert!((p.bandwidth_gbps / 373.0 - 1.0).abs() <= 0.1, "{p:?}");
        assert_eq!(p.outcome, Outcome::Reached);
    }

    #[test]
    fn a_7g_has_no_neighbour_and_says_partitioned_equals_alone() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        let g = gpu(2450.0, 0.0);
        let (p, _) = run(&g, 100, 1.0, &cache, None);
        assert_eq!((p.outcome, p.load, p.neighbour_pid), (Outcome::NoSpareSms, None, None));
        assert_eq!(p.bandwidth_gbps, 2450.0);
        assert_eq!(g.borrow().started, 0);
    }

    #[test]
    fn a_neighbour_on_the_client_s_sms_is_said() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        let g = gpu(1300.0, 1100.0);
        g.borrow_mut().overlap_slowdown = 0.08;
        let (p, _) = run(&g, 13, 1.0 / 8.0, &cache, None);
        let w = p.warnings();
        assert_eq!(w.len(), 1, "{w:?}");
        assert!(w[0].contains("8.0% slower") && w[0].contains("2 SMs ran both"), "{w:?}");
    }

    #[test]
    fn an_unreachable_share_is_recorded_and_said() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("c.json"));
        // The neighbour at full rate takes only 300 of a client's 1,300: its share stays far off.
        let (p, _) = run(&gpu(1300.0, 300.0), 13, 1.0 / 8.0, &cache, None);
        assert_eq!(p.outcome, Outcome::NeighbourTooWeak);
        assert!(p.warnings()[0].contains("cannot hold the client to its share"));
        // Cached too: the next client does not search again, and is told again.
        let (again, _) = run(&gpu(1300.0, 300.0), 13, 1.0 / 8.0, &cache, None);
        assert!(again.cached && again.outcome == Outcome::NeighbourTooWeak);
    }
}
