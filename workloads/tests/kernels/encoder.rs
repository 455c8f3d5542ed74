//! Encoder layers as one op against the layers built of ops.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn encoder_layers_as_one_op_match_the_layers_built_of_ops() {
    use candle_nn::{VarBuilder, VarMap};
    use workloads::kernels::{attention, Act, ScoreBias};
    use workloads::models::encoder::{self, Norms, Params};
    use workloads::models::layers::{LayerNorm, Linear};
    use workloads::optim::ParamGrads;
    let gpu = gpu();
    // 37 tokens (a partial tile of keys and queries), 2 heads of 64 (the fused attention kernels),
    // an MLP twice as wide.
    let (b, t, c, heads) = (2usize, 37usize, 128usize, 2usize);
    for dtype in [DType::F32, DType::BF16] {
        let var = |shape: &[usize], seed: u64, scale: f64| {
            Var::from_tensor(
                &(random(shape, seed) * scale)
                    .unwrap()
                    .to_device(&gpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap()
        };
        let linear = |i: usize, o: usize, seed: u64| {
            Linear::new(
                var(&[o, i], seed, 1.0 / (i as f64).sqrt()).as_tensor().clone(),
                Some(var(&[o], seed + 1, 0.1).as_tensor().clone()),
            )
        };
        let vm = VarMap::new();
        let vb = VarBuilder::from_varmap(&vm, dtype, &gpu);
        let (norm1, norm2) = (
            LayerNorm::new(c, 1e-6, vb.pp("norm1")).unwrap(),
            LayerNorm::new(c, 1e-6, vb.pp("norm2")).unwrap(),
        );
        // Weights and biases away from 1 and 0, so that their gradients matter.
        for (i, v) in vm.all_vars().iter().enumerate() {
            v.set(
                &random(&[c], 500 + i as u64)
                    .affine(0.2, 1.0)
                    .unwrap()
                    .to_device(&gpu)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap(),
            )
            .unwrap();
        }
        let (q, k, v, packed) = (
            linear(c, c, 510),
            linear(c, c, 512),
            linear(c, c, 514),
            linear(c, 3 * c, 516),
        );
        let (out, fc1, fc2) = (linear(c, c, 518), linear(c, 2 * c, 520), linear(2 * c, c, 522));
        // BERT-like with a key mask (the last 5 keys of sequence 1), ViT-like without.
        let mut mask = vec![0f32; b * t];
        mask[2 * t - 5..].iter_mut().for_each(|m| *m = -10000.0);
        let mask = Tensor::from_vec(mask, (b, t), &Device::Cpu)
            .unwrap()
            .to_device(&gpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        let r = random(&[b, t, c], 530)
            .to_device(&gpu)
            .unwrap()
            .to_dtype(dtype)
            .unwrap();
        // One layer, and the same layer twice in a row (each parameter's gradient then the sum of
        // its two uses, pushed by the op's backward pass once per layer).
        for (norms, depth) in [(Norms::Post, 1), (Norms::Pre, 1), (Norms::Post, 2), (Norms::Pre, 2)] {
            let (qkv, bias): (Vec<&Linear>, _) = match norms {
                Norms::Post => (vec![&q, &k, &v], ScoreBias::Keys(&mask)),
                Norms::Pre => (vec![&packed], ScoreBias::None),
            };
            let params = || Params {
                qkv: &qkv,
                out: &out,
                norm1: &norm1,
                fc1: &fc1,
                fc2: &fc2,
                norm2: &norm2,
            };
            let p = params();
            let x = var(&[b, t, c], 540, 1.0);
            assert!(
                encoder::runs_as_one_op(x.as_tensor(), std::slice::from_ref(&p)),
                "{norms:?} {dtype:?}: the fused path must run"
            );
            {
                use workloads::kernels::{options::EncoderLayers, KernelOptions};
                let _ops = KernelOptions {
                    layers: EncoderLayers::Composed,
                    ..KernelOptions::default()
                }
                .enter();
                assert!(
                    !encoder::runs_as_one_op(x.as_tensor(), std::slice::from_ref(&p)),
                    "layers=ops builds the layer of ops"
                );
            }
            // The same layer of our ops, as the models build it without the fused op.
            let composed = |x: &Tensor| -> Tensor {
                let qkv = Linear::packed(&qkv).unwrap();
                match norms {
                    Norms::Post => {
                        let ctx = attention(&qkv.forward_act(x, Act::None).unwrap(), heads, bias).unwrap();
                        let h = norm1.forward(&out.forward_residual(&ctx, x).unwrap()).unwrap();
                        let m = fc1.forward_act(&h, Act::GeluErf).unwrap();
                        norm2.forward(&fc2.forward_residual(&m, &h).unwrap()).unwrap()
                    }
                    Norms::Pre => {
                        let ctx = attention(
                            &qkv.forward_act(&norm1.forward(x).unwrap(), Act::None).unwrap(),
                            heads,
                            bias,
                        )
                        .unwrap();
                        let x1 = out.forward_residual(&ctx, x).unwrap();
                        let m = fc1.forward_act(&norm2.forward(&x1).unwrap(), Act::GeluErf).unwrap();
                        fc2.forward_residual(&m, &x1).unwrap()
                    }
                }
            };
            let mask_arg = match bias {
                ScoreBias::Keys(m) => Some(m),
                _ => None,
            };
            let recorded = ParamGrads::default();
            let layers: Vec<Params> = (0..depth).map(|_| params()).collect();
            let y = encoder::forward(x.as_tensor(), &layers, heads, norms, mask_arg, &recorded).unwrap();
            let mut grads = (&y * &r).unwrap().sum_all().unwrap().backward().unwrap();
            recorded.drain_into(&mut grads).unwrap();
            let y_ref = (0..depth).fold(x.as_tensor().clone(), |h, _| composed(&h));
            let grads_ref = (&y_ref * &r).unwrap().sum_all().unwrap().backward().unwrap();
            let tol = if dtype == DType::F32 { 1e-4 } else { 3e-2 } * depth as f32;
            let e = rel_err(&y, &y_ref);
            let mut tensors: Vec<(String, &Tensor)> = vec![("x".into(), x.as_tensor())];
            for (name, l) in qkv.iter().enumerate().map(|(i, l)| (format!("qkv{i}"), *l)).chain([
                ("out".into(), &out),
                ("fc1".into(), &fc1),
                ("fc2".into(), &fc2),
            ]) {
                tensors.push((format!("{name}.weight"), l.weight()));
                tensors.push((format!("{name}.bias"), l.bias().unwrap()));
            }
            for (name, n) in [("norm1", &norm1), ("norm2", &norm2)] {
                tensors.push((format!("{name}.weight"), n.weight()));
                tensors.push((format!("{name}.bias"), n.bias()));
            }
            // The key bias's gradient is zero in exact arithmetic (a constant added to every key
            // shifts a row's scores alike, and the softmax ignores it): both sides are rounding
            // noise, measured against the query bias's gradient.
            let largest = |t: &Tensor| {
                t.abs()
                    .unwrap()
                    .max_all()
                    .unwrap()
                    .to_dtype(DType::F32)
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
            };
            let query_bias = largest(grads_ref.get(qkv[0].bias().unwrap()).unwrap());
            let errors: Vec<(String, f32)> = tensors
                .iter()
                .map(|(name, t)| {
                    let g = grads
                        .get(t)
                        .unwrap_or_else(|| panic!("{norms:?} {dtype:?}: no gradient for {name}"));
                    let want = grads_ref.get(t).unwrap();
                    let e = rel_err(g, want);
                    let e = if qkv.len() == 3 && name == "qkv1.bias" {
                        e * largest(want).max(1e-12) / query_bias
                    } else {
                        e
                    };
                    (name.clone(), e)
                })
                .collect();
            let worst = errors.iter().fold(0f32, |m, (_, e)| m.max(*e));
            eprintln!(
                "encoder layers {norms:?} x{depth} {dtype:?}: y {e:.1e}, worst of {} gradients {worst:.1e}",
                errors.len()
            );
            assert!(
                e < tol && worst < tol,
                "{norms:?} x{depth} {dtype:?}: y {e}, gradients {errors:?}"
            );
        }
    }
}
