//! Setting the memory-system neighbour so that an emulated slice reads its share of the GPU's
//! bandwidth, and remembering the setting.
//!
//! The neighbour streams through memory on the SMs the client does not have, pausing a set number of
//! nanoseconds between bursts: no pause takes all the bandwidth it can, a long pause almost none. The
//! client's copy probe reads more the longer the pause, so the pause is found by bisection (on a log
//! scale: the bandwidth moves most at short pauses) until the probe reads the share within half of
//! [`TOLERANCE`], or as close as it gets within [`TOLERANCE`]. Two bounds end it early and are said: a neighbour that even without pausing leaves
//! the client above its share (too few spare SMs to take the rest), and a client that is below its
//! share even beside a neighbour that hardly runs.
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
/// Bisection steps after the two bounds.
const STEPS: usize = 12;

/// Set by `--recalibrate` for this command and the processes it starts: calibrate again rather than
/// trust a cached setting (a setting this same command calibrated, whose token matches, is kept).
pub const RECALIBRATE_ENV: &str = "MIGPROF_RECALIBRATE";
/// Names the folder of migprof's cache instead of `$XDG_CACHE_HOME/migprof` or `~/.cache/migprof`.
pub const CACHE_DIR_ENV: &str = "MIGPROF_CACHE_DIR";

/// A memory-system neighbour whose traffic can be set.
pub trait Neighbour {
    /// Streams with `pause_ns` between bursts (0: without pausing), from its next launch on.
    fn set_pause(&mut self, pause_ns: u32) -> Result<()>;
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
    /// Without pausing, the neighbour still leaves the client above its share.
    NeighbourTooWeak,
    /// Beside the longest pause, the client is still below its share.
    ClientBelowShare,
    /// Bisection ended between settings on either side of the band (a noisy probe): the closest kept.
    NotConverged,
    /// The target holds every SM: there is nowhere for a neighbour to run, and partitioned equals alone.
    NoSpareSms,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Reached => "reached",
            Outcome::NeighbourTooWeak => "neighbour_too_weak",
            Outcome::ClientBelowShare => "client_below_share",
            Outcome::NotConverged => "not_converged",
            Outcome::NoSpareSms => "no_spare_sms",
        }
    }

    /// What the user must know when the share was not reached; `None` when it was.
    pub fn warning(self, got_gbps: f64, share_gbps: f64) -> Option<String> {
        let (got, share) = (got_gbps.round(), share_gbps.round());
        match self {
            Outcome::Reached => None,
            Outcome::NeighbourTooWeak => Some(format!(
                "the memory-system neighbour cannot hold the client to its share: it reads {got} GB/s beside a neighbour that never pauses, above its share of {share} GB/s (±{:.0}%); this slice's rows still overstate a real slice's memory",
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
        }
    }
}

/// The neighbour's setting and what the client read beside it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Setting {
    pub pause_ns: u32,
    pub bandwidth_gbps: f64,
    pub outcome: Outcome,
    /// Settings tried, the first included.
    pub tries: usize,
}

/// Whether `gbps` is within [`TOLERANCE`] of the share.
pub fn within(gbps: f64, share_gbps: f64) -> bool {
    (gbps - share_gbps).abs() <= TOLERANCE * share_gbps
}

