//! AdamW and the master-weight updates against the CPU.

use super::*;

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
