//! Which device a run uses: parsing `--device`, resolving a GPU or MIG device against NVML's topology,
//! pinning the process to it through CUDA_VISIBLE_DEVICES before CUDA starts, and naming it for the
//! record.

use std::fmt;
use std::str::FromStr;

use anyhow::{anyhow, bail, Result};
use candle_core::Device;

use crate::gpu::{self, Selected, Topology};

/// The valid spellings of `--device`, for error messages.
pub const VALID_DEVICES: &str = "cpu, cuda (the first GPU), a GPU index (0, 1, ... as nvidia-smi numbers them; cuda:N is the same), \
     GPU-<uuid>, MIG-<uuid>, a MIG profile such as 3g.40gb (when exactly one MIG device has it), \
     mps:<profile> or mps:<percent>% (a slice emulated with MPS on a GPU with MIG off, e.g. mps:3g.40gb, mps:45%; @<index> picks the GPU), \
     mps-mem:<profile> or mps-mem:<percent>% (the same with the slice's share of memory bandwidth: a neighbour streams on the other SMs)";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    Cpu,
    /// The first GPU CUDA would see: CUDA_VISIBLE_DEVICES's first entry when set, else GPU 0.
    Cuda,
    /// A GPU index, `GPU-<uuid>` or `MIG-<uuid>` (a unique prefix is enough).
    Gpu(String),
    /// A slice emulated as an MPS client on a whole GPU.
    Mps(crate::mps::MpsTarget),
}

impl FromStr for DeviceSpec {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Self> {
        let s = s.trim();
        if let Some(target) = crate::mps::MpsTarget::parse_device(s) {
            return Ok(Self::Mps(target?));
        }
        match s {
            "cpu" => return Ok(Self::Cpu),
            "cuda" => return Ok(Self::Cuda),
            _ => {}
        }
        let id = s.strip_prefix("cuda:").unwrap_or(s);
        let uuid = id.len() > 4 && (id.starts_with("GPU-") || id.starts_with("MIG-"));
        if id.parse::<u32>().is_ok() || uuid || gpu::select::is_profile_name(id) {
            return Ok(Self::Gpu(id.to_string()));
        }
        bail!("unknown device `{s}`; valid devices: {VALID_DEVICES}")
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Cpu => f.write_str("cpu"),
            DeviceSpec::Cuda => f.write_str("cuda"),
            DeviceSpec::Gpu(id) => f.write_str(id),
            DeviceSpec::Mps(t) => t.fmt(f),
        }
    }
}

/// The device a run executed on, as recorded with its results.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceInfo {
    /// `cpu`, `cuda` (a whole GPU) or `mig` (a MIG device).
    pub kind: &'static str,
    /// What the hardware calls itself: the CPU model with candle's thread count, the GPU's name, or
    /// the GPU's name and the MIG profile.
    pub name: String,
    /// The GPU and MIG device, for CUDA runs.
    pub selected: Option<Selected>,
    /// The slice emulated, for a run as an MPS client.
    pub emulation: Option<crate::mps::Emulation>,
    /// The DRAM bandwidth the process reached, measured on a slice (real or emulated); `None`
    /// on a whole GPU and the CPU, or where the probe failed (it says so).
    pub memory_system: Option<gpu::memory_system::MemorySystem>,
    /// The multiprocessors migprof's kernels size their grids to (a slice's, where the driver tells
    /// the process its slice); `None` on the CPU.
    pub kernel_sms: Option<u32>,
}

impl DeviceInfo {
    /// The memory the run may use, MiB: an emulated slice's limit, a MIG device's, a GPU's; `None`
    /// on the CPU (the host's is read when asked: it changes).
    pub fn memory_mib(&self) -> Option<u64> {
        match (&self.emulation, &self.selected) {
            (Some(e), Some(s)) => Some(e.share.memory_limit_mib.unwrap_or(s.gpu.memory_mib)),
            (_, Some(s)) => Some(s.mig.as_ref().map_or(s.gpu.memory_mib, |m| m.memory_mib)),
            _ => None,
        }
    }

