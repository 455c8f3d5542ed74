//! Reading the topology from NVML (libnvidia-ml, loaded at run time: a machine without the driver gets
//! an error saying so, never a crash). nvml-wrapper leaves the GPU- and compute-instance queries of a
//! MIG device and the named profile table unwrapped; those go through nvml-wrapper-sys, each symbol
//! checked before use, since an older driver may lack it.

use std::ffi::CStr;

use anyhow::{anyhow, bail, Result};
use nvml_wrapper::error::NvmlError;
use nvml_wrapper::{Device, Nvml};
use nvml_wrapper_sys::bindings as sys;

use super::topology::{Gpu, MigDevice, Topology};
use crate::mig::mode::MigMode;

const MIB: u64 = 1 << 20;

pub fn read_topology() -> Result<Topology> {
    let nvml = Nvml::init().map_err(|e| anyhow!("no usable NVIDIA driver (NVML: {e})"))?;
    let driver_version = nvml.sys_driver_version().ok();
    let mut gpus = Vec::new();
    for index in 0..nvml.device_count()? {
        let dev = nvml.device_by_index(index)?;
        let mig_mode = match dev.mig_mode() {
            Ok(m) => Some(MigMode {
                current: m.current == 1,
                pending: m.pending == 1,
            }),
            Err(NvmlError::NotSupported) => None,
            Err(e) => return Err(e.into()),
        };
        let profiles = gpu_instance_profiles(&nvml, &dev);
        let mig_devices = if mig_mode.is_some_and(|m| m.current) {
            mig_devices(&nvml, &dev, &profiles)?
        } else {
            Vec::new()
        };
        // NVML's attributes answer for MIG devices only; the full-GPU profile (7g) has every SM.
        let sm_count = dev
            .attributes()
            .ok()
            .map(|a| a.multiprocessor_count)
            .or_else(|| profiles.iter().map(|p| p.sm_count).max());
        gpus.push(Gpu {
            index,
            uuid: dev.uuid()?,
            name: dev.name()?,
            memory_mib: dev.memory_info()?.total / MIB,
            sm_count,
            mig_mode,
            mig_devices,
        });
    }
    Ok(Topology { driver_version, gpus })
}

fn mig_devices(nvml: &Nvml, parent: &Device, profiles: &[GpuInstanceProfile]) -> Result<Vec<MigDevice>> {
    let mut out = Vec::new();
    for i in 0..parent.mig_device_count()? {
        let mig = match parent.mig_device_by_index(i) {
            Ok(m) => m,
            Err(NvmlError::NotFound) | Err(NvmlError::InvalidArg) => continue, // an empty slot
            Err(e) => return Err(e.into()),
        };
        let a = mig.attributes()?;
        let slices = Slices {
            gpu_instance: a.gpu_instance_slice_count,
            compute_instance: a.compute_instance_slice_count,
            memory_mib: a.memory_size_mb,
            decoders: a.shared_decoder_count,
            jpegs: a.shared_jpeg_count,
            ofas: a.shared_ofa_count,
        };
        // SAFETY: the handles come from this NVML session and outlive the calls.
        let handle = unsafe { mig.handle() };
        out.push(MigDevice {
            uuid: mig.uuid()?,
            gpu_instance_id: instance_id(nvml, handle, Instance::Gpu)?,
            compute_instance_id: instance_id(nvml, handle, Instance::Compute)?,
            profile: profile_name(&slices, profiles),
            sm_count: a.multiprocessor_count,
            memory_mib: mig.memory_info()?.total / MIB,
        });
    }
    out.sort_by_key(|m| (m.gpu_instance_id, m.compute_instance_id));
    Ok(out)
}

enum Instance {
    Gpu,
    Compute,
}

