//! The sampler's NVML source: memory of the device or MIG slice; power, energy, clocks, temperature and
//! throttle reasons of the parent GPU; utilisation rates where NVML has them (not on MIG); GPM
//! activity of the device or of the slice's GPU instance on Hopper and newer.

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use anyhow::Result;
use nvml_wrapper::enum_wrappers::device::{Clock, TemperatureSensor};
use nvml_wrapper::enums::gpm::GpmMetricId;
use nvml_wrapper::gpm::{gpm_metrics_get, GpmSample};
use nvml_wrapper::{Device, Nvml};

use super::select::Selected;
use crate::gpu::sampler::{Gpm, GpuProcess, MetricSource, Sample};

/// NVML computes GPM metrics between two samples at least this far apart.
const GPM_MIN_GAP: Duration = Duration::from_millis(100);

const GPM_METRICS: [GpmMetricId; 7] = [
    GpmMetricId::GraphicsUtil,
    GpmMetricId::SmUtil,
    GpmMetricId::SmOccupancy,
    GpmMetricId::AnyTensorUtil,
    GpmMetricId::DramBwUtil,
    GpmMetricId::Fp32Util,
    GpmMetricId::Fp16Util,
];

pub struct NvmlMetrics<'n> {
    nvml: &'n Nvml,
    gpu: Device<'n>,
    /// The MIG device and its GPU-instance id, for a run on a slice.
    mig: Option<(Device<'n>, u32)>,
    /// Recent GPM samples with when they were taken, oldest first; empty when the GPU has no GPM.
    gpm: VecDeque<(GpmSample<'n>, Instant)>,
    /// Names of the processes seen so far: asked once per pid, not at every reading.
    names: std::collections::HashMap<u32, Option<String>>,
}

impl<'n> NvmlMetrics<'n> {
    pub fn open(nvml: &'n Nvml, selected: &Selected) -> Result<Self> {
        let gpu = nvml.device_by_uuid(selected.gpu.uuid.as_str())?;
        let mig = match &selected.mig {
            Some(m) => Some((nvml.device_by_uuid(m.uuid.as_str())?, m.gpu_instance_id)),
            None => None,
        };
        let mut this = Self {
            nvml,
            gpu,
            mig,
            gpm: VecDeque::new(),
            names: Default::default(),
        };
        if this.gpu.gpm_support().unwrap_or(false) {
            if let Ok(s) = this.gpm_sample() {
                this.gpm.push_back((s, Instant::now()));
            }
        }
        Ok(this)
    }

    fn gpm_sample(&self) -> Result<GpmSample<'n>, nvml_wrapper::error::NvmlError> {
        match &self.mig {
            Some((_, gi)) => self.gpu.gpm_mig_sample(*gi),
            None => self.gpu.gpm_sample(),
        }
    }

    /// Activity since the newest GPM sample at least [`GPM_MIN_GAP`] old. A sampler ticking every
    /// 100 ms finds the previous sample a little under or over that; keeping the one before it too
    /// gives every tick a reading (over up to two intervals) without breaking NVML's rule.
    fn read_gpm(&mut self) -> Option<Gpm> {
        let taken = Instant::now();
        let now = self.gpm_sample().ok()?;
        let base = self
            .gpm
            .iter()
            .rposition(|(_, at)| taken.duration_since(*at) >= GPM_MIN_GAP);
        let result = base.and_then(|i| gpm_metrics_get(self.nvml, &self.gpm[i].0, &now, &GPM_METRICS).ok());
        // Older samples than the base are no longer needed.
        if let Some(i) = base {
            self.gpm.drain(..i);
        }
        self.gpm.push_back((now, taken));
        let v: Vec<Option<f64>> = result?.into_iter().map(|r| r.ok().map(|m| m.value)).collect();
        Some(Gpm {
            graphics: v[0],
            sm: v[1],
            sm_occupancy: v[2],
            tensor: v[3],
            dram_bandwidth: v[4],
            fp32: v[5],
            fp16: v[6],
        })
    }
}

impl MetricSource for NvmlMetrics<'_> {
    fn read(&mut self) -> Sample {
        const MIB: f64 = (1u64 << 20) as f64;
        let memory = match &self.mig {
            Some((m, _)) => m.memory_info(),
            None => self.gpu.memory_info(),
        }
        .ok();
        // NVML has no utilisation rates for MIG devices, and the parent's would be everyone's.
        let util = if self.mig.is_none() {
            self.gpu.utilization_rates().ok()
        } else {
            None
        };
        Sample {
            t: Duration::ZERO,
            fb_used_mib: memory.as_ref().map(|m| m.used as f64 / MIB),
            fb_total_mib: memory.as_ref().map(|m| m.total as f64 / MIB),
            gpu_power_w: self.gpu.power_usage().ok().map(|mw| mw as f64 / 1e3),
            gpu_energy_mj: self.gpu.total_energy_consumption().ok(),
            gpu_sm_clock_mhz: self.gpu.clock_info(Clock::SM).ok(),
            gpu_mem_clock_mhz: self.gpu.clock_info(Clock::Memory).ok(),
            gpu_temperature_c: self.gpu.temperature(TemperatureSensor::Gpu).ok(),
            gpu_throttle_reasons: self.gpu.current_throttle_reasons().ok().map(|r| r.bits()),
            util_gpu_pct: util.as_ref().map(|u| u.gpu),
            util_mem_pct: util.as_ref().map(|u| u.memory),
            gpm: self.read_gpm(),
            compute_processes: self.read_processes(),
        }
    }
}

impl NvmlMetrics<'_> {
    /// The compute processes of the slice (a MIG device handle lists its own) or of the GPU.
    fn read_processes(&mut self) -> Option<Vec<GpuProcess>> {
        use nvml_wrapper::enums::device::UsedGpuMemory;
        let device = self.mig.as_ref().map_or(&self.gpu, |(m, _)| m);
        let listed = device.running_compute_processes().ok()?;
        let nvml = self.nvml;
        Some(
            listed
                .into_iter()
                .map(|p| GpuProcess {
                    pid: p.pid,
                    name: self
                        .names
                        .entry(p.pid)
                        .or_insert_with(|| process_name(nvml, p.pid))
                        .clone(),
                    used_mib: match p.used_gpu_memory {
                        UsedGpuMemory::Used(bytes) => Some(bytes >> 20),
                        UsedGpuMemory::Unavailable => None,
                    },
                })
                .collect(),
        )
    }
}

/// A process's name: NVML's (the host's view), else this PID namespace's /proc.
fn process_name(nvml: &Nvml, pid: u32) -> Option<String> {
    nvml.sys_process_name(pid, 64)
        .ok()
        .filter(|n| !n.is_empty())
        .map(|n| n.rsplit('/').next().unwrap_or(&n).to_string())
        .or_else(|| {
            std::fs::read_to_string(format!("/proc/{pid}/comm"))
                .ok()
                .map(|s| s.trim().to_string())
        })
}

/// The SM clock and throttle reasons of `selected`'s GPU now, as one reading; `None`s where NVML
/// cannot say.
pub fn clocks_now(selected: &Selected) -> (Option<u32>, Option<u64>) {
    let Ok(nvml) = Nvml::init() else {
        return (None, None);
    };
    let reading = match NvmlMetrics::open(&nvml, selected) {
        Ok(mut m) => m.read(),
        Err(_) => return (None, None),
    };
    (reading.gpu_sm_clock_mhz, reading.gpu_throttle_reasons)
}