    /// Whose activity a GPM reading on this device is: `gpu_instance` on a MIG device (NVML samples
    /// its GPU instance), `gpu` on a whole GPU and on an emulated slice, whose readings count every
    /// process on the GPU; `None` on the CPU.
    pub fn gpm_scope(&self) -> Option<&'static str> {
        let selected = self.selected.as_ref()?;
        Some(if selected.mig.is_some() && self.emulation.is_none() {
            "gpu_instance"
        } else {
            "gpu"
        })
    }
}

/// An opened device and its identity.
pub struct OpenDevice {
    pub device: Device,
    pub info: DeviceInfo,
    /// The memory-system neighbour of an `mps-mem:` slice: it streams until this is dropped.
    pub neighbour: Option<std::sync::Mutex<crate::mps::neighbour::NeighbourProcess>>,
}

impl OpenDevice {
    /// An error when the slice's memory-system neighbour has ended: what was measured since ran
    /// beside no neighbour, not the partition its rows describe.
    pub fn neighbour_still_streams(&self) -> Result<()> {
        let Some(n) = &self.neighbour else {
            return Ok(());
        };
        let mut n = n.lock().unwrap_or_else(|e| e.into_inner());
        match n.ended()? {
            None => Ok(()),
            Some(status) => bail!(
                "the memory-system neighbour ended during the run ({status}; its error is above): the slice's memory was not partitioned for all of the measurement"
            ),
        }
    }
}

impl DeviceSpec {
    /// Resolves the device and opens it, or says why it cannot be used, before any workload runs.
    pub fn open(&self) -> Result<OpenDevice> {
        let id = match self {
            DeviceSpec::Cpu => return Ok(cpu()),
            DeviceSpec::Cuda => first_visible(),
            DeviceSpec::Gpu(id) => id.clone(),
            DeviceSpec::Mps(target) => {
                no_cuda_is_an_error(self)?;
                return open_mps_client(target);
            }
        };
        no_cuda_is_an_error(self)?;
        let topology = gpu::discover().map_err(|e| anyhow!("`{self}`: {e:#}"))?;
        let selected = gpu::select(&topology, &id)?;
        pin(&selected);
        let device = Device::new_cuda(0)?;
        // A slice's share of the memory system, before the pool: the probe's buffers go back.
        let memory_system = match &selected.mig {
            Some(m) => probe_memory_system(&device, m.sm_count),
            None => None,
        };
        workloads::memory::pool_allocations(&device)?;
        Ok(OpenDevice {
            info: DeviceInfo {
                memory_system,
                kernel_sms: kernel_sms(&device),
                ..describe(selected)
            },
            device,
            neighbour: None,
        })
    }

    pub fn is_mps(&self) -> bool {
        matches!(self, DeviceSpec::Mps(_))
    }

    /// The device to use when none is given: the first GPU when this build has CUDA and the topology
    /// (asked for only then) has a usable one, else the CPU, with the reason.
    pub fn default_for(discover: impl FnOnce() -> Result<Topology>) -> (DeviceSpec, Option<String>) {
        if !candle_core::utils::cuda_is_available() {
            return (
                DeviceSpec::Cpu,
                Some("this migprof was built without CUDA support; running on the CPU".into()),
            );
        }
        match discover() {
            Ok(t) => match gpu::select(&t, &first_visible()) {
                Ok(_) => (DeviceSpec::Cuda, None),
                Err(e) => (
                    DeviceSpec::Cpu,
                    Some(format!("no usable GPU ({e:#}); running on the CPU")),
                ),
            },
            Err(e) => (DeviceSpec::Cpu, Some(format!("{e:#}; running on the CPU"))),
        }
    }
}

/// A target resolved for a program migprof did not write: the environment that pins it there as a
/// user pins it, what its rows record of the device, and migprof's MPS daemon serving an emulated
/// slice (stopped when this is dropped). migprof opens no CUDA context of its own for it.
pub struct ProgramTarget {
    /// Set in the program's environment (the rest of it is the user's).
    pub env: Vec<(String, String)>,
    pub info: DeviceInfo,
    pub daemon: Option<crate::mps::daemon::Daemon>,
}

