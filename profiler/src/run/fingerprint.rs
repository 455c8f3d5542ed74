//! The environment a run measured in, recorded in its row: what built migprof, what it ran on and how
//! that device was set when the run started. Two rows that differ only here are not the same
//! measurement; a field this machine cannot report is `None`, never a guess.

use crate::gpu::Selected;
use crate::provenance;

#[derive(Debug, Clone, Default, PartialEq)]
pub struct Fingerprint {
    pub candle_version: String,
    /// Cargo features of this build (`cuda`, `cudnn`), comma-separated; empty for a CPU build.
    pub build_features: String,
    /// The source had uncommitted changes when built.
    pub git_dirty: bool,
    pub cpu_model: Option<String>,
    pub driver_version: Option<String>,
    /// The CUDA driver API version, e.g. `13.0`.
    pub cuda_driver_version: Option<String>,
    /// As loaded by this process: cuDNN (with the `cudnn` feature) and cuBLASLt.
    pub cudnn_version: Option<String>,
    pub cublas_version: Option<String>,
    pub mig_mode: Option<bool>,
    pub persistence_mode: Option<bool>,
    pub power_limit_w: Option<f64>,
    pub sm_clock_mhz: Option<u32>,
    pub mem_clock_mhz: Option<u32>,
    pub ecc_enabled: Option<bool>,
    /// MiB this process's memory pool held, unused, when the run started: what earlier runs of the
    /// same process left that the pool could not hand back (`workloads::memory::Ledger::pool_idle`).
    /// The run's device memory readings may include up to that. None on the CPU.
    pub pool_held_mib: Option<f64>,
}

/// Held memory from which a run says so (a warning after its result, a note under the report's
/// memory chart): below it is the pool's own granularity (what a run without CUDA graphs leaves
/// held: docs/kernels.md#memory).
pub const POOL_HELD_WARNING_MIB: f64 = 64.0;

/// Memory a pool held at a run's start, where it is enough to say so ([`POOL_HELD_WARNING_MIB`] or
/// more): the one rule for the run's warning and the report's note.
pub fn notable_pool_held(mib: Option<f64>) -> Option<f64> {
    mib.filter(|&m| m >= POOL_HELD_WARNING_MIB)
}

impl Fingerprint {
    /// Reads what this build, this host and (through NVML) the selected GPU report now.
    pub fn collect(selected: Option<&Selected>) -> Fingerprint {
        let mut f = Fingerprint {
            candle_version: provenance::CANDLE_VERSION.to_string(),
            build_features: build_features(),
            git_dirty: provenance::GIT_COMMIT.ends_with("-dirty"),
            cpu_model: provenance::cpu_model(),
            ..Default::default()
        };
        if let Some(sel) = selected {
            f.mig_mode = sel.gpu.mig_mode.map(|m| m.current);
            gpu_state(&mut f, &sel.gpu.uuid);
            libraries(&mut f);
        }
        f
    }

    /// What a run says after its result when the pool held [`POOL_HELD_WARNING_MIB`] or more at its
    /// start: its memory readings are then not its own alone.
    pub fn pool_warning(&self) -> Option<String> {
        let held = notable_pool_held(self.pool_held_mib)?;
        Some(format!(
            "this process's memory pool held {held:.0} MiB that earlier runs (or the memory probe before the first) left and it could not hand back; \
             this run's device memory readings (fb_used_*) may include up to that (column pool_held_mib_start). \
             `migprof sweep` runs each cell in a process of its own"
        ))
    }
}

/// MiB `device`'s memory pool holds unused now: read before a run builds anything, what earlier runs
/// of the process left ([`Fingerprint::pool_held_mib`]). None on the CPU, or where it cannot be read.
pub fn pool_held_mib(device: &candle_core::Device) -> Option<f64> {
    const MIB: f64 = (1u64 << 20) as f64;
    workloads::memory::ledger(device)
        .ok()
        .flatten()
        .map(|l| l.pool_idle() as f64 / MIB)
}

