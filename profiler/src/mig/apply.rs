//! `migprof mig apply`, `destroy` and `export`: turning a layout file into driver calls and back.
//!
//! Every change is planned in full and printed — each action with the `nvidia-smi` command that does
//! the same — before anything is touched. Acting needs `--yes` and root, an idle GPU, and an explicit
//! flag for a MIG mode change; a mode change that waits for a GPU reset is reported with the reset
//! command and never carried out by migprof. After acting, NVML is read again and the command fails
//! unless the GPU looks as asked.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write;

use anyhow::{anyhow, bail, Context, Result};

use super::config::{entries_by_gpu, DeviceConfig, Devices, GpuKey, MigPartedFile};
use super::control::{GpuInstanceState, GpuState, MigControl};
use super::mode::on_off;
use super::plan::{plan, Placement, Plan};
use super::profile::{MigProfile, ProfileTable};

/// What the caller allows.
#[derive(Debug, Clone, Copy, Default)]
pub struct Options {
    /// Act; without it, print the plan only.
    pub yes: bool,
    /// Turning MIG mode on is allowed.
    pub enable_mig: bool,
    /// Turning MIG mode off is allowed.
    pub disable_mig: bool,
    /// The effective user is root (NVML refuses MIG changes to anyone else).
    pub root: bool,
}

/// One driver call (two for a GPU instance: it is created with its spanning compute instance, as
/// `nvidia-smi mig -cgi … -C` does).
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    SetMigMode {
        gpu: u32,
        enabled: bool,
    },
    DestroyComputeInstance {
        gpu: u32,
        gpu_instance: u32,
        compute_instance: u32,
    },
    DestroyGpuInstance {
        gpu: u32,
        gpu_instance: u32,
        profile: String,
    },
    CreateGpuInstance {
        gpu: u32,
        profile: MigProfile,
        placement: Placement,
    },
}

impl Action {
    pub fn describe(&self) -> String {
        match self {
            Action::SetMigMode { enabled, .. } => format!("turn MIG mode {}", if *enabled { "on" } else { "off" }),
            Action::DestroyComputeInstance {
                gpu_instance,
                compute_instance,
                ..
            } => {
                format!("destroy compute instance {compute_instance} of GPU instance {gpu_instance}")
            }
            Action::DestroyGpuInstance {
                gpu_instance, profile, ..
            } => format!("destroy GPU instance {gpu_instance} ({profile})"),
            Action::CreateGpuInstance { profile, placement, .. } => format!(
                "create a {} GPU instance (profile id {}) at {}, with a compute instance spanning it",
                profile.name,
                profile.id,
                slices(*placement)
            ),
        }
    }

    /// The nvidia-smi command that does the same.
    pub fn nvidia_smi(&self) -> String {
        match self {
            Action::SetMigMode { gpu, enabled } => format!("sudo nvidia-smi -i {gpu} -mig {}", u8::from(*enabled)),
            Action::DestroyComputeInstance {
                gpu,
                gpu_instance,
                compute_instance,
            } => {
                format!("sudo nvidia-smi mig -i {gpu} -gi {gpu_instance} -ci {compute_instance} -dci")
            }
            Action::DestroyGpuInstance { gpu, gpu_instance, .. } => {
                format!("sudo nvidia-smi mig -i {gpu} -gi {gpu_instance} -dgi")
            }
            Action::CreateGpuInstance {
                gpu,
                profile,
                placement,
            } => {
                format!(
                    "sudo nvidia-smi mig -i {gpu} -cgi {}:{} -C",
                    profile.id, placement.start
                )
            }
        }
    }

    fn mode_change(&self) -> Option<bool> {
        match self {
            Action::SetMigMode { enabled, .. } => Some(*enabled),
            _ => None,
        }
    }
}

/// What one GPU should become.
#[derive(Debug, Clone, PartialEq)]
pub enum Target {
    MigOff,
    Layout(Plan),
    /// Every GPU instance gone, MIG mode as it is (`mig destroy`).
    Empty,
}

/// The planned change of one GPU.
#[derive(Debug, Clone)]
pub struct Change {
    pub gpu: GpuState,
    pub target: Target,
    pub actions: Vec<Action>,
}