impl DeviceSpec {
    /// Resolves `self` for a program: a GPU or MIG device by its UUID in CUDA_VISIBLE_DEVICES (NVML
    /// alone, so a build without CUDA pins one too); an `mps:` slice as a client of migprof's own
    /// daemon with the profile's SM share and memory limit; the CPU with no GPU visible. `mps-mem:`
    /// is refused: its share of the bandwidth is held by a neighbour calibrated against migprof's
    /// own client, which a program migprof did not write cannot be.
    pub fn for_program(&self) -> Result<ProgramTarget> {
        let visible = |uuid: &str| ("CUDA_VISIBLE_DEVICES".to_string(), uuid.to_string());
        let id = match self {
            DeviceSpec::Cpu => {
                return Ok(ProgramTarget {
                    env: vec![visible("")],
                    info: DeviceInfo {
                        name: host_cpu_name(),
                        ..cpu().info
                    },
                    daemon: None,
                })
            }
            DeviceSpec::Cuda => first_visible(),
            DeviceSpec::Gpu(id) => id.clone(),
            DeviceSpec::Mps(target) => return program_on_mps(target),
        };
        let topology = gpu::discover().map_err(|e| anyhow!("`{self}`: {e:#}"))?;
        let selected = gpu::select(&topology, &id)?;
        let info = describe(selected);
        let mut env = vec![visible(info.selected.as_ref().map_or("", |s| s.uuid()))];
        env.extend(memory_env(&info));
        Ok(ProgramTarget {
            env,
            info,
            daemon: None,
        })
    }
}

/// The memory a program's target allows and the whole GPU's, MiB, in its environment: a server that
/// sizes itself from the parent GPU's memory on a slice (vLLM's NVML paths) is given the slice's
/// through its command line (`$MIGPROF_TARGET_MEMORY_MIB`).
fn memory_env(info: &DeviceInfo) -> Vec<(String, String)> {
    let mut env = Vec::new();
    if let Some(mib) = info.memory_mib() {
        env.push(("MIGPROF_TARGET_MEMORY_MIB".to_string(), mib.to_string()));
    }
    if let Some(s) = &info.selected {
        env.push(("MIGPROF_GPU_MEMORY_MIB".to_string(), s.gpu.memory_mib.to_string()));
    }
    env
}

fn program_on_mps(target: &crate::mps::MpsTarget) -> Result<ProgramTarget> {
    if target.memory == crate::mps::MemoryEmulation::Partitioned {
        bail!(
            "`{target}`: a memory-partitioned slice holds its client to its share of the bandwidth with a neighbour calibrated against migprof's own kernels, which a program migprof did not write cannot be held to; use mps:{} (the SM share and memory limit) or a real MIG device",
            target.share
        );
    }
    // A sweep's child is handed the sweep's daemon; anything else starts its own.
    let (selected, share, daemon) = match std::env::var_os(crate::mps::daemon::CLIENT_PIPE_ENV) {
        Some(pipe) => {
            let topology = gpu::discover().map_err(|e| anyhow!("`{target}`: {e:#}"))?;
            let (selected, share) = crate::mps::resolve(&topology, target, crate::mps::profile_table)?;
            (selected, share, Err(std::path::PathBuf::from(pipe)))
        }
        None => {
            let (selected, share, daemon) = crate::mps::start_daemon(target)?;
            (selected, share, Ok(daemon))
        }
    };
    let pipe = match &daemon {
        Ok(d) => d.pipe_dir(),
        Err(pipe) => pipe.clone(),
    };
    let mut env = vec![("CUDA_VISIBLE_DEVICES".to_string(), selected.uuid().to_string())];
    env.extend(
        crate::mps::daemon::client_env(&pipe, &share)
            .into_iter()
            .map(|(k, v)| (k.to_string(), v)),
    );
    let name = format!("{} MPS-emulated {}", selected.gpu.name, share.describe());
    let info = DeviceInfo {
        kind: "mps",
        name,
        selected: Some(selected),
        emulation: Some(crate::mps::Emulation {
            share,
            measured_sms: None,
            measured_memory_mib: None,
            partition: None,
        }),
        memory_system: None,
        kernel_sms: None,
    };
    env.extend(memory_env(&info));
    Ok(ProgramTarget {
        env,
        info,
        daemon: daemon.ok(),
    })
}

