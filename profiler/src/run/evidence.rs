//! What the GPU sampler saw during the measured phase that bears on trusting the numbers: clocks
//! slowed by the hardware (NVML's throttle reasons), other processes computing on the same device or
//! slice, and a sampler that was off or failed (then nothing of this could be checked).
//!
//! Which throttle reasons count. Thermal slowdowns (hardware or software), the hardware slowdown
//! and the power brake slow the clocks for reasons outside the workload (heat, a failing power
//! supply, an external brake signal): a run that saw them in at least [`THROTTLE_SHARE`] of its
//! readings is `throttled`. The software power cap is different: a GPU at full load runs at its
//! power limit by design, so the cap is the normal operating point of a busy GPU, the one a
//! production deployment sees too. It is recorded (`power_capped`, with its share) and never
//! changes the verdict on its own; when it comes and goes during a run, the latencies drift and the
//! drift test says `unstable`. Idle, application-clock, sync-boost and display-clock reasons are
//! settings or states, not slowdowns, and are ignored.
//!
//! Other processes. NVML lists every process with a compute context on the device (on a MIG
//! device, on that slice). Expected there: this process, the neighbours a concurrent group started
//! on purpose, migprof's own MPS server when the run is an MPS client, and the memory-system
//! neighbour of a memory-partitioned emulated slice. Anyone else shares the
//! device: `shared`. NVML's pids are the host's; in a container with its own PID namespace this
//! process's pid never appears in the list, and then the pids cannot be told apart: a reading with
//! more processes than expected counts as shared, and the flag `processes_unattributed` says the
//! pids could not be matched.

use std::collections::BTreeMap;

use crate::gpu::sampler::{GpuProcess, Sample};

/// A slowdown seen in at least this share of the readings makes the run `throttled`.
pub const THROTTLE_SHARE: f64 = 0.05;

/// NVML's clock-event (throttle) reason bits.
pub mod reasons {
    pub const SW_POWER_CAP: u64 = 0x4;
    pub const HW_SLOWDOWN: u64 = 0x8;
    pub const SW_THERMAL: u64 = 0x20;
    pub const HW_THERMAL: u64 = 0x40;
    pub const HW_POWER_BRAKE: u64 = 0x80;
}

/// The throttle reasons that slow a run for reasons outside it, with their names.
pub const SLOWDOWNS: [(u64, &str); 4] = [
    (reasons::HW_SLOWDOWN, "hw_slowdown"),
    (reasons::SW_THERMAL, "sw_thermal"),
    (reasons::HW_THERMAL, "hw_thermal"),
    (reasons::HW_POWER_BRAKE, "hw_power_brake"),
];

/// The name of migprof's MPS server process, expected beside an MPS client.
pub const MPS_SERVER: &str = "nvidia-cuda-mps-server";

/// Processes that may compute on the device during a run without making it shared.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Expected {
    /// This process and the neighbours started on purpose (pids in this process's namespace).
    pub pids: Vec<u32>,
    /// The run is a client of migprof's own MPS daemon: its server is expected.
    pub mps_server: bool,
}

impl Expected {
    /// This process alone.
    pub fn this_process() -> Self {
        Self {
            pids: vec![std::process::id()],
            mps_server: false,
        }
    }

    /// This process on `device`: with migprof's MPS server beside it when it is an MPS client, or
    /// when the sweep that started it runs an MPS daemon on the same GPU, and with its own
    /// memory-system neighbour on a memory-partitioned slice.
    pub fn on(device: &crate::device::DeviceInfo) -> Self {
        let beside = std::env::var_os(crate::mps::daemon::BESIDE_ENV).is_some();
        let neighbour = device
            .emulation
            .as_ref()
            .and_then(|e| e.partition.as_ref())
            .and_then(|p| p.neighbour_pid);
        let mut expected = Self::this_process();
        expected.pids.extend(neighbour);
        Self {
            mps_server: device.emulation.is_some() || beside,
            ..expected
        }
    }
}

/// How the sampler fared.
#[derive(Debug, Clone, PartialEq)]
pub enum Sampling {
    /// Not a GPU run: nothing to sample.
    NotAGpu,
    /// A GPU run with the sampler turned off (`--sample-interval-ms 0`).
    Off,
    Failed(String),
    Ran,
}