fn instance_id(nvml: &Nvml, handle: sys::nvmlDevice_t, which: Instance) -> Result<u32> {
    let lib = nvml.lib();
    let (sym, name) = match which {
        Instance::Gpu => (lib.nvmlDeviceGetGpuInstanceId.as_ref(), "nvmlDeviceGetGpuInstanceId"),
        Instance::Compute => (
            lib.nvmlDeviceGetComputeInstanceId.as_ref(),
            "nvmlDeviceGetComputeInstanceId",
        ),
    };
    let f = sym.map_err(|_| anyhow!("this NVIDIA driver's NVML has no {name}"))?;
    let mut id = 0;
    // SAFETY: a valid MIG device handle and an out-pointer to a c_uint.
    let rc = unsafe { f(handle, &mut id) };
    if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
        bail!("{name} failed (NVML error {rc})")
    }
    Ok(id)
}

/// One GPU-instance profile of a GPU, as NVML describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct GpuInstanceProfile {
    /// Without NVML's "MIG " prefix: `1g.10gb`, `1g.10gb+me`, `7g.80gb`.
    pub name: String,
    pub id: u32,
    pub slices: u32,
    pub instances: u32,
    pub sm_count: u32,
    pub memory_mib: u64,
    pub copy_engines: u32,
    pub decoders: u32,
    pub encoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
}

/// The GPU's GPU-instance profiles by name (NVML answers this with MIG off too); empty when the
/// driver lacks the named query.
pub fn gpu_instance_profiles(nvml: &Nvml, gpu: &Device) -> Vec<GpuInstanceProfile> {
    let Ok(f) = nvml.lib().nvmlDeviceGetGpuInstanceProfileInfoV.as_ref() else {
        return Vec::new();
    };
    // SAFETY: a device handle of this NVML session.
    let handle = unsafe { gpu.handle() };
    let mut out = Vec::new();
    for p in 0..sys::NVML_GPU_INSTANCE_PROFILE_COUNT {
        // SAFETY: a zeroed plain-data struct with its version set, as the v2 query requires.
        let mut info: sys::nvmlGpuInstanceProfileInfo_v2_t = unsafe { std::mem::zeroed() };
        info.version = std::mem::size_of::<sys::nvmlGpuInstanceProfileInfo_v2_t>() as u32 | (2 << 24);
        if unsafe {
            f(
                handle,
                p,
                &mut info as *mut _ as *mut sys::nvmlGpuInstanceProfileInfo_v2_t,
            )
        } != sys::nvmlReturn_enum_NVML_SUCCESS
        {
            continue;
        }
        // SAFETY: NVML writes a NUL-terminated name into the fixed buffer.
        let name = unsafe { CStr::from_ptr(info.name.as_ptr()) }.to_string_lossy();
        out.push(GpuInstanceProfile {
            name: name.trim_start_matches("MIG ").to_string(),
            id: info.id,
            slices: info.sliceCount,
            instances: info.instanceCount,
            sm_count: info.multiprocessorCount,
            memory_mib: info.memorySizeMB,
            copy_engines: info.copyEngineCount,
            decoders: info.decoderCount,
            encoders: info.encoderCount,
            jpegs: info.jpegCount,
            ofas: info.ofaCount,
        });
    }
    out
}

/// Where instances of a GPU-instance profile may start, as (start, size) in memory slices. Called raw
/// because nvml-wrapper's `possible_placements` hands back an empty list (it never sets the length of
/// the vector NVML filled).
fn placements(nvml: &Nvml, gpu: &Device, profile_id: u32) -> Result<Vec<(u32, u32)>> {
    let f = nvml
        .lib()
        .nvmlDeviceGetGpuInstancePossiblePlacements_v2
        .as_ref()
        .map_err(|_| anyhow!("this NVIDIA driver's NVML has no nvmlDeviceGetGpuInstancePossiblePlacements_v2"))?;
    // SAFETY: a device handle of this NVML session; the first call only counts, the second fills `count`
    // zeroed plain-data structs.
    let handle = unsafe { gpu.handle() };
    let mut count = 0;
    let rc = unsafe { f(handle, profile_id, std::ptr::null_mut(), &mut count) };
    if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
        bail!("nvmlDeviceGetGpuInstancePossiblePlacements_v2 failed for profile {profile_id} (NVML error {rc})")
    }
    let mut out = vec![sys::nvmlGpuInstancePlacement_t { start: 0, size: 0 }; count as usize];
    let rc = unsafe { f(handle, profile_id, out.as_mut_ptr(), &mut count) };
    if rc != sys::nvmlReturn_enum_NVML_SUCCESS {
        bail!("nvmlDeviceGetGpuInstancePossiblePlacements_v2 failed for profile {profile_id} (NVML error {rc})")
    }
    out.truncate(count as usize);
    Ok(out.into_iter().map(|p| (p.start, p.size)).collect())
}

