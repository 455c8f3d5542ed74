//! The cross-entropy kernel's loss and gradient.

use super::*;

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
