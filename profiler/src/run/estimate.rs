//! What a run will need of the device's memory, before it allocates it: a short probe of the run's
//! model, mode and precision at batch 1 and 2 measures the memory that does not grow with the batch
//! (weights, optimizer state, workspaces) and what each sample adds (activations, inputs), and a batch
//! whose estimate exceeds what the device (the GPU, the slice, or the host for the CPU) has is refused
//! with both numbers. The same estimate says what fits a slice.

use anyhow::{bail, Result};
use candle_core::Device;

use crate::device::OpenDevice;
use crate::run::RunSpec;

/// Memory a run needs, MiB: `fixed + per_sample × batch`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MemoryEstimate {
    pub fixed_mib: f64,
    pub per_sample_mib: f64,
}

impl MemoryEstimate {
    pub fn at(&self, batch: usize) -> f64 {
        self.fixed_mib + self.per_sample_mib * batch as f64
    }

    /// The largest batch whose estimate fits `limit_mib`.
    pub fn largest_batch(&self, limit_mib: f64) -> usize {
        if self.per_sample_mib <= 0.0 {
            return usize::MAX;
        }
        ((limit_mib - self.fixed_mib) / self.per_sample_mib).floor().max(0.0) as usize
    }

    /// From the peaks of one step at batch 1 and one at batch 2 (MiB above what was in use before).
    pub fn from_peaks(at_1: f64, at_2: f64) -> MemoryEstimate {
        let per_sample = (at_2 - at_1).max(0.0);
        MemoryEstimate {
            fixed_mib: (at_1 - per_sample).max(0.0),
            per_sample_mib: per_sample,
        }
    }
}

/// What a language model's generation holds, computed from its shape (building a model that does
/// not fit to probe it would fail the same way): the weights; per sequence its KV cache at the
/// generation's full context and its share of the prefill's temporaries; and the prefill's MLP,
/// which grows with the sequences only up to the rows a pass runs at once
/// (`workloads::models::decoder::MLP_ROWS`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GenerationMemory {
    /// The weights and the rotary tables.
    pub weights_mib: f64,
    /// One sequence's keys and values at the full context.
    pub kv_cache_mib_per_seq: f64,
    /// One sequence's largest temporaries of a pass besides the MLP's intermediates: the residual
    /// stream, its norm, the projections and attention's output (with composed attention its
    /// scores, f32 and the probabilities beside them, and one layer's keys and values repeated for
    /// grouped-query attention), or the logits of its last token, or one layer's keys and values
    /// copied for attention.
    pub workspace_mib_per_seq: f64,
    /// One sequence's MLP intermediates (its norm, gate and up, SwiGLU's output, down's output) over
    /// the whole prompt, and the most of them a pass holds at once: one slice of rows.
    pub mlp_mib_per_seq: f64,
    pub mlp_cap_mib: f64,
}