fn build_features() -> String {
    let mut features = Vec::new();
    if cfg!(feature = "cuda") {
        features.push("cuda");
    }
    if cfg!(feature = "cudnn") {
        features.push("cudnn");
    }
    features.join(",")
}

/// The GPU's settings through NVML: whatever fails to answer stays `None`.
fn gpu_state(f: &mut Fingerprint, gpu_uuid: &str) {
    let Ok(nvml) = nvml_wrapper::Nvml::init() else { return };
    f.driver_version = nvml.sys_driver_version().ok();
    f.cuda_driver_version = nvml
        .sys_cuda_driver_version()
        .ok()
        .map(|v| format!("{}.{}", v / 1000, v % 1000 / 10));
    let Ok(dev) = nvml.device_by_uuid(gpu_uuid) else { return };
    f.persistence_mode = dev.is_in_persistent_mode().ok();
    f.power_limit_w = dev.power_management_limit().ok().map(|mw| mw as f64 / 1000.0);
    f.sm_clock_mhz = dev.clock_info(nvml_wrapper::enum_wrappers::device::Clock::SM).ok();
    f.mem_clock_mhz = dev.clock_info(nvml_wrapper::enum_wrappers::device::Clock::Memory).ok();
    f.ecc_enabled = dev.is_ecc_enabled().ok().map(|e| e.currently_enabled);
}

/// The versions of the CUDA libraries this process loaded, as they report themselves.
fn libraries(f: &mut Fingerprint) {
    #[cfg(feature = "cuda")]
    {
        use candle_core::cuda_backend::cudarc;
        // SAFETY: version getters without arguments; the libraries are loaded with the device.
        let v = unsafe { cudarc::cublaslt::sys::cublasLtGetVersion() };
        f.cublas_version = Some(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100));
        #[cfg(feature = "cudnn")]
        {
            // SAFETY: as above.
            let v = unsafe { cudarc::cudnn::sys::cudnnGetVersion() };
            f.cudnn_version = Some(format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100));
        }
    }
    let _ = f;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_run_names_its_build_and_cpu_and_no_gpu_setting() {
        let f = Fingerprint::collect(None);
        assert!(f.candle_version.starts_with("0."), "{}", f.candle_version);
        assert_eq!(
            f.build_features,
            if cfg!(feature = "cudnn") {
                "cuda,cudnn"
            } else if cfg!(feature = "cuda") {
                "cuda"
            } else {
                ""
            }
        );
        if std::path::Path::new("/proc/cpuinfo").exists()
            && std::fs::read_to_string("/proc/cpuinfo").unwrap().contains("model name")
        {
            assert!(f.cpu_model.as_deref().is_some_and(|m| !m.is_empty()));
        }
        assert_eq!(f.pool_warning(), None);
        assert_eq!(
            (
                f.driver_version,
                f.power_limit_w,
                f.ecc_enabled,
                f.mig_mode,
                f.pool_held_mib
            ),
            (None, None, None, None, None)
        );
        assert_eq!(
            pool_held_mib(&candle_core::Device::Cpu),
            None,
            "a CPU has no memory pool"
        );
    }

    #[test]
    fn a_run_says_so_when_the_pool_held_memory_from_earlier_runs() {
        // As measured on the H100: 32 MiB after a run without CUDA graphs, 576 after Swin-T training.
        let held = |mib| Fingerprint {
            pool_held_mib: Some(mib),
            ..Default::default()
        };
        assert_eq!(held(32.0).pool_warning(), None);
        assert_eq!(held(63.9).pool_warning(), None);
        let warning = held(576.0).pool_warning().expect("over the threshold");
        for part in ["576 MiB", "pool_held_mib_start", "migprof sweep"] {
            assert!(warning.contains(part), "{part} missing: {warning}");
        }
    }
}
