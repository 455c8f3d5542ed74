//! Embeddings and positions against the CPU.

use super::*;

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
