//! Our GPU kernels against candle's reference implementations on the CPU, forward and backward.
//! Built only with the `cudnn` feature and run on a GPU machine (`benches/gpu_run.sh kernels`, which
//! passes `--include-ignored`): every test is `#[ignore]`d and fails without a CUDA device.
#![cfg(feature = "cudnn")]

use candle_core::{DType, Device, Tensor, Var};
use workloads::init::Rng;

#[path = "../common/mod.rs"]
mod common;
use common::host_values;

mod attention;
mod batch_norm;
mod conv;
mod cross_entropy;
mod elementwise;
mod embedding;
mod encoder;
mod layer_norm;
mod linear;
mod max_pool;
mod memory;
mod optim;
mod resnet;
mod swin;

/// The GPU these tests need. They are `#[ignore]`d so that a plain `cargo test` skips them, and
/// fail, never pass, when run without one (`--include-ignored` on the GPU machine).
fn gpu() -> Device {
    Device::new_cuda(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and found none: {e}"))
}

fn random(shape: &[usize], seed: u64) -> Tensor {
    let mut rng = Rng::new(seed);
    let n: usize = shape.iter().product();
    Tensor::from_vec(
        (0..n).map(|_| rng.normal() as f32).collect::<Vec<f32>>(),
        shape,
        &Device::Cpu,
    )
    .unwrap()
}

/// Largest |a - b| relative to the largest |b|.
fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (host_values(a), host_values(b));
    let scale = b.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-12);
    a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

/// Runs `run` in f32 with TF32 forbidden (asserting f32 accuracy against `reference`), then with TF32
/// allowed; returns the second's error.
fn strict_then_tf32(what: &str, run: &dyn Fn() -> Tensor, reference: &Tensor) -> f32 {
    let strict = rel_err(&run(), reference);
    workloads::precision::allow_tf32(true);
    let tf32 = rel_err(&run(), reference);
    workloads::precision::allow_tf32(false);
    eprintln!("f32 {what} error: strict {strict:.1e}, tf32 allowed {tf32:.1e}");
    assert!(strict < 1e-5, "f32 {what} without TF32 differs by {strict}");
    tf32
}

/// ReLU whose gradient is 0 where its input is exactly 0, as PyTorch's (candle's passes it there;
/// in bf16 exact cancellations of x + b are common enough to show).
fn relu_as_pytorch(v: &Tensor, relu: bool) -> Tensor {
    if !relu {
        return v.clone();
    }
    let mask = v.gt(0.0).unwrap().to_dtype(v.dtype()).unwrap().detach();
    (v * mask).unwrap()
}

/// f on `inputs` made variables: its output and the gradient of sum(f · r) for each input.
fn with_grads(f: &dyn Fn(&[&Tensor]) -> Tensor, inputs: &[Tensor], r: &Tensor) -> (Tensor, Vec<Tensor>) {
    let vars: Vec<Var> = inputs.iter().map(|t| Var::from_tensor(t).unwrap()).collect();
    let args: Vec<&Tensor> = vars.iter().map(|v| v.as_tensor()).collect();
    let y = f(&args);
    let r = r.to_device(y.device()).unwrap().to_dtype(y.dtype()).unwrap();
    let grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
    let grads = vars
        .iter()
        .map(|v| grads.get(v.as_tensor()).expect("every input gets a gradient").clone())
        .collect();
    (y, grads)
}

