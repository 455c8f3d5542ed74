//! Setting the memory-system neighbour so that an emulated slice reads its share of the GPU's
//! bandwidth, and remembering the setting.
//!
//! The neighbour streams through memory on the SMs the client does not have. Two knobs set how hard
//! ([`Load`]): how many blocks of its grid stream, and a pause in nanoseconds between each block's
//! bursts. The client's copy probe reads more the fewer the blocks and the longer the pause, so the
//! setting is found by bisection: first on the blocks without pausing (steady traffic, a coarse
//! step: one block moves a few per cent of a large slice's share), then, when no block count lands
//! within half of [`TOLERANCE`], on the pause of the weakest count that still takes too much (a fine
//! step between two counts; both on a log scale, where the bandwidth moves most). Pausing every
//! block alone was too steep to settle for the large slices (benches/results/*-slice-fidelity.md).
//! Two bounds end it early and are said: a neighbour that at full
//! strength leaves the client above its share (too few spare SMs to take the rest), and a client
//! that is below its share even beside the quietest neighbour.
//!
//! The setting is kept per GPU, driver and share in a small JSON file ([`Cache`]); a later client
//! checks it with one probe and calibrates again when it no longer holds, or when asked to
//! ([`RECALIBRATE_ENV`]).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use serde::{Deserialize, Serialize};

/// The client's bandwidth must land within this share of its target.
pub const TOLERANCE: f64 = 0.10;
/// The longest pause tried, ns: the neighbour then moves a few per cent of the bandwidth.
pub const MAX_PAUSE_NS: u32 = 65_536;
/// The shortest pause bisection tries, ns; below it the neighbour runs as without pausing.
const MIN_PAUSE_NS: u32 = 8;
/// Bisection steps on the pause.
const PAUSE_STEPS: usize = 12;

/// Set by `--recalibrate` for this command and the processes it starts: calibrate again rather than
/// trust a cached setting (a setting this same command calibrated, whose token matches, is kept).
pub const RECALIBRATE_ENV: &str = "MIGPROF_RECALIBRATE";
/// Names the folder of migprof's cache instead of `$XDG_CACHE_HOME/migprof` or `~/.cache/migprof`.
pub const CACHE_DIR_ENV: &str = "MIGPROF_CACHE_DIR";

/// How hard the neighbour streams.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Load {
    /// Blocks of its grid that stream, at least one and at most [`Neighbour::max_blocks`].
    pub blocks: u32,
    /// Pause between each block's bursts, ns (0: none).
    pub pause_ns: u32,
}

impl Load {
    /// Every block, without pausing: the most the neighbour takes.
    pub fn full(max_blocks: u32) -> Load {
        Load {
            blocks: max_blocks.max(1),
            pause_ns: 0,
        }
    }
}

impl std::fmt::Display for Load {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} blocks, pause {} ns", self.blocks, self.pause_ns)
    }
}

/// A memory-system neighbour whose traffic can be set.
pub trait Neighbour {
    /// The most blocks it streams with: every warp slot of its SMs.
    fn max_blocks(&self) -> u32;
    /// Streams at `load` from its next launch on.
    fn set_load(&mut self, load: Load) -> Result<()>;
}

/// The client's measurement of the bandwidth it reaches.
pub trait BandwidthProbe {
    fn bandwidth_gbps(&mut self) -> Result<f64>;
}