/// Finds the neighbour's pause at which `probe` reads `share_gbps` within [`TOLERANCE`], or says why
/// none does; the neighbour is left at the setting returned.
pub fn calibrate(neighbour: &mut dyn Neighbour, probe: &mut dyn BandwidthProbe, share_gbps: f64) -> Result<Setting> {
    // The search aims at half the tolerance, so that a probe's noise (a few per cent beside a
    // neighbour) leaves the setting inside the band when it is read again before the run.
    let aimed = |gbps: f64| (gbps - share_gbps).abs() <= TOLERANCE / 2.0 * share_gbps;
    let mut tries = 0;
    let mut at = |pause_ns: u32| -> Result<f64> {
        tries += 1;
        neighbour.set_pause(pause_ns)?;
        probe.bandwidth_gbps()
    };
    let full = at(0)?;
    let mut best = (0, full);
    let outcome = 'search: {
        if aimed(full) {
            break 'search Outcome::Reached;
        }
        if full > share_gbps {
            // Pausing only gives the client more: this is as close as it gets.
            break 'search if within(full, share_gbps) {
                Outcome::Reached
            } else {
                Outcome::NeighbourTooWeak
            };
        }
        let quiet = at(MAX_PAUSE_NS)?;
        if quiet < share_gbps {
            if (share_gbps - quiet) < (share_gbps - full) {
                best = (MAX_PAUSE_NS, quiet);
            }
            break 'search if within(best.1, share_gbps) {
                Outcome::Reached
            } else {
                Outcome::ClientBelowShare
            };
        }
        if (quiet - share_gbps).abs() < (full - share_gbps).abs() {
            best = (MAX_PAUSE_NS, quiet);
        }
        // The client reads too little at `lo` and too much at `hi`, pauses on a log2 scale.
        let (mut lo, mut hi) = (f64::from(MIN_PAUSE_NS).log2(), f64::from(MAX_PAUSE_NS).log2());
        for _ in 0..STEPS {
            let mid = (lo + hi) / 2.0;
            let pause = mid.exp2().round() as u32;
            let got = at(pause)?;
            if (got - share_gbps).abs() < (best.1 - share_gbps).abs() {
                best = (pause, got);
            }
            if aimed(got) {
                break;
            }
            if got < share_gbps {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        if within(best.1, share_gbps) {
            Outcome::Reached
        } else {
            Outcome::NotConverged
        }
    };
    if tries > 1 {
        // Leave the neighbour where the result was read.
        neighbour.set_pause(best.0)?;
    }
    Ok(Setting {
        pause_ns: best.0,
        bandwidth_gbps: best.1,
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
    pub pause_ns: u32,
    pub outcome: Outcome,
    pub bandwidth_gbps: f64,
    pub calibrated_at: String,
    /// The `--recalibrate` token of the command that calibrated it, if any.
    #[serde(default)]
    pub token: Option<String>,
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

    pub fn get(&self, key: &Key) -> Option<Entry> {
        self.entries().into_iter().find(|e| &e.key == key)
    }

    /// The GPU's bandwidth from the newest entry of the same GPU and driver that `recalibrate` lets
    /// stand ([`trusted`]).
    pub fn gpu_bandwidth(&self, gpu_uuid: &str, driver: &str, recalibrate: Option<&str>) -> Option<f64> {
        self.entries()
            .into_iter()
            .filter(|e| e.key.gpu_uuid == gpu_uuid && e.key.driver == driver && trusted(e, recalibrate))
            .max_by(|a, b| a.calibrated_at.cmp(&b.calibrated_at))
            .map(|e| e.gpu_bandwidth_gbps)
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

    /// A neighbour and a probe in one: the client reads `curve(pause)` GB/s.
    struct Fake {
        curve: Box<dyn Fn(u32) -> f64>,
        pause: u32,
    }

    /// An H100-like client: `alone` GB/s less what the neighbour takes, which falls with its pause as
    /// `take / (1 + pause / 200 ns)`.
    fn fake(alone: f64, take: f64) -> Fake {
        Fake {
            curve: Box::new(move |p| alone - take / (1.0 + f64::from(p) / 200.0)),
            pause: 0,
        }
    }

    /// Calibrates against both roles of one fake, borrowed twice through a cell.
    fn run(fake: Fake, share: f64) -> (Setting, u32) {
        let cell = std::cell::RefCell::new(fake);
        struct N<'a>(&'a std::cell::RefCell<Fake>);
        struct P<'a>(&'a std::cell::RefCell<Fake>);
        impl Neighbour for N<'_> {
            fn set_pause(&mut self, ns: u32) -> Result<()> {
                self.0.borrow_mut().pause = ns;
                Ok(())
            }
        }
        impl BandwidthProbe for P<'_> {
            fn bandwidth_gbps(&mut self) -> Result<f64> {
                let f = self.0.borrow();
                Ok((f.curve)(f.pause))
            }
        }
        let setting = calibrate(&mut N(&cell), &mut P(&cell), share).unwrap();
        let left_at = cell.borrow().pause;
        (setting, left_at)
    }

    #[test]
    fn converges_to_the_share_and_leaves_the_neighbour_there() {
        // An emulated 1g of an H100: 1,300 GB/s alone, its share 373.
        let (s, left_at) = run(fake(1300.0, 1100.0), 373.0);
        assert_eq!(s.outcome, Outcome::Reached);
        assert!(within(s.bandwidth_gbps, 373.0), "{s:?}");
        assert!(s.pause_ns > 0 && s.tries <= 2 + STEPS, "{s:?}");
        assert_eq!(left_at, s.pause_ns, "left at the setting it reports");
        // A 3g: the neighbour without pausing already leaves it within its share.
        let (s, _) = run(fake(2700.0, 1250.0), 1491.0);
        assert_eq!((s.outcome, s.pause_ns, s.tries), (Outcome::Reached, 0, 1));
        // Within the band but near its edge without pausing (0.91 of the share): it searches on for
        // a setting nearer the share, so that noise does not push it out.
        let (s, _) = run(fake(1300.0, 960.0), 373.0);
        assert_eq!(s.outcome, Outcome::Reached);
        assert!(
            s.tries > 1 && (s.bandwidth_gbps / 373.0 - 1.0).abs() <= TOLERANCE / 2.0,
            "{s:?}"
        );
    }

    #[test]
    fn stops_at_a_bound_and_says_it_cannot_reach_the_share() {
        // A neighbour too weak: the client reads 900 beside it at full rate, its share is 373.
        let (s, left_at) = run(fake(1300.0, 400.0), 373.0);
        assert_eq!(
            (s.outcome, s.pause_ns, s.tries, left_at),
            (Outcome::NeighbourTooWeak, 0, 1, 0)
        );
        let w = s.outcome.warning(s.bandwidth_gbps, 373.0).unwrap();
        assert!(w.contains("900 GB/s") && w.contains("373 GB/s"), "{w}");
        // A client below its share even beside the quietest neighbour.
        let (s, left_at) = run(fake(300.0, 250.0), 373.0);
        assert_eq!(
            (s.outcome, s.pause_ns, left_at),
            (Outcome::ClientBelowShare, MAX_PAUSE_NS, MAX_PAUSE_NS)
        );
        assert!(s
            .outcome
            .warning(s.bandwidth_gbps, 373.0)
            .unwrap()
            .contains("below its share"));
        assert_eq!(Outcome::Reached.warning(373.0, 373.0), None);
    }

    #[test]
    fn a_probe_too_coarse_for_the_band_ends_not_converged_at_the_closest_setting() {
        // The bandwidth jumps from far below the share to far above it between two pauses.
        let step = Fake {
            curve: Box::new(|p| if p < 1000 { 100.0 } else { 900.0 }),
            pause: 0,
        };
        let (s, left_at) = run(step, 500.0);
        assert_eq!(s.outcome, Outcome::NotConverged);
        assert_eq!(s.tries, 2 + STEPS);
        assert!(s
            .outcome
            .warning(s.bandwidth_gbps, 500.0)
            .unwrap()
            .contains("did not settle"));
        assert_eq!(left_at, s.pause_ns);
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
        let got = cache.get(&key).unwrap();
        assert_eq!(got.pause_ns, 120);
        assert_eq!(cache.gpu_bandwidth("GPU-1", "580.159.04", None), Some(2983.0));
        assert_eq!(cache.gpu_bandwidth("GPU-1", "590.0", None), None);
        // Under --recalibrate only this command's own entries stand.
        assert_eq!(cache.gpu_bandwidth("GPU-1", "580.159.04", Some("t1")), Some(2983.0));
        assert_eq!(cache.gpu_bandwidth("GPU-1", "580.159.04", Some("t2")), None);
        assert!(trusted(&got, None));
        assert!(trusted(&got, Some("t1")), "made by this same command");
        assert!(!trusted(&got, Some("t2")));
        std::fs::write(cache.path(), "not json").unwrap();
        assert!(cache.entries().is_empty(), "a broken cache is an empty one");
    }
}