/// The CPU model and the host's threads (a program's, not candle's).
fn host_cpu_name() -> String {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    format!("{} ({threads} threads)", cpu_model())
}

/// The refusal of a GPU device in a build without CUDA.
pub fn no_cuda_is_an_error(spec: &DeviceSpec) -> Result<()> {
    if !candle_core::utils::cuda_is_available() {
        bail!("`{spec}`: this migprof was built without CUDA support (cargo feature `cuda`); valid devices in this build: cpu")
    }
    Ok(())
}

/// Opens the GPU of an MPS target as a client of the daemon whose pipes [`crate::mps::daemon::CLIENT_PIPE_ENV`]
/// names (the migprof that started the daemon sets it), with the target's share, and measures what
/// the client got.
fn open_mps_client(target: &crate::mps::MpsTarget) -> Result<OpenDevice> {
    use crate::mps::daemon::{client_env, CLIENT_PIPE_ENV};
    let pipe = std::env::var_os(CLIENT_PIPE_ENV).ok_or_else(|| {
        anyhow!("`{target}`: an emulated slice runs under migprof's MPS daemon, which `migprof run` and `migprof sweep` start; this process has none ({CLIENT_PIPE_ENV} is unset)")
    })?;
    let topology = gpu::discover().map_err(|e| anyhow!("`{target}`: {e:#}"))?;
    let (selected, share) = crate::mps::resolve(&topology, target, crate::mps::profile_table)?;
    pin(&selected);
    for (k, v) in client_env(std::path::Path::new(&pipe), &share) {
        std::env::set_var(k, v);
    }
    let device = Device::new_cuda(0)?;
    // Before the pool: the probes' memory must go back to the driver.
    let reach = reach(&device, selected.gpu.sm_count.unwrap_or(0), share.memory_limit_mib);
    let sms = reach.as_ref().map_or(share.profile_sms, |r| r.sms);
    let (memory_system, partition, neighbour) = match target.memory {
        crate::mps::MemoryEmulation::Alone => (probe_memory_system(&device, sms), None, None),
        crate::mps::MemoryEmulation::Partitioned => match std::env::var_os(crate::mps::group::ENV) {
            // A member of a concurrent group: the sweep runs the group's one neighbour.
            Some(group) => {
                let (system, partition) = join_group_partition(&device, &selected, &share, sms, group.as_ref())?;
                (Some(system), Some(partition), None)
            }
            None => {
                let driver = topology.driver_version.clone().unwrap_or_default();
                let (system, partition, neighbour) =
                    partition_memory(&device, &selected, &share, sms, std::path::Path::new(&pipe), driver)?;
                (Some(system), Some(partition), neighbour)
            }
        },
    };
    workloads::memory::pool_allocations(&device)?;
    let emulation = crate::mps::Emulation {
        share,
        measured_sms: reach.as_ref().ok().map(|r| r.sms),
        measured_memory_mib: reach.as_ref().ok().and_then(|r| r.memory_mib),
        partition,
    };
    if let Err(e) = &reach {
        eprintln!("warning: could not measure what the MPS client got: {e:#}");
    }
    hold_kernels_to_the_share(&device, reach.as_ref().ok().map(|r| r.sms));
    if let Some(why) = emulation.mismatch() {
        eprintln!("warning: {why}");
    }
    let name = format!(
        "{} MPS-emulated {}{}",
        selected.gpu.name,
        emulation.share.describe(),
        if emulation.partition.is_some() {
            ", memory partitioned"
        } else {
            ""
        }
    );
    Ok(OpenDevice {
        info: DeviceInfo {
            kind: "mps",
            name,
            selected: Some(selected),
            emulation: Some(emulation),
            memory_system,
            kernel_sms: kernel_sms(&device),
        },
        device,
        neighbour: neighbour.map(std::sync::Mutex::new),
    })
}

/// What partitioning a client's memory system gives: the memory system it then reaches, the record
/// of the partition, and the neighbour, which streams until dropped.
type Partitioned = (
    gpu::memory_system::MemorySystem,
    crate::mps::partition::Partition,
    Option<crate::mps::neighbour::NeighbourProcess>,
);