impl GenerationMemory {
    /// `causal_kernel`: whether the prefill's attention runs as the causal kernel
    /// (`workloads::kernels::causal_attention::applies`), which keeps no scores and no copies of the
    /// key-value heads for their query groups.
    pub fn of(
        cfg: &workloads::models::decoder::Config,
        dtype: candle_core::DType,
        lengths: workloads::Lengths,
        layout: workloads::KvLayout,
        causal_kernel: bool,
    ) -> Self {
        let size = dtype.size_in_bytes() as f64;
        let t = lengths.prompt as f64;
        let rotary = (cfg.max_position_embeddings * cfg.head_dim) as f64 * size;
        let weights = cfg.params() as f64 * size + rotary;
        let per_token = cfg.kv_bytes_per_token(dtype) as f64;
        let context = lengths.context() as f64;
        // A paged cache holds whole blocks.
        let held = match layout.block_size() {
            Some(b) => (lengths.context().div_ceil(b.get()) * b.get()) as f64 * per_token,
            None => context * per_token,
        };
        // One layer's keys and values at the full context, and its copies for grouped-query
        // attention (each key-value head repeated for its query heads).
        let layer = context * per_token / cfg.num_layers as f64;
        let group = (cfg.num_heads / cfg.num_kv_heads) as f64;
        let repeated = if group > 1.0 && !causal_kernel {
            layer * group
        } else {
            0.0
        };
        // A pass's keys and values beside the cache's: both layouts write in place (a contiguous
        // cache into buffers reserved for the whole generation), and attention copies one layer's
        // at a time (a paged cache gathers its blocks; a contiguous one's view of its first tokens
        // is made contiguous).
        let copies = layer;
        // Attention's part of a layer, a token's: the residual stream, its norm and the output
        // beside the new stream (3 × hidden); q, k and v packed as made and rotated (2 × their
        // width); the keys and values moved head-major for the cache, and attention's output.
        // Composed attention adds its scores (in the dtype, then f32 for the softmax, and the
        // probabilities back in the dtype).
        let (h, d) = (cfg.hidden_size as f64, cfg.head_dim as f64);
        let (q, kv) = (cfg.num_heads as f64 * d, cfg.num_kv_heads as f64 * d);
        let streams = (3.0 * h + 2.0 * (q + 2.0 * kv) + 2.0 * kv + q) * t * size;
        let scores = match causal_kernel {
            true => 0.0,
            false => cfg.num_heads as f64 * t * t * (2.0 * 4.0 + 2.0 * size),
        };
        // The MLP's part: the stream, its slices' outputs and their concatenation (3 × hidden a
        // token, within `streams`), beside one slice's norm, gate and up, SwiGLU's output and
        // down's output.
        let mlp_row = (3.0 * cfg.intermediate_size as f64 + 2.0 * h) * size;
        // The output head runs on the prompt's last token alone.
        let logits = cfg.vocab_size as f64 * size;
        GenerationMemory {
            weights_mib: mib_f(weights),
            kv_cache_mib_per_seq: mib_f(held),
            workspace_mib_per_seq: mib_f((streams + scores).max(logits).max(copies) + repeated),
            mlp_mib_per_seq: mib_f(t * mlp_row),
            mlp_cap_mib: mib_f(workloads::models::decoder::MLP_ROWS as f64 * mlp_row),
        }
    }

    /// MiB that `batch` sequences need: the weights, their caches and temporaries, and the MLP's
    /// intermediates up to one slice's. The MLP's are counted beside the rest of the pass's
    /// temporaries, though attention's are freed before they are made: an estimate that errs by
    /// holding a little more.
    pub fn need_mib(&self, batch: usize) -> f64 {
        let b = batch as f64;
        self.weights_mib
            + b * (self.kv_cache_mib_per_seq + self.workspace_mib_per_seq)
            + (b * self.mlp_mib_per_seq).min(self.mlp_cap_mib)
    }

    /// The largest number of sequences whose need fits `limit_mib` (0 where not even one does).
    pub fn largest_batch(&self, limit_mib: f64) -> usize {
        if self.need_mib(1) > limit_mib {
            return 0;
        }
        // Doubling, then bisecting: the need grows with every sequence.
        let mut fits = 1usize;
        while fits < 1 << 30 && self.need_mib(fits * 2) <= limit_mib {
            fits *= 2;
        }
        let mut over = fits * 2;
        while over - fits > 1 {
            let mid = fits + (over - fits) / 2;
            match self.need_mib(mid) <= limit_mib {
                true => fits = mid,
                false => over = mid,
            }
        }
        fits
    }
}

