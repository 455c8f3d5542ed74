//! Convolutions: cuDNN's against candle's on the CPU, TF32 only where allowed, NHWC with its epilogue and in training.

use super::*;

/// (x shape, filter shape, padding, stride): ResNet's stem, 3x3 and strided 3x3, 1x1 and strided 1x1
/// projection, and the ViT/Swin patch embeddings.
const CASES: &[([usize; 4], [usize; 4], usize, usize)] = &[
    ([2, 3, 32, 32], [8, 3, 7, 7], 3, 2),
    ([2, 8, 16, 16], [8, 8, 3, 3], 1, 1),
    ([2, 8, 16, 16], [16, 8, 3, 3], 1, 2),
    ([2, 16, 8, 8], [32, 16, 1, 1], 0, 1),
    ([2, 16, 8, 8], [32, 16, 1, 1], 0, 2),
    ([2, 3, 32, 32], [24, 3, 16, 16], 0, 16),
    ([2, 3, 32, 32], [12, 3, 4, 4], 0, 4),
];

#[test]
#[ignore = "needs a CUDA GPU"]
fn cudnn_conv2d_matches_candle_on_the_cpu_forward_and_backward() {
    let gpu = gpu();
    for (i, &(xs, ws, pad, stride)) in CASES.iter().enumerate() {
        let x = random(&xs, 10 + i as u64);
        let w = random(&ws, 20 + i as u64);
        // The reference: candle's CPU convolution and its autograd, in f32.
        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let y_ref = xv.as_tensor().conv2d(wv.as_tensor(), pad, stride, 1, 1).unwrap();
        let r = random(y_ref.dims(), 30 + i as u64);
        let g = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
        let (dx_ref, dw_ref) = (
            g.get(xv.as_tensor()).unwrap().clone(),
            g.get(wv.as_tensor()).unwrap().clone(),
        );

        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            let on = |t: &Tensor| Var::from_tensor(&t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap()).unwrap();
            let (xg, wg) = (on(&x), on(&w));
            let y = workloads::kernels::conv2d(xg.as_tensor(), wg.as_tensor(), pad, stride).unwrap();
            assert_eq!(y.dims(), y_ref.dims(), "case {i} {dtype:?}");
            let e = rel_err(&y, &y_ref);
            assert!(e < tol, "case {i} {dtype:?}: forward differs by {e}");
            let rg = r.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
            let grads = (&y * &rg).unwrap().sum_all().unwrap().backward().unwrap();
            let dx = grads.get(xg.as_tensor()).expect("a gradient for the input");
            let dw = grads.get(wg.as_tensor()).expect("a gradient for the filter");
            let (ex, ew) = (rel_err(dx, &dx_ref), rel_err(dw, &dw_ref));
            assert!(
                ex < tol && ew < tol,
                "case {i} {dtype:?}: dx differs by {ex}, dw by {ew}"
            );
            eprintln!("case {i} {dtype:?}: forward {e:.1e}, dx {ex:.1e}, dw {ew:.1e}");
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn f32_convolutions_stay_off_tf32_unless_allowed_and_stay_close_when_allowed() {
    let gpu = gpu();
    // Long reductions (c * k * k = 1152 terms) make TF32's 10-bit inputs visible: ~1e-3 relative,
    // against ~1e-6 for f32.
    let x = random(&[4, 128, 16, 16], 1);
    let w = random(&[64, 128, 3, 3], 2);
    let reference = x.conv2d(&w, 1, 1, 1, 1).unwrap();
    let run = || workloads::kernels::conv2d(&x.to_device(&gpu).unwrap(), &w.to_device(&gpu).unwrap(), 1, 1).unwrap();
    let tf32 = strict_then_tf32("conv", &run, &reference);
    // Allowed is not required: cuDNN takes the fastest algorithm, which may still be an FMA one.
    assert!(tf32 < 1e-2, "f32 with TF32 allowed differs by {tf32}");
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nhwc_convolutions_with_their_epilogue_match_candle_on_the_cpu() {
    use workloads::kernels::conv_nhwc;
    let gpu = gpu();
    let nhwc = |t: &Tensor| t.permute((0, 2, 3, 1)).unwrap().contiguous().unwrap();
    // ResNet's shapes (the patch embeddings are not convolutions of ours in NHWC): the stem's three
    // channels too, which the NHWC engines take padded.
    for (i, &(xs, ws, pad, stride)) in CASES[..5].iter().enumerate() {
        let (x, w, b) = (
            random(&xs, 40 + i as u64),
            random(&ws, 50 + i as u64),
            random(&[ws[0]], 60 + i as u64),
        );
        let conv = x
            .conv2d(&w, pad, stride, 1, 1)
            .unwrap()
            .broadcast_add(&b.reshape((1, ws[0], 1, 1)).unwrap())
            .unwrap();
        let r = random(conv.dims(), 70 + i as u64);
        for (residual, relu) in [(false, false), (false, true), (true, true)] {
            let sum = if residual { (&conv + &r).unwrap() } else { conv.clone() };
            let want = if relu { sum.relu().unwrap() } else { sum };
            for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
                let on = |t: &Tensor| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap();
                let r = residual.then(|| on(&nhwc(&r)));
                let y = conv_nhwc(&on(&nhwc(&x)), &on(&nhwc(&w)), &on(&b), r.as_ref(), pad, stride, relu).unwrap();
                let y = y.permute((0, 3, 1, 2)).unwrap();
                assert_eq!(y.dims(), want.dims(), "case {i} {dtype:?}");
                let e = rel_err(&y, &want);
                eprintln!("NHWC case {i} {dtype:?} residual {residual} relu {relu}: {e:.1e}");
                assert!(
                    e < tol,
                    "NHWC case {i} {dtype:?} residual {residual} relu {relu}: differs by {e}"
                );
            }
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn nhwc_training_convolutions_match_candle_on_the_cpu_forward_and_backward() {
    use workloads::kernels::conv_nhwc::conv_nhwc_train;
    let gpu = gpu();
    // ResNet's shapes, the stem's three channels (padded to 8 for the NHWC engines) included.
    for (i, &(xs, ws, pad, stride)) in CASES[..5].iter().enumerate() {
        let (x, w) = (random(&xs, 200 + i as u64), random(&ws, 210 + i as u64));
        let r = random(x.conv2d(&w, pad, stride, 1, 1).unwrap().dims(), 220 + i as u64);
        // The reference: candle's CPU convolution and its autograd, in f32, NCHW and KCRS.
        let (y_ref, g_ref) = with_grads(
            &|a| a[0].conv2d(a[1], pad, stride, 1, 1).unwrap(),
            &[x.clone(), w.clone()],
            &r,
        );
        // Ours over NHWC and KRSC, seen back as NCHW and KCRS (the permutes' gradients carry back).
        let nhwc = |a: &[&Tensor]| {
            let (x, w) = (a[0].permute((0, 2, 3, 1)).unwrap(), a[1].permute((0, 2, 3, 1)).unwrap());
            conv_nhwc_train(&x, &w, pad, stride)
                .unwrap()
                .permute((0, 3, 1, 2))
                .unwrap()
        };
        for (dtype, tol) in [(DType::F32, 1e-5f32), (DType::BF16, 2e-2), (DType::F16, 5e-3)] {
            let on: Vec<Tensor> = [&x, &w]
                .iter()
                .map(|t| t.to_device(&gpu).unwrap().to_dtype(dtype).unwrap())
                .collect();
            let (y, g) = with_grads(&nhwc, &on, &r);
            let (e, ex, ew) = (
                rel_err(&y, &y_ref),
                rel_err(&g[0], &g_ref[0]),
                rel_err(&g[1], &g_ref[1]),
            );
            eprintln!("NHWC training case {i} {dtype:?}: forward {e:.1e}, dx {ex:.1e}, dw {ew:.1e}");
            assert!(
                e < tol && ex < tol && ew < tol,
                "NHWC training case {i} {dtype:?}: forward {e}, dx {ex}, dw {ew}"
            );
        }
    }
}
