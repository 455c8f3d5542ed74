//! MIG layouts as files, in the format of NVIDIA's mig-parted (`version: v1`, `mig-configs`), so a
//! layout written for the GPU operator's MIG manager applies with `migprof mig apply` and the other
//! way round:
//!
//! ```yaml
//! version: v1
//! mig-configs:
//!   inference:
//!     - devices: [0]
//!       mig-enabled: true
//!       mig-devices:
//!         3g.40gb: 1
//!         2g.20gb: 1
//!         1g.10gb: 2
//!     - devices: [1]          # each GPU may be named by one entry only
//!       mig-enabled: false
//! ```

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::{Deserialize, Serialize};

/// A mig-parted file: named configurations, each a list of per-GPU entries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct MigPartedFile {
    pub version: String,
    pub mig_configs: BTreeMap<String, Vec<DeviceConfig>>,
}

/// What one or more GPUs should look like.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct DeviceConfig {
    pub devices: Devices,
    /// PCI device ids (`0x233010DE`) the entry is limited to, as mig-parted writes them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_filter: Option<DeviceFilter>,
    pub mig_enabled: bool,
    /// GPU-instance profile name -> how many.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub mig_devices: BTreeMap<String, u32>,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Devices {
    /// Only `all` is meaningful; anything else is refused when the file is read.
    Word(String),
    Indices(Vec<u32>),
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum DeviceFilter {
    One(String),
    Many(Vec<String>),
}

/// What a GPU looks like to the selection rules of an entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuKey {
    pub index: u32,
    /// NVML's combined PCI device and vendor id, e.g. 0x233010DE for an H100 SXM.
    pub pci_device_id: u32,
}

impl MigPartedFile {
    pub fn read(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("{} is not a mig-parted layout file", path.display()))
    }

    pub fn parse(text: &str) -> Result<Self> {
        let file: Self = serde_yaml::from_str(text)?;
        if file.version != "v1" {
            bail!(
                "version `{}` is not supported; the only mig-parted version is `v1`",
                file.version
            )
        }
        for (name, entries) in &file.mig_configs {
            if entries.is_empty() {
                bail!("config `{name}` has no entries")
            }
            for e in entries {
                if let Devices::Word(w) = &e.devices {
                    if w != "all" {
                        bail!("config `{name}`: devices must be `all` or a list of GPU indices, not `{w}`")
                    }
                }
                if !e.mig_enabled && !e.mig_devices.is_empty() {
                    bail!("config `{name}`: mig-devices are listed for GPUs with mig-enabled: false")
                }
                for (profile, count) in &e.mig_devices {
                    if *count == 0 {
                        bail!("config `{name}`: {profile}: 0 instances; leave the profile out instead")
                    }
                }
            }
        }
        Ok(file)
    }

    pub fn to_yaml(&self) -> Result<String> {
        Ok(serde_yaml::to_string(self)?)
    }

    /// The configuration to apply: the one named, or the file's only one.
    pub fn select(&self, name: Option<&str>) -> Result<(&str, &[DeviceConfig])> {
        let names = || {
            self.mig_configs
                .keys()
                .map(String::as_str)
                .collect::<Vec<_>>()
                .join(", ")
        };
        match name {
            Some(n) => match self.mig_configs.get_key_value(n) {
                Some((k, v)) => Ok((k.as_str(), v.as_slice())),
                None => bail!("no config `{n}` in the file; its configs: {}", names()),
            },
            None if self.mig_configs.len() == 1 => {
                let (k, v) = self.mig_configs.iter().next().expect("one config");
                Ok((k.as_str(), v.as_slice()))
            }
            None if self.mig_configs.is_empty() => bail!("the file has no mig-configs"),
            None => bail!(
                "the file holds {} configs ({}); pick one with --config NAME",
                self.mig_configs.len(),
                names()
            ),
        }
    }
}

impl DeviceConfig {
    pub fn selects(&self, gpu: GpuKey) -> bool {
        let listed = match &self.devices {
            Devices::Word(_) => true,
            Devices::Indices(v) => v.contains(&gpu.index),
        };
        let filtered = match &self.device_filter {
            None => true,
            Some(DeviceFilter::One(id)) => same_pci_id(id, gpu.pci_device_id),
            Some(DeviceFilter::Many(ids)) => ids.iter().any(|id| same_pci_id(id, gpu.pci_device_id)),
        };
        listed && filtered
    }

    /// The profiles of the entry, each repeated as often as it is wanted.
    pub fn profiles(&self) -> Vec<&str> {
        self.mig_devices
            .iter()
            .flat_map(|(name, n)| std::iter::repeat_n(name.as_str(), *n as usize))
            .collect()
    }
}

fn same_pci_id(text: &str, id: u32) -> bool {
    let digits = text.trim().trim_start_matches("0x").trim_start_matches("0X");
    u32::from_str_radix(digits, 16).is_ok_and(|v| v == id)
}

