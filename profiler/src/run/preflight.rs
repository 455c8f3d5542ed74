//! Before the first run: one step of each family's tiny preset for every (family, mode, dtype) asked
//! for, so that a combination the device's kernels cannot run fails in milliseconds, with the list
//! of those that do run, instead of after an hour of earlier runs.

use anyhow::{bail, Context, Result};
use candle_core::{DType, Device};
use workloads::kernels::KernelOptions;
use workloads::{Family, KvLayout, Mode, TrainConfig, WorkloadConfig};

use crate::device::OpenDevice;
use crate::run::RunSpec;

const DTYPES: [DType; 3] = [DType::F32, DType::BF16, DType::F16];
/// The modes a family runs in: language models generate, the others infer and train.
fn modes(family: Family) -> &'static [Mode] {
    if family.is_decoder() {
        &[Mode::Generate]
    } else {
        &[Mode::Infer, Mode::Train]
    }
}

/// What the device decides without running anything: TF32 exists only on NVIDIA tensor cores.
pub fn check_precision(specs: &[RunSpec], device: &OpenDevice) -> Result<()> {
    if specs.iter().any(|s| s.precision.tf32()) && !device.device.is_cuda() {
        bail!(
            "tf32 is a mode of NVIDIA tensor cores; on {} f32 is computed exactly: use --dtype f32 (choices: f32, bf16, f16, tf32 on a GPU)",
            device.info.kind
        )
    }
    Ok(())
}

/// Refuses what the device cannot run, before any time is spent: [`check_precision`], then each
/// (family, mode, dtype, kernels) by one step of its tiny preset, then each batch whose memory
/// estimate (`estimate`) exceeds what the device has.
pub fn check(specs: &[RunSpec], device: &OpenDevice) -> Result<()> {
    check_precision(specs, device)?;
    check_kernels(specs, device)?;
    check_memory(specs, device)
}

/// Each run's batch against the memory the device has, by one probe per model, mode, precision,
/// sequence length and kernels.
pub fn check_memory(specs: &[RunSpec], device: &OpenDevice) -> Result<()> {
    let Some(limit) = crate::run::estimate::limit_mib(device)? else {
        return Ok(());
    };
    let mut probed: Vec<(RunSpec, Option<crate::run::estimate::MemoryEstimate>)> = Vec::new();
    let memory = match device.info.memory_mib() {
        Some(_) => format!("{} has", device.info.name),
        None => format!("the host ({}) has available", device.info.name),
    };
    for s in specs {
        if let Some(lengths) = s.lengths {
            let (_, info) = workloads::lookup(&s.model)?;
            let cfg = info.decoder.context("generate runs a language model")?;
            let causal_kernel = workloads::kernels::causal_attention::applies(
                device.device.is_cuda(),
                s.precision.dtype(),
                cfg.num_heads,
                cfg.num_kv_heads,
                cfg.head_dim,
                s.kernels.attention,
            );
            let needs = crate::run::estimate::GenerationMemory::of(
                &cfg,
                s.precision.dtype(),
                lengths,
                s.kv_layout,
                causal_kernel,
            );
            crate::run::estimate::check_generation_fits(s, &needs, limit, &memory)?;
            continue;
        }
        let same = |p: &RunSpec| {
            (p.model.as_str(), p.mode, p.precision, p.seq_len, p.kernels)
                == (s.model.as_str(), s.mode, s.precision, s.seq_len, s.kernels)
        };
        let estimate = match probed.iter().find(|(p, _)| same(p)) {
            Some((_, e)) => *e,
            None => {
                // The estimate guards against a batch that cannot fit; a probe that fails leaves the
                // run to find out itself, as it would have without one.
                let e = crate::run::estimate::probe(s, device).unwrap_or_else(|e| {
                    eprintln!("warning: {} {}: no memory estimate ({e:#}); the batch is not checked against the device's memory", s.model, s.mode.as_str());
                    None
                });
                probed.push((s.clone(), e));
                e
            }
        };
        if let Some(e) = estimate {
            crate::run::estimate::check_fits(s, &e, limit, &memory)?;
        }
    }
    Ok(())
}