/// `f` on the GPU in f32, bf16 and f16 against the same op on the CPU in f32 (its reference loops),
/// on inputs rounded to each dtype: forward and every input's gradient within `tol` of the dtype.
fn matches_cpu(what: &str, f: &dyn Fn(&[&Tensor]) -> Tensor, inputs: &[Tensor], tols: [f32; 3]) {
    let gpu = gpu();
    let y0 = f(&inputs.iter().collect::<Vec<_>>());
    let r = random(y0.dims(), 99);
    for (dtype, tol) in [DType::F32, DType::BF16, DType::F16].into_iter().zip(tols) {
        let rounded: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap())
            .collect();
        let (y_ref, g_ref) = with_grads(f, &rounded, &r);
        let on_gpu: Vec<Tensor> = inputs
            .iter()
            .map(|t| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap())
            .collect();
        let (y, g) = with_grads(f, &on_gpu, &r);
        assert_eq!(y.dtype(), dtype, "{what}");
        let e = rel_err(&y, &y_ref);
        let eg: Vec<f32> = g.iter().zip(&g_ref).map(|(a, b)| rel_err(a, b)).collect();
        let shown: Vec<String> = eg.iter().map(|v| format!("{v:.1e}")).collect();
        eprintln!("{what} {dtype:?}: y {e:.1e}, gradients {}", shown.join(" "));
        assert!(
            e < tol && eg.iter().all(|&x| x < tol),
            "{what} {dtype:?}: y {e}, gradients {eg:?}"
        );
    }
}

/// One SGD step on `device` of a fresh model from the seed-5 weights (its first update is lr times the
/// gradient) under `kernels`, f32 GEMMs and convolutions on TF32 when `tf32`: the loss, and each
/// parameter's update and each running statistic, by name.
fn sgd_step(
    device: &Device,
    name: &str,
    batch: usize,
    dtype: DType,
    kernels: workloads::kernels::KernelOptions,
    tf32: bool,
) -> (f32, Vec<(String, Tensor)>) {
    use workloads::{build, Mode, TrainConfig, WorkloadConfig};
    let host = |t: &Tensor| {
        t.to_device(&Device::Cpu)
            .unwrap()
            .to_dtype(DType::F32)
            .unwrap()
            .flatten_all()
            .unwrap()
    };
    workloads::precision::allow_tf32(tf32);
    let cfg = WorkloadConfig {
        device: device.clone(),
        dtype,
        mode: Mode::Train,
        seed: 5,
        seq_len: None,
        weights: None,
        train: TrainConfig::sgd(),
        kernels,
    };
    let mut workload = build(name, &cfg).unwrap();
    let before: Vec<Tensor> = workload.tensors().iter().map(|(_, t)| host(t)).collect();
    let b = workload.synthetic_batch(batch, 1).unwrap();
    let loss = host(&workload.train_step(&b).unwrap()).to_vec1::<f32>().unwrap()[0];
    let moved = workload.tensors().into_iter().zip(before).map(|((n, t), b)| {
        let t = host(&t);
        let moved = if n.contains("running") { t } else { (t - b).unwrap() };
        (n, moved)
    });
    let moved = moved.collect();
    workloads::precision::allow_tf32(false);
    (loss, moved)
}

/// ||a - b|| / ||b||: a sum's rounding, relative to the sum (a largest-element measure makes
/// near-cancelling sums, such as a late batch norm's bias gradient, look wrong).
fn l2(a: &Tensor, b: &Tensor) -> f32 {
    let d = (a - b)
        .unwrap()
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt();
    d / b
        .sqr()
        .unwrap()
        .sum_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
        .sqrt()
        .max(1e-20)
}

/// The tensor of `a` farthest from its namesake in `b` by [`l2`], among those `keep` names.
fn worst_update(a: &[(String, Tensor)], b: &[(String, Tensor)], keep: &dyn Fn(&str) -> bool) -> (f32, String) {
    a.iter()
        .zip(b)
        .filter(|((n, _), _)| keep(n))
        .map(|((n, x), (_, y))| (l2(x, y), n.clone()))
        .fold((0f32, String::new()), |m, e| if e.0 > m.0 { e } else { m })
}

/// Every parameter's update in one vector (running statistics left out).
fn all_updates(a: &[(String, Tensor)]) -> Tensor {
    Tensor::cat(
        &a.iter()
            .filter(|(n, _)| !n.contains("running"))
            .map(|(_, t)| t.clone())
            .collect::<Vec<_>>(),
        0,
    )
    .unwrap()
}
