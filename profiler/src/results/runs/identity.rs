//! The groups of columns the `runs` table shares with the `load` and `serve` tables: which cell a row
//! belongs to, where it ran, and the environment it ran in; each a table of (name, type, value).

use polars::prelude::*;

use crate::device::DeviceInfo;
use crate::mps::partition::Partition;
use crate::run::fingerprint::Fingerprint;
use crate::run::record::CellIdentity;

/// A column of a shared group: its name, and how a row's value is read from a `T`, which gives its
/// type (null where there is none).
pub(crate) enum Field<T: 'static> {
    Text(&'static str, fn(&T) -> Option<String>),
    Int(&'static str, fn(&T) -> Option<i64>),
    Float(&'static str, fn(&T) -> Option<f64>),
    Flag(&'static str, fn(&T) -> Option<bool>),
}

use Field::*;

/// The columns of `fields` for `rows`, one value a row.
fn columns<T>(fields: &[Field<T>], rows: &[&T]) -> Vec<Column> {
    fn column<T, V>(name: &str, rows: &[&T], read: fn(&T) -> Option<V>) -> Column
    where
        Series: NamedFrom<Vec<Option<V>>, [Option<V>]>,
    {
        Column::new(name.into(), rows.iter().map(|r| read(r)).collect::<Vec<Option<V>>>())
    }
    fields
        .iter()
        .map(|f| match f {
            Text(name, read) => column(name, rows, *read),
            Int(name, read) => column(name, rows, *read),
            Float(name, read) => column(name, rows, *read),
            Flag(name, read) => column(name, rows, *read),
        })
        .collect()
}

/// Which cell each row belongs to and how it ended (`error` is null: a row with a measurement has none).
pub(crate) fn cell_columns(cells: &[&CellIdentity]) -> Vec<Column> {
    columns(CELL, cells)
}

static CELL: &[Field<CellIdentity>] = &[
    Text("sweep", |c| c.sweep.clone()),
    Text("target", |c| Some(c.target.clone())),
    Text("cell_id", |c| Some(c.cell_id.clone())),
    Text("status", |c| Some(c.status.as_str().to_string())),
    Text("error", |_| None),
    Text("concurrency_group", |c| c.concurrency_group.clone()),
    Text("neighbours", |c| neighbours(&c.neighbours)),
    Flag("baseline", |c| Some(c.baseline)),
    Text("cell_settings", |c| c.settings.clone()),
];

/// A group member's neighbours as a row holds them: `target:model/mode/dtype/batch`, comma-separated.
fn neighbours(list: &[String]) -> Option<String> {
    (!list.is_empty()).then(|| list.join(","))
}

/// Where each row ran: the device, its GPU and MIG identity, an emulated slice's share.
pub(crate) fn device_columns(devices: &[&DeviceInfo]) -> Vec<Column> {
    columns(DEVICE, devices)
}

fn selected(d: &DeviceInfo) -> Option<&crate::gpu::Selected> {
    d.selected.as_ref()
}

fn mig(d: &DeviceInfo) -> Option<&crate::gpu::MigDevice> {
    d.selected.as_ref().and_then(|s| s.mig.as_ref())
}

fn emulation(d: &DeviceInfo) -> Option<&crate::mps::Emulation> {
    d.emulation.as_ref()
}

/// A memory-partitioned slice's neighbour and its calibration.
fn partition(d: &DeviceInfo) -> Option<&Partition> {
    d.emulation.as_ref().and_then(|e| e.partition.as_ref())
}

static DEVICE: &[Field<DeviceInfo>] = &[
    Text("device_kind", |d| Some(d.kind.to_string())),
    Text("device_name", |d| Some(d.name.clone())),
    Text("gpu_name", |d| selected(d).map(|s| s.gpu.name.clone())),
    Text("gpu_uuid", |d| selected(d).map(|s| s.gpu.uuid.clone())),
    Text("mig_uuid", |d| mig(d).map(|m| m.uuid.clone())),
    Text("mig_profile", |d| mig(d).map(|m| m.profile.clone())),
    Int("gpu_instance_id", |d| mig(d).map(|m| m.gpu_instance_id as i64)),
    Int("compute_instance_id", |d| mig(d).map(|m| m.compute_instance_id as i64)),
    // What the run could use: the slice's, or an MPS client's as measured (else its share's).
    Int("sm_count", |d| match (&d.emulation, &d.selected) {
        (Some(e), _) => Some(i64::from(e.measured_sms.unwrap_or(e.share.profile_sms))),
        (None, Some(s)) => s.mig.as_ref().map(|m| m.sm_count).or(s.gpu.sm_count).map(i64::from),
        (None, None) => None,
    }),
    // What migprof's kernels sized their grids to: the driver's count (a slice's where it tells the
    // process its slice), apart from `sm_count` so that a row says if they differed.
    Int("kernel_sm_count", |d| d.kernel_sms.map(i64::from)),
    Int("device_memory_mib", |d| d.memory_mib().map(|m| m as i64)),
    Text("emulation", |d| emulation(d).map(|_| "mps".to_string())),
    Text("emulated_profile", |d| {
        emulation(d).and_then(|e| e.share.profile.clone())
    }),
    Int("mps_share_pct", |d| emulation(d).map(|e| i64::from(e.share.percent))),
    Int("profile_sms", |d| emulation(d).map(|e| i64::from(e.share.profile_sms))),
    Int("measured_sms", |d| {
        emulation(d).and_then(|e| e.measured_sms).map(i64::from)
    }),
    Int("mps_memory_limit_mib", |d| {
        emulation(d).and_then(|e| e.share.memory_limit_mib).map(|m| m as i64)
    }),
    Int("measured_memory_mib", |d| {
        emulation(d).and_then(|e| e.measured_memory_mib).map(|m| m as i64)
    }),
    Float("measured_bandwidth_gbps", |d| {
        d.memory_system.as_ref().map(|m| m.bandwidth_gbps)
    }),
    Float("measured_l2_mib", |d| d.memory_system.as_ref().and_then(|m| m.l2_mib)),
    // A memory-partitioned emulated slice: its neighbour and what it was set to.
    Text("memory_emulation", |d| {
        emulation(d).map(|e| e.memory().as_str().to_string())
    }),
    Float("gpu_bandwidth_gbps", |d| partition(d).map(|p| p.gpu_bandwidth_gbps)),
    Float("memory_share_gbps", |d| partition(d).map(|p| p.share_gbps)),
    Float("alone_bandwidth_gbps", |d| {
        partition(d).and_then(|p| p.alone_bandwidth_gbps)
    }),
    Text("calibration", |d| partition(d).map(|p| p.outcome.as_str().to_string())),
    Flag("calibration_cached", |d| partition(d).map(|p| p.cached)),
    Int("neighbour_blocks", |d| {
        partition(d).and_then(|p| p.load).map(|l| i64::from(l.blocks))
    }),
    Int("neighbour_pause_ns", |d| {
        partition(d).and_then(|p| p.load).map(|l| i64::from(l.pause_ns))
    }),
    Int("neighbour_sms", |d| {
        partition(d).and_then(|p| p.neighbour_sms).map(i64::from)
    }),
    Int("shared_sms", |d| partition(d).and_then(|p| p.shared_sms).map(i64::from)),
    Float("compute_slowdown_pct", |d| {
        partition(d).and_then(|p| p.compute_slowdown_pct)
    }),
    Int("calibration_sm_clock_mhz", |d| {
        partition(d).and_then(|p| p.sm_clock_mhz).map(i64::from)
    }),
    Int("calibration_throttle_reasons", |d| {
        partition(d).and_then(|p| p.throttle_reasons).map(|r| r as i64)
    }),
];

/// The environment fingerprint's columns, one row per fingerprint.
pub(crate) fn fingerprint_columns(fingerprints: &[&Fingerprint]) -> Vec<Column> {
    columns(FINGERPRINT, fingerprints)
}

static FINGERPRINT: &[Field<Fingerprint>] = &[
    Text("candle_version", |f| Some(f.candle_version.clone())),
    Text("build_features", |f| Some(f.build_features.clone())),
    Flag("git_dirty", |f| Some(f.git_dirty)),
    Text("cpu_model", |f| f.cpu_model.clone()),
    Text("driver_version", |f| f.driver_version.clone()),
    Text("cuda_driver_version", |f| f.cuda_driver_version.clone()),
    Text("cudnn_version", |f| f.cudnn_version.clone()),
    Text("cublas_version", |f| f.cublas_version.clone()),
    Flag("mig_mode", |f| f.mig_mode),
    Flag("persistence_mode", |f| f.persistence_mode),
    Float("power_limit_w", |f| f.power_limit_w),
    Int("sm_clock_mhz_start", |f| f.sm_clock_mhz.map(i64::from)),
    Int("mem_clock_mhz_start", |f| f.mem_clock_mhz.map(i64::from)),
    Flag("ecc_enabled", |f| f.ecc_enabled),
    Float("pool_held_mib_start", |f| f.pool_held_mib),
];