/// The sampler's evidence about one run.
#[derive(Debug, Clone, PartialEq)]
pub struct Evidence {
    pub sampling: Sampling,
    /// Readings that had throttle reasons.
    pub readings: usize,
    /// Share of those readings showing each slowdown of [`SLOWDOWNS`] seen at all, in that order.
    pub slowdowns: Vec<(&'static str, f64)>,
    /// Share of readings showing any slowdown; `None` without readings.
    pub throttle_share: Option<f64>,
    /// Share of readings at the software power cap; `None` without readings.
    pub power_cap_share: Option<f64>,
    /// Unexpected processes seen, each once, with the share of process readings that listed it.
    pub others: Vec<(GpuProcess, f64)>,
    /// This process was never in NVML's list: its pids are of another PID namespace.
    pub unattributed: bool,
}

impl Evidence {
    /// The evidence of a run without GPU readings.
    pub fn none(sampling: Sampling) -> Self {
        Self {
            sampling,
            readings: 0,
            slowdowns: Vec::new(),
            throttle_share: None,
            power_cap_share: None,
            others: Vec::new(),
            unattributed: false,
        }
    }

    pub fn from_samples(samples: &[Sample], expected: &Expected) -> Self {
        let reasons: Vec<u64> = samples.iter().filter_map(|s| s.gpu_throttle_reasons).collect();
        let share = |mask: u64| {
            (!reasons.is_empty())
                .then(|| reasons.iter().filter(|&&r| r & mask != 0).count() as f64 / reasons.len() as f64)
        };
        let slowdowns = SLOWDOWNS
            .iter()
            .filter_map(|&(bit, name)| share(bit).filter(|&s| s > 0.0).map(|s| (name, s)))
            .collect();
        let any_slowdown = SLOWDOWNS.iter().fold(0, |m, (bit, _)| m | bit);
        let (others, unattributed) = others(samples, expected);
        Self {
            sampling: Sampling::Ran,
            readings: reasons.len(),
            slowdowns,
            throttle_share: share(any_slowdown),
            power_cap_share: share(reasons::SW_POWER_CAP),
            others,
            unattributed,
        }
    }

    /// Clocks were slowed by something outside the run for long enough to count.
    pub fn throttled(&self) -> bool {
        self.throttle_share.is_some_and(|s| s >= THROTTLE_SHARE)
    }

    pub fn shared(&self) -> bool {
        !self.others.is_empty()
    }

    /// The other processes as a row holds them: `pid name (MiB), ...`, highest share first.
    pub fn others_text(&self) -> Option<String> {
        (!self.others.is_empty()).then(|| {
            self.others
                .iter()
                .map(|(p, share)| {
                    let name = p.name.as_deref().unwrap_or("?");
                    let mib = p.used_mib.map_or(String::new(), |m| format!(", {m} MiB"));
                    format!("{} {name} ({:.0}% of readings{mib})", p.pid, share * 100.0)
                })
                .collect::<Vec<_>>()
                .join("; ")
        })
    }