/// `migprof mig apply`: brings the GPUs the config names to its layout.
pub fn apply(
    ctl: &mut dyn MigControl,
    file: &MigPartedFile,
    config: Option<&str>,
    opts: &Options,
    out: &mut dyn Write,
) -> Result<()> {
    let (name, entries) = file.select(config)?;
    let changes = plan_apply(ctl, entries).with_context(|| format!("config `{name}`"))?;
    writeln!(out, "config `{name}`")?;
    carry_out(ctl, changes, opts, out)
}

/// `migprof mig destroy`: removes every compute and GPU instance of the GPUs given (all with MIG on
/// when none are given). MIG mode stays as it is.
pub fn destroy(ctl: &mut dyn MigControl, gpus: &[u32], opts: &Options, out: &mut dyn Write) -> Result<()> {
    let all = ctl.gpus()?;
    for i in gpus {
        let Some(g) = all.iter().find(|g| g.index == *i) else {
            bail!("no GPU {i}; this machine's GPUs: {}", indices(&all))
        };
        if !g.mig_mode.is_some_and(|m| m.current) {
            bail!("GPU {i} ({}) has MIG mode off: it has no instances to destroy", g.name)
        }
    }
    let chosen = all
        .into_iter()
        .filter(|g| g.mig_mode.is_some_and(|m| m.current) && (gpus.is_empty() || gpus.contains(&g.index)));
    let changes = chosen
        .map(|g| {
            // Only for naming the profiles in the printed plan: ids do without.
            let table = ctl.profile_table(g.index).ok();
            Change {
                actions: teardown(&g, table.as_ref()),
                target: Target::Empty,
                gpu: g,
            }
        })
        .collect();
    carry_out(ctl, changes, opts, out)
}

/// `migprof mig export`: the current layout as a mig-parted file with one config, `name`, and a
/// warning for each thing the file cannot express.
pub fn export(ctl: &mut dyn MigControl, name: &str) -> Result<(MigPartedFile, Vec<String>)> {
    let mut entries = Vec::new();
    let mut warnings = Vec::new();
    for g in ctl.gpus()? {
        let Some(mode) = g.mig_mode else {
            warnings.push(format!("GPU {} ({}) does not support MIG; left out", g.index, g.name));
            continue;
        };
        if mode.pending != mode.current {
            warnings.push(format!(
                "GPU {}: MIG mode is {} until the next GPU reset; exported as it is now",
                g.index,
                on_off(mode.current)
            ));
        }
        let mut mig_devices = BTreeMap::new();
        if mode.current {
            let table = ctl.profile_table(g.index)?;
            for gi in &g.gpu_instances {
                let profile = profile_by_id(&table, gi.profile_id)?;
                if gi.compute_instances.is_empty() {
                    warnings.push(format!(
                        "GPU {} GI {}: no compute instance; `mig apply` would create one spanning it",
                        g.index, gi.id
                    ));
                }
                if gi
                    .compute_instances
                    .iter()
                    .any(|c| c.compute_slices != profile.compute_slices)
                {
                    let parts: Vec<String> = gi
                        .compute_instances
                        .iter()
                        .map(|c| format!("{}c.{}", c.compute_slices, profile.name))
                        .collect();
                    warnings.push(format!(
                        "GPU {} GI {} ({}) is split into compute instances {}; exported as one {}: `mig apply` creates one compute instance per GPU instance",
                        g.index, gi.id, profile.name, parts.join(", "), profile.name
                    ));
                }
                *mig_devices.entry(profile.name.clone()).or_insert(0) += 1;
            }
        }
        entries.push(DeviceConfig {
            devices: Devices::Indices(vec![g.index]),
            device_filter: None,
            mig_enabled: mode.current,
            mig_devices,
        });
    }
    if entries.is_empty() {
        bail!("no GPU here supports MIG: nothing to export")
    }
    let file = MigPartedFile {
        version: "v1".into(),
        mig_configs: BTreeMap::from([(name.to_string(), entries)]),
    };
    Ok((file, warnings))
}

