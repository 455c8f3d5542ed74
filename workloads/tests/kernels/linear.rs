//! Linear layers: the op against the CPU, with a residual, and off TF32 unless allowed.

use super::*;

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