/// Each (family, mode, dtype, kernels) by one step of its tiny preset.
pub fn check_kernels(specs: &[RunSpec], device: &OpenDevice) -> Result<()> {
    let mut checked: Vec<(Family, Mode, DType, KernelOptions, KvLayout)> = Vec::new();
    for s in specs {
        let (_, info) = workloads::lookup(&s.model)?;
        let key = (info.family, s.mode, s.precision.dtype(), s.kernels, s.kv_layout);
        if checked.contains(&key) {
            continue;
        }
        checked.push(key);
        if let Err(e) = probe(key, &device.device) {
            let runnable: Vec<String> = modes(info.family)
                .iter()
                .flat_map(|&m| DTYPES.iter().map(move |&d| (m, d)))
                .filter(|&(m, d)| probe((info.family, m, d, s.kernels, s.kv_layout), &device.device).is_ok())
                .map(|(m, d)| format!("{} {}", m.as_str(), d.as_str()))
                .collect();
            bail!(
                "{} {} {} cannot run on {}: {} failed with: {}; what runs there for {} models: {}",
                s.model,
                s.mode.as_str(),
                s.precision.as_str(),
                device.info.kind,
                workloads::tiny_model(info.family),
                first_line(&e.to_string()),
                info.family.as_str(),
                if runnable.is_empty() {
                    "nothing".to_string()
                } else {
                    runnable.join(", ")
                }
            );
        }
    }
    Ok(())
}

/// One step of the family's tiny preset at batch 2 with the run's kernels, synchronised.
fn probe(
    (family, mode, dtype, kernels, kv_layout): (Family, Mode, DType, KernelOptions, KvLayout),
    device: &Device,
) -> Result<()> {
    let cfg = WorkloadConfig {
        device: device.clone(),
        dtype,
        mode,
        seed: 0,
        seq_len: None,
        weights: None,
        train: TrainConfig::default(),
        kernels,
    };
    if mode == Mode::Generate {
        // A prompt of 4 tokens, then 2 decode steps: the prefill's and the decode's kernels, and the
        // cache's.
        let mut g = workloads::Generator::build(workloads::tiny_model(family), &cfg, kv_layout)?;
        let prompts = g.prompts(2, 4, 0)?;
        let first = g.prefill(&prompts, 6)?;
        let next = g.decode(&first)?;
        drop(g.decode(&next)?);
        device.synchronize()?;
        return Ok(());
    }
    let mut w = workloads::build(workloads::tiny_model(family), &cfg)?;
    let batch = w.synthetic_batch(2, 0)?;
    match mode {
        Mode::Infer => drop(w.infer(&batch)?),
        Mode::Train => drop(w.train_step(&batch)?),
        Mode::Generate => unreachable!("generation returned above"),
    }
    device.synchronize()?;
    Ok(())
}

/// candle appends a backtrace to its messages when RUST_BACKTRACE is set; the first line is the cause.
fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceSpec;
    use crate::run::record::tests::spec;

    #[test]
    fn f32_inference_and_training_pass_on_cpu() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let device = DeviceSpec::Cpu.open()?;
        let mut train = spec(2, 1);
        train.mode = Mode::Train;
        check(&[spec(2, 1), train], &device)
    }

    #[test]
    fn bf16_on_cpu_fails_naming_the_cause_and_what_runs() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        // candle's CPU matmul has no bf16 kernel.
        let device = DeviceSpec::Cpu.open()?;
        let mut s = spec(2, 1);
        s.precision = crate::run::spec::Precision::Bf16;
        let err = check(&[s], &device).unwrap_err().to_string();
        assert!(err.starts_with("resnet_tiny infer bf16 cannot run on cpu"), "{err}");
        assert!(
            err.contains("BF16") && err.contains("infer f32") && err.contains("train f32"),
            "{err}"
        );
        assert!(!err.contains("infer bf16,") && !err.contains("train bf16"), "{err}");
        Ok(())
    }

    #[test]
    fn tf32_is_refused_on_the_cpu() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let device = DeviceSpec::Cpu.open()?;
        let mut s = spec(2, 1);
        s.precision = crate::run::spec::Precision::Tf32;
        let e = check(&[s], &device).unwrap_err().to_string();
        assert!(
            e.contains("tf32 is a mode of NVIDIA tensor cores") && e.contains("f32, bf16, f16"),
            "{e}"
        );
        Ok(())
    }
}
