//! The decode kernels (`kernels::decode`: the products with their rotary embedding, cache write,
//! gate and residual; attention split over the cache) against the same decode steps run as candle's
//! ops, on the GPU: every step's logits, teacher-forced so that both read the same tokens, each
//! kernel alone and all together, in bf16 and f16, at batch sizes the products take and one they
//! do not, across a chunk of the attention's split. The prefill's kernels (`kernels::prefill`, the
//! projections through cuBLASLt with the residual added by the GEMM) against candle's ops on the CPU.
//! Built with the `cuda` feature and run on a GPU machine (`benches/gpu_run.sh kernels`, which passes
//! `--include-ignored`): every test is `#[ignore]`d and fails without a CUDA device.
#![cfg(feature = "cuda")]

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::VarBuilder;
use workloads::kernels::decode;
use workloads::kernels::options::{Attention, EncoderLayers};
use workloads::kernels::KernelOptions;
use workloads::models::decoder::{self, Config, Decoder, KvCache, KvStore};

fn gpu() -> Device {
    let gpu = Device::new_cuda(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and found none: {e}"));
    workloads::memory::pool_allocations(&gpu).unwrap();
    gpu
}

/// A tiny preset reshaped to heads the attention kernel takes: `heads` query heads over `kv` of
/// `dim` features, an MLP of `inter`, two layers.
fn reshaped(preset: usize, hidden: usize, heads: usize, kv: usize, dim: usize, inter: usize) -> Config {
    let mut v: serde_json::Value = serde_json::from_str(decoder::PRESETS[preset].1).unwrap();
    for (key, value) in [
        ("hidden_size", hidden),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("head_dim", dim),
        ("intermediate_size", inter),
        ("max_position_embeddings", 512),
        ("vocab_size", 1000),
    ] {
        v[key] = value.into();
    }
    Config::from_json(&v.to_string()).unwrap()
}

/// Seeded weights with random norms and biases (a bias or a norm read from the wrong place shows).
fn weights(cfg: &Config, device: &Device, dtype: DType) -> VarBuilder<'static> {
    let mut w = decoder::random_weights(cfg, 3, &Device::Cpu, DType::F32).unwrap();
    for (name, t) in w.iter_mut() {
        let (mean, std) = match name {
            n if n.ends_with("norm.weight") => (1.0, 0.2),
            n if n.ends_with(".bias") => (0.0, 0.5),
            _ => continue,
        };
        let values = workloads::init::Rng::for_name(9, name).normal_vec(t.elem_count(), mean, std);
        *t = Tensor::from_vec(values, t.shape(), &Device::Cpu).unwrap();
    }
    let w = w
        .into_iter()
        .map(|(n, t)| (n, t.to_dtype(dtype).unwrap().to_device(device).unwrap()))
        .collect();
    VarBuilder::from_tensors(w, dtype, device)
}

/// Llama with heads of 64 in pairs (group 2); Qwen2 with biases, heads of 128, groups of 3 and a
/// tied head.
fn models() -> [(&'static str, Config); 2] {
    [
        ("llama d64", reshaped(5, 256, 4, 2, 64, 512)),
        ("qwen2 d128", reshaped(6, 384, 6, 2, 128, 1024)),
    ]
}

/// The largest logit error allowed, relative to the largest logit: rounding where PyTorch rounds,
/// in another order, is a few of the element type's steps.
fn bound(dtype: DType) -> f32 {
    if dtype == DType::BF16 {
        3e-2
    } else {
        5e-3
    }
}

fn options(layers: EncoderLayers, attention: Attention) -> KernelOptions {
    KernelOptions {
        layers,
        attention,
        ..KernelOptions::default()
    }
}

/// Largest |a - b| over the largest |b|, in f32.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.to_dtype(DType::F32).unwrap(), b.to_dtype(DType::F32).unwrap());
    let diff = (&a - &b).unwrap().abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    let scale = b.abs().unwrap().flatten_all().unwrap().max(0).unwrap();
    diff.to_scalar::<f32>().unwrap() / scale.to_scalar::<f32>().unwrap().max(1e-12)
}

