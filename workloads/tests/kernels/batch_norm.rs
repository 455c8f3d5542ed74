//! Batch norm: over NCHW and NHWC, its running statistics, its weight and bias apart.

use super::*;

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