/// Partitions the memory system of an `mps-mem:` client ([`crate::mps::partition`]): the neighbour
/// started, set and checked, and what the client's memory system then is. A partition that cannot be
/// made is an error (the row would not be what it says); one that misses its share is a warning and
/// recorded.
#[cfg(feature = "cuda")]
fn partition_memory(
    device: &Device,
    selected: &Selected,
    share: &crate::mps::Share,
    sms: u32,
    pipe: &std::path::Path,
    driver: String,
) -> Result<Partitioned> {
    use crate::mps::calibration::{self, Cache, Key};
    use crate::mps::partition::{partition, Calibrations};

    let device_sms = selected.gpu.sm_count.unwrap_or(sms);
    let mut probe = ClientSide {
        probe: gpu::memory_system::Probe::new(device, sms)?,
        device: device.clone(),
    };
    let mut spawner = crate::mps::neighbour::Spawner {
        exe: std::env::current_exe().map_err(|e| anyhow!("finding this migprof to start its neighbour: {e}"))?,
        gpu_uuid: selected.gpu.uuid.clone(),
        gpu_sms: device_sms,
        pipe_dir: pipe.to_path_buf(),
    };
    let cache = Cache::default_location();
    let calibrations = Calibrations {
        cache: &cache,
        key: Key {
            gpu_uuid: selected.gpu.uuid.clone(),
            driver,
            share: share.profile.clone().unwrap_or_else(|| format!("{}%", share.percent)),
        },
        recalibrate: calibration::recalibrate_token(),
    };
    let (partition, neighbour) = partition(
        share.percent,
        share.memory_fraction,
        &mut probe,
        &mut spawner,
        &calibrations,
        &mut || gpu::metrics::clocks_now(selected),
        &mut |line| eprintln!("MPS: {line}"),
    )
    .map_err(|e| anyhow!("partitioning the memory system of {}: {e:#}", share.describe()))?;
    if partition.outcome == calibration::Outcome::NoSpareSms {
        eprintln!(
            "MPS: {} holds every SM: there is nowhere for a memory-system neighbour, so the partitioned slice equals the one alone",
            share.describe()
        );
    }
    for w in partition.warnings() {
        eprintln!("warning: {w}");
    }
    let system = probe.memory_system(partition.bandwidth_gbps)?;
    Ok((system, partition, neighbour))
}

#[cfg(not(feature = "cuda"))]
fn partition_memory(
    _: &Device,
    _: &Selected,
    _: &crate::mps::Share,
    _: u32,
    _: &std::path::Path,
    _: String,
) -> Result<Partitioned> {
    bail!("this migprof was built without CUDA support")
}

/// A member of a memory-partitioned group ([`crate::mps::group`]): the neighbour the sweep set for
/// the group already streams; the member measures its own bandwidth and L2 beside it.
#[cfg(feature = "cuda")]
fn join_group_partition(
    device: &Device,
    selected: &Selected,
    share: &crate::mps::Share,
    sms: u32,
    record: &std::path::Path,
) -> Result<(gpu::memory_system::MemorySystem, crate::mps::partition::Partition)> {
    use crate::mps::calibration::BandwidthProbe;

    let group = crate::mps::group::GroupPartition::read(record)?;
    let mut probe = ClientSide {
        probe: gpu::memory_system::Probe::new(device, sms)?,
        device: device.clone(),
    };
    let bandwidth_gbps = probe.bandwidth_gbps()?;
    let partition = group.member(
        share.memory_fraction,
        bandwidth_gbps,
        None,
        gpu::metrics::clocks_now(selected),
    );
    eprintln!(
        "MPS: {} in a memory-partitioned group: the group's neighbour holds the members' SMs to {:.0} of their {:.0} GB/s share together ({}); this member reads {bandwidth_gbps:.0} GB/s of its {:.0} GB/s share",
        share.describe(),
        group.bandwidth_gbps,
        group.share_gbps(),
        group.outcome.as_str(),
        partition.share_gbps
    );
    // The group's own miss the sweep said once; here, the member's against its own share.
    for w in partition.warnings() {
        eprintln!("warning: {w}");
    }
    Ok((probe.memory_system(bandwidth_gbps)?, partition))
}

