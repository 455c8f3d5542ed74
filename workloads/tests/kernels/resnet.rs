//! ResNet over NHWC, frozen, and in training with blocks as one op.

use super::*;

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