/// The live MIG profile table of GPU `index` (NVML answers it with MIG off too).
pub fn profile_table(index: u32) -> Result<crate::mig::ProfileTable> {
    let nvml = Nvml::init().map_err(|e| anyhow!("no usable NVIDIA driver (NVML: {e})"))?;
    profile_table_of(&nvml, index)
}

/// The live MIG profile table of GPU `index`, in an NVML session already open.
pub fn profile_table_of(nvml: &Nvml, index: u32) -> Result<crate::mig::ProfileTable> {
    let gpu = nvml.device_by_index(index).map_err(|e| anyhow!("GPU {index}: {e}"))?;
    let name = gpu.name()?;
    let mut profiles = Vec::new();
    for p in gpu_instance_profiles(nvml, &gpu) {
        let spots = placements(nvml, &gpu, p.id)?;
        let size = spots.first().map(|s| s.1).unwrap_or(0);
        profiles.push(crate::mig::MigProfile {
            name: p.name,
            id: p.id,
            compute_slices: p.slices,
            memory_slices: size,
            memory_gib: p.memory_mib as f64 / 1024.0,
            sm_count: p.sm_count,
            max_instances: p.instances,
            copy_engines: p.copy_engines,
            decoders: p.decoders,
            encoders: p.encoders,
            jpegs: p.jpegs,
            ofas: p.ofas,
            placements: spots.into_iter().map(|s| s.0).collect(),
        });
    }
    if profiles.is_empty() {
        bail!("GPU {index} ({name}) reports no MIG profiles: it does not support MIG")
    }
    // nvidia-smi's order: by compute slices, then memory (NVML's profile indices put 1g.20gb last).
    profiles.sort_by(|a, b| {
        (a.compute_slices, a.memory_slices, &a.name).cmp(&(b.compute_slices, b.memory_slices, &b.name))
    });
    Ok(crate::mig::ProfileTable {
        gpu: format!("gpu{index}"),
        compute_slices: profiles.iter().map(|p| p.compute_slices).max().unwrap_or(0),
        memory_slices: profiles.iter().map(|p| p.memory_slices).max().unwrap_or(0),
        product: name,
        source: "NVML on this machine".into(),
        profiles,
    })
}

/// What a MIG device's attributes say about its slice.
#[derive(Debug, Clone, PartialEq)]
pub struct Slices {
    pub gpu_instance: u32,
    pub compute_instance: u32,
    pub memory_mib: u64,
    pub decoders: u32,
    pub jpegs: u32,
    pub ofas: u32,
}