/// The entry for each GPU of `gpus` that `entries` names (GPUs named by none are left alone); an
/// error when an entry names a GPU that is not there or two entries name the same GPU.
pub fn entries_by_gpu<'a>(entries: &'a [DeviceConfig], gpus: &[GpuKey]) -> Result<Vec<(GpuKey, &'a DeviceConfig)>> {
    for e in entries {
        if let Devices::Indices(v) = &e.devices {
            for i in v {
                if !gpus.iter().any(|g| g.index == *i) {
                    let have: Vec<String> = gpus.iter().map(|g| g.index.to_string()).collect();
                    bail!(
                        "the layout names GPU {i}; this machine's GPUs: {}",
                        if have.is_empty() {
                            "none".into()
                        } else {
                            have.join(", ")
                        }
                    )
                }
            }
        }
    }
    let mut out = Vec::new();
    for &g in gpus {
        let matching: Vec<&DeviceConfig> = entries.iter().filter(|e| e.selects(g)).collect();
        match matching.as_slice() {
            [] => {}
            [e] => out.push((g, *e)),
            _ => bail!(
                "{} entries of the config select GPU {}; each GPU may be named once",
                matching.len(),
                g.index
            ),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
version: v1
mig-configs:
  all-disabled:
    - devices: all
      mig-enabled: false
  mixed:
    - devices: [0]
      mig-enabled: true
      mig-devices:
        "3g.40gb": 1
        "2g.20gb": 1
        "1g.10gb": 2
    - devices: [1]
      device-filter: "0x233010DE"
      mig-enabled: false
"#;

    fn gpus() -> Vec<GpuKey> {
        vec![
            GpuKey {
                index: 0,
                pci_device_id: 0x2330_10DE,
            },
            GpuKey {
                index: 1,
                pci_device_id: 0x2330_10DE,
            },
        ]
    }

    #[test]
    fn parses_mig_parted_files_and_selects_a_config() {
        let f = MigPartedFile::parse(FILE).unwrap();
        let (name, entries) = f.select(Some("mixed")).unwrap();
        assert_eq!(name, "mixed");
        assert_eq!(entries[0].profiles(), vec!["1g.10gb", "1g.10gb", "2g.20gb", "3g.40gb"]);
        let e = f.select(None).unwrap_err().to_string();
        assert!(
            e.contains("2 configs (all-disabled, mixed)") && e.contains("--config"),
            "{e}"
        );
        assert!(f
            .select(Some("none"))
            .unwrap_err()
            .to_string()
            .contains("its configs: all-disabled, mixed"));
    }

    #[test]
    fn entries_are_matched_to_gpus_by_index_and_pci_id() {
        let f = MigPartedFile::parse(FILE).unwrap();
        let (_, mixed) = f.select(Some("mixed")).unwrap();
        let by_gpu = entries_by_gpu(mixed, &gpus()).unwrap();
        assert_eq!(
            by_gpu.iter().map(|(g, e)| (g.index, e.mig_enabled)).collect::<Vec<_>>(),
            vec![(0, true), (1, false)]
        );
        // A filter for another product leaves the GPU alone.
        let other = vec![
            GpuKey {
                index: 0,
                pci_device_id: 0x2330_10DE,
            },
            GpuKey {
                index: 1,
                pci_device_id: 0x20B0_10DE,
            },
        ];
        assert_eq!(entries_by_gpu(mixed, &other).unwrap().len(), 1);
        let (_, all) = f.select(Some("all-disabled")).unwrap();
        assert_eq!(entries_by_gpu(all, &gpus()).unwrap().len(), 2);
        let e = entries_by_gpu(mixed, &gpus()[..1]).unwrap_err().to_string();
        assert!(e.contains("names GPU 1; this machine's GPUs: 0"), "{e}");
    }

    #[test]
    fn a_gpu_named_twice_is_refused() {
        let f = MigPartedFile::parse(
            "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: false\n    - devices: [0]\n      mig-enabled: false\n",
        )
        .unwrap();
        let e = entries_by_gpu(f.select(None).unwrap().1, &gpus())
            .unwrap_err()
            .to_string();
        assert!(e.contains("2 entries of the config select GPU 0"), "{e}");
    }

    #[test]
    fn bad_files_name_what_is_wrong() {
        let bad = |text: &str| MigPartedFile::parse(text).unwrap_err().to_string();
        assert!(bad("version: v2\nmig-configs: {}\n").contains("only mig-parted version is `v1`"));
        assert!(
            bad("version: v1\nmig-configs:\n  c:\n    - devices: some\n      mig-enabled: false\n")
                .contains("`all` or a list")
        );
        assert!(bad("version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: false\n      mig-devices: {1g.10gb: 1}\n")
            .contains("mig-enabled: false"));
        assert!(
            bad("version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enable: true\n")
                .contains("unknown field `mig-enable`")
        );
        assert!(bad("version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {1g.10gb: 0}\n")
            .contains("0 instances"));
    }

    #[test]
    fn written_files_read_back_the_same() {
        let f = MigPartedFile::parse(FILE).unwrap();
        let text = f.to_yaml().unwrap();
        assert!(
            text.contains("mig-configs:") && text.contains("mig-enabled: true"),
            "{text}"
        );
        assert_eq!(MigPartedFile::parse(&text).unwrap(), f);
    }
}