const PROMPT: usize = 60;
/// Decode steps: positions 60 to 79, across the attention's first chunk of 64 slots.
const STEPS: usize = 20;

/// Decodes `batch` sequences with `kernels` and with candle's ops, feeding both the ops' tokens:
/// the worst step's relative logit error, and the share of (sequence, step) whose tokens agree.
fn against_ops(model: &Decoder, gpu: &Device, dtype: DType, batch: usize, kernels: KernelOptions) -> (f32, f64) {
    let ops = options(EncoderLayers::Composed, Attention::Composed);
    let vocab = model.config().vocab_size as u32;
    let ids: Vec<u32> = (0..batch * PROMPT).map(|i| (i as u32 * 7919 + 13) % vocab).collect();
    let prompt = Tensor::from_vec(ids, (batch, PROMPT), gpu).unwrap();
    let mut caches = [KvCache::new(model.config()), KvCache::new(model.config())];
    let mut tokens = Tensor::zeros((batch, 1), DType::U32, gpu).unwrap();
    for cache in caches.iter_mut() {
        cache.reserve(batch, PROMPT + STEPS, dtype, gpu).unwrap();
        let _ops = ops.enter();
        let logits = model.forward(&prompt, cache).unwrap();
        tokens = logits
            .i((.., PROMPT - 1, ..))
            .unwrap()
            .argmax(D::Minus1)
            .unwrap()
            .unsqueeze(1)
            .unwrap();
    }
    let (mut worst, mut agree) = (0f32, 0usize);
    for _ in 0..STEPS {
        let pos = Tensor::new(&[caches[0].len() as u32], gpu).unwrap();
        let ours = {
            let _k = kernels.enter();
            model.decode_step(&tokens, &pos, &caches[0]).unwrap()
        };
        let reference = {
            let _k = ops.enter();
            model.decode_step(&tokens, &pos, &caches[1]).unwrap()
        };
        for cache in caches.iter_mut() {
            cache.advance(1).unwrap();
        }
        worst = worst.max(rel_err(&ours, &reference));
        let picked = |l: &Tensor| {
            l.argmax(D::Minus1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<u32>()
                .unwrap()
        };
        let (a, b) = (picked(&ours), picked(&reference));
        agree += a.iter().zip(&b).filter(|(x, y)| x == y).count();
        tokens = Tensor::from_vec(b, (batch, 1), gpu).unwrap();
    }
    (worst, agree as f64 / (batch * STEPS) as f64)
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn decode_kernels_give_the_logits_of_candles_ops() {
    let gpu = gpu();
    let mut failures = Vec::new();
    for (label, cfg) in &models() {
        for dtype in [DType::BF16, DType::F16] {
            let model = Decoder::new(cfg, weights(cfg, &gpu, dtype)).unwrap();
            let bound = bound(dtype);
            for batch in [1, 3, 8, 9] {
                let widths = [cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.intermediate_size];
                let _all = options(EncoderLayers::Fused, Attention::Fused).enter();
                let takes = (
                    decode::products_take(&gpu, dtype, batch, &widths),
                    decode::attention_takes(&gpu, dtype, cfg.head_dim, cfg.num_heads / cfg.num_kv_heads),
                );
                assert_eq!(takes, (batch <= decode::MAX_BATCH, true), "{label} batch {batch}");
                // With both, the step's layers run as one op at batch 1.
                let one_op = decode::layers_take(takes.0, takes.1, batch, cfg.hidden_size);
                assert_eq!(one_op, batch <= decode::OVERLAP_MAX_BATCH, "{label} batch {batch}");
                drop(_all);
                for (what, layers, attention) in [
                    ("products", EncoderLayers::Fused, Attention::Composed),
                    ("attention", EncoderLayers::Composed, Attention::Fused),
                    (
                        "both (layers as one op at batch 1)",
                        EncoderLayers::Fused,
                        Attention::Fused,
                    ),
                ] {
                    let (err, agree) = against_ops(&model, &gpu, dtype, batch, options(layers, attention));
                    println!("{label} {dtype:?} batch {batch} {what}: logits {err:.2e}, tokens {agree:.3}");
                    if err > bound || agree < 0.9 {
                        failures.push(format!("{label} {dtype:?} batch {batch} {what}: {err:.2e}, {agree:.3}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_decode_product_refuses_what_it_cannot_read() {
    // Rows not whole 16-byte words, or more sequences than the kernel keeps, are errors that say
    // so, not wrong numbers.
    let gpu = gpu();
    let x = Tensor::zeros((2, 1, 12), DType::BF16, &gpu).unwrap();
    let w = Tensor::zeros((16, 12), DType::BF16, &gpu).unwrap();
    let e = decode::gemv(&x, None, &w, None).unwrap_err().to_string();
    assert!(e.contains("16-byte words"), "{e}");
    let x = Tensor::zeros((9, 1, 16), DType::BF16, &gpu).unwrap();
    let w = Tensor::zeros((16, 16), DType::BF16, &gpu).unwrap();
    let e = decode::gemv(&x, None, &w, None).unwrap_err().to_string();
    assert!(e.contains("9 sequences"), "{e}");
    // What it takes it computes: ones times ones is k.
    let x = Tensor::ones((3, 1, 24), DType::BF16, &gpu).unwrap();
    let w = Tensor::ones((40, 24), DType::BF16, &gpu).unwrap();
    let y = decode::gemv(
        &x,
        None,
        &w,
        Some(&Tensor::ones((3, 1, 40), DType::BF16, &gpu).unwrap()),
    )
    .unwrap();
    assert_eq!(y.dims(), [3, 1, 40]);
    let values = y
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    assert!(values.iter().all(|v| *v == 25.0), "{values:?}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn long_rows_split_over_warps_give_candles_product() {
    // Rows split over 1, 2, 4 and 8 warps (decode::gemv_split), with row counts that leave warps of
    // the last block without a row and a row length whose last span is shorter, at batches of 8 and
    // 4 words in flight, against candle's product of the same rounded inputs in f32; half the cases
    // add a residual.
    let gpu = gpu();
    let shapes = [(64, 2048), (66, 4096), (65, 8192), (72, 8984)];
    let sms = workloads::kernels::multiprocessors(&gpu).expect("the GPU's multiprocessor count");
    let mut splits = Vec::new();
    let mut failures = Vec::new();
    for (i, &(n, k)) in shapes.iter().enumerate() {
        for batch in [1, 3, 5, 8] {
            splits.push(decode::gemv_split(n, k, batch, false, sms));
            for dtype in [DType::BF16, DType::F16] {
                let normal = |name: &str, len: usize, dims: &[usize]| {
                    let v = workloads::init::Rng::for_name(i as u64, name).normal_vec(len, 0.0, 1.0);
                    Tensor::from_vec(v, dims, &gpu).unwrap().to_dtype(dtype).unwrap()
                };
                let x = normal("x", batch * k, &[batch, 1, k]);
                let w = (normal("w", n * k, &[n, k]) * (1.0 / (k as f64).sqrt())).unwrap();
                let res = (batch % 2 == 1).then(|| normal("res", batch * n, &[batch, 1, n]));
                let y = decode::gemv(&x, None, &w, res.as_ref()).unwrap();
                let f32_of = |t: &Tensor| t.to_dtype(DType::F32).unwrap();
                let mut want = f32_of(&x).broadcast_matmul(&f32_of(&w).t().unwrap()).unwrap();
                // The product is rounded before the residual is added, as PyTorch's is.
                want = f32_of(&want.to_dtype(dtype).unwrap());
                if let Some(r) = &res {
                    want = (want + f32_of(r)).unwrap();
                }
                let got = f32_of(&y).flatten_all().unwrap().to_vec1::<f32>().unwrap();
                let want = want.flatten_all().unwrap().to_vec1::<f32>().unwrap();
                // Two roundings of values near 1: a few units in the last place of the type.
                let tol = if dtype == DType::BF16 { 3e-2 } else { 4e-3 };
                let worst = got
                    .iter()
                    .zip(&want)
                    .map(|(g, w)| (g - w).abs() / w.abs().max(1.0))
                    .fold(0f32, f32::max);
                if worst > tol || got.len() != batch * n {
                    failures.push(format!("[{n}, {k}] batch {batch} {dtype:?}: worst {worst:.3e}"));
                }
            }
        }
    }
    splits.sort_unstable();
    splits.dedup();
    assert_eq!(splits, [1, 2, 4, 8], "the shapes no longer cover every split");
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_causal_prefill_kernel_gives_the_logits_and_cache_of_candles_ops() {
    // Every position's logits of a prompt from position 0, through the causal kernel and through
    // candle's ops with the mask; then one decode step from each cache, so that keys and values
    // written in the wrong place show. Prompts of one partial tile, of several with a partial
    // last one, and of whole tiles.
    let gpu = gpu();
    let mut failures = Vec::new();
    for (label, cfg) in &models() {
        for dtype in [DType::BF16, DType::F16] {
            let model = Decoder::new(cfg, weights(cfg, &gpu, dtype)).unwrap();
            assert_kernel_takes(label, cfg, dtype, &gpu);
            for (batch, tokens) in [(1, 37), (3, 150), (2, 128)] {
                let vocab = cfg.vocab_size as u32;
                let ids: Vec<u32> = (0..batch * tokens).map(|i| (i as u32 * 104_729 + 5) % vocab).collect();
                let prompt = Tensor::from_vec(ids, (batch, tokens), &gpu).unwrap();
                let run = |attention| prefill_then_step(&model, cfg, &prompt, &[tokens], attention);
                let what = format!("{label} {dtype:?} batch {batch} × {tokens}");
                judge_prefill(
                    &what,
                    bound(dtype),
                    run(Attention::Fused),
                    run(Attention::Composed),
                    &mut failures,
                );
            }
        }
    }
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

/// Asserts that the causal kernel takes `cfg`'s heads in `dtype`: else a test comparing it with
/// candle's ops would compare those with themselves.
fn assert_kernel_takes(label: &str, cfg: &Config, dtype: DType, gpu: &Device) {
    let _fused = options(EncoderLayers::Composed, Attention::Fused).enter();
    assert!(
        workloads::kernels::causal_attention::takes(gpu, dtype, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim),
        "{label} {dtype:?}: the causal kernel does not take these heads"
    );
}

/// `prompt` [batch, tokens] prefilled in `pieces` (their lengths, in order) over a contiguous cache
/// with `attention`, then one decode step from the cache: every position's logits, the token fed to
/// the step, and the step's logits.
fn prefill_then_step(
    model: &Decoder,
    cfg: &Config,
    prompt: &Tensor,
    pieces: &[usize],
    attention: Attention,
) -> (Tensor, Tensor, Tensor) {
    let _k = options(EncoderLayers::Composed, attention).enter();
    let (batch, tokens) = prompt.dims2().unwrap();
    let gpu = prompt.device();
    let mut cache = KvCache::new(cfg);
    cache.reserve(batch, tokens + 1, model.dtype(), gpu).unwrap();
    let mut start = 0;
    let mut logits = Vec::new();
    for &len in pieces {
        logits.push(
            model
                .forward(&prompt.narrow(1, start, len).unwrap(), &mut cache)
                .unwrap(),
        );
        start += len;
    }
    let logits = Tensor::cat(&logits, 1).unwrap();
    let next = logits
        .i((.., tokens - 1, ..))
        .unwrap()
        .argmax(D::Minus1)
        .unwrap()
        .unsqueeze(1)
        .unwrap();
    let pos = Tensor::new(&[tokens as u32], gpu).unwrap();
    let step = model.decode_step(&next, &pos, &cache).unwrap();
    (logits, next, step)
}

/// The kernel's prefill and next step against candle's ops: a failure where the prefill's logits
/// are beyond `bound`, or the step's where both fed the same token (random weights leave near ties
/// that rounding may break either way).
fn judge_prefill(
    what: &str,
    bound: f32,
    (kernel, kernel_next, kernel_step): (Tensor, Tensor, Tensor),
    (ops, ops_next, ops_step): (Tensor, Tensor, Tensor),
    failures: &mut Vec<String>,
) {
    let (prefill, step) = (rel_err(&kernel, &ops), rel_err(&kernel_step, &ops_step));
    let same_next = kernel_next.flatten_all().unwrap().to_vec1::<u32>().unwrap()
        == ops_next.flatten_all().unwrap().to_vec1::<u32>().unwrap();
    println!("{what}: prefill {prefill:.2e}, next step {step:.2e}, same next tokens {same_next}");
    if prefill > bound || (same_next && step > bound) {
        failures.push(format!("{what}: {prefill:.2e}, {step:.2e}"));
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_prompt_continued_after_its_cache_runs_the_causal_kernel_as_candles_ops_do() {
    // A prompt prefilled in pieces, as a chunked prefill runs it: every piece after the first attends
    // the keys and values the earlier ones cached. Each piece's logits through the causal kernel and
    // through candle's ops with the mask, then one decode step from each cache. Pieces end inside a
    // tile and on one; the third case's last piece starts at 129, past two tiles.
    use workloads::models::decoder::{KvPool, SequenceCache};
    let gpu = gpu();
    let mut failures = Vec::new();
    for (label, cfg) in &models() {
        for dtype in [DType::BF16, DType::F16] {
            let model = Decoder::new(cfg, weights(cfg, &gpu, dtype)).unwrap();
            let bound = bound(dtype);
            assert_kernel_takes(label, cfg, dtype, &gpu);
            for (batch, pieces) in [(1, vec![37, 90]), (2, vec![64, 64]), (3, vec![100, 29, 21])] {
                let tokens: usize = pieces.iter().sum();
                let vocab = cfg.vocab_size as u32;
                let ids: Vec<u32> = (0..batch * tokens).map(|i| (i as u32 * 7_919 + 11) % vocab).collect();
                let prompt = Tensor::from_vec(ids, (batch, tokens), &gpu).unwrap();
                let run = |attention| prefill_then_step(&model, cfg, &prompt, &pieces, attention);
                let what = format!("{label} {dtype:?} batch {batch} × {pieces:?}");
                judge_prefill(
                    &what,
                    bound,
                    run(Attention::Fused),
                    run(Attention::Composed),
                    &mut failures,
                );
            }
            // The same pieces over a pool of blocks, as a served sequence holds them (its blocks
            // after another sequence's): each piece's last logits.
            for pieces in [vec![37, 90], vec![100, 29, 21]] {
                let tokens: usize = pieces.iter().sum();
                let vocab = cfg.vocab_size as u32;
                let ids: Vec<u32> = (0..tokens).map(|i| (i as u32 * 7_919 + 11) % vocab).collect();
                let run = |attention: Attention| {
                    let _k = options(EncoderLayers::Composed, attention).enter();
                    let mut pool = KvPool::new(cfg, 64, 16, dtype, &gpu).unwrap();
                    let (mut other, mut table) = (Vec::new(), Vec::new());
                    pool.cover(&mut other, 40).unwrap();
                    pool.cover(&mut table, tokens).unwrap();
                    let mut start = 0;
                    let mut logits = Vec::new();
                    for &len in &pieces {
                        let piece = Tensor::from_vec(ids[start..start + len].to_vec(), (1, len), &gpu).unwrap();
                        logits.push(
                            model
                                .forward_last(&piece, &mut SequenceCache::new(&pool, &table, start))
                                .unwrap(),
                        );
                        start += len;
                    }
                    Tensor::cat(&logits, 1).unwrap()
                };
                let err = rel_err(&run(Attention::Fused), &run(Attention::Composed));
                println!("{label} {dtype:?} pooled × {pieces:?}: last logits {err:.2e}");
                if err > bound {
                    failures.push(format!("{label} {dtype:?} pooled {pieces:?}: {err:.2e}"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn argmax_picks_each_rows_first_largest_as_candle_does_on_the_cpu() {
    // Rows of a vocabulary's length and shorter ones, in every dtype; bf16 rounds many logits to
    // equal values, and a planted tie in row 0 must resolve to its first index.
    let gpu = gpu();
    for n in [128_256usize, 4_097, 7] {
        let mut values = workloads::init::Rng::for_name(1, "argmax").normal_vec(5 * n, 0.0, 1.0);
        values[n - 1] = 9.0;
        values[n / 3] = 9.0;
        values[2 * n..3 * n].fill(-1.0);
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let cpu = Tensor::from_vec(values.clone(), (5, n), &Device::Cpu)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let want = cpu.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
            let got = decode::argmax(&cpu.to_device(&gpu).unwrap())
                .unwrap()
                .to_vec1::<u32>()
                .unwrap();
            assert_eq!(got, want, "{n} {dtype:?}");
            assert_eq!(
                (got[0], got[2]),
                ((n / 3) as u32, 0),
                "{n} {dtype:?}: the first of equal ones"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_prefill_s_rotary_swiglu_and_products_give_candles_results() {
    // Against candle's ops on the CPU in f32, from the same inputs rounded to the dtype: the
    // packed rotary embedding (rows of 2 sequences × 19 tokens from position 5, heads of 64 and 128,
    // the v heads copied), SwiGLU over rows of gate and up, and a product with its residual.
    let gpu = gpu();
    let cpu = Device::Cpu;
    let normal = |name: &str, shape: &[usize]| {
        let n = shape.iter().product();
        Tensor::from_vec(
            workloads::init::Rng::for_name(17, name).normal_vec(n, 0.0, 1.0),
            shape,
            &cpu,
        )
        .unwrap()
    };
    let mut failures = Vec::new();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // A step or two of the dtype, relative to the largest value.
        let bound = match dtype {
            DType::BF16 => 1.6e-2,
            DType::F16 => 2e-3,
            _ => 1e-5,
        };
        let rounded = |t: Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
        let on_gpu = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
        let mut check = |what: String, ours: Tensor, reference: Tensor| {
            let e = rel_err(&ours.to_device(&cpu).unwrap(), &reference);
            println!("{what} {dtype:?}: {e:.2e}");
            if e > bound {
                failures.push(format!("{what} {dtype:?}: {e:.2e}"));
            }
        };
        for (q, kv, d) in [(4usize, 2usize, 64usize), (6, 2, 128)] {
            let (b, t, offset, positions) = (2, 19, 5, 40);
            let width = (q + 2 * kv) * d;
            let packed = rounded(normal("packed", &[b * t, width]));
            let angles = normal("angles", &[positions, d / 2]);
            let (cos, sin) = (rounded(angles.cos().unwrap()), rounded(angles.sin().unwrap()));
            let heads = decode::Heads { q, kv, dim: d };
            let ours = workloads::kernels::prefill::rope_packed(
                &on_gpu(&packed),
                t,
                offset,
                heads,
                (&on_gpu(&cos), &on_gpu(&sin)),
            )
            .unwrap();
            // candle's rotary embedding of the q and k heads, [b, t, heads, d], at positions 5..24.
            let split = packed.reshape((b, t, q + 2 * kv, d)).unwrap();
            let turned = candle_nn::rotary_emb::rope_thd(
                &split.narrow(2, 0, q + kv).unwrap().contiguous().unwrap(),
                &cos.narrow(0, offset, t).unwrap(),
                &sin.narrow(0, offset, t).unwrap(),
            )
            .unwrap();
            let reference = Tensor::cat(&[turned, split.narrow(2, q + kv, kv).unwrap()], 2)
                .unwrap()
                .reshape((b * t, width))
                .unwrap();
            check(format!("rotary, heads of {d}"), ours, reference);
        }
        let gate_up = rounded(normal("gate_up", &[37, 2 * 96]));
        let ours = workloads::kernels::prefill::swiglu(&on_gpu(&gate_up)).unwrap();
        let gate = gate_up.narrow(1, 0, 96).unwrap();
        let reference = (candle_nn::ops::silu(&gate).unwrap() * gate_up.narrow(1, 96, 96).unwrap()).unwrap();
        check("swiglu".into(), ours, reference);
        let (x, w, r) = (
            rounded(normal("x", &[3, 37, 64])),
            rounded(normal("w", &[48, 64])),
            rounded(normal("r", &[3, 37, 48])),
        );
        let ours = workloads::kernels::product(&on_gpu(&x), &on_gpu(&w), Some(&on_gpu(&r))).unwrap();
        assert_eq!(ours.dims(), [3, 37, 48]);
        let reference = (x.broadcast_matmul(&w.t().unwrap()).unwrap() + &r).unwrap();
        check("product with its residual".into(), ours, reference);
    }
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_prefill_s_mlp_gives_candles_logits_in_slices_of_rows_or_in_one() {
    // A prompt's logits with the MLP's products and SwiGLU (`--encoder-layers fused`) against
    // candle's ops for it (composed), and in slices of 5 rows (whose products start at rows that
    // are not a tile's, the residual a view from such a row) against one slice.
    let gpu = gpu();
    let mut failures = Vec::new();
    for (label, cfg) in &models() {
        for dtype in [DType::BF16, DType::F16] {
            let bound = bound(dtype);
            let (batch, tokens) = (3, 41);
            let vocab = cfg.vocab_size as u32;
            let ids: Vec<u32> = (0..batch * tokens).map(|i| (i as u32 * 7_919 + 3) % vocab).collect();
            let prompt = Tensor::from_vec(ids, (batch, tokens), &gpu).unwrap();
            let logits = |model: &Decoder, layers: EncoderLayers| {
                let _k = options(layers, Attention::Fused).enter();
                let mut cache = KvCache::new(cfg);
                cache.reserve(batch, tokens, dtype, &gpu).unwrap();
                model.forward(&prompt, &mut cache).unwrap()
            };
            let whole = Decoder::new(cfg, weights(cfg, &gpu, dtype)).unwrap();
            let sliced = Decoder::new(cfg, weights(cfg, &gpu, dtype)).unwrap().with_mlp_rows(5);
            let fused = logits(&whole, EncoderLayers::Fused);
            let ops = rel_err(&fused, &logits(&whole, EncoderLayers::Composed));
            let slices = rel_err(&logits(&sliced, EncoderLayers::Fused), &fused);
            println!("{label} {dtype:?}: against candle's ops {ops:.2e}, in slices of 5 rows {slices:.2e}");
            if ops > bound || slices > bound {
                failures.push(format!("{label} {dtype:?}: {ops:.2e}, {slices:.2e}"));
            }
        }
    }
    assert!(failures.is_empty(), "beyond the bound:\n{}", failures.join("\n"));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn paged_decode_kernels_give_the_logits_of_candles_ops_with_each_sequence_at_its_own_position() {
    // A server's batch: sequences of prompts of 20, 29, 38, ... tokens in blocks of 16 taken in
    // turns (no table in order), so that a chunk of the attention's split spans blocks. One sequence
    // runs the step's layers as one op; three run the products with the rotary embedding and the
    // cache write op by op; eleven run cuBLAS's products, the attention kernel still reading the pool
    // through the tables.
    use workloads::models::decoder::{KvPool, SequenceCache};
    let gpu = gpu();
    let ops = options(EncoderLayers::Composed, Attention::Composed);
    let kernels = KernelOptions::default();
    for dtype in [DType::BF16, DType::F16] {
        for (name, cfg) in models() {
            let model = Decoder::new(&cfg, weights(&cfg, &gpu, dtype)).unwrap();
            let vocab = cfg.vocab_size as u32;
            for n in [1, 3, 11] {
                let lens: Vec<usize> = (0..n).map(|i| 20 + 9 * i).collect();
                let most = lens.iter().max().unwrap() + STEPS;
                let mut pools: Vec<KvPool> = (0..2)
                    .map(|_| KvPool::new(&cfg, 256, 16, dtype, &gpu).unwrap())
                    .collect();
                let mut tables = vec![vec![Vec::new(); n]; 2];
                for blocks in 1..=most.div_ceil(16) {
                    for s in 0..n {
                        for (pool, t) in pools.iter_mut().zip(tables.iter_mut()) {
                            pool.cover(&mut t[s], (lens[s] + STEPS).min(blocks * 16)).unwrap();
                        }
                    }
                }
                assert_eq!(tables[0], tables[1]);
                for (pool, t) in pools.iter().zip(&tables) {
                    let _ops = ops.enter();
                    for s in 0..n {
                        let ids: Vec<u32> = (0..lens[s])
                            .map(|i| ((s * 131 + i) as u32 * 7919 + 13) % vocab)
                            .collect();
                        let ids = Tensor::from_vec(ids, (1, lens[s]), &gpu).unwrap();
                        model
                            .forward_last(&ids, &mut SequenceCache::new(pool, &t[s], 0))
                            .unwrap();
                    }
                }
                let table_refs: Vec<&[u32]> = tables[0].iter().map(Vec::as_slice).collect();
                let mut tokens =
                    Tensor::from_vec((0..n as u32).map(|i| i * 37 % vocab).collect::<Vec<_>>(), (n, 1), &gpu).unwrap();
                let mut worst = 0f32;
                for step in 0..STEPS {
                    let positions: Vec<u32> = lens.iter().map(|l| (l + step) as u32).collect();
                    let run = |pool: &KvPool, k: KernelOptions| {
                        let _k = k.enter();
                        let st = model.paged_step(&positions, &table_refs, pool, &gpu).unwrap();
                        model.decode_paged(&tokens, &st, pool).unwrap()
                    };
                    let (ours, reference) = (run(&pools[0], kernels), run(&pools[1], ops));
                    worst = worst.max(rel_err(&ours, &reference));
                    tokens = reference.argmax(D::Minus1).unwrap().reshape((n, 1)).unwrap();
                }
                println!("{name} {dtype:?} paged, {n} sequences: worst logit error {worst:.2e}");
                assert!(worst <= bound(dtype), "{name} {dtype:?} {n}: {worst}");
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn writing_rows_into_a_pool_puts_each_where_the_cpu_scatter_does() {
    let gpu = gpu();
    for dtype in [DType::F32, DType::BF16, DType::F16] {
        // 3,000 rows of 64 into a pool of 10,000, in a scrambled order.
        let (n, width, rows) = (3000usize, 64usize, 10_000usize);
        let src = Tensor::randn(0f32, 1.0, (n, width), &Device::Cpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let at: Vec<u32> = (0..n as u32).map(|i| (i * 7919 + 11) % rows as u32).collect();
        let at = Tensor::from_vec(at, n, &Device::Cpu).unwrap();
        let cpu = Tensor::zeros((rows, width), dtype, &Device::Cpu).unwrap();
        workloads::kernels::prefill::write_rows(&cpu, &at, &src).unwrap();
        let dst = Tensor::zeros((rows, width), dtype, &gpu).unwrap();
        workloads::kernels::prefill::write_rows(&dst, &at.to_device(&gpu).unwrap(), &src.to_device(&gpu).unwrap())
            .unwrap();
        let diff = (dst.to_device(&Device::Cpu).unwrap().to_dtype(DType::F32).unwrap()
            - cpu.to_dtype(DType::F32).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
        assert_eq!(diff, 0.0, "{dtype:?}");
    }
}