/// How a calibration ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    /// The client reads its share within the tolerance.
    Reached,
    /// Beside the neighbour at full strength, the client is still above its share.
    NeighbourTooWeak,
    /// Beside the quietest neighbour (one block, the longest pause), the client is below its share.
    ClientBelowShare,
    /// Bisection ended between settings on either side of the band (a noisy probe): the closest kept.
    NotConverged,
    /// The target holds every SM: there is nowhere for a neighbour to run, and partitioned equals alone.
    NoSpareSms,
    /// A member of a concurrent group outside its own share: the group's neighbour holds the members
    /// to their share together, which they divide among themselves as MPS clients do.
    SharedInGroup,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Reached => "reached",
            Outcome::NeighbourTooWeak => "neighbour_too_weak",
            Outcome::ClientBelowShare => "client_below_share",
            Outcome::NotConverged => "not_converged",
            Outcome::NoSpareSms => "no_spare_sms",
            Outcome::SharedInGroup => "shared_in_group",
        }
    }

    /// The outcome a row's `calibration` column names.
    pub fn parse(name: &str) -> Option<Outcome> {
        [
            Outcome::Reached,
            Outcome::NeighbourTooWeak,
            Outcome::ClientBelowShare,
            Outcome::NotConverged,
            Outcome::NoSpareSms,
            Outcome::SharedInGroup,
        ]
        .into_iter()
        .find(|o| o.as_str() == name)
    }

    /// Whether a `calibration` column says the client was not held to its share (a neighbour that
    /// could not, or a search that did not settle); not for a slice with no neighbour at all.
    pub fn missed_share(name: &str) -> bool {
        matches!(
            Outcome::parse(name),
            Some(
                Outcome::NeighbourTooWeak | Outcome::ClientBelowShare | Outcome::NotConverged | Outcome::SharedInGroup
            )
        )
    }

    /// What the user must know when the share was not reached; `None` when it was.
    pub fn warning(self, got_gbps: f64, share_gbps: f64) -> Option<String> {
        let (got, share) = (got_gbps.round(), share_gbps.round());
        match self {
            Outcome::Reached => None,
            Outcome::NeighbourTooWeak => Some(format!(
                "the memory-system neighbour cannot hold the client to its share: it reads {got} GB/s beside a neighbour at full strength, above its share of {share} GB/s (±{:.0}%); this slice's rows still overstate a real slice's memory",
                TOLERANCE * 100.0
            )),
            Outcome::ClientBelowShare => Some(format!(
                "the client reads {got} GB/s beside the quietest neighbour, below its share of {share} GB/s (±{:.0}%): its SMs cannot draw its share of the bandwidth, so the neighbour holds it back no further",
                TOLERANCE * 100.0
            )),
            Outcome::NotConverged => Some(format!(
                "the memory-system neighbour's calibration did not settle: the closest setting left the client at {got} GB/s against a share of {share} GB/s (the probe varies by more than ±{:.0}% between settings)",
                TOLERANCE * 100.0
            )),
            Outcome::NoSpareSms => None,
            Outcome::SharedInGroup => Some(format!(
                "this member of a concurrent group reads {got} GB/s against its share of {share} GB/s: the group's neighbour holds the members to their memory slices' share together, and they divide it as MPS clients do, not each its own as on MIG"
            )),
        }
    }
}

/// The neighbour's setting and what the client read beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    pub load: Load,
    pub bandwidth_gbps: f64,
    pub outcome: Outcome,
    /// Settings tried, the first included.
    pub tries: usize,
}

/// Whether `gbps` is within [`TOLERANCE`] of the share.
pub fn within(gbps: f64, share_gbps: f64) -> bool {
    (gbps - share_gbps).abs() <= TOLERANCE * share_gbps
}