/// Refuses a generation whose weights and cache for its batch exceed `limit_mib`, naming both
/// numbers and the largest batch that fits (or that the weights alone do not).
pub fn check_generation_fits(spec: &RunSpec, memory: &GenerationMemory, limit_mib: f64, has: &str) -> Result<()> {
    let Some(lengths) = spec.lengths else {
        return Ok(());
    };
    let need = memory.need_mib(spec.batch);
    if need <= limit_mib {
        return Ok(());
    }
    let cache = memory.kv_cache_mib_per_seq * spec.batch as f64;
    let what = format!(
        "{} generate {} batch {} at context {} ({} prompt + {} output tokens) needs about {need:.0} MiB: weights {:.0} MiB + KV cache {:.0} MiB ({:.1} MiB a sequence) + {:.0} MiB of workspace; {has} {limit_mib:.0} MiB",
        spec.model,
        spec.precision.as_str(),
        spec.batch,
        lengths.context(),
        lengths.prompt,
        lengths.output,
        memory.weights_mib,
        cache,
        memory.kv_cache_mib_per_seq,
        need - memory.weights_mib - cache,
    );
    let why = match memory.largest_batch(limit_mib) {
        0 if memory.weights_mib >= limit_mib => format!("{what}: the weights alone do not fit"),
        0 => format!("{what}: not even one sequence fits"),
        n => format!("{what}: the largest batch that fits is about {n}"),
    };
    Err(DoesNotFit(why).into())
}

/// A generation refused by its memory estimate (as opposed to one whose estimate could not be made).
#[derive(Debug)]
pub struct DoesNotFit(pub String);

impl std::fmt::Display for DoesNotFit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for DoesNotFit {}

fn mib_f(bytes: f64) -> f64 {
    bytes / (1u64 << 20) as f64
}

/// Probes `spec`'s model, mode and precision on `device` at batch 1 and 2. `None` where this device
/// cannot say how much memory a step takes.
pub fn probe(spec: &RunSpec, device: &OpenDevice) -> Result<Option<MemoryEstimate>> {
    let Some(mut peak) = Peak::of(&device.device)? else {
        return Ok(None);
    };
    // Seeded weights of the same shapes take the same memory; the checkpoint is the run's to read.
    let probe_spec = RunSpec {
        batch: 1,
        weights: None,
        ..spec.clone()
    };
    let (mut workload, _) = probe_spec.build_workload(&device.device)?;
    let mut at = Vec::new();
    for batch in [1, 2] {
        let inputs = workload.synthetic_batch(batch, spec.seed)?;
        peak.reset()?;
        match spec.mode {
            workloads::Mode::Infer => drop(workload.infer(&inputs)?),
            workloads::Mode::Train => drop(workload.train_step(&inputs)?),
            workloads::Mode::Generate => bail!("a generation's memory is computed (GenerationMemory), not probed"),
        }
        device.device.synchronize()?;
        at.push(peak.read()?);
    }
    drop(workload);
    // What the probe's steps freed goes back to the driver: the run after it starts as without it.
    workloads::memory::release_pooled(&device.device)?;
    Ok(Some(MemoryEstimate::from_peaks(at[0], at[1])))
}

/// Refuses `spec`'s batch when its estimate exceeds `limit_mib`, naming both, and what does fit;
/// `has` says whose memory that is (`the host (…) has available`).
pub fn check_fits(spec: &RunSpec, estimate: &MemoryEstimate, limit_mib: f64, has: &str) -> Result<()> {
    let need = estimate.at(spec.batch);
    if need > limit_mib {
        bail!(
            "{} {} {} batch {} needs about {:.0} MiB ({:.0} MiB fixed + {:.2} MiB a sample, measured at batch 1 and 2); {has} {:.0} MiB: the largest batch that fits is about {}",
            spec.model,
            spec.mode.as_str(),
            spec.precision.as_str(),
            spec.batch,
            need,
            estimate.fixed_mib,
            estimate.per_sample_mib,
            limit_mib,
            estimate.largest_batch(limit_mib)
        );
    }
    Ok(())
}

