//! A few training steps of one model from a weights file on one fixed batch, and the weights the
//! optimizer holds afterwards (the f32 masters where training keeps them): migprof's side of the
//! update-error comparison with PyTorch (`benches/update_error.py`, which writes the weights and the
//! batch and reads what this writes).
//!
//! usage: update_steps MODEL DTYPE MASTER_WEIGHTS STEPS WEIGHTS.safetensors BATCH.safetensors OUT
//!   DTYPE f32, bf16 or f16; MASTER_WEIGHTS f32 or none; STEPS the step counts after which to write
//!   the weights, comma-separated (`1,3`), each to OUT-<count>.safetensors. The optimizer is SGD (lr
//!   0.01, momentum 0.9, no weight decay). BATCH holds `labels` (integers) and `pixels` (images) or
//!   `input_ids`, `token_type_ids` and `attention_mask` (tokens). Runs on the first GPU of a CUDA
//!   build, else the CPU.

use std::collections::HashMap;
use std::path::PathBuf;

use candle_core::{DType, Device, Result, Tensor};
use workloads::{build, Batch, Inputs, MasterWeights, Mode, TrainConfig, WorkloadConfig};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [model, dtype, masters, steps, weights, batch, out] = &args[..] else {
        candle_core::bail!("usage: update_steps MODEL DTYPE MASTER_WEIGHTS STEPS WEIGHTS BATCH OUT")
    };
    let dtype = match dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => candle_core::bail!("dtype {other}: choose f32, bf16 or f16"),
    };
    let master_weights: MasterWeights = masters.parse().map_err(candle_core::Error::Msg)?;
    let counts: Vec<usize> = steps
        .split(',')
        .map(|n| {
            n.parse()
                .map_err(|e| candle_core::Error::Msg(format!("steps {steps}: {e}")))
        })
        .collect::<Result<_>>()?;
    let device = Device::cuda_if_available(0)?;
    let cfg = WorkloadConfig {
        device: device.clone(),
        dtype,
        mode: Mode::Train,
        seed: 0,
        seq_len: None,
        weights: Some(PathBuf::from(weights)),
        train: TrainConfig {
            master_weights,
            ..TrainConfig::sgd()
        },
        kernels: Default::default(),
    };
    let mut workload = build(model, &cfg)?;
    let batch = read_batch(&candle_core::safetensors::load(batch, &Device::Cpu)?, dtype, &device)?;
    for step in 1..=counts.iter().copied().max().unwrap_or(0) {
        let loss = workload.train_step(&batch)?;
        eprintln!("step {step}: loss {}", loss.to_dtype(DType::F32)?.to_scalar::<f32>()?);
        if !counts.contains(&step) {
            continue;
        }
        if let Some(r) = workload.scale_reading()? {
            eprintln!("after step {step}: {r:?}");
        }
        let weights: HashMap<String, Tensor> = workload
            .weights()?
            .into_iter()
            .map(|(n, t)| Ok((n, t.to_dtype(DType::F32)?.to_device(&Device::Cpu)?)))
            .collect::<Result<_>>()?;
        candle_core::safetensors::save(&weights, format!("{out}-{step}.safetensors"))?;
    }
    Ok(())
}

fn read_batch(file: &HashMap<String, Tensor>, dtype: DType, device: &Device) -> Result<Batch> {
    let get = |name: &str| {
        file.get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("the batch file has no `{name}`")))
    };
    let ids = |name: &str| get(name)?.to_dtype(DType::U32)?.to_device(device);
    let labels = ids("labels")?;
    let inputs = match file.get("pixels") {
        Some(pixels) => Inputs::Images(pixels.to_dtype(dtype)?.to_device(device)?),
        None => Inputs::Tokens {
            input_ids: ids("input_ids")?,
            token_type_ids: ids("token_type_ids")?,
            attention_mask: get("attention_mask")?.to_dtype(dtype)?.to_device(device)?,
        },
    };
    Ok(Batch {
        size: labels.dims1()?,
        inputs,
        labels,
    })
}
