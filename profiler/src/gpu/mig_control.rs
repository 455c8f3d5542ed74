//! [`MigControl`] through NVML. nvml-wrapper wraps MIG mode and processes; GPU- and compute-instance
//! management it leaves out, so those calls go through nvml-wrapper-sys, each symbol checked first
//! (an older driver may lack it) and each return code turned into an error that names the call.
//!
//! Not verified on hardware: the lent GPUs must keep MIG off, so these calls have run only as far
//! as the read-only ones (the GPU list, MIG mode, processes, the profile table). The logic above them
//! is tested against `testing::nvml`.

use std::collections::BTreeSet;

use anyhow::{anyhow, bail, Result};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;

use crate::mig::control::{ComputeInstance, GpuInstanceState, GpuState, MigControl};
use crate::mig::mode::MigMode;
use crate::mig::{Placement, ProfileTable};

pub struct NvmlControl {
    nvml: Nvml,
}

impl NvmlControl {
    pub fn new() -> Result<Self> {
        Ok(NvmlControl {
            nvml: Nvml::init().map_err(|e| anyhow!("no usable NVIDIA driver (NVML: {e})"))?,
        })
    }

    fn device(&self, index: u32) -> Result<Device<'_>> {
        self.nvml
            .device_by_index(index)
            .map_err(|e| anyhow!("GPU {index}: {e}"))
    }
}

/// Fails with the call's name and NVML's error string unless it succeeded.
fn check(nvml: &Nvml, call: &str, rc: sys::nvmlReturn_t) -> Result<()> {
    if rc == sys::nvmlReturn_enum_NVML_SUCCESS {
        return Ok(());
    }
    let text = nvml
        .lib()
        .nvmlErrorString
        .as_ref()
        .ok()
        // SAFETY: nvmlErrorString returns a static NUL-terminated string for any code.
        .map(|f| {
            unsafe { std::ffi::CStr::from_ptr(f(rc)) }
                .to_string_lossy()
                .into_owned()
        })
        .unwrap_or_default();
    bail!("{call} failed: {text} (NVML error {rc})")
}

macro_rules! sym {
    ($nvml:expr, $name:ident) => {
        $nvml
            .lib()
            .$name
            .as_ref()
            .map_err(|_| anyhow!(concat!("this NVIDIA driver's NVML has no ", stringify!($name))))?
    };
}

impl NvmlControl {
    fn gpu_instance(&self, gpu: u32, id: u32) -> Result<sys::nvmlGpuInstance_t> {
        let dev = self.device(gpu)?;
        let f = sym!(self.nvml, nvmlDeviceGetGpuInstanceById);
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a device handle of this NVML session and an out-pointer.
        check(&self.nvml, "nvmlDeviceGetGpuInstanceById", unsafe {
            f(dev.handle(), id, &mut gi)
        })?;
        Ok(gi)
    }

    /// Every GPU instance of the GPU with its compute instances.
    fn gpu_instances(&self, dev: &Device) -> Result<Vec<GpuInstanceState>> {
        let list = sym!(self.nvml, nvmlDeviceGetGpuInstances);
        let info = sym!(self.nvml, nvmlGpuInstanceGetInfo);
        let mut out = Vec::new();
        for profile in super::nvml::gpu_instance_profiles(&self.nvml, dev) {
            let mut handles: Vec<sys::nvmlGpuInstance_t> =
                vec![std::ptr::null_mut(); profile.instances.max(1) as usize];
            let mut count = 0;
            // SAFETY: room for as many instances as the profile allows.
            check(&self.nvml, "nvmlDeviceGetGpuInstances", unsafe {
                list(dev.handle(), profile.id, handles.as_mut_ptr(), &mut count)
            })?;
            for &gi in &handles[..count as usize] {
                // SAFETY: a GPU-instance handle NVML just returned; a zeroed plain-data struct.
                let mut i: sys::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
                check(&self.nvml, "nvmlGpuInstanceGetInfo", unsafe { info(gi, &mut i) })?;
                out.push(GpuInstanceState {
                    id: i.id,
                    profile_id: i.profileId,
                    placement: Placement {
                        start: i.placement.start,
                        size: i.placement.size,
                    },
                    compute_instances: self.compute_instances(gi)?,
                });
            }
        }
        out.sort_by_key(|g| g.id);
        Ok(out)
    }

