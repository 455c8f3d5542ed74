//! Steps replayed as CUDA graphs against the same steps launched kernel by kernel, on the GPU: the
//! logits of inference, and the losses, parameters and buffers over consecutive training steps. A
//! shape whose capture is refused (the step copies from host memory) runs as is, and must still
//! give the same results.
//! Built only with the `cudnn` feature and run on a GPU machine (`benches/gpu_run.sh kernels`, which
//! passes `--include-ignored`): every test is `#[ignore]`d and fails without a CUDA device.
#![cfg(feature = "cudnn")]

use candle_core::{DType, Device};
use workloads::kernels::options::CudaGraphs;
use workloads::kernels::KernelOptions;
use workloads::{build, Batch, GraphStats, Mode, TrainConfig, Workload, WorkloadConfig};

mod common;
use common::host_values;

/// The GPU, opened as the profiler opens it (one stream, pooled memory, no per-allocation events).
fn gpu() -> Device {
    let gpu = Device::new_cuda(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and found none: {e}"));
    workloads::memory::pool_allocations(&gpu).unwrap();
    gpu
}

fn tiny_presets() -> Vec<&'static str> {
    workloads::model_names()
        .into_iter()
        .filter(|n| workloads::lookup(n).is_ok_and(|(_, m)| m.tiny && !m.family.is_decoder()))
        .collect()
}

fn workload(
    name: &str,
    device: &Device,
    dtype: DType,
    mode: Mode,
    train: TrainConfig,
    graphs: CudaGraphs,
) -> Box<dyn Workload> {
    let kernels = KernelOptions {
        graphs,
        ..KernelOptions::default()
    };
    let cfg = WorkloadConfig {
        device: device.clone(),
        dtype,
        mode,
        seed: 7,
        seq_len: None,
        weights: None,
        train,
        kernels,
    };
    build(name, &cfg).unwrap()
}

/// Largest |a - b| relative to the largest |b|.
fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Seven steps: the first of each of two shapes runs as is, the second captures, the rest replay with
/// new inputs copied in, the shapes interleaved so that each replay follows the other graph's.
/// Batches of 8 and 4, not smaller: resnet_tiny's last stage is 1x1, where batch norm over two
/// samples maps every input to ±1 and passes back a gradient that is zero but for rounding; a step
/// at batch 2 then trained every earlier layer on rounding noise, and two runs without graphs
/// (cuDNN's f32 backward sums in no fixed order) ended up to 8% apart in loss, more than the noise
/// measured at the step before could bound.
fn batches(w: &dyn Workload) -> Vec<Batch> {
    [(8, 1), (4, 2), (8, 3), (4, 4), (8, 5), (4, 6), (8, 7)]
        .iter()
        .map(|&(n, seed)| w.synthetic_batch(n, seed).unwrap())
        .collect()
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_inference_gives_the_logits_of_steps_launched_kernel_by_kernel() {
    let gpu = gpu();
    for name in tiny_presets() {
        for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 1e-2)] {
            let eager = workload(name, &gpu, dtype, Mode::Infer, TrainConfig::default(), CudaGraphs::Off);
            let graphed = workload(
                name,
                &gpu,
                dtype,
                Mode::Infer,
                TrainConfig::default(),
                CudaGraphs::Infer,
            );
            for (i, batch) in batches(eager.as_ref()).iter().enumerate() {
                let want = host_values(&eager.infer(batch).unwrap());
                let got = host_values(&graphed.infer(batch).unwrap());
                let err = rel_err(&got, &want);
                eprintln!(
                    "{name} {dtype:?} step {i} (batch {}): relative error {err:.2e}",
                    batch.size
                );
                assert!(
                    err <= tol,
                    "{name} {dtype:?} step {i}: replayed logits differ by {err:.2e} (> {tol:.0e})"
                );
            }
            let stats = graphed.graph_stats();
            eprintln!("{name} {dtype:?}: {stats:?} {:?}", graphed.graph_refusals());
            assert_eq!(stats.captured + stats.refused, 2, "{name} {dtype:?}: {stats:?}");
            assert_eq!(
                stats.replays,
                3 * stats.captured as u64 / 2,
                "{name} {dtype:?}: {stats:?}"
            );
            // ResNet's inference is all our kernels, cuDNN and cuBLAS on contiguous tensors: it
            // must be captured, or this test would compare nothing with nothing.
            if name == "resnet_tiny" {
                assert_eq!(
                    stats,
                    GraphStats {
                        captured: 2,
                        replays: 3,
                        refused: 0
                    },
                    "{name} {dtype:?}"
                );
            }
            assert_eq!(eager.graph_stats(), GraphStats::default());
        }
    }
}

