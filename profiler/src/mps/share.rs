//! How much of a GPU an MPS client is given to emulate a slice: `mps:3g.40gb` (a MIG profile of the
//! GPU at hand) or `mps:45%` (a share of its SMs).
//!
//! MPS caps a client's SMs by a percentage (`CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`) and its device
//! memory by a pinned limit (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`). A profile's percentage is rounded
//! up to a whole percent, so that the client gets at least the profile's SMs; how many SMs MPS
//! actually grants for it is measured in the client, never assumed. (Seen on an H100 with 132 SMs:
//! MPS grants the share's SMs rounded down to whole TPCs of 2 — 45% gave 58 SMs, and the profiles'
//! 13/25/46/49/100% gave exactly 16/32/60/64/132.) What MPS does not partition —
//! the L2 cache and memory bandwidth — a MIG slice has to itself: an emulated small slice looks
//! faster than the real one, and every row says that it was emulated.

use std::fmt;

use anyhow::{bail, Result};

use crate::mig::ProfileTable;

/// What a target asks for, as written after `mps:`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShareSpec {
    /// A MIG profile name of the GPU the client runs on.
    Profile(String),
    /// A whole percentage of the GPU's SMs, 1 to 100.
    Percent(u32),
}

impl ShareSpec {
    /// `3g.40gb` or `45%`.
    pub fn parse(s: &str) -> Result<ShareSpec> {
        if let Some(p) = s.strip_suffix('%') {
            match p.parse::<u32>() {
                Ok(n) if (1..=100).contains(&n) => return Ok(ShareSpec::Percent(n)),
                _ => bail!("`mps:{s}`: a share is a whole percentage from 1% to 100%"),
            }
        }
        if crate::gpu::select::is_profile_name(s) {
            return Ok(ShareSpec::Profile(s.to_string()));
        }
        bail!("`mps:{s}`: after `mps:` comes a MIG profile of the GPU (e.g. mps:3g.40gb) or a share of its SMs (e.g. mps:45%)")
    }
}

impl fmt::Display for ShareSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ShareSpec::Profile(p) => f.write_str(p),
            ShareSpec::Percent(n) => write!(f, "{n}%"),
        }
    }
}

/// The share an MPS client is given.
#[derive(Debug, Clone, PartialEq)]
pub struct Share {
    /// The MIG profile emulated; `None` for a bare percentage.
    pub profile: Option<String>,
    /// `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE`.
    pub percent: u32,
    /// The SMs the profile has (a percentage's share of the GPU's SMs, rounded up).
    pub profile_sms: u32,
    /// `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` in MiB: the profile's memory; `None` for a percentage.
    pub memory_limit_mib: Option<u64>,
    /// The share of the memory system a real slice owns: the profile's memory slices over the GPU's
    /// (1g.10gb of an H100: 1/8); a bare percentage's share of the SMs.
    pub memory_fraction: f64,
}

impl Share {
    /// The share for `spec` on a GPU of `total_sms` SMs whose profiles are `table`.
    pub fn resolve(spec: &ShareSpec, total_sms: u32, table: &ProfileTable) -> Result<Share> {
        if total_sms == 0 {
            bail!("the GPU reports no SMs: cannot size an MPS share")
        }
        match spec {
            ShareSpec::Percent(p) => Ok(Share {
                profile: None,
                percent: *p,
                profile_sms: (total_sms * p).div_ceil(100),
                memory_limit_mib: None,
                memory_fraction: f64::from(*p) / 100.0,
            }),
            ShareSpec::Profile(name) => {
                let profile = table.profile(name)?;
                if profile.sm_count > total_sms {
                    bail!("`{name}` has {} SMs, more than the GPU's {total_sms}", profile.sm_count)
                }
                Ok(Share {
                    profile: Some(name.clone()),
                    percent: (100 * profile.sm_count).div_ceil(total_sms),
                    profile_sms: profile.sm_count,
                    memory_limit_mib: Some((profile.memory_gib * 1024.0).round() as u64),
                    memory_fraction: f64::from(profile.memory_slices) / f64::from(table.memory_slices.max(1)),
                })
            }
        }
    }

    /// What a row calls the share: `3g.40gb (46% of SMs)` or `45% of SMs`.
    pub fn describe(&self) -> String {
        match &self.profile {
            Some(p) => format!("{p} ({}% of SMs)", self.percent),
            None => format!("{}% of SMs", self.percent),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_parse_and_junk_names_the_two_forms() {
        assert_eq!(
            ShareSpec::parse("3g.40gb").unwrap(),
            ShareSpec::Profile("3g.40gb".into())
        );
        assert_eq!(ShareSpec::parse("45%").unwrap(), ShareSpec::Percent(45));
        for bad in ["0%", "101%", "4.5%", "half", "3g"] {
            let e = ShareSpec::parse(bad).unwrap_err().to_string();
            assert!(
                e.contains(&format!("`mps:{bad}`")) && (e.contains("1% to 100%") || e.contains("mps:3g.40gb")),
                "{e}"
            );
        }
    }

    #[test]
    fn every_profile_of_every_checked_in_table_gets_at_least_its_sms_and_at_most_one_percent_more() {
        for (gpu, _) in crate::mig::GPUS {
            let table = crate::mig::table(gpu).unwrap();
            let total = table.profiles.iter().map(|p| p.sm_count).max().unwrap();
            for p in &table.profiles {
                let s = Share::resolve(&ShareSpec::Profile(p.name.clone()), total, &table).unwrap();
                let granted = s.percent as f64 / 100.0 * total as f64;
                assert!(
                    granted >= p.sm_count as f64,
                    "{gpu} {}: {}% of {total} = {granted}",
                    p.name,
                    s.percent
                );
                // The smallest whole percent that does: one less would not.
                assert!(
                    ((s.percent - 1) as f64 / 100.0 * total as f64) < p.sm_count as f64,
                    "{gpu} {}: {}%",
                    p.name,
                    s.percent
                );
                assert_eq!(s.memory_limit_mib, Some((p.memory_gib * 1024.0).round() as u64));
                assert_eq!(s.profile_sms, p.sm_count);
            }
        }
    }

    #[test]
    fn the_h100_profiles_as_the_lent_gpu_gets_them() {
        let table = crate::mig::table("h100-80gb").unwrap();
        let pct = |name: &str| {
            Share::resolve(&ShareSpec::Profile(name.into()), 132, &table)
                .unwrap()
                .percent
        };
        assert_eq!(
            [
                pct("1g.10gb"),
                pct("2g.20gb"),
                pct("3g.40gb"),
                pct("4g.40gb"),
                pct("7g.80gb")
            ],
            [13, 25, 46, 49, 100]
        );
        let s = Share::resolve(&ShareSpec::Profile("3g.40gb".into()), 132, &table).unwrap();
        assert_eq!(
            (s.memory_limit_mib, s.describe()),
            (Some(40448), "3g.40gb (46% of SMs)".to_string())
        );
        let bare = Share::resolve(&ShareSpec::Percent(45), 132, &table).unwrap();
        assert_eq!(
            (bare.profile_sms, bare.memory_limit_mib, bare.describe()),
            (60, None, "45% of SMs".to_string())
        );
        let e = Share::resolve(&ShareSpec::Profile("3g.71gb".into()), 132, &table)
            .unwrap_err()
            .to_string();
        assert!(e.contains("3g.40gb") && e.contains("not a MIG profile"), "{e}");
    }
}