fn plan_apply(ctl: &mut dyn MigControl, entries: &[DeviceConfig]) -> Result<Vec<Change>> {
    let gpus = ctl.gpus()?;
    let keys: Vec<GpuKey> = gpus
        .iter()
        .map(|g| GpuKey {
            index: g.index,
            pci_device_id: g.pci_device_id,
        })
        .collect();
    let chosen = entries_by_gpu(entries, &keys)?;
    if chosen.is_empty() {
        bail!("it names none of this machine's GPUs ({})", indices(&gpus))
    }
    let mut changes = Vec::new();
    for (key, entry) in chosen {
        let gpu = gpus
            .iter()
            .find(|g| g.index == key.index)
            .expect("chosen from these")
            .clone();
        let who = format!("GPU {} ({})", gpu.index, gpu.name);
        let Some(mode) = gpu.mig_mode else {
            bail!("{who} does not support MIG")
        };
        let table = ctl.profile_table(gpu.index).with_context(|| who.clone())?;
        let change = if entry.mig_enabled {
            for name in entry.mig_devices.keys() {
                if let Some((ci, gi)) = split_compute_prefix(name) {
                    bail!("{who}: `{name}` asks for {ci}-slice compute instances inside a {gi} GPU instance; migprof creates one compute instance spanning each GPU instance, so name the GPU-instance profile ({gi})")
                }
            }
            let layout = plan(&table, &entry.profiles()).with_context(|| format!("{who}: the layout does not fit"))?;
            let mut actions = Vec::new();
            if !mode.current && !mode.pending {
                actions.push(Action::SetMigMode {
                    gpu: gpu.index,
                    enabled: true,
                });
            }
            if !in_place(&gpu, &layout, &table) {
                actions.extend(teardown(&gpu, Some(&table)));
                actions.extend(layout.instances.iter().map(|gi| Action::CreateGpuInstance {
                    gpu: gpu.index,
                    profile: gi.profile.clone(),
                    placement: gi.placement,
                }));
            }
            Change {
                gpu,
                target: Target::Layout(layout),
                actions,
            }
        } else {
            let mut actions = teardown(&gpu, Some(&table));
            if mode.current || mode.pending {
                actions.push(Action::SetMigMode {
                    gpu: gpu.index,
                    enabled: false,
                });
            }
            Change {
                gpu,
                target: Target::MigOff,
                actions,
            }
        };
        changes.push(change);
    }
    Ok(changes)
}

/// `2c.3g.40gb` -> ("2c", "3g.40gb").
fn split_compute_prefix(name: &str) -> Option<(&str, &str)> {
    let (head, rest) = name.split_once('.')?;
    (head.ends_with('c') && head[..head.len() - 1].parse::<u32>().is_ok()).then_some((head, rest))
}

/// Whether the GPU already holds exactly the planned instances, each spanned by one compute instance.
fn in_place(gpu: &GpuState, layout: &Plan, table: &ProfileTable) -> bool {
    if !gpu.mig_mode.is_some_and(|m| m.current) {
        return false;
    }
    let mut have: Vec<u32> = gpu.gpu_instances.iter().map(|g| g.profile_id).collect();
    let mut want: Vec<u32> = layout.instances.iter().map(|g| g.profile.id).collect();
    have.sort_unstable();
    want.sort_unstable();
    have == want && gpu.gpu_instances.iter().all(|gi| spanned(gi, table))
}

fn spanned(gi: &GpuInstanceState, table: &ProfileTable) -> bool {
    let slices = table.by_id(gi.profile_id).map(|p| p.compute_slices);
    matches!(gi.compute_instances.as_slice(), [ci] if Some(ci.compute_slices) == slices)
}

/// Destroying every instance: compute instances first (NVML refuses to destroy a GPU instance that
/// still has them).
fn teardown(gpu: &GpuState, table: Option<&ProfileTable>) -> Vec<Action> {
    let mut actions = Vec::new();
    for gi in &gpu.gpu_instances {
        for ci in &gi.compute_instances {
            actions.push(Action::DestroyComputeInstance {
                gpu: gpu.index,
                gpu_instance: gi.id,
                compute_instance: ci.id,
            });
        }
    }
    for gi in &gpu.gpu_instances {
        let profile = table
            .and_then(|t| t.by_id(gi.profile_id))
            .map_or_else(|| format!("profile id {}", gi.profile_id), |p| p.name.clone());
        actions.push(Action::DestroyGpuInstance {
            gpu: gpu.index,
            gpu_instance: gi.id,
            profile,
        });
    }
    actions
}

