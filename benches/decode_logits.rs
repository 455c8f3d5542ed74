//! A language model's logits on given tokens, and its own greedy tokens: migprof's side of the
//! comparison with transformers (`benches/decoder_truth.py`, which writes the model folder and the
//! tokens and reads what this writes).
//!
//! usage: decode_logits DIR DTYPE TOKENS.safetensors OUT.safetensors [BLOCK_SIZE]
//!   DIR a Hugging Face folder (config.json, *.safetensors) of a Llama or Qwen2 model; DTYPE f32, bf16
//!   or f16. TOKENS holds `prompt` [batch, prompt tokens] and `forced` [batch, steps]: the tokens fed
//!   to the decode steps one by one (the reference's own greedy tokens, so that both sides' logits
//!   are of the same history). OUT gets `prefill_logits` [batch, prompt, vocab], `decode_logits`
//!   [steps, batch, vocab] (f32), and `greedy` [batch, steps + 1]: the tokens this model generates
//!   from the prompt alone, step by step through the model's `forward`; and `generated` [batch,
//!   steps + 1]: the tokens of the path `migprof run --mode generate` times, the `Generator` with the
//!   run's default kernel options (a contiguous cache's decode steps replayed as CUDA graphs), each
//!   returned token tensor held on the device until the generation's end. With BLOCK_SIZE the KV
//!   cache is paged in blocks of that many tokens, else contiguous. Runs on the first GPU of a CUDA
//!   build, else the CPU; TF32 off.

use std::collections::HashMap;

use candle_core::{DType, Device, Result, Tensor};
use workloads::generation::greedy as next_tokens;
use workloads::models::decoder::{self, KvCache, KvStore, PagedKvCache};

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (dir, dtype, tokens, out, block_size) = match &args[..] {
        [dir, dtype, tokens, out] => (dir, dtype, tokens, out, None),
        [dir, dtype, tokens, out, b] => (
            dir,
            dtype,
            tokens,
            out,
            Some(
                b.parse::<workloads::BlockSize>()
                    .map_err(|e| candle_core::Error::Msg(format!("BLOCK_SIZE {e}")))?,
            ),
        ),
        _ => candle_core::bail!("usage: decode_logits DIR DTYPE TOKENS.safetensors OUT.safetensors [BLOCK_SIZE]"),
    };
    let dtype = match dtype.as_str() {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        other => candle_core::bail!("dtype {other}: choose f32, bf16 or f16"),
    };
    workloads::precision::allow_tf32(false);
    let device = Device::cuda_if_available(0)?;
    let model = decoder::load_folder(std::path::Path::new(dir), &device, dtype)?;
    let file = candle_core::safetensors::load(tokens, &Device::Cpu)?;
    let ids = |name: &str| -> Result<Tensor> {
        file.get(name)
            .ok_or_else(|| candle_core::Error::Msg(format!("{tokens} has no `{name}`")))?
            .to_dtype(DType::U32)?
            .to_device(&device)
    };
    let (prompt, forced) = (ids("prompt")?, ids("forced")?);
    let steps = forced.dim(1)?;
    let (batch, room) = (prompt.dim(0)?, prompt.dim(1)? + steps);
    let new_cache = || -> Result<Box<dyn KvStore>> {
        Ok(match block_size {
            None => Box::new(KvCache::new(model.config())),
            Some(b) => Box::new(PagedKvCache::new(
                model.config(),
                batch,
                PagedKvCache::blocks_for(batch, room, b.get()),
                b.get(),
                dtype,
                &device,
            )?),
        })
    };
    let f32_host = |t: &Tensor| t.to_dtype(DType::F32)?.to_device(&Device::Cpu);

    // The reference's history: the prompt, then its tokens one at a time.
    let mut cache = new_cache()?;
    let prefill_logits = model.forward(&prompt, cache.as_mut())?;
    let mut decode_logits = Vec::with_capacity(steps);
    for i in 0..steps {
        let logits = model.forward(&forced.narrow(1, i, 1)?, cache.as_mut())?;
        decode_logits.push(f32_host(&logits.squeeze(1)?)?);
    }

    // Its own greedy tokens from the prompt alone.
    let mut cache = new_cache()?;
    let mut token = next_tokens(&model.forward(&prompt, cache.as_mut())?)?;
    let mut greedy = vec![token.clone()];
    for _ in 0..steps {
        token = next_tokens(&model.forward(&token, cache.as_mut())?)?;
        greedy.push(token.clone());
    }

    // The timed path: the generator `migprof run` drives, over the same folder and prompt.
    let layout = match block_size {
        None => workloads::KvLayout::Contiguous,
        Some(block_size) => workloads::KvLayout::Paged { block_size },
    };
    let cfg = workloads::WorkloadConfig {
        device: device.clone(),
        dtype,
        mode: workloads::Mode::Generate,
        seed: 0,
        seq_len: None,
        weights: None,
        train: workloads::TrainConfig::default(),
        kernels: workloads::kernels::KernelOptions::default(),
    };
    let mut generator = workloads::Generator::build(&format!("{}{dir}", workloads::FOLDER_PREFIX), &cfg, layout)?;
    let mut generated = vec![generator.prefill(&prompt, room)?];
    for _ in 0..steps {
        let next = generator.decode(generated.last().expect("the prefill's token"))?;
        generated.push(next);
    }

    let mut saved: HashMap<String, Tensor> = HashMap::new();
    saved.insert(
        "generated".into(),
        Tensor::cat(&generated, 1)?
            .to_dtype(DType::I64)?
            .to_device(&Device::Cpu)?,
    );
    saved.insert("prefill_logits".into(), f32_host(&prefill_logits)?);
    saved.insert("decode_logits".into(), Tensor::stack(&decode_logits, 0)?);
    saved.insert(
        "greedy".into(),
        Tensor::cat(&greedy, 1)?.to_dtype(DType::I64)?.to_device(&Device::Cpu)?,
    );
    candle_core::safetensors::save(&saved, out)?;
    Ok(())
}