/// The memory a run may take on `device`, MiB: the device's (a GPU's, a slice's) less what is in use
/// there now, or the host's available memory for the CPU.
pub fn limit_mib(device: &OpenDevice) -> Result<Option<f64>> {
    match device.info.memory_mib() {
        Some(total) => {
            let used = workloads::memory::ledger(&device.device)?.map_or(0.0, |l| mib(l.device_used));
            // A slice's limit counts only this process's use; a whole GPU's, everyone's.
            let used = if device.info.emulation.is_some() { 0.0 } else { used };
            Ok(Some(total as f64 - used))
        }
        None => Ok(host_available_mib()),
    }
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// The host's available memory (`MemAvailable` of /proc/meminfo), MiB.
fn host_available_mib() -> Option<f64> {
    kib_field_mib("/proc/meminfo", "MemAvailable:")
}

/// The most memory in use since a reset, above what was in use at the reset: the heap's bytes on the
/// CPU (counted by the allocator, `heap`), the memory pool's high-water mark on a GPU.
enum Peak {
    Host { base: f64 },
    Pool { device: Device, base: f64 },
}

impl Peak {
    fn of(device: &Device) -> Result<Option<Peak>> {
        Ok(match device {
            Device::Cpu => Some(Peak::Host {
                base: mib(crate::heap::in_use() as u64),
            }),
            other => workloads::memory::ledger(other)?.map(|l| Peak::Pool {
                device: other.clone(),
                base: mib(l.pool_used),
            }),
        })
    }

    fn reset(&mut self) -> Result<()> {
        match self {
            Peak::Host { .. } => crate::heap::reset_peak(),
            // The pool's high-water mark starts again from what is in use (the weights): `base`, from
            // before the model was built, stays.
            Peak::Pool { device, .. } => workloads::memory::release_pooled(device)?,
        }
        Ok(())
    }

    fn read(&self) -> Result<f64> {
        Ok(match self {
            Peak::Host { base } => (mib(crate::heap::peak() as u64) - base).max(0.0),
            Peak::Pool { device, base } => {
                workloads::memory::ledger(device)?.map_or(0.0, |l| (mib(l.pool_used_high) - base).max(0.0))
            }
        })
    }
}

/// A `key:  N kB` line of a /proc file, in MiB.
fn kib_field_mib(path: &str, key: &str) -> Option<f64> {
    let text = std::fs::read_to_string(path).ok()?;
    let kib: f64 = text
        .lines()
        .find_map(|l| l.strip_prefix(key))?
        .trim()
        .trim_end_matches("kB")
        .trim()
        .parse()
        .ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::DeviceSpec;
    use crate::run::record::tests::spec;

    #[test]
    fn the_estimate_is_a_line_through_batch_1_and_2() {
        let _heap = crate::testing::heap_alone();
        let e = MemoryEstimate::from_peaks(110.0, 130.0);
        assert_eq!(
            e,
            MemoryEstimate {
                fixed_mib: 90.0,
                per_sample_mib: 20.0
            }
        );
        assert_eq!(e.at(100), 2090.0);
        assert_eq!(e.largest_batch(1090.0), 50);
        // Noise that makes batch 2 look smaller: nothing grows with the batch.
        assert_eq!(MemoryEstimate::from_peaks(110.0, 100.0).per_sample_mib, 0.0);
    }

    #[test]
    fn the_causal_kernel_s_prefill_holds_no_scores_and_its_mlp_one_slice_of_rows() {
        let _heap = crate::testing::heap_alone();
        // Llama-3.2-1B, a prompt of 1,920: composed attention's scores (32 heads × 1,920² × 12
        // bytes, 1.3 GiB a sequence) are most of the workspace; with the kernel, the rows of the
        // stream, q/k/v and attention are.
        let cfg = workloads::lookup("llama_3_2_1b").unwrap().1.decoder.expect("a decoder");
        let lengths = workloads::Lengths {
            prompt: 1920,
            output: 128,
        };
        let of = |kernel| {
            GenerationMemory::of(
                &cfg,
                candle_core::DType::BF16,
                lengths,
                workloads::KvLayout::default(),
                kernel,
            )
        };
        let (composed, kernel) = (of(false), of(true));
        let mib = |bytes: f64| bytes / 1048576.0;
        // A token's rows: 3 × hidden, q/k/v packed twice (2 × 3,072), k and v head-major (2 × 512)
        // and attention's output (2,048), in bf16.
        let streams = mib((3.0 * 2048.0 + 2.0 * 3072.0 + 2.0 * 512.0 + 2048.0) * 1920.0 * 2.0);
        // The scores, and one layer's keys and values at the context (2,047 tokens × 2 KiB) repeated
        // for the groups of four query heads.
        let scores = mib(32.0 * 1920.0 * 1920.0 * 12.0);
        let repeated = 2047.0 * 2.0 / 1024.0 * 4.0;
        assert!(
            (composed.workspace_mib_per_seq - streams - scores - repeated).abs() < 1e-6,
            "{composed:?}"
        );
        assert!((kernel.workspace_mib_per_seq - streams).abs() < 1e-9, "{kernel:?}");
        assert_eq!(kernel.kv_cache_mib_per_seq, composed.kv_cache_mib_per_seq);
        // The MLP: a token's norm, gate and up, SwiGLU's output and down's (3 × 8,192 + 2 × 2,048
        // in bf16), for the prompt's 1,920 tokens, and at most for one slice's 8,192 rows.
        let row = (3.0 * 8192.0 + 2.0 * 2048.0) * 2.0;
        assert!((kernel.mlp_mib_per_seq - mib(1920.0 * row)).abs() < 1e-9, "{kernel:?}");
        assert!((kernel.mlp_cap_mib - mib(8192.0 * row)).abs() < 1e-9, "{kernel:?}");
        let per_seq = kernel.kv_cache_mib_per_seq + kernel.workspace_mib_per_seq;
        assert!((kernel.need_mib(4) - kernel.weights_mib - 4.0 * per_seq - 4.0 * kernel.mlp_mib_per_seq).abs() < 1e-6);
        assert!((kernel.need_mib(32) - kernel.weights_mib - 32.0 * per_seq - kernel.mlp_cap_mib).abs() < 1e-6);
        // The largest batch is the last whose need fits, in both regimes of the MLP.
        for limit in [kernel.need_mib(3) + 1.0, kernel.need_mib(40) - 1.0, kernel.need_mib(40)] {
            let n = kernel.largest_batch(limit);
            assert!(
                kernel.need_mib(n) <= limit && kernel.need_mib(n + 1) > limit,
                "{limit}: {n}"
            );
        }
        assert_eq!(kernel.largest_batch(kernel.weights_mib), 0);
    }

    #[test]
    fn llama_3_1_8b_in_bf16_is_refused_on_a_1g_slice_naming_weights_and_cache() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let table = crate::mig::profile::table("h100-80gb")?;
        let slice_mib = table.profile("1g.10gb")?.memory_gib * 1024.0;
        let cfg = workloads::lookup("llama_3_1_8b")?.1.decoder.expect("a decoder");
        let lengths = workloads::Lengths {
            prompt: 512,
            output: 128,
        };
        let memory = GenerationMemory::of(
            &cfg,
            candle_core::DType::BF16,
            lengths,
            workloads::KvLayout::default(),
            false,
        );
        // Paged in blocks of 16: 639 tokens take 40 blocks, 640 tokens, and no second copy.
        let paged = GenerationMemory::of(
            &cfg,
            candle_core::DType::BF16,
            lengths,
            workloads::KvLayout::Paged {
                block_size: workloads::BlockSize::DEFAULT,
            },
            false,
        );
        assert!((paged.kv_cache_mib_per_seq - 640.0 * 128.0 / 1024.0).abs() < 1e-9);
        // A long generation: neither layout holds a second copy of the cache, so its workspace is
        // the prefill's or one layer's, the same in both.
        let long = workloads::Lengths {
            prompt: 128,
            output: 4096,
        };
        let m = GenerationMemory::of(
            &cfg,
            candle_core::DType::BF16,
            long,
            workloads::KvLayout::default(),
            false,
        );
        assert!(m.workspace_mib_per_seq < m.kv_cache_mib_per_seq / 4.0, "{m:?}");
        let p = GenerationMemory::of(
            &cfg,
            candle_core::DType::BF16,
            long,
            workloads::KvLayout::Paged {
                block_size: workloads::BlockSize::DEFAULT,
            },
            false,
        );
        assert!(
            (p.workspace_mib_per_seq - m.workspace_mib_per_seq).abs() < 1.0,
            "{p:?} {m:?}"
        );
        // 8,030,261,248 parameters × 2 bytes, plus the rotary tables (131,072 × 128 × 2 bytes).
        assert!((memory.weights_mib - (8_030_261_248.0 * 2.0 + 131_072.0 * 256.0) / 1048576.0).abs() < 1e-6);
        // 32 layers × 8 kv heads × 128 × 2 (k, v) × 2 bytes = 128 KiB a token, 639 tokens.
        assert!((memory.kv_cache_mib_per_seq - 639.0 * 128.0 / 1024.0).abs() < 1e-9);
        let mut s = spec(1, 1);
        s.model = "llama_3_1_8b".into();
        s.mode = workloads::Mode::Generate;
        s.precision = crate::run::spec::Precision::Bf16;
        s.lengths = Some(lengths);
        let e = check_generation_fits(&s, &memory, slice_mib, "1g.10gb has")
            .unwrap_err()
            .to_string();
        assert!(
            e.starts_with("llama_3_1_8b generate bf16 batch 1 at context 639")
                && e.contains("weights 15349 MiB + KV cache 80 MiB")
                && e.contains("1g.10gb has 9984 MiB")
                && e.ends_with("the weights alone do not fit"),
            "{e}"
        );
        // The same model on a 4g.40gb: the weights fit, and the batch is bounded by the cache.
        let four = table.profile("4g.40gb")?.memory_gib * 1024.0;
        check_generation_fits(&s, &memory, four, "4g.40gb has")?;
        s.batch = 1000;
        let e = check_generation_fits(&s, &memory, four, "4g.40gb has")
            .unwrap_err()
            .to_string();
        let largest = memory.largest_batch(four);
        assert!(
            largest > 1 && e.ends_with(&format!("the largest batch that fits is about {largest}")),
            "{e}"
        );
        Ok(())
    }

    #[test]
    fn a_batch_beyond_the_host_is_refused_naming_both_numbers() -> Result<()> {
        let _heap = crate::testing::heap_alone();
        let device = DeviceSpec::Cpu.open()?;
        let mut s = spec(1_000_000_000, 1);
        // The heap counted is the whole process's, and a test beside this one that builds no
        // workload (so does not wait for `heap_alone`) can free memory between the probe's two
        // batches and hide the second one's growth: the probe is taken again, three times at most.
        let mut estimate = probe(&s, &device)?.expect("the CPU's heap is counted");
        for _ in 0..2 {
            if estimate.per_sample_mib > 0.0 {
                break;
            }
            estimate = probe(&s, &device)?.expect("the CPU's heap is counted");
        }
        assert!(estimate.per_sample_mib > 0.0, "{estimate:?}");
        let limit = limit_mib(&device)?.expect("MemAvailable");
        let e = check_fits(&s, &estimate, limit, "the host has available")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("batch 1000000000 needs about")
                && e.contains("the host has available")
                && e.contains("largest batch that fits"),
            "{e}"
        );
        s.batch = 2;
        check_fits(&s, &estimate, limit, "the host has available")?;
        Ok(())
    }
}