    /// The compute-instance profiles of a GPU instance: (NVML profile index, profile id, slices).
    fn compute_profiles(&self, gi: sys::nvmlGpuInstance_t) -> Result<Vec<(u32, u32, u32)>> {
        let f = sym!(self.nvml, nvmlGpuInstanceGetComputeInstanceProfileInfoV);
        let mut out = Vec::new();
        for p in 0..sys::NVML_COMPUTE_INSTANCE_PROFILE_COUNT {
            // SAFETY: a zeroed plain-data struct with its version set, as the v2 query requires.
            let mut info: sys::nvmlComputeInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
            info.version = std::mem::size_of::<sys::nvmlComputeInstanceProfileInfo_v2_t>() as u32 | (2 << 24);
            let rc = unsafe { f(gi, p, sys::NVML_COMPUTE_INSTANCE_ENGINE_PROFILE_SHARED, &mut info) };
            if rc == sys::nvmlReturn_enum_NVML_SUCCESS {
                out.push((p, info.id, info.sliceCount));
            }
        }
        Ok(out)
    }

    fn compute_instances(&self, gi: sys::nvmlGpuInstance_t) -> Result<Vec<ComputeInstance>> {
        let list = sym!(self.nvml, nvmlGpuInstanceGetComputeInstances);
        let info = sym!(self.nvml, nvmlComputeInstanceGetInfo_v2);
        let mut out = Vec::new();
        for (_, id, slices) in self.compute_profiles(gi)? {
            let mut handles: Vec<sys::nvmlComputeInstance_t> = vec![std::ptr::null_mut(); 8];
            let mut count = 0;
            // SAFETY: room for eight, the most compute instances a GPU instance can hold.
            check(&self.nvml, "nvmlGpuInstanceGetComputeInstances", unsafe {
                list(gi, id, handles.as_mut_ptr(), &mut count)
            })?;
            for &ci in &handles[..count as usize] {
                // SAFETY: a handle NVML just returned; a zeroed plain-data struct.
                let mut i: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
                check(&self.nvml, "nvmlComputeInstanceGetInfo_v2", unsafe { info(ci, &mut i) })?;
                out.push(ComputeInstance {
                    id: i.id,
                    compute_slices: slices,
                });
            }
        }
        out.sort_by_key(|c| c.id);
        Ok(out)
    }

    fn processes(&self, dev: &Device) -> Result<Vec<u32>> {
        let mut pids = BTreeSet::new();
        let mut add = |r: Result<Vec<nvml_wrapper::struct_wrappers::device::ProcessInfo>, NvmlError>| match r {
            Ok(v) => {
                pids.extend(v.into_iter().map(|p| p.pid));
                Ok(())
            }
            Err(NvmlError::NotSupported) => Ok(()),
            Err(e) => Err(e),
        };
        add(dev.running_compute_processes())?;
        add(dev.running_graphics_processes())?;
        // With MIG on, a process on a MIG device is listed on that device.
        if dev.mig_mode().is_ok_and(|m| m.current == 1) {
            for i in 0..dev.mig_device_count()? {
                if let Ok(mig) = dev.mig_device_by_index(i) {
                    add(mig.running_compute_processes())?;
                }
            }
        }
        Ok(pids.into_iter().collect())
    }
}

impl MigControl for NvmlControl {
    fn gpus(&mut self) -> Result<Vec<GpuState>> {
        let mut out = Vec::new();
        for index in 0..self.nvml.device_count()? {
            let dev = self.device(index)?;
            let mig_mode = match dev.mig_mode() {
                Ok(m) => Some(MigMode {
                    current: m.current == 1,
                    pending: m.pending == 1,
                }),
                Err(NvmlError::NotSupported) => None,
                Err(e) => return Err(e.into()),
            };
            let gpu_instances = if mig_mode.is_some_and(|m| m.current) {
                self.gpu_instances(&dev)?
            } else {
                Vec::new()
            };
            out.push(GpuState {
                index,
                uuid: dev.uuid()?,
                name: dev.name()?,
                pci_device_id: dev.pci_info()?.pci_device_id,
                mig_mode,
                processes: self.processes(&dev)?,
                gpu_instances,
            });
        }
        Ok(out)
    }