#[cfg(not(feature = "cuda"))]
fn join_group_partition(
    _: &Device,
    _: &Selected,
    _: &crate::mps::Share,
    _: u32,
    _: &std::path::Path,
) -> Result<(gpu::memory_system::MemorySystem, crate::mps::partition::Partition)> {
    bail!("this migprof was built without CUDA support")
}

/// The client's probes of itself on a GPU.
#[cfg(feature = "cuda")]
struct ClientSide {
    probe: gpu::memory_system::Probe,
    device: Device,
}

#[cfg(feature = "cuda")]
impl ClientSide {
    /// The memory system the client reached: `bandwidth_gbps` as it read it, and the L2 it has.
    /// The probe's buffers go back to the driver, before the allocation pool is set up.
    fn memory_system(mut self, bandwidth_gbps: f64) -> Result<gpu::memory_system::MemorySystem> {
        let l2_mib = self.probe.l2_mib_or_warn();
        let device = self.device.clone();
        drop(self);
        device.synchronize()?;
        Ok(gpu::memory_system::MemorySystem { bandwidth_gbps, l2_mib })
    }
}

#[cfg(feature = "cuda")]
impl crate::mps::calibration::BandwidthProbe for ClientSide {
    /// The median of three copy probes ([`crate::mps::partition::median_of_three`]), each over
    /// [`crate::mps::partition::PROBE_WINDOW_MS`].
    fn bandwidth_gbps(&mut self) -> Result<f64> {
        crate::mps::partition::median_of_three(|| {
            self.probe.bandwidth_over_gbps(crate::mps::partition::PROBE_WINDOW_MS)
        })
    }
}

#[cfg(feature = "cuda")]
impl crate::mps::partition::ClientProbe for ClientSide {
    fn compute_ms(&mut self) -> Result<f64> {
        self.probe.compute_ms()
    }
    fn while_filling(
        &mut self,
        during: &mut dyn FnMut() -> Result<std::collections::BTreeSet<u32>>,
    ) -> Result<std::collections::BTreeSet<u32>> {
        self.probe.while_filling(during)
    }
}

#[cfg(feature = "cuda")]
fn reach(device: &Device, device_sms: u32, memory_limit_mib: Option<u64>) -> Result<gpu::reach::Reach> {
    gpu::reach::measure(device, device_sms, memory_limit_mib)
}

#[cfg(not(feature = "cuda"))]
fn reach(_: &Device, _: u32, _: Option<u64>) -> Result<gpu::reach::Reach> {
    bail!("this migprof was built without CUDA support")
}

/// The memory system a slice's process reaches ([`gpu::memory_system`]); a failed probe is said and
/// leaves the row's columns empty rather than ending the run.
fn probe_memory_system(device: &Device, sms: u32) -> Option<gpu::memory_system::MemorySystem> {
    #[cfg(feature = "cuda")]
    let measured = gpu::memory_system::measure(device, sms);
    #[cfg(not(feature = "cuda"))]
    let measured: Result<gpu::memory_system::MemorySystem> = {
        let _ = (device, sms);
        Err(anyhow!("this migprof was built without CUDA support"))
    };
    measured
        .map_err(|e| eprintln!("warning: could not measure the slice's memory bandwidth: {e:#}"))
        .ok()
}

/// CUDA_VISIBLE_DEVICES's first entry when the user set one, else the first GPU.
fn first_visible() -> String {
    std::env::var("CUDA_VISIBLE_DEVICES")
        .ok()
        .and_then(|v| v.split(',').next().map(|s| s.trim().to_string()))
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "first".to_string())
}

/// Makes the selected device CUDA's only device, ordinal 0. CUDA reads the variable when it
/// initialises, which no code has done yet when this runs.
fn pin(selected: &Selected) {
    std::env::set_var("CUDA_VISIBLE_DEVICES", selected.uuid());
}

fn describe(selected: Selected) -> DeviceInfo {
    let (kind, name) = match &selected.mig {
        Some(m) => ("mig", format!("{} MIG {}", selected.gpu.name, m.profile)),
        None => ("cuda", selected.gpu.name.clone()),
    };
    DeviceInfo {
        kind,
        name,
        selected: Some(selected),
        emulation: None,
        memory_system: None,
        kernel_sms: None,
    }
}

