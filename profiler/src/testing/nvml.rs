//! A stand-in for NVML's MIG calls that keeps its own GPU state, enforces the rules the driver
//! enforces (MIG mode on before instances, a placement of the profile, no overlap, instance limits, a
//! GPU instance destroyed only once its compute instances are gone, no mode change while instances
//! exist), and records every call. The tests of `migprof mig` run against it; no lent GPU may have
//! its MIG layout changed.

use anyhow::{anyhow, bail, Result};

use crate::mig::control::{ComputeInstance, GpuInstanceState, GpuState, MigControl};
use crate::mig::mode::MigMode;
use crate::mig::plan::Placement;
use crate::mig::profile::ProfileTable;

pub struct FakeGpu {
    pub state: GpuState,
    /// `None` for a GPU without MIG.
    pub table: Option<ProfileTable>,
}

pub struct FakeNvml {
    pub gpus: Vec<FakeGpu>,
    /// Every call that changes something, in order, e.g. `create_gpu_instance(gpu 0, profile 9, 4:4)`.
    pub calls: Vec<String>,
    /// A mode change waits for a GPU reset (as on most bare-metal A100/H100 systems).
    pub mode_change_needs_reset: bool,
    /// Creations report success but leave nothing behind (what the post-apply check is for).
    pub creations_vanish: bool,
}

impl FakeNvml {
    /// A machine with one GPU of `table`'s kind, MIG in `mig_on` mode and no instances.
    pub fn with_gpu(table: ProfileTable, mig_on: bool) -> Self {
        let state = GpuState {
            index: 0,
            uuid: "GPU-00000000-0000-0000-0000-000000000000".into(),
            name: table.product.clone(),
            pci_device_id: 0x2330_10DE,
            mig_mode: Some(MigMode {
                current: mig_on,
                pending: mig_on,
            }),
            processes: Vec::new(),
            gpu_instances: Vec::new(),
        };
        FakeNvml {
            gpus: vec![FakeGpu {
                state,
                table: Some(table),
            }],
            calls: Vec::new(),
            mode_change_needs_reset: false,
            creations_vanish: false,
        }
    }

    fn gpu(&mut self, index: u32) -> Result<&mut FakeGpu> {
        self.gpus
            .iter_mut()
            .find(|g| g.state.index == index)
            .ok_or_else(|| anyhow!("NVML: no GPU {index}"))
    }
}

impl MigControl for FakeNvml {
    fn gpus(&mut self) -> Result<Vec<GpuState>> {
        Ok(self.gpus.iter().map(|g| g.state.clone()).collect())
    }

    fn profile_table(&mut self, gpu: u32) -> Result<ProfileTable> {
        self.gpu(gpu)?
            .table
            .clone()
            .ok_or_else(|| anyhow!("NVML: GPU {gpu} does not support MIG"))
    }

    fn set_mig_mode(&mut self, gpu: u32, enabled: bool) -> Result<MigMode> {
        self.calls.push(format!("set_mig_mode(gpu {gpu}, {enabled})"));
        let needs_reset = self.mode_change_needs_reset;
        let g = self.gpu(gpu)?;
        let Some(mode) = g.state.mig_mode.as_mut() else {
            bail!("NVML: GPU {gpu} does not support MIG")
        };
        if !g.state.gpu_instances.is_empty() {
            bail!("NVML: in use (GPU {gpu} still has GPU instances)")
        }
        mode.pending = enabled;
        if !needs_reset {
            mode.current = enabled;
        }
        Ok(*mode)
    }

    fn create_gpu_instance(&mut self, gpu: u32, profile_id: u32, placement: Placement) -> Result<u32> {
        self.calls.push(format!(
            "create_gpu_instance(gpu {gpu}, profile {profile_id}, {}:{})",
            placement.start, placement.size
        ));
        let vanish = self.creations_vanish;
        let g = self.gpu(gpu)?;
        if !g.state.mig_mode.is_some_and(|m| m.current) {
            bail!("NVML: MIG mode is off on GPU {gpu}")
        }
        let table = g.table.as_ref().expect("MIG on implies a table");
        let Some(profile) = table.by_id(profile_id) else {
            bail!("NVML: no GPU-instance profile {profile_id}")
        };
        if placement.size != profile.memory_slices || !profile.placements.contains(&placement.start) {
            bail!(
                "NVML: invalid placement {}:{} for profile {profile_id}",
                placement.start,
                placement.size
            )
        }
        let same = g
            .state
            .gpu_instances
            .iter()
            .filter(|i| i.profile_id == profile_id)
            .count() as u32;
        if same >= profile.max_instances {
            bail!(
                "NVML: insufficient resources (profile {profile_id} allows {})",
                profile.max_instances
            )
        }
        let overlaps = |i: &GpuInstanceState| {
            placement.start < i.placement.start + i.placement.size
                && i.placement.start < placement.start + placement.size
        };
        if g.state.gpu_instances.iter().any(overlaps) {
            bail!(
                "NVML: insufficient resources (placement {}:{} is taken)",
                placement.start,
                placement.size
            )
        }
        let id = (1..)
            .find(|id| g.state.gpu_instances.iter().all(|i| i.id != *id))
            .expect("a free id");
        if !vanish {
            g.state.gpu_instances.push(GpuInstanceState {
                id,
                profile_id,
                placement,
                compute_instances: Vec::new(),
            });
        }
        Ok(id)
    }

    fn create_compute_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<u32> {
        self.calls
            .push(format!("create_compute_instance(gpu {gpu}, gi {gpu_instance})"));
        if self.creations_vanish {
            return Ok(0);
        }
        let g = self.gpu(gpu)?;
        let table = g.table.clone().expect("instances imply a table");
        let gi = g
            .state
            .gpu_instances
            .iter_mut()
            .find(|i| i.id == gpu_instance)
            .ok_or_else(|| anyhow!("NVML: no GPU instance {gpu_instance}"))?;
        if !gi.compute_instances.is_empty() {
            bail!("NVML: insufficient resources (GPU instance {gpu_instance} is already spanned)")
        }
        let slices = table.by_id(gi.profile_id).expect("a known profile").compute_slices;
        gi.compute_instances.push(ComputeInstance {
            id: 0,
            compute_slices: slices,
        });
        Ok(0)
    }

    fn destroy_compute_instance(&mut self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()> {
        self.calls.push(format!(
            "destroy_compute_instance(gpu {gpu}, gi {gpu_instance}, ci {compute_instance})"
        ));
        let g = self.gpu(gpu)?;
        let gi = g
            .state
            .gpu_instances
            .iter_mut()
            .find(|i| i.id == gpu_instance)
            .ok_or_else(|| anyhow!("NVML: no GPU instance {gpu_instance}"))?;
        let before = gi.compute_instances.len();
        gi.compute_instances.retain(|c| c.id != compute_instance);
        if gi.compute_instances.len() == before {
            bail!("NVML: no compute instance {compute_instance} in GPU instance {gpu_instance}")
        }
        Ok(())
    }

    fn destroy_gpu_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<()> {
        self.calls
            .push(format!("destroy_gpu_instance(gpu {gpu}, gi {gpu_instance})"));
        let g = self.gpu(gpu)?;
        let i = g
            .state
            .gpu_instances
            .iter()
            .position(|i| i.id == gpu_instance)
            .ok_or_else(|| anyhow!("NVML: no GPU instance {gpu_instance}"))?;
        if !g.state.gpu_instances[i].compute_instances.is_empty() {
            bail!("NVML: in use (GPU instance {gpu_instance} still has compute instances)")
        }
        g.state.gpu_instances.remove(i);
        Ok(())
    }
}