    fn profile_table(&mut self, gpu: u32) -> Result<ProfileTable> {
        super::nvml::profile_table_of(&self.nvml, gpu)
    }

    fn set_mig_mode(&mut self, gpu: u32, enabled: bool) -> Result<MigMode> {
        let dev = self.device(gpu)?;
        dev.set_mig_mode(enabled)
            .map_err(|e| anyhow!("nvmlDeviceSetMigMode failed: {e}"))?;
        let m = dev.mig_mode()?;
        Ok(MigMode {
            current: m.current == 1,
            pending: m.pending == 1,
        })
    }

    fn create_gpu_instance(&mut self, gpu: u32, profile_id: u32, placement: Placement) -> Result<u32> {
        let dev = self.device(gpu)?;
        let create = sym!(self.nvml, nvmlDeviceCreateGpuInstanceWithPlacement);
        let info = sym!(self.nvml, nvmlGpuInstanceGetInfo);
        let p = sys::nvmlGpuInstancePlacement_t {
            start: placement.start,
            size: placement.size,
        };
        let mut gi: sys::nvmlGpuInstance_t = std::ptr::null_mut();
        // SAFETY: a device handle of this NVML session, a placement struct and an out-pointer.
        check(&self.nvml, "nvmlDeviceCreateGpuInstanceWithPlacement", unsafe {
            create(dev.handle(), profile_id, &p, &mut gi)
        })?;
        // SAFETY: the handle NVML just returned; a zeroed plain-data struct.
        let mut i: sys::nvmlGpuInstanceInfo_t = unsafe { std::mem::zeroed() };
        check(&self.nvml, "nvmlGpuInstanceGetInfo", unsafe { info(gi, &mut i) })?;
        Ok(i.id)
    }

    fn create_compute_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<u32> {
        let gi = self.gpu_instance(gpu, gpu_instance)?;
        // The profile with the most slices spans the GPU instance: nvidia-smi's default (`-C`).
        let (_, profile_id, _) = self
            .compute_profiles(gi)?
            .into_iter()
            .max_by_key(|p| p.2)
            .ok_or_else(|| anyhow!("GPU {gpu} GI {gpu_instance} reports no compute-instance profiles"))?;
        let create = sym!(self.nvml, nvmlGpuInstanceCreateComputeInstance);
        let info = sym!(self.nvml, nvmlComputeInstanceGetInfo_v2);
        let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: a GPU-instance handle of this NVML session and an out-pointer.
        check(&self.nvml, "nvmlGpuInstanceCreateComputeInstance", unsafe {
            create(gi, profile_id, &mut ci)
        })?;
        // SAFETY: the handle NVML just returned; a zeroed plain-data struct.
        let mut i: sys::nvmlComputeInstanceInfo_t = unsafe { std::mem::zeroed() };
        check(&self.nvml, "nvmlComputeInstanceGetInfo_v2", unsafe { info(ci, &mut i) })?;
        Ok(i.id)
    }

    fn destroy_compute_instance(&mut self, gpu: u32, gpu_instance: u32, compute_instance: u32) -> Result<()> {
        let gi = self.gpu_instance(gpu, gpu_instance)?;
        let by_id = sym!(self.nvml, nvmlGpuInstanceGetComputeInstanceById);
        let destroy = sym!(self.nvml, nvmlComputeInstanceDestroy);
        let mut ci: sys::nvmlComputeInstance_t = std::ptr::null_mut();
        // SAFETY: a GPU-instance handle of this NVML session and an out-pointer; then the handle it gave.
        check(&self.nvml, "nvmlGpuInstanceGetComputeInstanceById", unsafe {
            by_id(gi, compute_instance, &mut ci)
        })?;
        check(&self.nvml, "nvmlComputeInstanceDestroy", unsafe { destroy(ci) })
    }

    fn destroy_gpu_instance(&mut self, gpu: u32, gpu_instance: u32) -> Result<()> {
        let gi = self.gpu_instance(gpu, gpu_instance)?;
        let destroy = sym!(self.nvml, nvmlGpuInstanceDestroy);
        // SAFETY: a GPU-instance handle of this NVML session.
        check(&self.nvml, "nvmlGpuInstanceDestroy", unsafe { destroy(gi) })
    }
}