fn carry_out(ctl: &mut dyn MigControl, changes: Vec<Change>, opts: &Options, out: &mut dyn Write) -> Result<()> {
    if changes.is_empty() {
        writeln!(out, "no GPU with MIG on: nothing to do")?;
        return Ok(());
    }
    let mut flags = Vec::new();
    for c in &changes {
        write!(out, "{}", render(c))?;
        for a in &c.actions {
            match a.mode_change() {
                Some(true) if !opts.enable_mig => flags.push("--enable-mig"),
                Some(false) if !opts.disable_mig => flags.push("--disable-mig"),
                _ => {}
            }
        }
    }
    flags.dedup();
    let waiting: Vec<&Change> = changes.iter().filter(|c| awaits_reset(c)).collect();
    if changes.iter().all(|c| c.actions.is_empty()) && waiting.is_empty() {
        writeln!(out, "nothing to do: every GPU already looks as asked")?;
        return verify(ctl, &changes, out);
    }
    if !opts.yes {
        let mut how = String::from("--yes");
        for f in &flags {
            how += &format!(" {f}");
        }
        writeln!(
            out,
            "dry run: nothing was changed. To act, run the same command as root with {how}."
        )?;
        return Ok(());
    }
    // Every refusal before the first call, so that no GPU is left half-changed by one.
    if !opts.root {
        bail!("changing MIG instances needs root (NVML refuses anyone else); run it again with sudo. Nothing was changed.")
    }
    if !flags.is_empty() {
        bail!(
            "the plan changes MIG mode; pass {} to allow it. Nothing was changed.",
            flags.join(" and ")
        )
    }
    for c in &changes {
        if !c.actions.is_empty() && !c.gpu.processes.is_empty() {
            let pids: Vec<String> = c.gpu.processes.iter().map(|p| p.to_string()).collect();
            bail!(
                "GPU {} is in use by process(es) {}; MIG changes need an idle GPU: stop them and run again. Nothing was changed.",
                c.gpu.index,
                pids.join(", ")
            )
        }
    }
    if let Some(c) = waiting.first() {
        bail!(
            "{}",
            pending_message(c.gpu.index, c.gpu.mig_mode.is_some_and(|m| m.pending))
        )
    }
    for c in &changes {
        execute(ctl, c, out)?;
    }
    verify(ctl, &changes, out)
}

/// MIG mode already asked for, waiting for a reset: nothing can be created before it.
fn awaits_reset(c: &Change) -> bool {
    let Some(mode) = c.gpu.mig_mode else { return false };
    matches!(c.target, Target::Layout(_)) && !mode.current && mode.pending
}

fn pending_message(gpu: u32, enabled: bool) -> String {
    format!(
        "MIG mode {} on GPU {gpu} is pending: it takes effect after a GPU reset, which migprof never does itself. \
         Stop every process and service using the GPU (nvidia-persistenced, DCGM, ...), then run `sudo nvidia-smi --gpu-reset -i {gpu}` \
         (or reboot), and run this command again{}.",
        on_off(enabled),
        if enabled { " to create the instances" } else { "" }
    )
}

fn render(c: &Change) -> String {
    let mut s = format!("GPU {} ({}, {}):\n", c.gpu.index, c.gpu.name, c.gpu.uuid);
    let _ = match &c.target {
        Target::MigOff => writeln!(s, "  want: MIG mode off"),
        Target::Empty => writeln!(s, "  want: no GPU instances"),
        Target::Layout(p) => {
            let names: Vec<String> = p
                .instances
                .iter()
                .map(|g| format!("{} at {}", g.profile.name, slices(g.placement)))
                .collect();
            writeln!(s, "  want: MIG on with {}", names.join(", "))
        }
    };
    if awaits_reset(c) {
        let _ = writeln!(
            s,
            "  MIG mode on is pending a GPU reset; nothing can be created before it"
        );
    }
    if c.actions.is_empty() && !awaits_reset(c) {
        let _ = writeln!(s, "  already in place");
    }
    for (i, a) in c.actions.iter().enumerate() {
        let _ = writeln!(s, "  {}. {}\n       $ {}", i + 1, a.describe(), a.nvidia_smi());
    }
    s
}