/// The multiprocessors migprof's kernels size their grids to on `device`.
fn kernel_sms(device: &Device) -> Option<u32> {
    workloads::kernels::multiprocessors(device).and_then(|n| u32::try_from(n).ok())
}

/// An MPS client's kernels sized to the SMs it measured where its driver reports more (the driver
/// of the H200 here tells a client its share; one that reports the whole GPU would have the
/// kernels fill SMs the client cannot use).
#[cfg(feature = "cuda")]
fn hold_kernels_to_the_share(device: &Device, measured: Option<u32>) {
    let (Some(reported), Some(measured)) = (kernel_sms(device), measured) else {
        return;
    };
    if measured > 0 && reported > measured {
        eprintln!(
            "note: the driver reports {reported} multiprocessors to this MPS client, which reached {measured}; migprof's kernels size their grids to {measured}"
        );
        workloads::kernels::hold_multiprocessors(measured as usize);
    }
}

#[cfg(not(feature = "cuda"))]
fn hold_kernels_to_the_share(_: &Device, _: Option<u32>) {}

fn cpu() -> OpenDevice {
    OpenDevice {
        device: Device::Cpu,
        info: DeviceInfo {
            kind: "cpu",
            name: cpu_name(),
            selected: None,
            emulation: None,
            memory_system: None,
            kernel_sms: None,
        },
        neighbour: None,
    }
}

/// The CPU model and the number of threads candle's CPU kernels use.
fn cpu_name() -> String {
    format!("{} ({} threads)", cpu_model(), candle_core::utils::get_num_threads())
}