/// The largest relative difference between two workloads' tensors, and its tensor's name.
fn worst_tensor(a: &dyn Workload, b: &dyn Workload) -> (f32, String) {
    let (want, got) = (a.tensors(), b.tensors());
    assert_eq!(want.len(), got.len());
    let mut worst = (0f32, String::new());
    for ((n, w), (_, g)) in want.iter().zip(&got) {
        let err = rel_err(&host_values(g), &host_values(w));
        if err > worst.0 {
            worst = (err, n.clone());
        }
    }
    worst
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_training_steps_move_the_model_as_steps_launched_kernel_by_kernel() {
    let gpu = gpu();
    // Every case runs before any is judged, so that one failure still shows the others' figures.
    let mut failures = Vec::new();
    // Every preset in f32; ResNet in bf16 too, which trains over NHWC (cuDNN's graph API, our batch
    // norm over rows of channels).
    let cases = tiny_presets()
        .into_iter()
        .map(|n| (n, DType::F32))
        .chain([("resnet_tiny", DType::BF16)]);
    for (name, dtype) in cases {
        for train in [TrainConfig::sgd(), TrainConfig::adamw()] {
            // Two workloads without graphs measure how far run-to-run differences (atomic sums in
            // backward kernels) alone move the model; the graphed one may differ from the first by
            // little more than that.
            let mut eager = workload(name, &gpu, dtype, Mode::Train, train, CudaGraphs::Off);
            let mut control = workload(name, &gpu, dtype, Mode::Train, train, CudaGraphs::Off);
            let mut graphed = workload(name, &gpu, dtype, Mode::Train, train, CudaGraphs::On);
            let case = format!("{name} {dtype:?} {:?}", train.optimizer);
            for (i, batch) in batches(eager.as_ref()).iter().enumerate() {
                let want = host_values(&eager.train_step(batch).unwrap());
                let noise = rel_err(&host_values(&control.train_step(batch).unwrap()), &want);
                let got = host_values(&graphed.train_step(batch).unwrap());
                let err = rel_err(&got, &want);
                eprintln!("{case} step {i} (batch {}): loss {} against {}, relative error {err:.2e} (without graphs, run to run: {noise:.2e})", batch.size, got[0], want[0]);
                let bound = (10.0 * noise).max(1e-4);
                if err > bound {
                    failures.push(format!(
                        "{case} step {i}: loss {} against {} (bound {bound:.1e})",
                        got[0], want[0]
                    ));
                }
            }
            let stats = graphed.graph_stats();
            eprintln!("{case}: {stats:?} {:?}", graphed.graph_refusals());
            if stats.captured + stats.refused != 2 {
                failures.push(format!("{case}: {stats:?}"));
            }
            // Every parameter and buffer (batch norm's running statistics too) after the seven steps.
            let (noise, noisiest) = worst_tensor(eager.as_ref(), control.as_ref());
            let (worst, name_of_worst) = worst_tensor(eager.as_ref(), graphed.as_ref());
            eprintln!("{case}: worst tensor {name_of_worst} at {worst:.2e}; without graphs, run to run: {noisiest} at {noise:.2e}");
            let bound = (10.0 * noise).max(1e-5);
            if worst > bound {
                failures.push(format!(
                    "{case}: {name_of_worst} differs by {worst:.2e} after seven steps (bound {bound:.1e})"
                ));
            }
        }
    }
    assert!(
        failures.is_empty(),
        "replayed training differs:\n{}",
        failures.join("\n")
    );
}

/// `name`'s generator on `device`, seeded, with the CUDA graphs of `graphs`.
fn generator(
    name: &str,
    device: &Device,
    dtype: DType,
    graphs: CudaGraphs,
    layout: workloads::KvLayout,
) -> workloads::Generator {
    let cfg = WorkloadConfig {
        device: device.clone(),
        dtype,
        mode: Mode::Generate,
        seed: 7,
        seq_len: None,
        weights: None,
        train: TrainConfig::default(),
        kernels: KernelOptions {
            graphs,
            ..KernelOptions::default()
        },
    };
    workloads::Generator::build(name, &cfg, layout).unwrap()
}

/// The tokens of `generations` greedy generations of `name` (batch 3, prompt 9, 24 new tokens), and
/// the generator's graph counts.
fn generate(
    name: &str,
    device: &Device,
    dtype: DType,
    graphs: CudaGraphs,
    generations: usize,
    layout: workloads::KvLayout,
) -> (Vec<Vec<u32>>, GraphStats) {
    let mut g = generator(name, device, dtype, graphs, layout);
    let prompts = g.prompts(3, 9, 11).unwrap();
    let mut tokens = Vec::new();
    for _ in 0..generations {
        let mut next = g.prefill(&prompts, 9 + 23).unwrap();
        let mut seq = vec![next.flatten_all().unwrap().to_vec1::<u32>().unwrap()];
        for _ in 0..23 {
            next = g.decode(&next).unwrap();
            seq.push(next.flatten_all().unwrap().to_vec1::<u32>().unwrap());
        }
        tokens.push(seq.concat());
    }
    (tokens, g.graph_stats())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn replayed_decode_steps_give_the_tokens_of_steps_launched_op_by_op() {
    // A decode step captured once and replayed at every later position (the cache's buffers and
    // the step's shapes fixed, its position a device tensor) must decode what the same steps
    // launched op by op do, generation after generation over the same buffers. Qwen2.5-0.5B in
    // bf16 runs the decode kernels (heads of 64: the products, and attention split over the cache).
    let gpu = gpu();
    for (name, dtypes) in [
        ("llama_tiny", &[DType::F32, DType::BF16][..]),
        ("qwen2_tiny", &[DType::F32, DType::BF16][..]),
        ("qwen2_5_0_5b", &[DType::BF16][..]),
    ] {
        for &dtype in dtypes {
            let contiguous = workloads::KvLayout::Contiguous;
            let (with, stats) = generate(name, &gpu, dtype, CudaGraphs::Infer, 2, contiguous);
            let (without, none) = generate(name, &gpu, dtype, CudaGraphs::Off, 2, contiguous);
            assert_eq!(with, without, "{name} {dtype:?}");
            assert_eq!(
                with[0], with[1],
                "{name} {dtype:?}: the second generation replays the first"
            );
            assert_eq!((stats.captured, stats.refused), (1, 0), "{name} {dtype:?}: {stats:?}");
            // 2 × 23 steps: the first runs op by op, the second is captured, the rest replay.
            assert_eq!(stats.replays, 44, "{name} {dtype:?}: {stats:?}");
            assert_eq!((none.captured, none.replays), (0, 0));
            println!("{name} {dtype:?}: {} tokens equal, {stats:?}", with[0].len());
        }
    }
}

/// `preset` as a Hugging Face folder, its output head tied to the embeddings or its own (`tied`),
/// seeded weights with norms spread and embeddings a tenth of their seeded size, so that the layers'
/// outputs lead the residual stream: a tied head on seeded weights otherwise scores the token it was
/// fed highest, and greedy decoding repeats one token.
fn folder(preset: &str, tied: bool) -> tempfile::TempDir {
    use workloads::models::decoder;
    let json = decoder::PRESETS.iter().find(|(n, _)| *n == preset).unwrap().1;
    let mut config: serde_json::Value = serde_json::from_str(json).unwrap();
    config["tie_word_embeddings"] = serde_json::json!(tied);
    let text = config.to_string();
    let cfg = decoder::Config::from_json(&text).unwrap();
    let mut weights = decoder::random_weights(&cfg, 11, &Device::Cpu, DType::F32).unwrap();
    for (name, t) in weights.iter_mut() {
        let (mean, std) = match name.as_str() {
            n if n.ends_with("norm.weight") => (1.0, 0.2),
            "model.embed_tokens.weight" => {
                *t = (&*t * 0.1).unwrap();
                continue;
            }
            _ => continue,
        };
        let values = workloads::init::Rng::for_name(5, name).normal_vec(t.elem_count(), mean, std);
        *t = candle_core::Tensor::from_vec(values, t.shape(), &Device::Cpu).unwrap();
    }
    assert_eq!(weights.contains_key("lm_head.weight"), !tied);
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), text).unwrap();
    candle_core::safetensors::save(&weights, dir.path().join("model.safetensors")).unwrap();
    dir
}