fn execute(ctl: &mut dyn MigControl, c: &Change, out: &mut dyn Write) -> Result<()> {
    let gpu = c.gpu.index;
    for (i, a) in c.actions.iter().enumerate() {
        let step = || format!("GPU {gpu}, step {} of {} ({})", i + 1, c.actions.len(), a.describe());
        match a {
            Action::SetMigMode { enabled, .. } => {
                let mode = ctl.set_mig_mode(gpu, *enabled).with_context(step)?;
                if mode.current != *enabled {
                    writeln!(out, "  MIG mode {} is pending on GPU {gpu}", on_off(*enabled))?;
                    bail!("{}", pending_message(gpu, *enabled))
                }
            }
            Action::DestroyComputeInstance {
                gpu_instance,
                compute_instance,
                ..
            } => ctl
                .destroy_compute_instance(gpu, *gpu_instance, *compute_instance)
                .with_context(step)?,
            Action::DestroyGpuInstance { gpu_instance, .. } => {
                ctl.destroy_gpu_instance(gpu, *gpu_instance).with_context(step)?
            }
            Action::CreateGpuInstance { profile, placement, .. } => {
                let gi = ctl
                    .create_gpu_instance(gpu, profile.id, *placement)
                    .with_context(step)?;
                ctl.create_compute_instance(gpu, gi).with_context(step)?;
            }
        }
        writeln!(out, "  done: {}", a.describe())?;
    }
    Ok(())
}

