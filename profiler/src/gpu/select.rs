//! Which GPU or MIG device a `--device` names, checked against the topology before CUDA starts.

use anyhow::{bail, Result};

use super::topology::{Gpu, MigDevice, Topology};

/// The device a run will use, with everything recorded about it.
#[derive(Debug, Clone, PartialEq)]
pub struct Selected {
    pub gpu: Gpu,
    /// The MIG device, when the run is on a slice.
    pub mig: Option<MigDevice>,
}

impl Selected {
    /// The UUID CUDA_VISIBLE_DEVICES must hold so that CUDA sees exactly this device, as ordinal 0.
    pub fn uuid(&self) -> &str {
        match &self.mig {
            Some(m) => &m.uuid,
            None => &self.gpu.uuid,
        }
    }
}

/// Whether `s` reads as a MIG profile name: `3g.40gb`, `1g.10gb+me`, `1c.3g.40gb`.
pub fn is_profile_name(s: &str) -> bool {
    let s = s.strip_suffix("+me").unwrap_or(s);
    let parts: Vec<&str> = s.split('.').collect();
    let count = |p: &str, unit: &str| {
        p.strip_suffix(unit)
            .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
    };
    match parts.as_slice() {
        [g, mem] => count(g, "g") && count(mem, "gb"),
        [c, g, mem] => count(c, "c") && count(g, "g") && count(mem, "gb"),
        _ => false,
    }
}

/// Resolves `id`: a GPU index, `GPU-<uuid>` or `MIG-<uuid>` (a unique prefix is enough, as for
/// CUDA_VISIBLE_DEVICES), a MIG profile name when exactly one MIG device has it, or `first` for the
/// first GPU. A GPU with MIG on cannot run CUDA work itself, so naming one is an error listing its MIG
/// devices.
pub fn select(topology: &Topology, id: &str) -> Result<Selected> {
    if topology.gpus.is_empty() {
        bail!("`{id}`: there are no NVIDIA GPUs here")
    }
    let selected = if id == "first" {
        gpu_itself(topology, &topology.gpus[0], id)?
    } else if let Ok(index) = id.parse::<u32>() {
        match topology.gpus.iter().find(|g| g.index == index) {
            Some(g) => gpu_itself(topology, g, id)?,
            None => bail!("there is no GPU {index}; the devices here:\n{}", topology.choices()),
        }
    } else if is_profile_name(id) {
        let hits = mig_devices_where(topology, |m| m.profile == id);
        match hits.len() {
            1 => hits.into_iter().next().expect("one"),
            0 => bail!(
                "no MIG device has the profile `{id}`; the devices here:\n{}",
                topology.choices()
            ),
            n => bail!(
                "{n} MIG devices have the profile `{id}`; name one by its MIG UUID:\n{}",
                topology.choices()
            ),
        }
    } else if id.starts_with("MIG-") {
        one_of(mig_devices_where(topology, |m| m.uuid.starts_with(id)), id, topology)?
    } else if id.starts_with("GPU-") {
        let hits: Vec<&Gpu> = topology.gpus.iter().filter(|g| g.uuid.starts_with(id)).collect();
        match hits.as_slice() {
            [g] => gpu_itself(topology, g, id)?,
            _ => one_of(
                hits.into_iter()
                    .map(|g| Selected {
                        gpu: g.clone(),
                        mig: None,
                    })
                    .collect(),
                id,
                topology,
            )?,
        }
    } else {
        bail!(
            "`{id}` is not a GPU index, GPU-<uuid>, MIG-<uuid> or MIG profile; the devices here:\n{}",
            topology.choices()
        )
    };
    Ok(selected)
}

/// Every MIG device that `keep` accepts, with its GPU.
fn mig_devices_where(topology: &Topology, keep: impl Fn(&MigDevice) -> bool) -> Vec<Selected> {
    topology
        .gpus
        .iter()
        .flat_map(|g| g.mig_devices.iter().map(move |m| (g, m)))
        .filter(|(_, m)| keep(m))
        .map(|(g, m)| Selected {
            gpu: g.clone(),
            mig: Some(m.clone()),
        })
        .collect()
}

fn gpu_itself(topology: &Topology, g: &Gpu, id: &str) -> Result<Selected> {
    if g.mig_mode.is_some_and(|m| m.current) {
        if g.mig_devices.is_empty() {
            bail!(
                "`{id}`: GPU {} has MIG on and no MIG devices, so nothing can run on it",
                g.index
            )
        }
        bail!(
            "`{id}`: GPU {} has MIG on, so CUDA work runs on its MIG devices only; pick one:\n{}",
            g.index,
            topology.choices()
        )
    }
    Ok(Selected {
        gpu: g.clone(),
        mig: None,
    })
}

fn one_of(mut hits: Vec<Selected>, id: &str, topology: &Topology) -> Result<Selected> {
    match hits.len() {
        1 => Ok(hits.remove(0)),
        0 => bail!(
            "no device has the UUID `{id}`; the devices here:\n{}",
            topology.choices()
        ),
        n => bail!(
            "`{id}` matches {n} devices; give more of the UUID:\n{}",
            topology.choices()
        ),
    }
}