    /// A sentence for `verdict_reason`, or `None` when there is nothing to say.
    pub fn describe(&self) -> Option<String> {
        let mut parts = Vec::new();
        match &self.sampling {
            Sampling::NotAGpu => {}
            Sampling::Off => parts.push("GPU sampler off: throttling and other processes not checked".to_string()),
            Sampling::Failed(why) => parts.push(format!(
                "GPU sampler failed ({why}): throttling and other processes not checked"
            )),
            Sampling::Ran => {}
        }
        if !self.slowdowns.is_empty() {
            let each: Vec<String> = self
                .slowdowns
                .iter()
                .map(|(n, s)| format!("{n} {:.0}%", s * 100.0))
                .collect();
            let counts = if self.throttled() { "counts" } else { "below the" };
            parts.push(format!(
                "clocks slowed in {:.0}% of {} readings ({}; {counts} {:.0}% that makes a run throttled)",
                self.throttle_share.unwrap_or(0.0) * 100.0,
                self.readings,
                each.join(", "),
                THROTTLE_SHARE * 100.0
            ));
        }
        if let Some(s) = self.power_cap_share.filter(|&s| s > 0.0) {
            parts.push(format!(
                "at the software power cap in {:.0}% of readings (normal at full load)",
                s * 100.0
            ));
        }
        if let Some(others) = self.others_text() {
            parts.push(format!("other processes on the device: {others}"));
        }
        if self.unattributed {
            parts.push(
                "NVML's pids are of another PID namespace (a container?): processes counted, not matched".to_string(),
            );
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }
}

/// The unexpected processes of the readings, and whether the pids could not be matched to ours.
fn others(samples: &[Sample], expected: &Expected) -> (Vec<(GpuProcess, f64)>, bool) {
    let lists: Vec<&Vec<GpuProcess>> = samples.iter().filter_map(|s| s.compute_processes.as_ref()).collect();
    if lists.is_empty() {
        return (Vec::new(), false);
    }
    let is_server = |p: &GpuProcess| expected.mps_server && p.name.as_deref() == Some(MPS_SERVER);
    let ours_listed = lists.iter().any(|l| l.iter().any(|p| expected.pids.contains(&p.pid)));
    let anyone_listed = lists.iter().any(|l| !l.is_empty());
    // Seen per pid: the process as last listed (its memory then), and in how many readings.
    let mut seen: BTreeMap<u32, (GpuProcess, usize)> = BTreeMap::new();
    let mut note = |p: &GpuProcess| {
        let e = seen.entry(p.pid).or_insert_with(|| (p.clone(), 0));
        e.0 = p.clone();
        e.1 += 1;
    };
    let unattributed = anyone_listed && !ours_listed;
    let mut expected_pids = expected.pids.clone();
    expected_pids.sort_unstable();
    expected_pids.dedup();
    for list in &lists {
        let unexpected: Vec<&GpuProcess> = list
            .iter()
            .filter(|p| !is_server(p) && !expected_pids.contains(&p.pid))
            .collect();
        if unattributed {
            // Which listed process is which cannot be told: only a count above the expected one
            // (ours, our neighbours, and the MPS server when its name could not be read either)
            // shows someone else, and all are named.
            let server_unnamed = expected.mps_server && !list.iter().any(is_server);
            if unexpected.len() > expected_pids.len() + usize::from(server_unnamed) {
                unexpected.into_iter().for_each(&mut note);
            }
        } else {
            unexpected.into_iter().for_each(&mut note);
        }
    }
    let mut others: Vec<(GpuProcess, f64)> = seen
        .into_values()
        .map(|(p, n)| (p, n as f64 / lists.len() as f64))
        .collect();
    others.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.pid.cmp(&b.0.pid)));
    (others, unattributed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reading(reasons: u64, processes: &[(u32, &str)]) -> Sample {
        Sample {
            gpu_throttle_reasons: Some(reasons),
            compute_processes: Some(
                processes
                    .iter()
                    .map(|&(pid, name)| GpuProcess {
                        pid,
                        name: Some(name.into()),
                        used_mib: Some(500),
                    })
                    .collect(),
            ),
            ..Default::default()
        }
    }

    fn us() -> Expected {
        Expected {
            pids: vec![100],
            mps_server: false,
        }
    }

    #[test]
    fn a_quiet_gpu_at_its_power_cap_is_no_evidence_against_the_run() {
        let samples: Vec<Sample> = (0..50)
            .map(|i| reading(if i % 2 == 0 { reasons::SW_POWER_CAP } else { 0 }, &[(100, "migprof")]))
            .collect();
        let e = Evidence::from_samples(&samples, &us());
        assert!(!e.throttled() && !e.shared() && !e.unattributed);
        assert_eq!(e.power_cap_share, Some(0.5));
        assert_eq!(
            e.describe().unwrap(),
            "at the software power cap in 50% of readings (normal at full load)"
        );
    }

    #[test]
    fn thermal_slowdown_in_enough_readings_throttles_the_run_and_says_how_much() {
        // 10 of 100 readings in hardware thermal slowdown, 2 of them with the power brake too.
        let samples: Vec<Sample> = (0..100)
            .map(|i| {
                reading(
                    if i < 2 {
                        reasons::HW_THERMAL | reasons::HW_POWER_BRAKE
                    } else if i < 10 {
                        reasons::HW_THERMAL
                    } else {
                        0
                    },
                    &[(100, "migprof")],
                )
            })
            .collect();
        let e = Evidence::from_samples(&samples, &us());
        assert!(e.throttled());
        assert_eq!(e.slowdowns, vec![("hw_thermal", 0.1), ("hw_power_brake", 0.02)]);
        assert!(
            e.describe()
                .unwrap()
                .starts_with("clocks slowed in 10% of 100 readings (hw_thermal 10%, hw_power_brake 2%; counts 5%"),
            "{:?}",
            e.describe()
        );
        // 4 readings of 100 stay below the share that counts, and are still reported.
        let few: Vec<Sample> = (0..100)
            .map(|i| reading(if i < 4 { reasons::HW_SLOWDOWN } else { 0 }, &[]))
            .collect();
        let e = Evidence::from_samples(&few, &us());
        assert!(!e.throttled());
        assert!(e.describe().unwrap().contains("below the 5%"), "{:?}", e.describe());
    }

    #[test]
    fn another_process_shares_the_device_and_expected_ones_do_not() {
        let mut samples: Vec<Sample> = (0..10)
            .map(|_| reading(0, &[(100, "migprof"), (7, "nvidia-cuda-mps-server"), (300, "migprof")]))
            .collect();
        samples.extend((0..10).map(|_| {
            reading(
                0,
                &[
                    (100, "migprof"),
                    (7, "nvidia-cuda-mps-server"),
                    (300, "migprof"),
                    (4242, "python3"),
                ],
            )
        }));
        // Neighbour 300 and the MPS server are expected; python3 came in half-way.
        let expected = Expected {
            pids: vec![100, 300],
            mps_server: true,
        };
        let e = Evidence::from_samples(&samples, &expected);
        assert!(e.shared());
        assert_eq!(e.others.len(), 1);
        assert_eq!(e.others_text().unwrap(), "4242 python3 (50% of readings, 500 MiB)");
        // Without the MPS client the server is someone else, and so is an unexpected neighbour.
        let e = Evidence::from_samples(&samples, &us());
        let pids: Vec<u32> = e.others.iter().map(|(p, _)| p.pid).collect();
        assert_eq!(pids, vec![7, 300, 4242]);
    }

    #[test]
    fn pids_of_another_namespace_are_counted_not_matched() {
        // Inside a container NVML lists host pids: ours (100) never appears.
        let alone: Vec<Sample> = (0..10).map(|_| reading(0, &[(90_001, "?")])).collect();
        let e = Evidence::from_samples(&alone, &us());
        assert!(e.unattributed && !e.shared(), "{e:?}");
        let crowded: Vec<Sample> = (0..10).map(|_| reading(0, &[(90_001, "?"), (90_002, "?")])).collect();
        let e = Evidence::from_samples(&crowded, &us());
        assert!(e.unattributed && e.shared(), "{e:?}");
        // An MPS client beside its server whose name cannot be read: two processes, both expected.
        let client = Expected {
            pids: vec![100, 100],
            mps_server: true,
        };
        assert!(
            !Evidence::from_samples(&crowded, &client).shared(),
            "the server and this client"
        );
        let three: Vec<Sample> = (0..10)
            .map(|_| reading(0, &[(90_001, "?"), (90_002, "?"), (90_003, "?")]))
            .collect();
        assert!(
            Evidence::from_samples(&three, &client).shared(),
            "a third is someone else"
        );
        assert!(e.describe().unwrap().contains("another PID namespace"));
    }

    #[test]
    fn readings_without_the_counters_judge_nothing() {
        let e = Evidence::from_samples(&[Sample::default(), Sample::default()], &us());
        assert_eq!(
            (e.throttle_share, e.power_cap_share, e.shared(), e.unattributed),
            (None, None, false, false)
        );
        assert_eq!(e.describe(), None);
        assert!(Evidence::none(Sampling::Failed("NVML went away".into()))
            .describe()
            .unwrap()
            .contains("sampler failed (NVML went away)"));
    }
}