/// The fine search: `blocks` take too much without pausing; pause them, on a log2 scale, until
/// the client reads within aim (`at` sets a load, reads the client and says whether it is).
fn pause_search(at: &mut dyn FnMut(Load) -> Result<(f64, bool)>, blocks: u32, share_gbps: f64) -> Result<Outcome> {
    let (mut lo, mut hi) = (f64::from(MIN_PAUSE_NS).log2(), f64::from(MAX_PAUSE_NS).log2());
    for _ in 0..PAUSE_STEPS {
        let mid = (lo + hi) / 2.0;
        let pause_ns = mid.exp2().round() as u32;
        let (got, done) = at(Load { blocks, pause_ns })?;
        if done {
            return Ok(Outcome::Reached);
        }
        if got < share_gbps {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(Outcome::NotConverged)
}

/// Finds the neighbour's load at which `probe` reads `share_gbps` within [`TOLERANCE`], or says why
/// none does; the neighbour is left at the setting returned.
pub fn calibrate(neighbour: &mut dyn Neighbour, probe: &mut dyn BandwidthProbe, share_gbps: f64) -> Result<Setting> {
    // The search aims at half the tolerance, so that a probe's noise (a few per cent beside a
    // neighbour) leaves the setting inside the band when it is read again before the run.
    let aimed = |gbps: f64| (gbps - share_gbps).abs() <= TOLERANCE / 2.0 * share_gbps;
    let max_blocks = neighbour.max_blocks().max(1);
    let mut tries = 0;
    let mut best: Option<(Load, f64)> = None;
    // Sets the load, reads the client, keeps the closest; true when it is close enough to stop.
    let mut at = |load: Load| -> Result<(f64, bool)> {
        tries += 1;
        neighbour.set_load(load)?;
        let got = probe.bandwidth_gbps()?;
        if best.is_none_or(|(_, b)| (got - share_gbps).abs() < (b - share_gbps).abs()) {
            best = Some((load, got));
        }
        Ok((got, aimed(got)))
    };
    let outcome = 'search: {
        let (full, done) = at(Load::full(max_blocks))?;
        if done {
            break 'search Outcome::Reached;
        }
        if full > share_gbps {
            // A weaker neighbour only gives the client more: this is as close as it gets.
            break 'search Outcome::NeighbourTooWeak;
        }
        let (quiet, done) = at(Load {
            blocks: 1,
            pause_ns: MAX_PAUSE_NS,
        })?;
        if done {
            break 'search Outcome::Reached;
        }
        if quiet < share_gbps {
            break 'search Outcome::ClientBelowShare;
        }
        // Coarse: blocks without pausing. The client reads too little beside `strong` blocks and
        // too much beside `weak` ones (none at all reads as alone, above the share as `quiet` is).
        let (mut weak, mut strong) = (0u32, max_blocks);
        while strong - weak > 1 {
            let mid = (f64::from(weak).max(0.5) * f64::from(strong)).sqrt().round() as u32;
            let blocks = mid.clamp(weak + 1, strong - 1);
            let (got, done) = at(Load { blocks, pause_ns: 0 })?;
            if done {
                break 'search Outcome::Reached;
            }
            if got < share_gbps {
                strong = blocks;
            } else {
                weak = blocks;
            }
        }
        pause_search(&mut at, strong, share_gbps)?
    };
    let (load, bandwidth_gbps) = best.expect("one setting was tried");
    let outcome = match outcome {
        // Outside the aim but inside the band: as good as asked.
        Outcome::NeighbourTooWeak | Outcome::ClientBelowShare | Outcome::NotConverged
            if within(bandwidth_gbps, share_gbps) =>
        {
            Outcome::Reached
        }
        o => o,
    };
    if tries > 1 {
        // Leave the neighbour where the result was read.
        neighbour.set_load(load)?;
    }
    Ok(Setting {
        load,
        bandwidth_gbps,
        outcome,
        tries,
    })
}

/// What identifies a calibration: the GPU, its driver, the share emulated.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Key {
    pub gpu_uuid: String,
    pub driver: String,
    /// `1g.10gb`, or `45%` for a bare percentage.
    pub share: String,
}

/// A remembered calibration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Entry {
    #[serde(flatten)]
    pub key: Key,
    /// The GPU's copy bandwidth with every SM, GB/s.
    pub gpu_bandwidth_gbps: f64,
    /// The neighbour's streaming blocks; `None` in entries made before the blocks were a knob,
    /// which streamed with every block.
    #[serde(default)]
    pub blocks: Option<u32>,
    pub pause_ns: u32,
    pub outcome: Outcome,
    pub bandwidth_gbps: f64,
    pub calibrated_at: String,
    /// The `--recalibrate` token of the command that calibrated it, if any.
    #[serde(default)]
    pub token: Option<String>,
}

impl Entry {
    /// The neighbour's load this entry keeps, for a neighbour of `max_blocks`.
    pub fn load(&self, max_blocks: u32) -> Load {
        Load {
            blocks: self.blocks.unwrap_or(max_blocks).clamp(1, max_blocks.max(1)),
            pause_ns: self.pause_ns,
        }
    }
}

/// The calibrations kept on this machine: one JSON file.
pub struct Cache {
    path: PathBuf,
}

impl Cache {
    pub fn at(path: PathBuf) -> Cache {
        Cache { path }
    }

