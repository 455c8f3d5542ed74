//! Layer norm against the CPU.

use super::*;

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
