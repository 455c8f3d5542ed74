//! What a cluster target asks its scheduler for: a MIG slice of a profile, a whole GPU, or CPUs,
//! optionally on a GPU product. A cell runs on whatever the scheduler assigned, the first device it
//! can see, so a target that names one device (an index, a UUID) has no meaning on a cluster.

use anyhow::{bail, Result};

use crate::sweep::file::Target;

/// A cluster target's resource request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request {
    Cpu,
    /// A whole GPU (`device = "cuda"`).
    Gpu {
        product: Option<String>,
    },
    /// A MIG slice of a profile (`device = "3g.40gb"`).
    Mig {
        profile: String,
        product: Option<String>,
    },
}

impl Request {
    /// The request of `target`, or why a cluster cannot serve it.
    pub fn of(target: &Target) -> Result<Request> {
        let d = target.device.trim();
        let product = target.product.clone();
        let at = format!("[[targets]] `{}`: device = \"{d}\"", target.label);
        let is_profile = d
            .split_once('g')
            .is_some_and(|(n, rest)| !n.is_empty() && n.chars().all(|c| c.is_ascii_digit()) && rest.starts_with('.'));
        match d {
            "cpu" if product.is_some() => bail!("{at}: a CPU target takes no product"),
            "cpu" => Ok(Request::Cpu),
            "cuda" => Ok(Request::Gpu { product }),
            _ if is_profile => {
                let known = known_profiles();
                if !known.contains(d) {
                    bail!("{at}: no known GPU has a MIG profile `{d}`; profiles of the checked-in tables: {}", known.into_iter().collect::<Vec<_>>().join(", "));
                }
                Ok(Request::Mig { profile: d.to_string(), product })
            }
            _ if crate::mps::is_emulated(d) => bail!("{at}: on a cluster, emulated slices are not scheduled resources; ask for a MIG profile (\"3g.40gb\") or a whole GPU (\"cuda\")"),
            _ => bail!(
                "{at}: on a cluster the scheduler picks the device, and a cell runs on the one it assigned; name what to ask for instead: a MIG profile (\"3g.40gb\"), a whole GPU (\"cuda\", with product = \"NVIDIA-H100-80GB-HBM3\" to pick the GPU model) or \"cpu\""
            ),
        }
    }

    /// The `--device` a cell runs with there: the first device the scheduler made visible.
    pub fn cell_device(&self) -> &'static str {
        match self {
            Request::Cpu => "cpu",
            Request::Gpu { .. } | Request::Mig { .. } => "cuda",
        }
    }
}

/// Every profile name of the checked-in GPU tables.
fn known_profiles() -> std::collections::BTreeSet<String> {
    crate::mig::profile::GPUS
        .iter()
        .filter_map(|(gpu, _)| crate::mig::profile::table(gpu).ok())
        .flat_map(|t| t.profiles.into_iter().map(|p| p.name))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(device: &str, product: Option<&str>) -> Target {
        Target {
            label: "t".into(),
            device: device.into(),
            alone: true,
            baseline: false,
            product: product.map(str::to_string),
        }
    }

    #[test]
    fn profiles_whole_gpus_and_cpus_are_requests_and_devices_are_refused_with_the_reason() {
        assert_eq!(
            Request::of(&target("3g.40gb", None)).unwrap(),
            Request::Mig {
                profile: "3g.40gb".into(),
                product: None
            }
        );
        assert_eq!(
            Request::of(&target("1g.10gb+me", None)).unwrap(),
            Request::Mig {
                profile: "1g.10gb+me".into(),
                product: None
            }
        );
        assert_eq!(
            Request::of(&target("cuda", Some("NVIDIA-H100-80GB-HBM3"))).unwrap(),
            Request::Gpu {
                product: Some("NVIDIA-H100-80GB-HBM3".into())
            }
        );
        assert_eq!(Request::of(&target("cpu", None)).unwrap().cell_device(), "cpu");
        for device in ["0", "GPU-5e3f", "MIG-8a1c", "cuda:1"] {
            let e = Request::of(&target(device, None)).unwrap_err().to_string();
            assert!(
                e.contains("the scheduler picks the device") && e.contains("3g.40gb"),
                "{device}: {e}"
            );
        }
        assert!(Request::of(&target("mps:3g.40gb", None))
            .unwrap_err()
            .to_string()
            .contains("emulated slices"));
        let e = Request::of(&target("3g.41gb", None)).unwrap_err().to_string();
        assert!(
            e.contains("no known GPU has a MIG profile `3g.41gb`") && e.contains("3g.40gb"),
            "{e}"
        );
    }
}