    /// `memory-calibration.json` in [`CACHE_DIR_ENV`], else `$XDG_CACHE_HOME/migprof`, else
    /// `~/.cache/migprof`, else the temporary folder.
    pub fn default_location() -> Cache {
        let dir = std::env::var_os(CACHE_DIR_ENV)
            .map(PathBuf::from)
            .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("migprof")))
            .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/migprof")))
            .unwrap_or_else(|| std::env::temp_dir().join("migprof"));
        Cache::at(dir.join("memory-calibration.json"))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Every entry; none when the file is missing or unreadable (a cache is never worth failing for).
    pub fn entries(&self) -> Vec<Entry> {
        std::fs::read_to_string(&self.path)
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or_default()
    }

    /// From one read of the file: the entry of `key` that `recalibrate` lets stand ([`trusted`]),
    /// and the GPU's bandwidth: that entry's, else the newest standing entry's of the same GPU and
    /// driver.
    pub fn lookup(&self, key: &Key, recalibrate: Option<&str>) -> (Option<Entry>, Option<f64>) {
        let standing: Vec<Entry> = self.entries().into_iter().filter(|e| trusted(e, recalibrate)).collect();
        let own = standing.iter().find(|e| &e.key == key).cloned();
        let gpu_bandwidth = own.as_ref().map(|e| e.gpu_bandwidth_gbps).or_else(|| {
            standing
                .iter()
                .filter(|e| e.key.gpu_uuid == key.gpu_uuid && e.key.driver == key.driver)
                .max_by(|a, b| a.calibrated_at.cmp(&b.calibrated_at))
                .map(|e| e.gpu_bandwidth_gbps)
        });
        (own, gpu_bandwidth)
    }

    /// Keeps `entry`, replacing one of the same key; written to a temporary file and renamed, so
    /// that a reader never sees half a file, under a lock, so that the cells of a sweep on several
    /// GPUs do not lose each other's entries.
    pub fn put(&self, entry: Entry) -> Result<()> {
        if let Some(dir) = self.path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let lock_path = self.path.with_extension("lock");
        let lock = std::fs::File::create(&lock_path).with_context(|| format!("creating {}", lock_path.display()))?;
        // SAFETY: flock on a descriptor this function owns; released when `lock` is closed.
        if unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&lock), libc::LOCK_EX) } != 0 {
            anyhow::bail!("locking {}: {}", lock_path.display(), std::io::Error::last_os_error());
        }
        let mut entries: Vec<Entry> = self.entries().into_iter().filter(|e| e.key != entry.key).collect();
        entries.push(entry);
        let tmp = self.path.with_extension(format!("json.{}", std::process::id()));
        std::fs::write(&tmp, serde_json::to_string_pretty(&entries)?)
            .with_context(|| format!("writing {}", tmp.display()))?;
        std::fs::rename(&tmp, &self.path).with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Whether a cached entry may stand: not when `--recalibrate` asked for fresh ones, unless this same
/// command made it.
pub fn trusted(entry: &Entry, recalibrate: Option<&str>) -> bool {
    match recalibrate {
        None => true,
        Some(token) => entry.token.as_deref() == Some(token),
    }
}