/// The CPU model as a device's name says it (its runs of spaces made one), else the architecture.
fn cpu_model() -> String {
    crate::provenance::cpu_model()
        .map(|m| m.split_whitespace().collect::<Vec<_>>().join(" "))
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    #[test]
    fn a_neighbour_that_ended_during_the_run_fails_it_and_its_stop() {
        // A stand-in for `migprof memory-neighbour` that says it is ready and then ends.
        let dir = tempfile::tempdir().unwrap();
        let exe = dir.path().join("neighbour");
        std::fs::write(&exe, "#!/bin/sh\necho 'ready 8'\nexit 3\n").unwrap();
        std::fs::set_permissions(&exe, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
        let start = || crate::mps::neighbour::NeighbourProcess::start(&exe, "GPU-test", dir.path(), 100, 1).unwrap();
        let wait_until_ended = |n: &mut crate::mps::neighbour::NeighbourProcess| {
            for _ in 0..200 {
                if n.ended().unwrap().is_some() {
                    return;
                }
                std::thread::sleep(std::time::Duration::from_millis(10));
            }
            panic!("the stand-in did not end");
        };
        let mut n = start();
        wait_until_ended(&mut n);
        let mut device = cpu();
        device.neighbour = Some(std::sync::Mutex::new(n));
        let e = device.neighbour_still_streams().unwrap_err().to_string();
        assert!(
            e.contains("ended during the run") && e.contains("exit status: 3"),
            "{e}"
        );
        assert!(cpu().neighbour_still_streams().is_ok(), "no neighbour, nothing to end");
        let mut n = start();
        wait_until_ended(&mut n);
        let e = n.stop().unwrap_err().to_string();
        assert!(e.contains("had ended before it was stopped"), "{e}");
    }

    /// The recorded H100 with a 3g, a 2g and two 1g slices: its GPU, and its 3g slice.
    pub(crate) fn recorded_gpu_and_slice() -> (Selected, Selected) {
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/topologies/h100_3g_2g_1g_1g.json"
        ))
        .unwrap();
        let topology: Topology = serde_json::from_str(&text).unwrap();
        let slice = gpu::select(&topology, "3g.40gb").unwrap();
        let whole = Selected {
            mig: None,
            ..slice.clone()
        };
        (whole, slice)
    }

    #[test]
    fn gpm_readings_are_the_slice_s_only_on_a_real_slice() {
        let (whole, slice) = recorded_gpu_and_slice();
        let info = |kind, selected: Option<Selected>, emulation| DeviceInfo {
            kind,
            name: String::new(),
            selected,
            emulation,
            memory_system: None,
            kernel_sms: None,
        };
        assert_eq!(info("cpu", None, None).gpm_scope(), None);
        assert_eq!(info("cuda", Some(whole.clone()), None).gpm_scope(), Some("gpu"));
        assert_eq!(info("mig", Some(slice), None).gpm_scope(), Some("gpu_instance"));
        assert_eq!(
            info("mps", Some(whole), Some(emulated_1g(None))).gpm_scope(),
            Some("gpu")
        );
    }

    /// An H100's 1g.10gb emulated on 16 SMs, with its memory partitioned when `partition` is given.
    pub(crate) fn emulated_1g(partition: Option<crate::mps::partition::Partition>) -> crate::mps::Emulation {
        crate::mps::Emulation {
            share: crate::mps::Share {
                profile: Some("1g.10gb".into()),
                percent: 13,
                profile_sms: 16,
                memory_limit_mib: Some(9856),
                memory_fraction: 0.125,
            },
            measured_sms: Some(16),
            measured_memory_mib: None,
            partition,
        }
    }

    #[test]
    fn parses_every_form() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cuda);
        assert_eq!("cuda:3".parse::<DeviceSpec>().unwrap(), DeviceSpec::Gpu("3".into()));
        assert_eq!("1".parse::<DeviceSpec>().unwrap(), DeviceSpec::Gpu("1".into()));
        let mig = "MIG-4f6e2a1c-0000-5000-8000-000000000000";
        assert_eq!(mig.parse::<DeviceSpec>().unwrap(), DeviceSpec::Gpu(mig.into()));
        assert_eq!(
            "GPU-ab12".parse::<DeviceSpec>().unwrap(),
            DeviceSpec::Gpu("GPU-ab12".into())
        );
        for profile in ["3g.40gb", "1g.10gb+me", "1c.3g.40gb"] {
            assert_eq!(profile.parse::<DeviceSpec>().unwrap(), DeviceSpec::Gpu(profile.into()));
        }
        let mps = "mps:3g.40gb@1".parse::<DeviceSpec>().unwrap();
        assert!(mps.is_mps());
        assert_eq!(mps.to_string(), "mps:3g.40gb@1");
        assert!("mps:120%"
            .parse::<DeviceSpec>()
            .unwrap_err()
            .to_string()
            .contains("1% to 100%"));
    }

    #[test]
    fn rejects_junk_naming_the_valid_choices() {
        for bad in [
            "tpu",
            "cuda:x",
            "cuda:-1",
            "MIG-",
            "gpu0",
            "-1",
            "3g",
            "3g.40",
            "g.40gb",
            "3g.40gb+mx",
        ] {
            let err = bad.parse::<DeviceSpec>().unwrap_err().to_string();
            assert!(
                err.contains(&format!("`{bad}`")) && err.contains(VALID_DEVICES),
                "{err}"
            );
        }
    }

    #[test]
    fn cpu_opens_and_names_itself() {
        let d = DeviceSpec::Cpu.open().unwrap();
        assert_eq!((d.info.kind, d.info.selected), ("cpu", None));
        assert!(d.info.name.ends_with("threads)"), "{}", d.info.name);
    }

    #[test]
    fn gpus_without_the_cuda_feature_are_a_clear_error() {
        if candle_core::utils::cuda_is_available() {
            return; // a CUDA build: covered on the GPU machine instead
        }
        for spec in [
            DeviceSpec::Cuda,
            DeviceSpec::Gpu("0".into()),
            "mps:3g.40gb".parse().unwrap(),
        ] {
            let err = spec.open().err().unwrap().to_string();
            assert!(
                err.contains("built without CUDA support") && err.contains("valid devices in this build: cpu"),
                "{err}"
            );
        }
        let (spec, why) = DeviceSpec::default_for(|| panic!("a CPU build does not ask NVML"));
        assert_eq!(spec, DeviceSpec::Cpu);
        assert!(why.unwrap().contains("without CUDA support"));
    }
}
