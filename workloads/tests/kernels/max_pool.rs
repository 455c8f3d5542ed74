//! Max pooling over NCHW and NHWC.

use super::*;

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
