//! Bias, add and ReLU: each against the CPU, written over its input, and two ReLU branches' gradients in one pass.

use super::*;

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
