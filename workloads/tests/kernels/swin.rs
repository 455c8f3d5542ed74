//! Swin's window kernels, and its training with blocks as one op.

use super::*;

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