/// Reads NVML again and fails unless each GPU looks as planned.
fn verify(ctl: &mut dyn MigControl, changes: &[Change], out: &mut dyn Write) -> Result<()> {
    let now = ctl.gpus().context("reading the GPUs back after the change")?;
    for c in changes {
        let gpu = now
            .iter()
            .find(|g| g.index == c.gpu.index)
            .ok_or_else(|| anyhow!("GPU {} is gone from NVML after the change", c.gpu.index))?;
        let on = gpu.mig_mode.is_some_and(|m| m.current);
        let table = if on { Some(ctl.profile_table(gpu.index)?) } else { None };
        let seen = describe_instances(gpu, table.as_ref());
        let ok = match &c.target {
            Target::MigOff => !on,
            Target::Empty => gpu.gpu_instances.is_empty(),
            Target::Layout(p) => table.as_ref().is_some_and(|t| in_place(gpu, p, t)),
        };
        if !ok {
            let wanted = match &c.target {
                Target::MigOff => "MIG mode off".to_string(),
                Target::Empty => "no GPU instances".to_string(),
                Target::Layout(p) => p
                    .instances
                    .iter()
                    .map(|g| g.profile.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
            };
            bail!(
                "post-apply check failed on GPU {}: asked for {wanted}, but NVML now reports MIG {} with {seen}. The driver accepted every call; \
                 look at `nvidia-smi mig -lgi` and `nvidia-smi mig -lci` before running anything on this GPU",
                gpu.index,
                on_off(on)
            )
        }
        writeln!(out, "checked GPU {}: MIG {}, {seen}", gpu.index, on_off(on))?;
    }
    Ok(())
}

fn describe_instances(gpu: &GpuState, table: Option<&ProfileTable>) -> String {
    if gpu.gpu_instances.is_empty() {
        return "no GPU instances".into();
    }
    let parts: Vec<String> = gpu
        .gpu_instances
        .iter()
        .map(|gi| {
            let name = table
                .and_then(|t| t.by_id(gi.profile_id))
                .map_or("?", |p| p.name.as_str());
            format!(
                "{name} (GI {}, {}:{}, {} CI)",
                gi.id,
                gi.placement.start,
                gi.placement.size,
                gi.compute_instances.len()
            )
        })
        .collect();
    parts.join(", ")
}

/// `memory slice 2`, `memory slices 4..7`.
fn slices(p: Placement) -> String {
    if p.size == 1 {
        format!("memory slice {}", p.start)
    } else {
        format!("memory slices {}..{}", p.start, p.start + p.size - 1)
    }
}

fn profile_by_id(table: &ProfileTable, id: u32) -> Result<&MigProfile> {
    table
        .by_id(id)
        .ok_or_else(|| anyhow!("GPU-instance profile id {id} is not in the {}'s table", table.product))
}

fn indices(gpus: &[GpuState]) -> String {
    if gpus.is_empty() {
        return "none".into();
    }
    gpus.iter().map(|g| g.index.to_string()).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mig::control::ComputeInstance;
    use crate::mig::profile::table;
    use crate::testing::nvml::FakeNvml;

    const MIXED: &str = "version: v1\nmig-configs:\n  mixed:\n    - devices: all\n      mig-enabled: true\n      mig-devices:\n        3g.40gb: 1\n        2g.20gb: 1\n        1g.10gb: 2\n";

    fn act() -> Options {
        Options {
            yes: true,
            enable_mig: false,
            disable_mig: false,
            root: true,
        }
    }

    fn run_apply(fake: &mut FakeNvml, yaml: &str, opts: Options) -> (Result<()>, String) {
        let file = MigPartedFile::parse(yaml).unwrap();
        let mut out = Vec::new();
        let r = apply(fake, &file, None, &opts, &mut out);
        (r, String::from_utf8(out).unwrap())
    }

    fn layout(fake: &FakeNvml) -> Vec<(u32, u32, usize)> {
        let mut v: Vec<(u32, u32, usize)> = fake.gpus[0]
            .state
            .gpu_instances
            .iter()
            .map(|g| (g.profile_id, g.placement.start, g.compute_instances.len()))
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_dry_run_prints_the_plan_with_nvidia_smi_commands_and_calls_nothing() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        let (r, text) = run_apply(&mut fake, MIXED, Options { yes: false, ..act() });
        r.unwrap();
        assert!(fake.calls.is_empty(), "{:?}", fake.calls);
        assert!(
            text.contains("1. create a 3g.40gb GPU instance (profile id 9) at memory slices 4..7"),
            "{text}"
        );
        assert!(text.contains("$ sudo nvidia-smi mig -i 0 -cgi 9:4 -C"), "{text}");
        assert!(text.contains("$ sudo nvidia-smi mig -i 0 -cgi 14:0 -C"), "{text}");
        assert!(
            text.contains("dry run: nothing was changed") && text.contains("as root with --yes."),
            "{text}"
        );
    }

    #[test]
    fn apply_creates_largest_first_each_with_a_compute_instance_and_checks_the_result() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        let (r, text) = run_apply(&mut fake, MIXED, act());
        r.unwrap();
        assert_eq!(
            fake.calls,
            vec![
                "create_gpu_instance(gpu 0, profile 9, 4:4)",
                "create_compute_instance(gpu 0, gi 1)",
                "create_gpu_instance(gpu 0, profile 14, 0:2)",
                "create_compute_instance(gpu 0, gi 2)",
                "create_gpu_instance(gpu 0, profile 19, 2:1)",
                "create_compute_instance(gpu 0, gi 3)",
                "create_gpu_instance(gpu 0, profile 19, 3:1)",
                "create_compute_instance(gpu 0, gi 4)",
            ]
        );
        assert_eq!(layout(&fake), vec![(9, 4, 1), (14, 0, 1), (19, 2, 1), (19, 3, 1)]);
        assert!(
            text.contains("checked GPU 0: MIG on, 3g.40gb (GI 1, 4:4, 1 CI)"),
            "{text}"
        );
        // Applying again finds it in place and calls nothing.
        fake.calls.clear();
        let (r, text) = run_apply(&mut fake, MIXED, act());
        r.unwrap();
        assert!(fake.calls.is_empty() && text.contains("already in place"), "{text}");
    }

    #[test]
    fn a_different_layout_replaces_the_old_one_compute_instances_first() {
        let mut fake = FakeNvml::with_gpu(table("a100-40gb").unwrap(), true);
        let two = "version: v1\nmig-configs:\n  c:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {3g.20gb: 2}\n";
        run_apply(&mut fake, two, act()).0.unwrap();
        fake.calls.clear();
        let seven = "version: v1\nmig-configs:\n  c:\n    - devices: [0]\n      mig-enabled: true\n      mig-devices: {1g.5gb: 7}\n";
        run_apply(&mut fake, seven, act()).0.unwrap();
        assert_eq!(
            &fake.calls[..4],
            [
                "destroy_compute_instance(gpu 0, gi 1, ci 0)",
                "destroy_compute_instance(gpu 0, gi 2, ci 0)",
                "destroy_gpu_instance(gpu 0, gi 1)",
                "destroy_gpu_instance(gpu 0, gi 2)"
            ]
        );
        assert_eq!(layout(&fake).len(), 7);
        assert!(layout(&fake).iter().all(|&(p, _, cis)| p == 19 && cis == 1));
    }

    #[test]
    fn without_yes_or_root_nothing_is_called() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        let (r, _) = run_apply(&mut fake, MIXED, Options { root: false, ..act() });
        let e = r.unwrap_err().to_string();
        assert!(e.contains("needs root") && e.contains("Nothing was changed"), "{e}");
        let (r, _) = run_apply(
            &mut fake,
            MIXED,
            Options {
                yes: false,
                root: false,
                ..act()
            },
        );
        r.unwrap();
        assert!(fake.calls.is_empty() && fake.gpus[0].state.gpu_instances.is_empty());
    }

    #[test]
    fn a_busy_gpu_is_refused() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        fake.gpus[0].state.processes = vec![4242];
        let e = run_apply(&mut fake, MIXED, act()).0.unwrap_err().to_string();
        assert!(e.contains("in use by process(es) 4242"), "{e}");
        assert!(fake.calls.is_empty());
    }

    #[test]
    fn mig_mode_is_turned_on_only_when_asked_and_a_pending_change_is_reported_not_reset() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), false);
        let (r, text) = run_apply(&mut fake, MIXED, Options { yes: false, ..act() });
        r.unwrap();
        assert!(
            text.contains("1. turn MIG mode on\n       $ sudo nvidia-smi -i 0 -mig 1"),
            "{text}"
        );
        assert!(text.contains("as root with --yes --enable-mig."), "{text}");
        let e = run_apply(&mut fake, MIXED, act()).0.unwrap_err().to_string();
        assert!(e.contains("pass --enable-mig"), "{e}");
        assert!(fake.calls.is_empty());

        fake.mode_change_needs_reset = true;
        let e = run_apply(
            &mut fake,
            MIXED,
            Options {
                enable_mig: true,
                ..act()
            },
        )
        .0
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("pending") && e.contains("sudo nvidia-smi --gpu-reset -i 0") && e.contains("never does itself"),
            "{e}"
        );
        assert_eq!(fake.calls, vec!["set_mig_mode(gpu 0, true)"]);
        // Still pending: nothing more is tried, and the reset command is repeated.
        let e = run_apply(
            &mut fake,
            MIXED,
            Options {
                enable_mig: true,
                ..act()
            },
        )
        .0
        .unwrap_err()
        .to_string();
        assert!(e.contains("--gpu-reset"), "{e}");
        assert_eq!(fake.calls.len(), 1);
        // After the reset (done by a person), the same command finishes the job.
        fake.gpus[0].state.mig_mode = Some(crate::mig::mode::MigMode {
            current: true,
            pending: true,
        });
        run_apply(
            &mut fake,
            MIXED,
            Options {
                enable_mig: true,
                ..act()
            },
        )
        .0
        .unwrap();
        assert_eq!(layout(&fake).len(), 4);
    }

    #[test]
    fn mode_on_without_a_reset_goes_straight_on_to_the_instances() {
        let mut fake = FakeNvml::with_gpu(table("a30-24gb").unwrap(), false);
        let yaml = "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {2g.12gb: 1, 1g.6gb: 2}\n";
        run_apply(
            &mut fake,
            yaml,
            Options {
                enable_mig: true,
                ..act()
            },
        )
        .0
        .unwrap();
        assert_eq!(fake.calls[0], "set_mig_mode(gpu 0, true)");
        assert_eq!(layout(&fake), vec![(5, 0, 1), (14, 2, 1), (14, 3, 1)]);
    }

    #[test]
    fn the_post_apply_check_fails_loudly_when_nothing_is_there() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        fake.creations_vanish = true;
        let e = run_apply(&mut fake, MIXED, act()).0.unwrap_err().to_string();
        assert!(
            e.contains("post-apply check failed on GPU 0") && e.contains("no GPU instances"),
            "{e}"
        );
    }

    #[test]
    fn layouts_that_do_not_fit_are_refused_before_any_call() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        let yaml = "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {4g.40gb: 2}\n";
        let e = format!("{:#}", run_apply(&mut fake, yaml, act()).0.unwrap_err());
        assert!(e.contains("does not fit") && e.contains("at most 1"), "{e}");
        let yaml = "version: v1\nmig-configs:\n  c:\n    - devices: all\n      mig-enabled: true\n      mig-devices: {1c.3g.40gb: 1}\n";
        let e = format!("{:#}", run_apply(&mut fake, yaml, act()).0.unwrap_err());
        assert!(e.contains("one compute instance spanning each GPU instance"), "{e}");
        assert!(fake.calls.is_empty());
    }

    #[test]
    fn mig_off_destroys_everything_then_turns_the_mode_off_when_allowed() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        run_apply(&mut fake, MIXED, act()).0.unwrap();
        fake.calls.clear();
        let off = "version: v1\nmig-configs:\n  all-disabled:\n    - devices: all\n      mig-enabled: false\n";
        assert!(run_apply(&mut fake, off, act())
            .0
            .unwrap_err()
            .to_string()
            .contains("--disable-mig"));
        run_apply(
            &mut fake,
            off,
            Options {
                disable_mig: true,
                ..act()
            },
        )
        .0
        .unwrap();
        assert_eq!(fake.calls.last().unwrap(), "set_mig_mode(gpu 0, false)");
        assert_eq!(fake.calls.len(), 9);
        assert!(!fake.gpus[0].state.mig_mode.unwrap().current);
    }

    #[test]
    fn destroy_removes_every_instance_and_checks() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        run_apply(&mut fake, MIXED, act()).0.unwrap();
        fake.calls.clear();
        let mut out = Vec::new();
        destroy(&mut fake, &[], &Options { yes: false, ..act() }, &mut out).unwrap();
        let text = String::from_utf8(out).unwrap();
        assert!(
            text.contains("$ sudo nvidia-smi mig -i 0 -gi 1 -ci 0 -dci")
                && text.contains("$ sudo nvidia-smi mig -i 0 -gi 4 -dgi"),
            "{text}"
        );
        assert!(fake.calls.is_empty());
        assert!(destroy(&mut fake, &[], &Options { root: false, ..act() }, &mut Vec::new()).is_err());
        destroy(&mut fake, &[0], &act(), &mut Vec::new()).unwrap();
        assert_eq!(fake.calls.len(), 8);
        assert!(fake.gpus[0].state.gpu_instances.is_empty());
        assert!(destroy(&mut fake, &[3], &act(), &mut Vec::new())
            .unwrap_err()
            .to_string()
            .contains("no GPU 3; this machine's GPUs: 0"));
    }

    #[test]
    fn export_writes_the_current_layout_and_it_applies_back() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        run_apply(&mut fake, MIXED, act()).0.unwrap();
        let (file, warnings) = export(&mut fake, "current").unwrap();
        assert!(warnings.is_empty(), "{warnings:?}");
        let yaml = file.to_yaml().unwrap();
        assert!(
            yaml.contains("current:") && yaml.contains("1g.10gb: 2") && yaml.contains("3g.40gb: 1"),
            "{yaml}"
        );
        let mut fresh = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        run_apply(&mut fresh, &yaml, act()).0.unwrap();
        assert_eq!(layout(&fresh), layout(&fake));
    }

    #[test]
    fn export_warns_about_what_the_format_cannot_hold() {
        let mut fake = FakeNvml::with_gpu(table("h100-80gb").unwrap(), true);
        fake.gpus[0].state.gpu_instances.push(GpuInstanceState {
            id: 1,
            profile_id: 9,
            placement: Placement { start: 0, size: 4 },
            compute_instances: vec![
                ComputeInstance {
                    id: 0,
                    compute_slices: 1,
                },
                ComputeInstance {
                    id: 1,
                    compute_slices: 2,
                },
            ],
        });
        let (_, warnings) = export(&mut fake, "x").unwrap();
        assert!(
            warnings[0].contains("split into compute instances 1c.3g.40gb, 2c.3g.40gb"),
            "{warnings:?}"
        );
    }
}