/// Two generations of `name` (batch 3, prompt 9, 24 new tokens) through the `Generator`, as `migprof
/// run --mode generate` drives it, every token tensor it returns held on the device until the
/// generation's end (as a caller collecting its tokens does) and only then read.
fn generate_held(
    name: &str,
    device: &Device,
    dtype: DType,
    graphs: CudaGraphs,
    layout: workloads::KvLayout,
) -> (Vec<Vec<u32>>, GraphStats) {
    let mut g = generator(name, device, dtype, graphs, layout);
    let prompts = g.prompts(3, 9, 11).unwrap();
    let mut generations = Vec::new();
    for _ in 0..2 {
        let mut held = vec![g.prefill(&prompts, 9 + 23).unwrap()];
        for _ in 0..23 {
            let next = g.decode(held.last().unwrap()).unwrap();
            held.push(next);
        }
        // Step by step, each step's batch in order, as `generate` lists them.
        let steps = candle_core::Tensor::cat(&held, 1)
            .unwrap()
            .t()
            .unwrap()
            .contiguous()
            .unwrap();
        generations.push(steps.to_vec2::<u32>().unwrap().concat());
    }
    (generations, g.graph_stats())
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_generator_s_tokens_equal_the_model_s_for_tied_and_untied_heads_held_to_the_end() {
    // The path `migprof run --mode generate` times: graphs on, a contiguous cache (its steps
    // replayed) and a paged one, f32 and bf16, against the same generator launched op by op with
    // each token read at once. Holding the tokens is what a replay's input copy once broke: the
    // graph had kept the first decode token's own tensor as its input and rewrote it every step.
    let gpu = gpu();
    let mut failures = Vec::new();
    for (preset, tied) in [
        ("qwen2_tiny", true),
        ("qwen2_tiny", false),
        ("llama_tiny", false),
        ("llama_tiny", true),
    ] {
        let dir = folder(preset, tied);
        let name = format!("hf:{}", dir.path().display());
        for dtype in [DType::F32, DType::BF16] {
            for layout in [
                workloads::KvLayout::Contiguous,
                workloads::KvLayout::Paged {
                    block_size: workloads::BlockSize::DEFAULT,
                },
            ] {
                let case = format!("{preset} tied={tied} {dtype:?} {}", layout.as_str());
                let (reference, _) = generate(&name, &gpu, dtype, CudaGraphs::Off, 2, layout);
                let (held, stats) = generate_held(&name, &gpu, dtype, CudaGraphs::Infer, layout);
                // The rewrite left the first decode token's tensor holding the last token fed (the
                // 22nd): a reference where the two are equal in every sequence could not show it.
                let (first, last_fed) = (&reference[0][3..6], &reference[0][22 * 3..23 * 3]);
                assert_ne!(
                    first, last_fed,
                    "{case}: the first and last decode tokens agree: {reference:?}"
                );
                if held != reference {
                    failures.push(format!("{case}: {:?}\n  against {:?}", held[0], reference[0]));
                }
                let replayed = layout == workloads::KvLayout::Contiguous;
                if (stats.captured == 1 && stats.replays == 44) != replayed {
                    failures.push(format!("{case}: {stats:?}"));
                }
                println!("{case}: {} tokens a generation equal, {stats:?}", held[0].len());
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