/// The nvidia-smi name of a MIG device's profile: the GPU-instance profile with its slice count,
/// memory and media engines (which tell `1g.10gb` from `1g.10gb+me`), prefixed with `Nc.` when the
/// compute instance has fewer slices than its GPU instance. Without a matching profile, a name built
/// from the slice count and the memory rounded up to whole GiB: right for every H100 80GB profile, but
/// NVIDIA's names follow no single rule (the H200's 1g.18gb has 16 GiB), hence the named table first.
pub fn profile_name(s: &Slices, profiles: &[GpuInstanceProfile]) -> String {
    let same_size = |p: &&GpuInstanceProfile| p.slices == s.gpu_instance && p.memory_mib == s.memory_mib;
    let candidates: Vec<&GpuInstanceProfile> = profiles.iter().filter(same_size).collect();
    let exact = candidates
        .iter()
        .find(|p| p.decoders == s.decoders && p.jpegs == s.jpegs && p.ofas == s.ofas);
    let gi = match (exact, candidates.first()) {
        (Some(p), _) | (None, Some(p)) => p.name.clone(),
        (None, None) => format!("{}g.{}gb", s.gpu_instance, s.memory_mib.div_ceil(1024)),
    };
    if s.compute_instance < s.gpu_instance {
        format!("{}c.{gi}", s.compute_instance)
    } else {
        gi
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The H100 80GB HBM3's GPU-instance profiles as `nvidia-smi mig -lgip` listed them on the lent GPU
    /// (driver 580.159.04, 2026-11-22): memory in GiB there (9.75, 19.62, 39.50, 79.25) is MiB here.
    fn h100() -> Vec<GpuInstanceProfile> {
        let p = |name: &str, slices, memory_mib, decoders, jpegs, ofas| GpuInstanceProfile {
            name: name.to_string(),
            id: 0,
            slices,
            instances: 1,
            sm_count: 0,
            memory_mib,
            copy_engines: 0,
            encoders: 0,
            decoders,
            jpegs,
            ofas,
        };
        vec![
            p("1g.10gb", 1, 9984, 1, 1, 0),
            p("1g.10gb+me", 1, 9984, 1, 1, 1),
            p("1g.20gb", 1, 20096, 1, 1, 0),
            p("2g.20gb", 2, 20096, 2, 2, 0),
            p("3g.40gb", 3, 40448, 3, 3, 0),
            p("4g.40gb", 4, 40448, 4, 4, 0),
            p("7g.80gb", 7, 81152, 7, 7, 1),
        ]
    }

    fn slices(gi: u32, ci: u32, memory_mib: u64, media: (u32, u32, u32)) -> Slices {
        Slices {
            gpu_instance: gi,
            compute_instance: ci,
            memory_mib,
            decoders: media.0,
            jpegs: media.1,
            ofas: media.2,
        }
    }

    #[test]
    fn names_follow_the_profile_table() {
        assert_eq!(profile_name(&slices(3, 3, 40448, (3, 3, 0)), &h100()), "3g.40gb");
        assert_eq!(profile_name(&slices(4, 4, 40448, (4, 4, 0)), &h100()), "4g.40gb");
        assert_eq!(profile_name(&slices(1, 1, 20096, (1, 1, 0)), &h100()), "1g.20gb");
    }

    #[test]
    fn media_engines_tell_the_me_profile_apart() {
        // The two differ only in the optical-flow engine.
        assert_eq!(profile_name(&slices(1, 1, 9984, (1, 1, 1)), &h100()), "1g.10gb+me");
        assert_eq!(profile_name(&slices(1, 1, 9984, (1, 1, 0)), &h100()), "1g.10gb");
    }

    #[test]
    fn a_smaller_compute_instance_is_prefixed() {
        assert_eq!(profile_name(&slices(3, 1, 40448, (3, 3, 0)), &h100()), "1c.3g.40gb");
        assert_eq!(profile_name(&slices(7, 2, 81152, (7, 7, 1)), &h100()), "2c.7g.80gb");
    }

    #[test]
    fn without_a_table_the_name_is_built_from_slices_and_memory() {
        // Memory rounded up to whole GiB, which reproduces every H100 name above.
        assert_eq!(profile_name(&slices(2, 2, 20096, (0, 0, 0)), &[]), "2g.20gb");
        assert_eq!(profile_name(&slices(3, 1, 40448, (0, 0, 0)), &[]), "1c.3g.40gb");
        assert_eq!(profile_name(&slices(7, 7, 81152, (0, 0, 0)), &[]), "7g.80gb");
    }
}