/// The `--recalibrate` token of this command, if it asked.
pub fn recalibrate_token() -> Option<String> {
    std::env::var(RECALIBRATE_ENV).ok().filter(|t| !t.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A neighbour and a probe in one: the client reads `curve(load)` GB/s.
    struct Fake {
        curve: Box<dyn Fn(Load) -> f64>,
        max_blocks: u32,
        load: Load,
    }

    /// An H100-like client beside a neighbour of `max_blocks`: `alone` GB/s less what the neighbour
    /// takes, up to `take` with every block, each block taking an equal part until `saturate`
    /// blocks and nothing more after, and a pause dividing it as `1 / (1 + pause / 200 ns)`.
    fn fake(alone: f64, take: f64, max_blocks: u32, saturate: u32) -> Fake {
        Fake {
            curve: Box::new(move |l: Load| {
                let part = f64::from(l.blocks.min(saturate)) / f64::from(saturate);
                alone - take * part / (1.0 + f64::from(l.pause_ns) / 200.0)
            }),
            max_blocks,
            load: Load::full(max_blocks),
        }
    }

    /// Calibrates against both roles of one fake, borrowed twice through a cell.
    fn run(fake: Fake, share: f64) -> (Setting, Load) {
        let cell = std::cell::RefCell::new(fake);
        struct N<'a>(&'a std::cell::RefCell<Fake>);
        struct P<'a>(&'a std::cell::RefCell<Fake>);
        impl Neighbour for N<'_> {
            fn max_blocks(&self) -> u32 {
                self.0.borrow().max_blocks
            }
            fn set_load(&mut self, load: Load) -> Result<()> {
                assert!((1..=self.max_blocks()).contains(&load.blocks), "{load}");
                self.0.borrow_mut().load = load;
                Ok(())
            }
        }
        impl BandwidthProbe for P<'_> {
            fn bandwidth_gbps(&mut self) -> Result<f64> {
                let f = self.0.borrow();
                Ok((f.curve)(f.load))
            }
        }
        let setting = calibrate(&mut N(&cell), &mut P(&cell), share).unwrap();
        let left_at = cell.borrow().load;
        (setting, left_at)
    }

    #[test]
    fn converges_to_the_share_on_the_blocks_and_leaves_the_neighbour_there() {
        // An emulated 3g of an H100 (share 1,491): every one of the neighbour's 560 blocks takes the
        // client below its share, fewer take less.
        let (s, left_at) = run(fake(2700.0, 1500.0, 560, 40), 1491.0);
        assert_eq!(s.outcome, Outcome::Reached);
        assert!((s.bandwidth_gbps / 1491.0 - 1.0).abs() <= TOLERANCE / 2.0, "{s:?}");
        assert!(s.load.blocks < 560 && s.load.pause_ns == 0, "{s:?}");
        assert!(s.tries <= 2 + 10, "a bisection over 560 blocks: {s:?}");
        assert_eq!(left_at, s.load, "left at the setting it reports");
        // A 1g: the neighbour at full strength already leaves it near its share.
        let (s, _) = run(fake(1300.0, 940.0, 912, 40), 373.0);
        assert_eq!((s.outcome, s.load, s.tries), (Outcome::Reached, Load::full(912), 1));
        // Within the band but near its edge at full strength (0.91 of the share): it searches on
        // for a setting nearer the share, so that noise does not push it out.
        let (s, _) = run(fake(1300.0, 960.0, 912, 40), 373.0);
        assert_eq!(s.outcome, Outcome::Reached);
        assert!(
            s.tries > 1 && (s.bandwidth_gbps / 373.0 - 1.0).abs() <= TOLERANCE / 2.0,
            "{s:?}"
        );
    }

    #[test]
    fn blocks_too_coarse_for_the_band_are_paused() {
        // Four blocks, each taking a quarter: between two counts the client jumps across the band,
        // and pausing the stronger count finds the share.
        // One block leaves the client at 1,300, two at 1,000: both 13 % from a share of 1,150.
        let (s, left_at) = run(fake(1600.0, 1200.0, 4, 4), 1150.0);
        assert_eq!(s.outcome, Outcome::Reached);
        assert!((s.bandwidth_gbps / 1150.0 - 1.0).abs() <= TOLERANCE / 2.0, "{s:?}");
        assert_eq!(s.load.blocks, 2, "{s:?}");
        assert!(s.load.pause_ns > 0, "{s:?}");
        assert_eq!(left_at, s.load);
    }

    #[test]
    fn stops_at_a_bound_and_says_it_cannot_reach_the_share() {
        // A neighbour too weak: the client reads 900 beside it at full strength, its share is 373.
        let (s, left_at) = run(fake(1300.0, 400.0, 912, 40), 373.0);
        assert_eq!(
            (s.outcome, s.load, s.tries, left_at),
            (Outcome::NeighbourTooWeak, Load::full(912), 1, Load::full(912))
        );
        let w = s.outcome.warning(s.bandwidth_gbps, 373.0).unwrap();
        assert!(w.contains("900 GB/s") && w.contains("373 GB/s"), "{w}");
        // A client below its share even beside the quietest neighbour.
        let (s, left_at) = run(fake(300.0, 250.0, 912, 40), 373.0);
        let quietest = Load {
            blocks: 1,
            pause_ns: MAX_PAUSE_NS,
        };
        assert_eq!(
            (s.outcome, s.load, left_at),
            (Outcome::ClientBelowShare, quietest, quietest)
        );
        assert!(s
            .outcome
            .warning(s.bandwidth_gbps, 373.0)
            .unwrap()
            .contains("below its share"));
        assert_eq!(Outcome::Reached.warning(373.0, 373.0), None);
        assert!(Outcome::missed_share("neighbour_too_weak") && Outcome::missed_share("not_converged"));
        assert!(!Outcome::missed_share("reached") && !Outcome::missed_share("no_spare_sms"));
        assert!(!Outcome::missed_share("") && Outcome::parse("client_below_share").is_some());
    }

    #[test]
    fn a_probe_too_coarse_for_the_band_ends_not_converged_at_the_closest_setting() {
        // The bandwidth jumps from far below the share to far above it, on either knob.
        let step = Fake {
            curve: Box::new(|l: Load| {
                if l.blocks > 8 && l.pause_ns < 1000 {
                    100.0
                } else {
                    900.0
                }
            }),
            max_blocks: 64,
            load: Load::full(64),
        };
        let (s, left_at) = run(step, 500.0);
        assert_eq!(s.outcome, Outcome::NotConverged);
        // Both bounds; blocks 6, 20, 11, 8 and 9 (between 0 and 64 on a log scale); every pause.
        assert_eq!(s.tries, 2 + 5 + PAUSE_STEPS, "{s:?}");
        assert_eq!(s.load.blocks, 64, "the closest reading was the first: {s:?}");
        assert!(s
            .outcome
            .warning(s.bandwidth_gbps, 500.0)
            .unwrap()
            .contains("did not settle"));
        assert_eq!(left_at, s.load);
    }

    #[test]
    fn the_cache_keeps_one_entry_per_key_and_trusts_it_unless_asked_again() {
        let dir = tempfile::tempdir().unwrap();
        let cache = Cache::at(dir.path().join("sub/memory-calibration.json"));
        assert!(cache.entries().is_empty());
        let key = Key {
            gpu_uuid: "GPU-1".into(),
            driver: "580.159.04".into(),
            share: "1g.10gb".into(),
        };
        let entry = |pause, token: Option<&str>| Entry {
            key: key.clone(),
            gpu_bandwidth_gbps: 2983.0,
            blocks: Some(40),
            pause_ns: pause,
            outcome: Outcome::Reached,
            bandwidth_gbps: 370.0,
            calibrated_at: "2026-11-26T00:00:00Z".into(),
            token: token.map(str::to_string),
        };
        cache.put(entry(100, None)).unwrap();
        cache.put(entry(120, Some("t1"))).unwrap();
        let other = Key {
            share: "3g.40gb".into(),
            ..key.clone()
        };
        cache
            .put(Entry {
                key: other.clone(),
                ..entry(0, None)
            })
            .unwrap();
        assert_eq!(cache.entries().len(), 2);
        let got = cache.lookup(&key, None).0.unwrap();
        assert_eq!(got.pause_ns, 120);
        assert_eq!(
            got.load(560),
            Load {
                blocks: 40,
                pause_ns: 120
            }
        );
        // An entry from before the blocks were a knob streamed with every block.
        let old = r#"[{"gpu_uuid":"GPU-1","driver":"d","share":"1g.10gb","gpu_bandwidth_gbps":2983.0,"pause_ns":0,"outcome":"reached","bandwidth_gbps":370.0,"calibrated_at":"x"}]"#;
        let old: Vec<Entry> = serde_json::from_str(old).unwrap();
        assert_eq!(old[0].load(912), Load::full(912));
        let gpu = |driver: &str, recalibrate| {
            let k = Key {
                share: "2g.20gb".into(),
                driver: driver.into(),
                ..key.clone()
            };
            cache.lookup(&k, recalibrate).1
        };
        assert_eq!(
            gpu("580.159.04", None),
            Some(2983.0),
            "another share's, same GPU and driver"
        );
        assert_eq!(gpu("590.0", None), None);
        assert_eq!(cache.lookup(&key, None).0.map(|e| e.pause_ns), Some(120));
        // Under --recalibrate only this command's own entries stand.
        assert_eq!(gpu("580.159.04", Some("t1")), Some(2983.0));
        assert_eq!(gpu("580.159.04", Some("t2")), None);
        assert_eq!(cache.lookup(&key, Some("t2")), (None, None));
        assert!(trusted(&got, None));
        assert!(trusted(&got, Some("t1")), "made by this same command");
        assert!(!trusted(&got, Some("t2")));
        std::fs::write(cache.path(), "not json").unwrap();
        assert!(cache.entries().is_empty(), "a broken cache is an empty one");
    }
}
