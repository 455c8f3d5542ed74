//! Our GPU kernels against candle's reference implementations on the CPU, forward and backward.
//! Built only with the `cudnn` feature and run on a GPU machine (`benches/gpu_run.sh kernels`, which
//! passes `--include-ignored`): every test is `#[ignore]`d and fails without a CUDA device.
#![cfg(feature = "cudnn")]

use candle_core::{DType, Device, Tensor, Var};
use workloads::init::Rng;

mod common;
use common::host_values;

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

/// (x shape, filter shape, padding, stride): ResNet's stem, 3x3 and strided 3x3, 1x1 and strided 1x1
/// projection, and the ViT/Swin patch embeddings.
const CASES: &[([usize; 4], [usize; 4], usize, usize)] = &[
    ([2, 3, 32, 32], [8, 3, 7, 7], 3, 2),
    ([2, 8, 16, 16], [8, 8, 3, 3], 1, 1),
    ([2, 8, 16, 16], [16, 8, 3, 3], 1, 2),
    ([2, 16, 8, 8], [32, 16, 1, 1], 0, 1),
    ([2, 16, 8, 8], [32, 16, 1, 1], 0, 2),
    ([2, 3, 32, 32], [24, 3, 16, 16], 0, 16),
    ([2, 3, 32, 32], [12, 3, 4, 4], 0, 4),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn cudnn_conv2d_matches_candle_on_the_cpu_forward_and_backward() {
    let gpu = gpu();
    for (i, &(xs, ws, pad, stride)) in CASES.iter().enumerate() {
        let x = random(&xs, 10 + i as u64);
        let w = random(&ws, 20 + i as u64);
        // The reference: candle's CPU convolution and its autograd, in f32.
        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let y_ref = xv.as_tensor().conv2d(wv.as_tensor(), pad, stride, 1, 1).unwrap();
        let r = random(y_ref.dims(), 30 + i as u64);
        let g = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let (dx_ref, dw_ref) = (
            g.get(xv.as_tensor()).unwrap().clone(),
            g.get(wv.as_tensor()).unwrap().clone(),
        );

        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            let on = |t: &Tensor| Var::from_tensor(&t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let (xg, wg) = (on(&x), on(&w));
            let y = workloads::kernels::conv2d(xg.as_tensor(), wg.as_tensor(), pad, stride).unwrap();
            assert_eq!(y.dims(), y_ref.dims(), "case {i} {dtype:?}");
            let e = rel_err(&y, &y_ref);
            assert!(e < tol, "case {i} {dtype:?}: forward differs by {e}");
            let rg = r.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
            let grads = (&y * &rg).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = grads.get(xg.as_tensor()).expect("a gradient for the input");
            let dw = grads.get(wg.as_tensor()).expect("a gradient for the filter");
            let (ex, ew) = (rel_err(dx, &dx_ref), rel_err(dw, &dw_ref));
            assert!(
                ex < tol && ew < tol,
                "case {i} {dtype:?}: dx differs by {ex}, dw by {ew}"
            );
            eprintln!("case {i} {dtype:?}: forward {e:.1e}, dx {ex:.1e}, dw {ew:.1e}");
        }
    }
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn f32_convolutions_stay_off_tf32_unless_allowed_and_stay_close_when_allowed() {
    let gpu = gpu();
    // Long reductions (c * k * k = 1152 terms) make TF32's 10-bit inputs visible: ~1e-3 relative,
    // against ~1e-6 for f32.
    let x = random(&[4, 128, 16, 16], 1);
    let w = random(&[64, 128, 3, 3], 2);
    let reference = x.conv2d(&w, 1, 1, 1, 1).unwrap();
    let run = || workloads::kernels::conv2d(&x.to_device(&gpu).unwrap(), &w.to_device(&gpu).unwrap(), 1, 1).unwrap();
    let tf32 = strict_then_tf32("conv", &run, &reference);
    // Allowed is not required: cuDNN takes the fastest algorithm, which may still be an FMA one.
    assert!(tf32 < 1e-2, "f32 with TF32 allowed differs by {tf32}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f32_linear_layers_stay_off_tf32_unless_allowed() {
    use workloads::kernels::{linear, Act};
    let gpu = gpu();
    // 2048-term dot products: TF32's 10-bit inputs show at ~1e-3 relative, f32 at ~1e-6. cuBLASLt
    // is asked for COMPUTE_32F_FAST_TF32 when allowed, so there it must show.
    let (x, w, b) = (random(&[64, 2048], 3), random(&[96, 2048], 4), random(&[96], 5));
    let reference = linear(&x, &w, Some(&b), Act::None).unwrap();
    let on = |t: &Tensor| t.to_device(&gpu).unwrap();
    let run = || linear(&on(&x), &on(&w), Some(&on(&b)), Act::None).unwrap();
    let tf32 = strict_then_tf32("linear", &run, &reference);
    assert!(tf32 > 1e-5 && tf32 < 1e-2, "f32 with TF32 allowed differs by {tf32}");
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn bias_kernel_matches_candle_on_the_cpu_forward_and_backward() {
    use workloads::kernels::{bias_act, Act, BiasAxis};
    let gpu = gpu();
    // NCHW channel biases (ResNet's folded batch norm, patch embeddings) and last-axis biases
    // (linear layers, attention biases seen as rows), with each activation.
    // Shapes whose planes hold whole 16-byte words take the vector kernel, the others the scalar one.
    let cases: &[(&[usize], BiasAxis)] = &[
        (&[3, 5, 7, 9], BiasAxis::Channels),
        (&[2, 4, 8, 8], BiasAxis::Channels),
        // 7x7 planes in 16-byte words: words span two channels.
        (&[2, 8, 7, 7], BiasAxis::Channels),
        (&[2, 64, 1, 1], BiasAxis::Channels),
        (&[6, 33], BiasAxis::Last),
        (&[2, 197, 40], BiasAxis::Last),
        // Many rows: the bias's column sums split the rows over several block rows (words of 8
        // bf16 columns across 32 lanes, and 24 words over 32 lanes).
        (&[4, 3136, 384], BiasAxis::Last),
        (&[1, 2049, 192], BiasAxis::Last),
    ];
    for (i, &(shape, axis)) in cases.iter().enumerate() {
        let channels = match axis {
            BiasAxis::Channels => shape[1],
            BiasAxis::Last => shape[shape.len() - 1],
        };
        let x = random(shape, 40 + i as u64);
        let b = random(&[channels], 50 + i as u64);
        let r = random(shape, 60 + i as u64);
        for act in [Act::None, Act::Relu, Act::GeluErf] {
            for (dtype, tol) in [(DType::F32, 1e-6f32), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
                // The reference: candle's broadcast add and ReLU on the CPU, with autograd, in f32 on
                // the inputs rounded to the dtype (so that the ReLU sees the same signs near zero).
                let rounded = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let (xv, bv) = (
                    Var::from_tensor(&rounded(&x)).unwrap(),
                    Var::from_tensor(&rounded(&b)).unwrap(),
                );
                let y_ref = match act {
                    Act::Relu => relu_as_pytorch(
                        &bias_act(xv.as_tensor(), bv.as_tensor(), axis, Act::None).unwrap(),
                        true,
                    ),
                    _ => bias_act(xv.as_tensor(), bv.as_tensor(), axis, act).unwrap(),
                };
                let g = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let (dx_ref, db_ref) = (
                    g.get(xv.as_tensor()).unwrap().clone(),
                    g.get(bv.as_tensor()).unwrap().clone(),
                );
                let on = |t: &Tensor| Var::from_tensor(&t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
                let (xg, bg) = (on(&x), on(&b));
                let y = bias_act(xg.as_tensor(), bg.as_tensor(), axis, act).unwrap();
                let e = rel_err(&y, &y_ref);
                let rg = r.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
                let grads = (&y * &rg).unwrap().sum_all().unwrap().backward().unwrap();
                let ex = rel_err(grads.get(xg.as_tensor()).unwrap(), &dx_ref);
                // The bias gradient sums many terms: bf16 accumulates its rounding.
                let eb = rel_err(grads.get(bg.as_tensor()).unwrap(), &db_ref);
                eprintln!("bias case {i} {act:?} {dtype:?}: y {e:.1e}, dx {ex:.1e}, db {eb:.1e}");
                assert!(
                    e < tol && ex < tol && eb < 10.0 * tol,
                    "case {i} {act:?} {dtype:?}: y {e}, dx {ex}, db {eb}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn add_kernel_matches_candle_on_the_cpu_forward_and_backward() {
    let gpu = gpu();
    // 945 elements (the scalar kernel) and 512 (16-byte words).
    for shape in [[3usize, 5, 7, 9], [2, 4, 8, 8]] {
        let (x, z, r) = (random(&shape, 70), random(&shape, 71), random(&shape, 72));
        for relu in [false, true] {
            for (dtype, tol) in [(DType::F32, 1e-6f32), (DType::BF16, 1e-2), (DType::F16, 2e-3)] {
                // The reference on the inputs rounded to the dtype, so that the ReLU sees the same signs.
                let rounded = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
                let (xv, zv) = (
                    Var::from_tensor(&rounded(&x)).unwrap(),
                    Var::from_tensor(&rounded(&z)).unwrap(),
                );
                let y_ref = relu_as_pytorch(
                    &workloads::kernels::add(xv.as_tensor(), zv.as_tensor(), false).unwrap(),
                    relu,
                );
                let g = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
                let (dx_ref, dz_ref) = (
                    g.get(xv.as_tensor()).unwrap().clone(),
                    g.get(zv.as_tensor()).unwrap().clone(),
                );
                let on = |t: &Tensor| Var::from_tensor(&t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
                let (xg, zg) = (on(&x), on(&z));
                let y = workloads::kernels::add(xg.as_tensor(), zg.as_tensor(), relu).unwrap();
                let rg = r.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
                let grads = (&y * &rg).unwrap().sum_all().unwrap().backward().unwrap();
                let (e, ex, ez) = (
                    rel_err(&y, &y_ref),
                    rel_err(grads.get(xg.as_tensor()).unwrap(), &dx_ref),
                    rel_err(grads.get(zg.as_tensor()).unwrap(), &dz_ref),
                );
                eprintln!("add relu {relu} {dtype:?}: y {e:.1e}, dx {ex:.1e}, dz {ez:.1e}");
                assert!(
                    e < tol && ex < tol && ez < tol,
                    "add relu {relu} {dtype:?}: y {e}, dx {ex}, dz {ez}"
                );
            }
        }
    }
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn bias_and_add_written_over_their_input_match_the_ops_that_make_a_new_tensor() {
    use workloads::kernels::{add, add_over, bias_act, bias_act_over, Act, BiasAxis};
    let gpu = gpu();
    // Planes of 35 (single elements, not words) and of 64 (16-byte words); a channel bias.
    for (shape, dtype) in [
        ([2, 8, 5, 7], DType::F32),
        ([2, 8, 8, 8], DType::F32),
        ([2, 8, 8, 8], DType::BF16),
    ] {
        let on_gpu = |seed: u64, dims: &[usize]| random(dims, seed).to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
        let (x, z, b) = (on_gpu(900, &shape), on_gpu(901, &shape), on_gpu(902, &[8]));
        for act in [Act::None, Act::Relu] {
            let want = host_values(&bias_act(&x, &b, BiasAxis::Channels, act).unwrap());
            // A copy of x of its own, and a second handle on its storage: written over, both read
            // the result.
            let fresh = x.copy().unwrap();
            let handle = fresh.clone();
            let got = bias_act_over(fresh, &b, BiasAxis::Channels, act).unwrap();
            assert_eq!(host_values(&got), want, "{shape:?} {dtype:?} {act:?}: bias over x");
            assert_eq!(
                host_values(&handle),
                want,
                "{shape:?} {dtype:?} {act:?}: the bias was not written over x"
            );
            let relu = act == Act::Relu;
            let want = host_values(&add(&x, &z, relu).unwrap());
            let fresh = x.copy().unwrap();
            let handle = fresh.clone();
            assert_eq!(
                host_values(&add_over(fresh, &z, relu).unwrap()),
                want,
                "{shape:?} {dtype:?} relu {relu}: add over x"
            );
            assert_eq!(
                host_values(&handle),
                want,
                "{shape:?} {dtype:?} relu {relu}: the sum was not written over x"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn layer_norm_kernel_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::layer_norm;
    // Swin's first stage (96), ViT/BERT (768), a row needing several elements per thread (3000),
    // and rows with a large mean (the statistics must not cancel it away).
    // Many rows (5000 of 96, 4500 of 768): more than one a warp in the parameters' sums.
    // Groups of 4, 8, 16 and 32 lanes a row (bf16 rows of 96, 192, 384, 768; f32 rows of 96 take 8),
    // a warp of eight words (1536), row counts that leave a warp's last groups without a row (13,
    // 1003, 77), a row of one word (8).
    for (i, (rows, cols)) in [
        (12usize, 96usize),
        (6, 768),
        (3, 3000),
        (5, 40),
        (5000, 96),
        (4500, 768),
        (13, 192),
        (1003, 384),
        (77, 1536),
        (1003, 8),
    ]
    .into_iter()
    .enumerate()
    {
        let x = random(&[rows, cols], 110 + i as u64);
        let x = if i == 3 { (x + 50.0).unwrap() } else { x };
        let w = random(&[cols], 120 + i as u64).affine(0.5, 1.0).unwrap();
        let b = random(&[cols], 130 + i as u64);
        // The bias and weight gradients sum over rows: bf16/f16 accumulate their rounding.
        matches_cpu(
            &format!("layer norm {rows}x{cols}"),
            &|a| layer_norm(a[0], a[1], a[2], 1e-5).unwrap(),
            &[x, w, b],
            [1e-4, 3e-2, 5e-3],
        );
    }
}

/// Batch norm in training, with and without ReLU, against the CPU (forward and every input's
/// gradient) over `shapes` ([n, c, h, w], or [n, h, w, c] when `channels_last`), random inputs from
/// `seed` on; the `shifted`-th input shifted by 30, so that a channel's mean dwarfs its spread.
fn batch_norm_matches_the_cpu(channels_last: bool, shapes: &[[usize; 4]], seed: u64, shifted: usize) {
    use workloads::kernels::batch_norm::{BatchNorm, BatchStats};
    let train = |relu: bool| {
        move |a: &[&Tensor]| {
            let stats = a[0].detach().apply_op1_no_bwd(&BatchStats { channels_last }).unwrap();
            let wb = Tensor::stack(&[a[1], a[2]], 0).unwrap();
            a[0].apply_op3(
                &wb,
                &stats,
                BatchNorm {
                    eps: 1e-5,
                    relu,
                    channels_last,
                },
            )
            .unwrap()
        }
    };
    let layout = if channels_last { "NHWC" } else { "NCHW" };
    for (i, &shape) in shapes.iter().enumerate() {
        let c = if channels_last { shape[3] } else { shape[1] };
        let x = random(&shape, seed + i as u64);
        let x = if i == shifted { (x + 30.0).unwrap() } else { x };
        let w = random(&[c], seed + 10 + i as u64).affine(0.5, 1.0).unwrap();
        let b = random(&[c], seed + 20 + i as u64);
        for relu in [false, true] {
            let f = train(relu);
            matches_cpu(
                &format!("batch norm {layout} {shape:?} relu {relu}"),
                &f,
                &[x.clone(), w.clone(), b.clone()],
                [1e-4, 3e-2, 5e-3],
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_kernels_match_the_cpu_forward_and_backward() {
    // ResNet's late stage (7x7 maps), a 1x1 map, and a channel whose mean dwarfs its spread.
    // The channel sums split images into chunks: one image each ([4, 8, 7, 7], [2, 4, 20, 20]),
    // two and a last of one ([9, 80, 4, 4]). Planes of 49, 6, 196 and 400 elements take words of 1,
    // 2, 4 and 8 bf16 elements (1, 2, 4, 4 in f32).
    let shapes = [
        [4usize, 8, 7, 7],
        [3, 16, 1, 1],
        [2, 4, 20, 20],
        [9, 80, 4, 4],
        [2, 6, 14, 14],
        [3, 5, 2, 3],
    ];
    batch_norm_matches_the_cpu(false, &shapes, 140, 2);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_over_nhwc_matches_the_cpu_forward_and_backward() {
    // [n, h, w, c]: ResNet's widths (words of 8 bf16 channels, lanes across 8 to 32 words and
    // several blocks of them for 2048), odd channel counts (single-element words), a channel whose
    // mean dwarfs its spread, more rows than one block's chunk, and a stem-sized map whose 392
    // chunks the finishing pass adds over lanes of unequal counts.
    let shapes = [
        [2usize, 7, 7, 64],
        [2, 3, 3, 2048],
        [3, 5, 2, 5],
        [2, 4, 4, 24],
        [4, 28, 28, 128],
        [1, 1, 1, 16],
        [4, 56, 56, 64],
    ];
    batch_norm_matches_the_cpu(true, &shapes, 170, 3);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn adamw_kernel_matches_the_cpu_over_three_steps() {
    use workloads::optim::{Optimizer, OptimizerKind};
    let gpu = gpu();
    let p0 = random(&[3000], 170);
    let grads: Vec<Tensor> = (0..3).map(|t| random(&[3000], 171 + t)).collect();
    let run = |device: &Device, dtype: DType| -> Tensor {
        let p = Var::from_tensor(&p0.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap();
        let mut opt = Optimizer::new(OptimizerKind::AdamW, vec![p.clone()], 1e-2, 0.01).unwrap();
        for g in &grads {
            // loss = sum(p · g): the gradient is g.
            let g = g.to_device(device).unwrap().to_dtype(dtype).unwrap();
            opt.backward_step(&(p.as_tensor() * g).unwrap().sum_all().unwrap(), None)
                .unwrap();
        }
        p.as_tensor().clone()
    };
    // The GPU computes in f32 and the CPU in f64, each rounding the parameter to its dtype after
    // every step: after three steps each element is within three units in the last place of the
    // parameter, plus f32's relative error on the update itself (three steps of at most lr = 1e-2:
    // 1e-6 absolute is ~30x that), which is what remains for parameters near 0.
    for (dtype, mantissa) in [(DType::F32, 23), (DType::BF16, 7), (DType::F16, 10)] {
        let (want, got) = (host_values(&run(&Device::Cpu, dtype)), host_values(&run(&gpu, dtype)));
        let start = host_values(&p0.to_dtype(dtype).unwrap());
        let moved = want.iter().zip(&start).filter(|(w, s)| w != s).count();
        let off = want
            .iter()
            .zip(&got)
            .filter(|(w, g)| (*w - *g).abs() > 3.0 * w.abs() * 2f32.powi(-mantissa) + 1e-6)
            .count();
        eprintln!(
            "adamw {dtype:?}: {moved} of {} elements moved, {off} differ by more than 3 ulp",
            want.len()
        );
        assert!(
            moved > want.len() / 2 && off == 0,
            "adamw {dtype:?}: {off} elements differ by more than 3 ulp"
        );
    }
}

/// Mixed-precision steps of parameters of `sizes` on the GPU against the CPU's f64 reference, for
/// AdamW and SGD in bf16 and f16: four steps, the second with a NaN in element `bad.1` of parameter
/// `bad.0`'s gradient (f16 only: the dynamic scale and its check are f16's). Every master within 4
/// f32 ulps of the CPU's, every working copy exactly its master rounded, the same step state.
fn masters_match_the_cpu(sizes: &[usize], bad: (usize, usize)) {
    use workloads::optim::{MixedOptimizer, Optimizer, OptimizerKind, ParamGrads};
    let gpu = gpu();
    let p0: Vec<Tensor> = sizes
        .iter()
        .enumerate()
        .map(|(i, &n)| random(&[n], 180 + i as u64))
        .collect();
    let grads: Vec<Vec<Tensor>> = (0..4)
        .map(|t| {
            sizes
                .iter()
                .enumerate()
                .map(|(i, &n)| random(&[n], 5000 + 97 * t + i as u64))
                .collect()
        })
        .collect();
    let run = |device: &Device, dtype: DType, kind: OptimizerKind| -> (Vec<Tensor>, Vec<Tensor>, String) {
        let params: Vec<Var> = p0
            .iter()
            .map(|p| Var::from_tensor(&p.to_device(device).unwrap().to_dtype(dtype).unwrap()).unwrap())
            .collect();
        let dynamic = dtype == DType::F16;
        let pairs = params
            .iter()
            .zip(&p0)
            .map(|(v, p)| (v.clone(), p.to_device(device).unwrap()))
            .collect();
        let mut opt = Optimizer::Mixed(MixedOptimizer::new(kind, pairs, 1e-2, 0.01, dynamic).unwrap());
        for (step, gs) in grads.iter().enumerate() {
            // loss = Σ sum(p · g) / 1000 in f32: each gradient is g · scale / 1000 in the dtype.
            let mut loss = Tensor::zeros((), DType::F32, device).unwrap();
            for (p, g) in params.iter().zip(gs) {
                let term = (p.as_tensor().to_dtype(DType::F32).unwrap() * g.to_device(device).unwrap())
                    .unwrap()
                    .sum_all()
                    .unwrap();
                loss = (loss + term).unwrap();
            }
            let loss = (loss * 1e-3).unwrap();
            let outside = ParamGrads::default();
            if step == 1 && dynamic {
                let mut nan = vec![0f32; sizes[bad.0]];
                nan[bad.1] = f32::NAN;
                let nan = Tensor::from_vec(nan, sizes[bad.0], &Device::Cpu).unwrap();
                outside.push(
                    params[bad.0].as_tensor(),
                    nan.to_device(device).unwrap().to_dtype(dtype).unwrap(),
                );
            }
            opt.backward_step(&loss, Some(&outside)).unwrap();
        }
        let Optimizer::Mixed(mixed) = &opt else { unreachable!() };
        let reading = format!("{:?}", opt.scale_reading().unwrap().unwrap());
        let copies = params.iter().map(|p| p.as_tensor().clone()).collect();
        (mixed.masters().unwrap(), copies, reading)
    };
    let flat = |ts: &[Tensor]| Tensor::cat(ts, 0).unwrap();
    for kind in [OptimizerKind::AdamW, OptimizerKind::Sgd { momentum: 0.9 }] {
        for dtype in [DType::BF16, DType::F16] {
            let (want_master, _, want_reading) = run(&Device::Cpu, dtype, kind);
            let (got_master, got_copy, got_reading) = run(&gpu, dtype, kind);
            // The CPU computes in f64 and the GPU in f32, both storing f32 masters: within a few f32
            // ulps of the master (1e-6 absolute for masters near 0).
            let (wm, gm) = (host_values(&flat(&want_master)), host_values(&flat(&got_master)));
            let off = wm
                .iter()
                .zip(&gm)
                .filter(|(w, g)| (*w - *g).abs() > 4.0 * w.abs() * f32::EPSILON + 1e-6)
                .count();
            let moved = wm.iter().zip(&host_values(&flat(&p0))).filter(|(w, s)| w != s).count();
            // The working copy is the device's own master rounded to the dtype, element for element.
            let rounded = host_values(&flat(&got_master).to_dtype(dtype).unwrap());
            let copies_off = host_values(&flat(&got_copy))
                .iter()
                .zip(&rounded)
                .filter(|(c, r)| c != r)
                .count();
            eprintln!(
                "masters of {} parameters {kind:?} {dtype:?}: {moved} of {} moved, {off} masters differ from the CPU's, {copies_off} copies from their masters; {got_reading}",
                sizes.len(),
                wm.len()
            );
            assert_eq!(want_reading, got_reading, "{kind:?} {dtype:?}");
            assert!(
                moved > wm.len() * 29 / 30 && off == 0 && copies_off == 0,
                "{kind:?} {dtype:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn master_weight_kernels_match_the_cpu_over_four_steps_with_one_skipped() {
    masters_match_the_cpu(&[3000], (0, 1234));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn master_weights_of_many_parameters_are_updated_in_groups_as_on_the_cpu() {
    // 200 parameters: more than one launch's group (96), of one element to several blocks' chunks
    // (4,096 elements a block), and the NaN in the third group.
    let sizes: Vec<usize> = (0..200)
        .map(|i| [1, 7, 64, 4096, 4097, 10_000, 3][i % 7] + i % 3)
        .collect();
    masters_match_the_cpu(&sizes, (197, 3));
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_op_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::{linear, Act};
    // ViT's tokens ([batch, tokens, features]) and plain rows, with each activation; the CPU takes
    // candle's matmul and broadcast add (with PyTorch's ReLU gradient at 0).
    for (i, (x_shape, out)) in [(&[2usize, 197, 64][..], 48usize), (&[6, 33], 40)]
        .into_iter()
        .enumerate()
    {
        let inp = *x_shape.last().unwrap();
        let x = random(x_shape, 180 + i as u64);
        // Pre-activations x wᵀ + b kept at least ~6 standard deviations of x wᵀ from 0, so that the
        // GPU's rounding of x wᵀ to bf16 before the bias cannot flip a ReLU against the f32 reference.
        let w = random(&[out, inp], 185 + i as u64).affine(0.02, 0.0).unwrap();
        let b: Vec<f32> = random(&[out], 190 + i as u64)
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .map(|v| v.signum() * (v.abs() + 1.0))
            .collect();
        let b = Tensor::from_vec(b, out, &Device::Cpu).unwrap();
        // A bias one element into its storage is not aligned for cuBLASLt's epilogue: the op adds it
        // with its own kernel instead.
        let offset_b = Tensor::cat(&[&Tensor::zeros(1, DType::F32, &Device::Cpu).unwrap(), &b], 0).unwrap();
        for (act, offset) in [
            (Act::None, 0),
            (Act::Relu, 0),
            (Act::GeluErf, 0),
            (Act::None, 1),
            (Act::Relu, 1),
        ] {
            let f = move |a: &[&Tensor]| {
                let b = a[2].narrow(0, offset, out).unwrap();
                if a[0].device().is_cpu() && act == Act::Relu {
                    relu_as_pytorch(&linear(a[0], a[1], Some(&b), Act::None).unwrap(), true)
                } else {
                    linear(a[0], a[1], Some(&b), act).unwrap()
                }
            };
            let b = if offset == 0 { b.clone() } else { offset_b.clone() };
            // The weight's and bias's gradients sum over up to 394 rows.
            matches_cpu(
                &format!("linear {x_shape:?} -> {out} {act:?}, bias at {offset}"),
                &f,
                &[x.clone(), w.clone(), b],
                [1e-5, 3e-2, 5e-3],
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_op_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::{attention, ScoreBias};
    // ViT's 197 tokens (padded to 200 on the GPU), 3 heads of 8.
    let qkv = random(&[2, 197, 72], 200);
    matches_cpu(
        "attention vit-like",
        &|a| attention(a[0], 3, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // Rows longer than the kernels keep in registers (300 keys, padded to 304).
    let qkv = random(&[1, 300, 24], 204);
    matches_cpu(
        "attention long rows",
        &|a| attention(a[0], 2, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // BERT: a key mask (-10000 on the last 3 keys of sequence 1), 12 tokens, 2 heads of 4.
    let mut mask = vec![0f32; 24];
    mask[21..].iter_mut().for_each(|m| *m = -10000.0);
    let mask = Tensor::from_vec(mask, (2, 12), &Device::Cpu).unwrap();
    let qkv = random(&[2, 12, 24], 201);
    let f = move |a: &[&Tensor]| {
        let m = mask.to_device(a[0].device()).unwrap().to_dtype(a[0].dtype()).unwrap();
        attention(a[0], 2, ScoreBias::Keys(&m)).unwrap()
    };
    matches_cpu("attention bert-like", &f, &[qkv], [1e-5, 3e-2, 5e-3]);
    // Swin: 8 windows of 49 tokens, a [4, heads, 49, 49] bias repeating every 4 windows, with its
    // gradient.
    let qkv = random(&[8, 49, 24], 202);
    let bias = random(&[4, 2, 49, 49], 203);
    matches_cpu(
        "attention swin-like",
        &|a| attention(a[0], 2, ScoreBias::Scores(a[1])).unwrap(),
        &[qkv, bias],
        [1e-5, 3e-2, 5e-3],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_memory_pool_keeps_freed_memory_across_synchronisations_until_released() {
    use workloads::memory::{pool_allocations, pooled_bytes};
    let gpu = gpu();
    pool_allocations(&gpu).unwrap();
    // What earlier tests in this process left pooled would serve the allocation below.
    workloads::memory::release_pooled(&gpu).unwrap();
    let before = pooled_bytes(&gpu).unwrap().expect("CUDA allocations come from a pool");
    // 256 MiB allocated, used, freed; then a synchronisation, where a pool with the default
    // threshold would hand the memory back.
    let x = Tensor::ones(64 << 20, DType::F32, &gpu).unwrap();
    assert_eq!(x.max_all().unwrap().to_scalar::<f32>().unwrap(), 1.0);
    drop(x);
    gpu.synchronize().unwrap();
    let after = pooled_bytes(&gpu).unwrap().unwrap();
    // Between runs the pool is trimmed: the 256 MiB go back.
    workloads::memory::release_pooled(&gpu).unwrap();
    let released = pooled_bytes(&gpu).unwrap().unwrap();
    eprintln!("pooled: {before} bytes before, {after} after, {released} once released");
    assert!(
        after >= before + (256 << 20),
        "the pool kept {after} bytes (had {before})"
    );
    assert!(
        released + (256 << 20) <= after,
        "releasing left {released} of {after} bytes"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn linear_with_a_residual_matches_the_cpu() {
    use workloads::kernels::linear_residual;
    let gpu = gpu();
    // ViT's tokens, 96 features in, 64 out; a bias at element 0 (the GEMM adds the residual) and at
    // element 1 (unaligned for the epilogue: linear, then our add).
    let (x, w, r) = (
        random(&[2, 197, 96], 300),
        random(&[64, 96], 301),
        random(&[2, 197, 64], 303),
    );
    let b_full = random(&[65], 302);
    for offset in [0, 1] {
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            // Inference (no graph): the reference from the same rounded inputs, in f32 on the CPU.
            let round = |t: &Tensor| t.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            let product = round(&x).broadcast_matmul(&round(&w).t().unwrap()).unwrap();
            let want = (product
                .broadcast_add(&round(&b_full).narrow(0, offset, 64).unwrap())
                .unwrap()
                + round(&r))
            .unwrap();
            let on = |t: &Tensor| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
            let b_gpu = on(&b_full).narrow(0, offset, 64).unwrap();
            let got = linear_residual(&on(&x), &on(&w), &b_gpu, &on(&r)).unwrap();
            let e = rel_err(&got, &want);
            eprintln!("linear + residual, bias at {offset}, {dtype:?}: {e:.1e}");
            assert!(
                e < tol,
                "linear + residual, bias at {offset}, {dtype:?}: differs by {e}"
            );
        }
        // Training records a graph: linear, then add, with every input's gradient.
        let f = move |a: &[&Tensor]| linear_residual(a[0], a[1], &a[2].narrow(0, offset, 64).unwrap(), a[3]).unwrap();
        matches_cpu(
            &format!("linear + residual with gradients, bias at {offset}"),
            &f,
            &[x.clone(), w.clone(), b_full.clone(), r.clone()],
            [1e-5, 3e-2, 5e-3],
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_attention_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::attention::runs_fused;
    let gpu = gpu();
    // The shapes below take a fused kernel in bf16 and f16, and in f32 but for heads of 128 (the
    // f32 kernel keeps a head in registers); heads of 8 compose in every dtype.
    for (shape, heads) in [([2usize, 197, 384], 2usize), ([1, 70, 384], 1), ([8, 49, 192], 2)] {
        let x = Tensor::zeros(&shape[..], DType::BF16, &gpu).unwrap();
        assert!(
            runs_fused(&x, heads).unwrap() && runs_fused(&x.to_dtype(DType::F16).unwrap(), heads).unwrap(),
            "{shape:?}"
        );
        assert_eq!(
            runs_fused(&x.to_dtype(DType::F32).unwrap(), heads).unwrap(),
            heads != 1,
            "{shape:?} f32"
        );
    }
    assert!(!runs_fused(&Tensor::zeros((2, 197, 72), DType::BF16, &gpu).unwrap(), 3).unwrap());
    assert!(!runs_fused(&Tensor::zeros((2, 197, 72), DType::F32, &gpu).unwrap(), 3).unwrap());
    // The kernel option `attention=composed` turns every fused launch off.
    {
        use workloads::kernels::{options::Attention, KernelOptions};
        let _composed = KernelOptions {
            attention: Attention::Composed,
            ..KernelOptions::default()
        }
        .enter();
        assert!(!runs_fused(&Tensor::zeros((2, 197, 384), DType::BF16, &gpu).unwrap(), 2).unwrap());
    }
    // The f32 kernels come in several sizes of block, each shape's first launch timing them: every
    // size is checked on its own (pinned: the pin, not a timing, picks the kernel), then the timed
    // choice, which the pinned launches left untimed.
    use workloads::kernels::attention::{fused_f32_queries, with_fused_f32_queries, FUSED_F32_QUERIES};
    let vit_like = Tensor::zeros((2, 197, 384), DType::F32, &gpu).unwrap();
    assert_eq!(
        fused_f32_queries(&vit_like, 2).unwrap(),
        None,
        "not timed before its first launch"
    );
    for q in FUSED_F32_QUERIES {
        let tag = format!("{q} queries a block");
        with_fused_f32_queries(q, || {
            assert_eq!(fused_f32_queries(&vit_like, 2).unwrap(), Some(q), "{tag}");
            fused_attention_cases(&tag)
        })
        .unwrap();
    }
    assert_eq!(
        fused_f32_queries(&vit_like, 2).unwrap(),
        None,
        "pinned launches time nothing"
    );
    fused_attention_cases("timed");
    let timed = fused_f32_queries(&vit_like, 2).unwrap();
    assert!(timed.is_some_and(|q| FUSED_F32_QUERIES.contains(&q)), "{timed:?}");
    // The pin refuses a size there is no kernel of.
    let refused = with_fused_f32_queries(48, || ()).unwrap_err().to_string();
    assert!(refused.contains("[128, 64, 32, 16]"), "{refused}");
}

/// The fused attention forward and backward against the CPU's, in f32, bf16 and f16, over shapes that
/// take the fused kernels: every bias mode, heads of 32 and 64, partial tiles, an offset projection.
fn fused_attention_cases(tag: &str) {
    use workloads::kernels::{attention, ScoreBias};
    // ViT-B-like: 197 tokens (four tiles of 64 keys, the last of 5), 2 heads of 64.
    let qkv = random(&[2, 197, 384], 210);
    matches_cpu(
        &format!("fused attention vit-like, {tag}"),
        &|a| attention(a[0], 2, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // One head of 128 (f32 composes) or two of 64 over 70 tokens, the projection starting 70·384
    // elements into its buffer.
    let qkv = random(&[2, 70, 384], 211);
    for heads in [1, 2] {
        let f = move |a: &[&Tensor]| attention(&a[0].narrow(0, 1, 1).unwrap(), heads, ScoreBias::None).unwrap();
        matches_cpu(
            &format!("fused attention d={} at an offset, {tag}", 128 / heads),
            &f,
            std::slice::from_ref(&qkv),
            [1e-5, 3e-2, 5e-3],
        );
    }
    // BERT-like: 128 tokens, a key mask (-10000 on the last 40 keys of sequence 1), 2 heads of 64.
    let mut mask = vec![0f32; 256];
    mask[216..].iter_mut().for_each(|m| *m = -10000.0);
    let mask = Tensor::from_vec(mask, (2, 128), &Device::Cpu).unwrap();
    let qkv = random(&[2, 128, 384], 212);
    let f = move |a: &[&Tensor]| {
        let m = mask.to_device(a[0].device()).unwrap().to_dtype(a[0].dtype()).unwrap();
        attention(a[0], 2, ScoreBias::Keys(&m)).unwrap()
    };
    matches_cpu(
        &format!("fused attention bert-like, {tag}"),
        &f,
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // Swin-T-like: 8 windows of 49 tokens, heads of 32, a bias repeating every 4 windows.
    let qkv = random(&[8, 49, 192], 213);
    let bias = random(&[4, 2, 49, 49], 214);
    matches_cpu(
        &format!("fused attention swin-like, {tag}"),
        &|a| attention(a[0], 2, ScoreBias::Scores(a[1])).unwrap(),
        &[qkv, bias],
        [1e-5, 3e-2, 5e-3],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn max_pool_kernel_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::max_pool2d;
    // ResNet's 3x3 stride-2 pool with padding 1, on even and odd sides. Values (37·i mod 101) - 50:
    // integers, exact in bf16 and f16, and distinct within every 3x3 window of these widths, so
    // that no window has a tie (PyTorch's first-maximum rule and candle's split gradient differ
    // there).
    for shape in [[2usize, 3, 8, 8], [2, 2, 7, 9], [1, 4, 112, 112]] {
        let n: usize = shape.iter().product();
        let x = Tensor::from_vec(
            (0..n).map(|i| ((i * 37 % 101) as f32) - 50.0).collect::<Vec<_>>(),
            &shape,
            &Device::Cpu,
        )
        .unwrap();
        matches_cpu(
            &format!("max pool {shape:?}"),
            &|a| max_pool2d(a[0], 3, 2, 1).unwrap(),
            &[x],
            [1e-6, 1e-2, 2e-3],
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn embedding_op_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::embedding;
    // 21 ids into a 50-row table, some repeated (their gradients add up in one row).
    let ids: Vec<u32> = (0..21u32).map(|i| (i * 17 + 3) % 50 % 13).collect();
    let ids = Tensor::from_vec(ids, (3, 7), &Device::Cpu).unwrap();
    let table = random(&[50, 16], 220);
    let f = move |a: &[&Tensor]| embedding(a[0], &ids.to_device(a[0].device()).unwrap()).unwrap();
    matches_cpu("embedding", &f, &[table], [1e-6, 1e-2, 2e-3]);
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swin_window_kernels_match_the_cpu_forward_and_backward() {
    use workloads::kernels::{window_merge, window_partition};
    // Swin-T's first stage (8x8 windows shown at 16x16, 96 channels: 16-byte words), a shift, and
    // 3 channels (12 bytes in f32, 6 in bf16/f16: narrower words).
    for (i, (side, window, shift, c)) in [(16usize, 8usize, 0usize, 96usize), (16, 8, 4, 96), (6, 3, 1, 3)]
        .into_iter()
        .enumerate()
    {
        let x = random(&[2, side, side, c], 260 + i as u64);
        let what = format!("windows {side}x{side} by {window} shift {shift} c {c}");
        // A permutation: exact forward; the gradients carry only the random weights' rounding to
        // the dtype (their f32 reference is not rounded).
        let tols = [1e-7, 4e-3, 1e-3];
        matches_cpu(
            &format!("{what} partition"),
            &|a| window_partition(a[0], window, shift).unwrap(),
            std::slice::from_ref(&x),
            tols,
        );
        let w = window_partition(&x, window, shift).unwrap();
        matches_cpu(
            &format!("{what} merge"),
            &|a| window_merge(a[0], side, window, shift).unwrap(),
            &[w],
            tols,
        );
    }
    // Patch merging's 2x2 gather (a strided copy and its scatter back), over even maps of 96 and 3
    // channels.
    for (i, shape) in [[2usize, 8, 8, 96], [1, 6, 4, 3]].into_iter().enumerate() {
        matches_cpu(
            &format!("patch merging gather {shape:?}"),
            &|a| workloads::kernels::merge_neighbours(a[0]).unwrap(),
            &[random(&shape, 265 + i as u64)],
            [1e-7, 4e-3, 1e-3],
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_statistics_move_the_running_ones_in_their_own_pass_as_the_cpu_does_in_two() {
    use workloads::kernels::batch_norm::{BatchStats, BatchStatsUpdating, Running, RunningUpdate};
    let gpu = gpu();
    // NCHW planes and NHWC rows (a stem-sized map: 392 chunks for the finishing pass), f32 and bf16.
    for (shape, channels_last, dtype) in [
        ([4usize, 6, 7, 7], false, DType::F32),
        ([2, 300, 3, 3], false, DType::BF16),
        ([4, 56, 56, 64], true, DType::BF16),
        ([3, 5, 2, 24], true, DType::F32),
    ] {
        let c = if channels_last { shape[3] } else { shape[1] };
        let n = shape.iter().product::<usize>() / c;
        let x = random(&shape, 270).to_dtype(dtype).unwrap();
        let (mean, var) = (random(&[c], 271), random(&[c], 272).abs().unwrap());
        let (keep, take_mean, take_var) = (0.9, 0.1, 0.1 * n as f64 / (n as f64 - 1.0));
        // The CPU: the statistics, then each running statistic's update.
        let stats_cpu = x.apply_op1_no_bwd(&BatchStats { channels_last }).unwrap();
        let (mean_cpu, var_cpu) = (mean.copy().unwrap(), var.copy().unwrap());
        mean_cpu
            .inplace_op2(
                &stats_cpu,
                &RunningUpdate {
                    row: 0,
                    keep,
                    take: take_mean,
                },
            )
            .unwrap();
        var_cpu
            .inplace_op2(
                &stats_cpu,
                &RunningUpdate {
                    row: 1,
                    keep,
                    take: take_var,
                },
            )
            .unwrap();
        // The GPU: one op, the running statistics updated in its finishing pass.
        let (mean_gpu, var_gpu) = (mean.to_device(&gpu).unwrap(), var.to_device(&gpu).unwrap());
        let op = BatchStatsUpdating {
            channels_last,
            running: Running {
                mean: mean_gpu.clone(),
                var: var_gpu.clone(),
                keep,
                take_mean,
                take_var,
            },
        };
        let stats_gpu = x.to_device(&gpu).unwrap().apply_op1_no_bwd(&op).unwrap();
        let what = format!("{shape:?} {dtype:?} channels last {channels_last}");
        for (name, got, want) in [
            ("statistics", &stats_gpu, &stats_cpu),
            ("running mean", &mean_gpu, &mean_cpu),
            ("running variance", &var_gpu, &var_cpu),
        ] {
            let e = rel_err(got, want);
            assert!(e < 1e-5, "{what}: the {name} differ from the CPU's by {e}");
        }
        assert!(
            rel_err(&mean_cpu, &mean) > 1e-2 && rel_err(&var_cpu, &var) > 1e-2,
            "{what}: the update changed nothing"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn batch_norm_with_its_weight_and_bias_apart_matches_the_op_over_them_stacked() {
    use workloads::kernels::batch_norm::{BatchNorm, BatchStats};
    let gpu = gpu();
    // Planes of NCHW and rows of NHWC; the weight and bias as two tensors and as rows of one (the
    // bias then starts c elements into its buffer).
    for (shape, channels_last) in [([4usize, 8, 7, 7], false), ([2, 6, 6, 64], true)] {
        let c = if channels_last { shape[3] } else { shape[1] };
        for dtype in [DType::F32, DType::BF16] {
            let on = |d: &Device, t: &Tensor| t.to_device(d).unwrap().to_dtype(dtype).unwrap();
            let x = random(&shape, 280);
            let w = random(&[c], 281).affine(0.5, 1.0).unwrap();
            let b = random(&[c], 282);
            let g = random(&shape, 283);
            let z = random(&shape, 284);
            // With a residual added before the ReLU (a block's last batch norm), forward only.
            for (relu, residual) in [(false, false), (true, false), (true, true)] {
                let op = BatchNorm {
                    eps: 1e-5,
                    relu,
                    channels_last,
                };
                let run = |d: &Device, stacked: bool| {
                    let (x, w, b, g, z) = (on(d, &x), on(d, &w), on(d, &b), on(d, &g), on(d, &z));
                    let stats = x.apply_op1_no_bwd(&BatchStats { channels_last }).unwrap();
                    let (w, b) = if stacked {
                        let wb = Tensor::stack(&[&w, &b], 0).unwrap();
                        (wb.get(0).unwrap(), wb.get(1).unwrap())
                    } else {
                        (w, b)
                    };
                    let y = op.forward_with(&x, &w, &b, &stats, residual.then_some(&z)).unwrap();
                    if residual {
                        return vec![y];
                    }
                    let (dx, dwb) = op.backward(&x, &w, &b, &stats, &y, &g).unwrap();
                    vec![y, dx, dwb]
                };
                let cpu = run(&Device::Cpu, false);
                for stacked in [false, true] {
                    let got = run(&gpu, stacked);
                    for (name, got, want) in ["output", "input gradient", "[dw; db]"]
                        .iter()
                        .zip(&got)
                        .zip(&cpu)
                        .map(|((n, a), b)| (n, a, b))
                    {
                        let e = rel_err(got, want);
                        let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 };
                        assert!(
                            e < tol,
                            "{shape:?} {dtype:?} relu {relu} residual {residual} stacked {stacked}: the {name} differs from the CPU's by {e}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_relu_gradient_of_two_branches_summed_in_one_pass_is_their_sum_where_the_output_is_positive() {
    use workloads::kernels::elementwise::relu_grad_of_sum;
    let gpu = gpu();
    // Words of 8 bf16 / 4 f32 elements, and a length that takes single elements.
    for (shape, dtype) in [
        (&[2usize, 4, 4, 16][..], DType::BF16),
        (&[3, 5, 7][..], DType::F32),
        (&[2, 3, 5][..], DType::BF16),
    ] {
        let (a, b, y) = (
            random(shape, 290),
            random(shape, 291),
            random(shape, 292).relu().unwrap(),
        );
        let want = ((&a + &b).unwrap() * y.gt(0.0).unwrap().to_dtype(DType::F32).unwrap()).unwrap();
        let on = |t: &Tensor| t.to_dtype(dtype).unwrap().to_device(&gpu).unwrap();
        let got = relu_grad_of_sum(&on(&a), &on(&b), &on(&y)).unwrap();
        let e = rel_err(&got, &want);
        let tol = if dtype == DType::F32 { 1e-6 } else { 1e-2 };
        assert!(e < tol, "{shape:?} {dtype:?}: differs from (a + b)·[y > 0] by {e}");
        // Exactly zero where the output is.
        let cut = got.to_dtype(DType::F32).unwrap().to_device(&Device::Cpu).unwrap();
        let kept = (cut * y.le(0.0).unwrap().to_dtype(DType::F32).unwrap()).unwrap();
        assert_eq!(kept.abs().unwrap().sum_all().unwrap().to_scalar::<f32>().unwrap(), 0.0);
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn encoder_layers_as_one_op_match_the_layers_built_of_ops() {
    use candle_nn::{VarBuilder, VarMap};
    use workloads::kernels::{attention, Act, ScoreBias};
    use workloads::models::encoder::{self, Norms, Params};
    use workloads::models::layers::{LayerNorm, Linear};
    use workloads::optim::ParamGrads;
    let gpu = gpu();
    // 37 tokens (a partial tile of keys and queries), 2 heads of 64 (the fused attention kernels),
    // an MLP twice as wide.
    let (b, t, c, heads) = (2usize, 37usize, 128usize, 2usize);
    for dtype in [DType::F32, DType::BF16] {
        let var = |shape: &[usize], seed: u64, scale: f64| {
            Var::from_tensor(
                &(random(shape, seed) * scale)
                    .unwrap()
                    .to_device(&gpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap()
        };
        let linear = |i: usize, o: usize, seed: u64| {
            Linear::new(
                var(&[o, i], seed, 1.0 / (i as f64).sqrt()).as_tensor().clone(),
                Some(var(&[o], seed + 1, 0.1).as_tensor().clone()),
            )
        };
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &gpu);
        let (norm1, norm2) = (
            LayerNorm::new(c, 1e-6, vb.pp("norm1")).unwrap(),
            LayerNorm::new(c, 1e-6, vb.pp("norm2")).unwrap(),
        );
        // Weights and biases away from 1 and 0, so that their gradients matter.
        for (i, v) in vm.all_vars().iter().enumerate() {
            v.set(
                &random(&[c], 500 + i as u64)
                    .affine(0.2, 1.0)
                    .unwrap()
                    .to_device(&gpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
        }
        let (q, k, v, packed) = (
            linear(c, c, 510),
            linear(c, c, 512),
            linear(c, c, 514),
            linear(c, 3 * c, 516),
        );
        let (out, fc1, fc2) = (linear(c, c, 518), linear(c, 2 * c, 520), linear(2 * c, c, 522));
        // BERT-like with a key mask (the last 5 keys of sequence 1), ViT-like without.
        let mut mask = vec![0f32; b * t];
        mask[2 * t - 5..].iter_mut().for_each(|m| *m = -10000.0);
        let mask = Tensor::from_vec(mask, (b, t), &Device::Cpu)
            .unwrap()
            .to_device(&gpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let r = random(&[b, t, c], 530)
            .to_device(&gpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // One layer, and the same layer twice in a row (each parameter's gradient then the sum of
        // its two uses, pushed by the op's backward pass once per layer).
        for (norms, depth) in [(Norms::Post, 1), (Norms::Pre, 1), (Norms::Post, 2), (Norms::Pre, 2)] {
            let (qkv, bias): (Vec<&Linear>, _) = match norms {
                Norms::Post => (vec![&q, &k, &v], ScoreBias::Keys(&mask)),
                Norms::Pre => (vec![&packed], ScoreBias::None),
            };
            let params = || Params {
                qkv: &qkv,
                out: &out,
                norm1: &norm1,
                fc1: &fc1,
                fc2: &fc2,
                norm2: &norm2,
            };
            let p = params();
            let x = var(&[b, t, c], 540, 1.0);
            assert!(
                encoder::runs_as_one_op(x.as_tensor(), std::slice::from_ref(&p)),
                "{norms:?} {dtype:?}: the fused path must run"
            );
            {
                use workloads::kernels::{options::EncoderLayers, KernelOptions};
                let _ops = KernelOptions {
                    layers: EncoderLayers::Composed,
                    ..KernelOptions::default()
                }
                .enter();
                assert!(
                    !encoder::runs_as_one_op(x.as_tensor(), std::slice::from_ref(&p)),
                    "layers=ops builds the layer of ops"
                );
            }
            // The same layer of our ops, as the models build it without the fused op.
            let composed = |x: &Tensor| -> Tensor {
                let qkv = Linear::packed(&qkv).unwrap();
                match norms {
                    Norms::Post => {
                        let ctx = attention(&qkv.forward_act(x, Act::None).unwrap(), heads, bias).unwrap();
                        let h = norm1.forward(&out.forward_residual(&ctx, x).unwrap()).unwrap();
                        let m = fc1.forward_act(&h, Act::GeluErf).unwrap();
                        norm2.forward(&fc2.forward_residual(&m, &h).unwrap()).unwrap()
                    }
                    Norms::Pre => {
                        let ctx = attention(
                            &qkv.forward_act(&norm1.forward(x).unwrap(), Act::None).unwrap(),
                            heads,
                            bias,
                        )
                        .unwrap();
                        let x1 = out.forward_residual(&ctx, x).unwrap();
                        let m = fc1.forward_act(&norm2.forward(&x1).unwrap(), Act::GeluErf).unwrap();
                        fc2.forward_residual(&m, &x1).unwrap()
                    }
                }
            };
            let mask_arg = match bias {
                ScoreBias::Keys(m) => Some(m),
                _ => None,
            };
            let recorded = ParamGrads::default();
            let layers: Vec<Params> = (0..depth).map(|_| params()).collect();
            let y = encoder::forward(x.as_tensor(), &layers, heads, norms, mask_arg, &recorded).unwrap();
            let mut grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            recorded.drain_into(&mut grads).unwrap();
            let y_ref = (0..depth).fold(x.as_tensor().clone(), |h, _| composed(&h));
            let grads_ref = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 } * depth as f32;
            let e = rel_err(&y, &y_ref);
            let mut tensors: Vec<(String, &Tensor)> = vec![("x".into(), x.as_tensor())];
            for (name, l) in qkv.iter().enumerate().map(|(i, l)| (format!("qkv{i}"), *l)).chain([
                ("out".into(), &out),
                ("fc1".into(), &fc1),
                ("fc2".into(), &fc2),
            ]) {
                tensors.push((format!("{name}.weight"), l.weight()));
                tensors.push((format!("{name}.bias"), l.bias().unwrap()));
            }
            for (name, n) in [("norm1", &norm1), ("norm2", &norm2)] {
                tensors.push((format!("{name}.weight"), n.weight()));
                tensors.push((format!("{name}.bias"), n.bias()));
            }
            // The key bias's gradient is zero in exact arithmetic (a constant added to every key
            // shifts a row's scores alike, and the softmax ignores it): both sides are rounding
            // noise, measured against the query bias's gradient.
            let largest = |t: &Tensor| {
                t.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let query_bias = largest(grads_ref.get(qkv[0].bias().unwrap()).unwrap());
            let errors: Vec<(String, f32)> = tensors
                .iter()
                .map(|(name, t)| {
                    let g = grads
                        .get(t)
                        .unwrap_or_else(|| panic!("{norms:?} {dtype:?}: no gradient for {name}"));
                    let want = grads_ref.get(t).unwrap();
                    let e = rel_err(g, want);
                    let e = if qkv.len() == 3 && name == "qkv1.bias" {
                        e * largest(want).max(1e-12) / query_bias
                    } else {
                        e
                    };
                    (name.clone(), e)
                })
                .collect();
            let worst = errors.iter().fold(0f32, |m, (_, e)| m.max(*e));
            eprintln!(
                "encoder layers {norms:?} x{depth} {dtype:?}: y {e:.1e}, worst of {} gradients {worst:.1e}",
                errors.len()
            );
            assert!(
                e < tol && worst < tol,
                "{norms:?} x{depth} {dtype:?}: y {e}, gradients {errors:?}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nhwc_convolutions_with_their_epilogue_match_candle_on_the_cpu() {
    use workloads::kernels::conv_nhwc;
    let gpu = gpu();
    let nhwc = |t: &Tensor| t.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
    // ResNet's shapes (the patch embeddings are not convolutions of ours in NHWC): the stem's three
    // channels too, which the NHWC engines take padded.
    for (i, &(xs, ws, pad, stride)) in CASES[..5].iter().enumerate() {
        let (x, w, b) = (
            random(&xs, 40 + i as u64),
            random(&ws, 50 + i as u64),
            random(&[ws[0]], 60 + i as u64),
        );
        let conv = x
            .conv2d(&w, pad, stride, 1, 1)
            .unwrap()
            .broadcast_add(&b.reshape((1, ws[0], 1, 1)).unwrap())
            .unwrap();
        let r = random(conv.dims(), 70 + i as u64);
        for (residual, relu) in [(false, false), (false, true), (true, true)] {
            let sum = if residual { (&conv + &r).unwrap() } else { conv.clone() };
            let want = if relu { sum.relu().unwrap() } else { sum };
            for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
                let on = |t: &Tensor| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
                let r = residual.then(|| on(&nhwc(&r)));
                let y = conv_nhwc(&on(&nhwc(&x)), &on(&nhwc(&w)), &on(&b), r.as_ref(), pad, stride, relu).unwrap();
                let y = y.permute((0, 3, 1, 2)).unwrap();
                assert_eq!(y.dims(), want.dims(), "case {i} {dtype:?}");
                let e = rel_err(&y, &want);
                eprintln!("NHWC case {i} {dtype:?} residual {residual} relu {relu}: {e:.1e}");
                assert!(
                    e < tol,
                    "NHWC case {i} {dtype:?} residual {residual} relu {relu}: differs by {e}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn max_pool_over_nhwc_matches_the_pool_over_nchw() {
    use workloads::kernels::max_pool::max_pool2d_nhwc;
    use workloads::kernels::max_pool2d;
    let gpu = gpu();
    // Channels taken one a thread (3, 2) and in words (24, 64: f32 words of 4, 16-bit ones of 8).
    let shapes = [[2usize, 3, 8, 8], [2, 2, 7, 9], [2, 24, 9, 7], [1, 64, 112, 112]];
    for (shape, dtype) in shapes
        .into_iter()
        .flat_map(|s| [DType::F32, DType::BF16].map(|d| (s, d)))
    {
        let x = random(&shape, 80).to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
        let r = random(max_pool2d(&x, 3, 2, 1).unwrap().dims(), 81);
        // Forward and the input's gradient (of sum(pool · r)), the NHWC one seen back as NCHW.
        let (want, want_dx) = with_grads(&|a| max_pool2d(a[0], 3, 2, 1).unwrap(), std::slice::from_ref(&x), &r);
        let nhwc = |a: &[&Tensor]| {
            max_pool2d_nhwc(&a[0].permute((0, 2, 3, 1)).unwrap(), 3, 2, 1)
                .unwrap()
                .permute((0, 3, 1, 2))
                .unwrap()
        };
        let (got, got_dx) = with_grads(&nhwc, std::slice::from_ref(&x), &r);
        assert_eq!(rel_err(&got, &want), 0.0, "max pool over NHWC {shape:?} {dtype:?}");
        assert_eq!(
            rel_err(&got_dx[0], &want_dx[0]),
            0.0,
            "max pool's backward over NHWC {shape:?} {dtype:?}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nhwc_training_convolutions_match_candle_on_the_cpu_forward_and_backward() {
    use workloads::kernels::conv_nhwc::conv_nhwc_train;
    let gpu = gpu();
    // ResNet's shapes, the stem's three channels (padded to 8 for the NHWC engines) included.
    for (i, &(xs, ws, pad, stride)) in CASES[..5].iter().enumerate() {
        let (x, w) = (random(&xs, 200 + i as u64), random(&ws, 210 + i as u64));
        let r = random(x.conv2d(&w, pad, stride, 1, 1).unwrap().dims(), 220 + i as u64);
        // The reference: candle's CPU convolution and its autograd, in f32, NCHW and KCRS.
        let (y_ref, g_ref) = with_grads(
            &|a| a[0].conv2d(a[1], pad, stride, 1, 1).unwrap(),
            &[x.clone(), w.clone()],
            &r,
        );
        // Ours over NHWC and KRSC, seen back as NCHW and KCRS (the permutes' gradients carry back).
        let nhwc = |a: &[&Tensor]| {
            let (x, w) = (a[0].permute((0, 2, 3, 1)).unwrap(), a[1].permute((0, 2, 3, 1)).unwrap());
            conv_nhwc_train(&x, &w, pad, stride)
                .unwrap()
                .permute((0, 3, 1, 2))
                .unwrap()
        };
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            let on: Vec<Tensor> = [&x, &w]
                .iter()
                .map(|t| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap())
                .collect();
            let (y, g) = with_grads(&nhwc, &on, &r);
            let (e, ex, ew) = (
                rel_err(&y, &y_ref),
                rel_err(&g[0], &g_ref[0]),
                rel_err(&g[1], &g_ref[1]),
            );
            eprintln!("NHWC training case {i} {dtype:?}: forward {e:.1e}, dx {ex:.1e}, dw {ew:.1e}");
            assert!(
                e < tol && ex < tol && ew < tol,
                "NHWC training case {i} {dtype:?}: forward {e}, dx {ex}, dw {ew}"
            );
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet_in_nhwc_gives_the_logits_of_resnet_in_nchw() {
    use workloads::kernels::options::{Convolutions, CudaGraphs};
    use workloads::kernels::KernelOptions;
    use workloads::{build, Mode, TrainConfig, WorkloadConfig};
    let gpu = gpu();
    workloads::memory::pool_allocations(&gpu).unwrap();
    // f32 runs NHWC only with TF32 allowed (then both layouts use it); half types always.
    for (name, batch) in [("resnet_tiny", 4), ("resnet50", 2)] {
        for (dtype, tf32, tol) in [
            (DType::F32, true, 1e-2f32),
            (DType::BF16, false, 3e-2),
            (DType::F16, false, 5e-3),
        ] {
            workloads::precision::allow_tf32(tf32);
            let workload = |convs| {
                // Without graphs, so that both run every step as launched.
                let kernels = KernelOptions {
                    convs,
                    graphs: CudaGraphs::Off,
                    ..KernelOptions::default()
                };
                let cfg = WorkloadConfig {
                    device: gpu.clone(),
                    dtype,
                    mode: Mode::Infer,
                    seed: 3,
                    seq_len: None,
                    weights: None,
                    train: TrainConfig::default(),
                    kernels,
                };
                build(name, &cfg).unwrap()
            };
            let (nchw, nhwc) = (workload(Convolutions::Nchw), workload(Convolutions::Nhwc));
            for seed in [1, 2] {
                let b = nchw.synthetic_batch(batch, seed).unwrap();
                let want = nchw.infer(&b).unwrap();
                let before = workloads::kernels::conv_nhwc::shapes_prepared();
                let got = nhwc.infer(&b).unwrap();
                // The NHWC path ran (a shape the NCHW workload never prepares), or this compares
                // NCHW with itself.
                assert!(
                    seed > 1 || workloads::kernels::conv_nhwc::shapes_prepared() > before,
                    "{name} {dtype:?}: no NHWC convolution ran"
                );
                let e = rel_err(&got, &want);
                eprintln!("{name} {dtype:?} batch {batch} seed {seed}: NHWC logits against NCHW {e:.1e}");
                assert!(e < tol, "{name} {dtype:?}: NHWC logits differ from NCHW by {e}");
            }
            workloads::precision::allow_tf32(false);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn a_frozen_resnet_holds_its_weights_once_and_infers_as_on_the_cpu() {
    use workloads::kernels::options::{Convolutions, CudaGraphs};
    use workloads::kernels::KernelOptions;
    use workloads::{build, Mode, TrainConfig, WorkloadConfig};
    let gpu = gpu();
    workloads::memory::pool_allocations(&gpu).unwrap();
    let cpu_logits = {
        let cfg = WorkloadConfig {
            device: Device::Cpu,
            dtype: DType::F32,
            mode: Mode::Infer,
            seed: 3,
            seq_len: None,
            weights: None,
            train: TrainConfig::default(),
            kernels: KernelOptions::default(),
        };
        let w = build("resnet50", &cfg).unwrap();
        let b = w.synthetic_batch(2, 1).unwrap();
        w.infer(&b).unwrap()
    };
    // f32 over NCHW (no TF32: the path f32 takes), bf16 over NHWC; without graphs, so that the pool
    // holds what the step left and nothing of a graph's.
    for (dtype, convs, tol) in [
        (DType::F32, Convolutions::Nchw, 1e-3f32),
        (DType::BF16, Convolutions::Nhwc, 1e-1),
    ] {
        workloads::memory::release_pooled(&gpu).unwrap();
        let kernels = KernelOptions {
            convs,
            graphs: CudaGraphs::Off,
            ..KernelOptions::default()
        };
        let cfg = WorkloadConfig {
            device: gpu.clone(),
            dtype,
            mode: Mode::Infer,
            seed: 3,
            seq_len: None,
            weights: None,
            train: TrainConfig::default(),
            kernels,
        };
        let w = build("resnet50", &cfg).unwrap();
        // Parameters and buffers as built (kept on the host), in their dtypes.
        let held: usize = w
            .tensors()
            .iter()
            .map(|(_, t)| t.elem_count() * t.dtype().size_in_bytes())
            .sum();
        assert!(
            w.tensors().iter().all(|(_, t)| t.device().is_cpu()),
            "a frozen model's tensors as built stay on the host"
        );
        let b = w.synthetic_batch(2, 1).unwrap();
        let logits = w.infer(&b).unwrap();
        let e = rel_err(&logits, &cpu_logits);
        let ledger = workloads::memory::ledger(&gpu)
            .unwrap()
            .expect("a pool on CUDA devices");
        // After the first step the pool holds the folded weights in place of the ones as built, the
        // batch and logits, cuBLASLt's 32 MiB workspace and cuDNN's shared one; the weights as built
        // beside the folded ones would be 45 (bf16) to 90 MiB (f32) more.
        let slack = 8 << 20;
        let bound = held
            + (32 << 20)
            + ledger.cudnn_workspaces as usize
            + b.inputs
                .tensors()
                .iter()
                .map(|t| t.elem_count() * t.dtype().size_in_bytes())
                .sum::<usize>()
            + slack;
        eprintln!("resnet50 {dtype:?} {convs:?}: logits against the CPU {e:.1e}; pool in use {} MiB, bound {} MiB (weights {} MiB)", ledger.pool_used >> 20, bound >> 20, held >> 20);
        assert!(e < tol, "resnet50 {dtype:?}: logits differ from the CPU's by {e}");
        assert!(
            (ledger.pool_used as usize) <= bound,
            "resnet50 {dtype:?}: {} bytes in use after a step, more than the weights once ({bound})",
            ledger.pool_used
        );
        drop(w);
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

#[test]
#[ignore = "needs a CUDA GPU"]
fn resnet_training_in_nhwc_and_blocks_as_one_op_move_the_model_as_training_of_ops_in_nchw() {
    use workloads::kernels::options::{Convolutions, CudaGraphs, EncoderLayers};
    use workloads::kernels::KernelOptions;
    let gpu = gpu();
    workloads::memory::pool_allocations(&gpu).unwrap();
    let step = |name: &str, batch: usize, dtype: DType, convs: Convolutions, layers: EncoderLayers, tf32: bool| {
        sgd_step(
            &gpu,
            name,
            batch,
            dtype,
            KernelOptions {
                convs,
                layers,
                graphs: CudaGraphs::Off,
                ..KernelOptions::default()
            },
            tf32,
        )
    };
    let filters =
        |n: &str| n.ends_with("weight") && (n.contains("conv") || n.contains("downsample.0") || n.starts_with("fc"));
    let running = |n: &str| n.contains("running");
    for (name, batch) in [("resnet_tiny", 4), ("resnet50", 2)] {
        // The block as one op against the same block built of ops (each op tested on its own against
        // the CPU above), in both layouts: the same kernels on the same inputs, so the same updates
        // but for the order of a few sums. NHWC runs f32 only with TF32; NCHW without.
        for (convs, tf32) in [(Convolutions::Nhwc, true), (Convolutions::Nchw, false)] {
            let before = workloads::kernels::conv_nhwc::shapes_prepared();
            let (loss_op, op) = step(name, batch, DType::F32, convs, EncoderLayers::Fused, tf32);
            if convs == Convolutions::Nhwc {
                assert!(
                    workloads::kernels::conv_nhwc::shapes_prepared() > before,
                    "{name}: no NHWC convolution ran"
                );
            }
            let (loss_ops, ops) = step(name, batch, DType::F32, convs, EncoderLayers::Composed, tf32);
            let (all, (w, w_name)) = (
                l2(&all_updates(&op), &all_updates(&ops)),
                worst_update(&op, &ops, &|_| true),
            );
            eprintln!("{name} f32 {convs:?} blocks as one op against their ops: loss {loss_op} / {loss_ops}; updates {all:.1e} overall, worst {w_name} {w:.1e}");
            assert!(
                loss_op == loss_ops && all < 1e-4 && w < 1e-3,
                "{name} {convs:?}: the block op moved {w_name} {w:.2e} away from its ops ({all:.2e} overall)"
            );
        }
        let (loss_op, op) = step(name, batch, DType::F32, Convolutions::Nhwc, EncoderLayers::Fused, true);
        // Against NCHW in f32 without TF32, built of ops (the path tested against the reference
        // implementations). TF32's rounding, carried back through a deep chain of batch norms, moves
        // the updates; how far, NCHW with TF32 allowed shows (where its algorithms take the tensor
        // cores). A wiring mistake (a filter's gradient transposed, a branch dropped) moves them by
        // their whole size, at any depth.
        let (loss_ref, exact) = step(
            name,
            batch,
            DType::F32,
            Convolutions::Nchw,
            EncoderLayers::Composed,
            false,
        );
        let (_, tf32) = step(
            name,
            batch,
            DType::F32,
            Convolutions::Nchw,
            EncoderLayers::Composed,
            true,
        );
        let (noise, (nf, nf_name)) = (
            l2(&all_updates(&tf32), &all_updates(&exact)),
            worst_update(&tf32, &exact, &filters),
        );
        let (all, (wf, wf_name), (wr, wr_name)) = (
            l2(&all_updates(&op), &all_updates(&exact)),
            worst_update(&op, &exact, &filters),
            worst_update(&op, &exact, &running),
        );
        eprintln!(
            "{name} f32 NHWC (TF32) against NCHW: loss {loss_op} / {loss_ref}; updates {all:.1e} overall, worst filter {wf_name} {wf:.1e}, worst running statistic {wr_name} {wr:.1e}; NCHW with TF32 allowed: {noise:.1e} overall, worst filter {nf_name} {nf:.1e}"
        );
        assert!(
            (loss_op - loss_ref).abs() <= 1e-3 * loss_ref.abs(),
            "{name}: NHWC loss {loss_op} against {loss_ref}"
        );
        let (bound, filter_bound) = ((3.0 * noise).max(0.1), (3.0 * nf).max(0.2));
        assert!(all < bound && wf < filter_bound && wr < 3e-2, "{name}: NHWC updates {all:.2e} (bound {bound:.1e}), {wf_name} {wf:.2e} (bound {filter_bound:.1e}), {wr_name} {wr:.2e}");
        // bf16: the losses of the two layouts' steps.
        let (bf_nchw, _) = step(
            name,
            batch,
            DType::BF16,
            Convolutions::Nchw,
            EncoderLayers::Fused,
            false,
        );
        let (bf_nhwc, _) = step(
            name,
            batch,
            DType::BF16,
            Convolutions::Nhwc,
            EncoderLayers::Fused,
            false,
        );
        eprintln!("{name} bf16: loss NHWC {bf_nhwc}, NCHW {bf_nchw}");
        assert!(
            (bf_nhwc - bf_nchw).abs() <= 2e-2 * bf_nchw.abs(),
            "{name} bf16: NHWC loss {bf_nhwc} against NCHW {bf_nchw}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn swin_training_with_blocks_as_one_op_moves_the_model_as_blocks_of_ops() {
    use workloads::kernels::options::{CudaGraphs, EncoderLayers};
    use workloads::kernels::KernelOptions;
    use workloads::models::swin::blocks_run_as_one_op;
    let gpu = gpu();
    workloads::memory::pool_allocations(&gpu).unwrap();
    let step = |name: &str, batch: usize, dtype: DType, layers: EncoderLayers| {
        sgd_step(
            &gpu,
            name,
            batch,
            dtype,
            KernelOptions {
                layers,
                graphs: CudaGraphs::Off,
                ..KernelOptions::default()
            },
            false,
        )
    };
    // Each op of a block is tested on its own against the CPU above; the block as one op runs the
    // same kernels in window order (the layer norms, linear layers and GELU work token by token),
    // so the same updates but for a few roundings: the attention's output projection adds the
    // residual in its GEMM's epilogue rather than after the merge. A wiring mistake (a window
    // merged with the wrong shift, the table's gradient transposed, a branch dropped) moves a
    // tensor's update by its whole size. Swin-T's blocks shift on 56, 28 and 14 maps; its last
    // stage is one window (no shift); swin_tiny's shift on 16 and 8.
    for (name, batch, blocks) in [("swin_tiny", 4, 4), ("swin_t", 2, 12)] {
        let before = blocks_run_as_one_op();
        let (loss_op, op) = step(name, batch, DType::F32, EncoderLayers::Fused);
        assert_eq!(
            blocks_run_as_one_op() - before,
            blocks,
            "{name}: every block runs as one op"
        );
        let (loss_ops, ops) = step(name, batch, DType::F32, EncoderLayers::Composed);
        assert_eq!(
            blocks_run_as_one_op() - before,
            blocks,
            "{name}: layers=ops builds the blocks of ops"
        );
        let (all, (w, w_name)) = (
            l2(&all_updates(&op), &all_updates(&ops)),
            worst_update(&op, &ops, &|_| true),
        );
        let (t, t_name) = worst_update(&op, &ops, &|n| n.ends_with("relative_position_bias_table"));
        eprintln!("{name} f32 blocks as one op against their ops: loss {loss_op} / {loss_ops}; updates {all:.1e} overall, worst {w_name} {w:.1e}, worst table {t_name} {t:.1e}");
        assert!(
            (loss_op - loss_ops).abs() <= 1e-5 * loss_ops.abs(),
            "{name}: loss {loss_op} against {loss_ops}"
        );
        assert!(
            all < 1e-4 && w < 1e-3,
            "{name}: the block op moved {w_name} {w:.2e} away from its ops ({all:.2e} overall)"
        );
        // bf16: the losses, and how far each path's updates are from f32's. bf16 parameters round
        // each update to their ulp, so the two bf16 paths' updates are some way apart; the block
        // as one op must land as close to f32's updates as the blocks of ops do.
        let before = blocks_run_as_one_op();
        let (bf_op, bf_op_updates) = step(name, batch, DType::BF16, EncoderLayers::Fused);
        let (bf_ops, bf_ops_updates) = step(name, batch, DType::BF16, EncoderLayers::Composed);
        assert_eq!(
            blocks_run_as_one_op() - before,
            blocks,
            "{name} bf16: every block of the op step runs as one op, none of the ops step"
        );
        // Over every parameter, and over the relative position bias tables alone (the table's
        // gradient is the op's own code; the large weights would drown an error in it). bf16
        // tables (about 0.02) round most of a first step's update away, so both paths land about
        // as far as the updates themselves from f32's (measured 1.0 and 0.99): this half catches
        // only gross errors; the f32 half above bounds each table's update.
        let tables = |u: &[(String, Tensor)]| {
            u.iter()
                .filter(|(n, _)| n.ends_with("relative_position_bias_table"))
                .cloned()
                .collect::<Vec<_>>()
        };
        for (what, keep) in [("every parameter", false), ("the bias tables", true)] {
            let pick = |u: &[(String, Tensor)]| all_updates(&if keep { tables(u) } else { u.to_vec() });
            let f32_updates = pick(&ops);
            let (from_op, from_ops) = (
                l2(&pick(&bf_op_updates), &f32_updates),
                l2(&pick(&bf_ops_updates), &f32_updates),
            );
            let apart = l2(&pick(&bf_op_updates), &pick(&bf_ops_updates));
            eprintln!("{name} bf16 blocks as one op against their ops, {what}: loss {bf_op} / {bf_ops}; updates {apart:.1e} apart, from f32's {from_op:.1e} / {from_ops:.1e}");
            assert!(
                from_op <= 1.25 * from_ops + 1e-3,
                "{name} bf16, {what}: the block op's updates are {from_op:.2e} from f32's, its ops' {from_ops:.2e}"
            );
        }
        assert!(
            (bf_op - bf_ops).abs() <= 1e-2 * bf_ops.abs(),
            "{name} bf16: loss {bf_op} against {bf_ops}"
        );
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn cross_entropy_kernel_matches_the_cpu_loss_and_gradient() {
    use workloads::kernels::cross_entropy;
    let gpu = gpu();
    // BERT's two classes, an odd width, ImageNet's 1000 at a training batch, and more rows than the
    // forward's 32 warps (a warp takes several).
    for (i, (n, k)) in [(5usize, 2usize), (7, 37), (32, 1000), (100, 1000)]
        .into_iter()
        .enumerate()
    {
        let logits = (random(&[n, k], 300 + i as u64) * 3.0).unwrap();
        let labels: Vec<u32> = (0..n as u32).map(|r| (r * 7 + 3) % k as u32).collect();
        let labels = Tensor::from_vec(labels, n, &Device::Cpu).unwrap();
        let on_gpu = labels.to_device(&gpu).unwrap();
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 1e-5), (DType::F16, 1e-5)] {
            // The reference takes the logits rounded to the dtype: what is left is f32's rounding.
            let rounded = logits.to_dtype(dtype).unwrap().to_dtype(DType::F32).unwrap();
            // The loss scaled by 3 on the way back: the kernel must read its upstream gradient.
            let loss_of = |x: &Tensor, labels: &Tensor| {
                let v = Var::from_tensor(x).unwrap();
                let loss = cross_entropy(v.as_tensor(), labels).unwrap();
                let g = (&loss * 3.0)
                    .unwrap()
                    .backward()
                    .unwrap()
                    .get(v.as_tensor())
                    .expect("a gradient")
                    .clone();
                (loss, g)
            };
            let (want, want_dx) = loss_of(&rounded, &labels);
            let (got, got_dx) = loss_of(&logits.to_device(&gpu).unwrap().to_dtype(dtype).unwrap(), &on_gpu);
            assert_eq!(
                (got.dtype(), got.dims()),
                (DType::F32, &[][..]),
                "the loss is an f32 scalar"
            );
            assert_eq!(got_dx.dtype(), dtype, "the gradient is in the logits' dtype");
            // The gradient is rounded once to the dtype: its tolerance is the dtype's.
            let dx_tol = match dtype {
                DType::F32 => 1e-5,
                DType::BF16 => 8e-3,
                _ => 1e-3,
            };
            let (e, ex) = (rel_err(&got, &want), rel_err(&got_dx, &want_dx));
            eprintln!("cross-entropy [{n}, {k}] {dtype:?}: loss {e:.1e}, dx {ex:.1e}");
            assert!(
                e < tol && ex < dx_tol,
                "cross-entropy [{n}, {k}] {dtype:?}: loss {e}, dx {ex}"
            );
        }
    }
    // A label past the classes makes the loss and its row's gradient NaN rather than read another
    // row or look like a row without a target.
    let logits = Var::from_tensor(&random(&[3, 4], 310).to_device(&gpu).unwrap()).unwrap();
    let labels = Tensor::new(&[0u32, 4, 1], &gpu).unwrap();
    let loss = cross_entropy(logits.as_tensor(), &labels).unwrap();
    assert!(loss.to_scalar::<f32>().unwrap().is_nan());
    let dx = loss
        .backward()
        .unwrap()
        .get(logits.as_tensor())
        .unwrap()
        .to_vec2::<f32>()
        .unwrap();
    assert!(
        dx[1].iter().all(|v| v.is_nan()) && dx[0].iter().chain(&dx[2]).all(|v| v.is_finite()),
        "{dx:?}"
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn position_kernels_match_the_cpu_forward_and_backward() {
    use workloads::kernels::{channels_first, channels_last, first_position, mean_over_positions};
    // ResNet-50's last stage (7x7 positions), Swin-T's, and a small odd shape.
    for (i, shape) in [[2usize, 49, 2048], [2, 49, 768], [3, 5, 7]].into_iter().enumerate() {
        let x = random(&shape, 320 + i as u64);
        // The mean adds p values in f32 and rounds once; the first position is a copy.
        matches_cpu(
            &format!("mean over positions {shape:?}"),
            &|a| mean_over_positions(a[0]).unwrap(),
            std::slice::from_ref(&x),
            [1e-6, 8e-3, 2e-3],
        );
        matches_cpu(
            &format!("first position {shape:?}"),
            &|a| first_position(a[0]).unwrap(),
            std::slice::from_ref(&x),
            [1e-7, 4e-3, 1e-3],
        );
    }
    let gpu = gpu();
    // Images (128 of them: more elements than the grid's 65,536 blocks of 256 threads cover at
    // once), a 3x3 filter (KCRS to KRSC), a 1x1 one (a view: no kernel) and an odd shape; then back.
    for shape in [[128usize, 3, 224, 224], [64, 32, 3, 3], [64, 32, 1, 1], [1, 5, 3, 7]] {
        let x = random(&shape, 330);
        let want = x.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
        for dtype in [DType::F32, DType::BF16, DType::F16] {
            let on_gpu = x.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
            let got = channels_last(&on_gpu).unwrap();
            assert_eq!(got.dims(), want.dims());
            // A permutation: exact, up to the input's rounding to the dtype.
            assert_eq!(
                rel_err(&got, &want.to_dtype(dtype).unwrap()),
                0.0,
                "channels last {shape:?} {dtype:?}"
            );
            let back = channels_first(&got).unwrap();
            assert_eq!(
                (back.dims(), rel_err(&back, &on_gpu)),
                (&shape[..], 0.0),
                "channels first {shape:?} {dtype:?}"
            );
        }
    }
}
