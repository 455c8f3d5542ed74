//! Our forward passes against candle-transformers' independent ResNet, ViT and BERT, built from the
//! very same tensors: the same logits (or sequence output) within 1e-4. An inference oracle only:
//! candle-transformers' models are not trainable as they stand.

use std::collections::HashMap;

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::VarBuilder;
use candle_transformers::models as reference;
use workloads::init::Rng;
use workloads::{build, Batch, Inputs, Mode, TrainConfig, WorkloadConfig};

fn config() -> WorkloadConfig {
    WorkloadConfig {
        device: Device::Cpu,
        dtype: DType::F32,
        mode: Mode::Infer,
        seed: 7,
        seq_len: None,
        weights: None,
        train: TrainConfig::default(),
        kernels: Default::default(),
    }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> Result<f32> {
    (a - b)?.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()
}

fn images(n: usize, side: usize) -> Result<Tensor> {
    Tensor::from_vec(
        Rng::new(11).normal_vec(n * 3 * side * side, 0.0, 1.0),
        (n, 3, side, side),
        &Device::Cpu,
    )
}

fn batch_of(x: Tensor) -> Result<Batch> {
    let n = x.dim(0)?;
    Ok(Batch {
        size: n,
        inputs: Inputs::Images(x),
        labels: Tensor::zeros(n, DType::U32, &Device::Cpu)?,
    })
}

#[test]
fn resnet18_and_resnet50_match_candle_transformers() -> Result<()> {
    // Non-trivial running statistics, so that eval-mode batch norm is really exercised.
    for name in ["resnet18", "resnet50"] {
        let w = build(name, &config())?;
        let mut tensors: HashMap<String, Tensor> = w.tensors().into_iter().collect();
        let mut rng = Rng::new(3);
        for (n, t) in tensors.iter_mut() {
            if n.ends_with("running_mean") || n.ends_with("running_var") {
                let shift = if n.ends_with("running_var") { 1.0 } else { 0.0 };
                let v: Vec<f32> = rng
                    .uniform_vec(t.elem_count(), 0.0, 0.5)
                    .iter()
                    .map(|x| x + shift)
                    .collect();
                *t = Tensor::from_vec(v, t.shape(), &Device::Cpu)?;
            }
        }
        let ours_vb = VarBuilder::from_tensors(tensors.clone(), DType::F32, &Device::Cpu);
        let cfg = if name == "resnet18" {
            workloads::models::resnet::Config::resnet18()
        } else {
            workloads::models::resnet::Config::resnet50()
        };
        let ours = workloads::models::resnet::ResNet::new(&cfg, ours_vb)?;
        let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
        let theirs = if name == "resnet18" {
            reference::resnet::resnet18(1000, vb)?
        } else {
            reference::resnet::resnet50(1000, vb)?
        };
        let x = images(2, 64)?;
        use workloads::models::Classifier;
        let a = ours.forward(&Inputs::Images(x.clone()), false)?;
        let b = theirs.forward(&x)?;
        let d = max_abs_diff(&a, &b)?;
        assert!(d < 1e-4, "{name}: logits differ by {d}");
    }
    Ok(())
}

/// torchvision's ViT names mapped to Hugging Face's, with the packed attention projection split.
fn vit_as_hugging_face(ours: Vec<(String, Tensor)>, layers: usize, d: usize) -> Result<HashMap<String, Tensor>> {
    let ours: HashMap<String, Tensor> = ours.into_iter().collect();
    let mut hf = HashMap::new();
    let mut put = |k: &str, t: &Tensor| hf.insert(k.to_string(), t.clone());
    put(
        "vit.embeddings.patch_embeddings.projection.weight",
        &ours["conv_proj.weight"],
    );
    put(
        "vit.embeddings.patch_embeddings.projection.bias",
        &ours["conv_proj.bias"],
    );
    put("vit.embeddings.cls_token", &ours["class_token"]);
    put("vit.embeddings.position_embeddings", &ours["encoder.pos_embedding"]);
    put("vit.layernorm.weight", &ours["encoder.ln.weight"]);
    put("vit.layernorm.bias", &ours["encoder.ln.bias"]);
    put("classifier.weight", &ours["heads.head.weight"]);
    put("classifier.bias", &ours["heads.head.bias"]);
    for i in 0..layers {
        let (o, h) = (
            format!("encoder.layers.encoder_layer_{i}"),
            format!("vit.encoder.layer.{i}"),
        );
        for (from, to) in [
            ("ln_1", "layernorm_before"),
            ("ln_2", "layernorm_after"),
            ("self_attention.out_proj", "attention.output.dense"),
            ("mlp.0", "intermediate.dense"),
            ("mlp.3", "output.dense"),
        ] {
            put(&format!("{h}.{to}.weight"), &ours[&format!("{o}.{from}.weight")]);
            put(&format!("{h}.{to}.bias"), &ours[&format!("{o}.{from}.bias")]);
        }
        let (w, b) = (
            &ours[&format!("{o}.self_attention.in_proj_weight")],
            &ours[&format!("{o}.self_attention.in_proj_bias")],
        );
        for (k, part) in ["query", "key", "value"].iter().enumerate() {
            put(
                &format!("{h}.attention.attention.{part}.weight"),
                &w.narrow(0, k * d, d)?,
            );
            put(&format!("{h}.attention.attention.{part}.bias"), &b.narrow(0, k * d, d)?);
        }
    }
    Ok(hf)
}

#[test]
fn vit_matches_candle_transformers() -> Result<()> {
    let w = build("vit_tiny", &config())?;
    let cfg = workloads::models::vit::Config::tiny();
    let hf = vit_as_hugging_face(w.tensors(), cfg.layers, cfg.hidden)?;
    let ref_cfg = reference::vit::Config {
        hidden_size: cfg.hidden,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        intermediate_size: cfg.mlp_dim,
        hidden_act: candle_nn::Activation::Gelu,
        layer_norm_eps: 1e-6,
        image_size: cfg.image_size,
        patch_size: cfg.patch_size,
        num_channels: 3,
        qkv_bias: true,
    };
    let theirs = reference::vit::Model::new(
        &ref_cfg,
        cfg.num_classes,
        VarBuilder::from_tensors(hf, DType::F32, &Device::Cpu),
    )?;
    let x = images(3, cfg.image_size)?;
    let d = max_abs_diff(&w.infer(&batch_of(x.clone())?)?, &theirs.forward(&x)?)?;
    assert!(d < 1e-4, "logits differ by {d}");
    Ok(())
}

#[test]
fn bert_matches_candle_transformers_with_a_padding_mask() -> Result<()> {
    let w = build("bert_tiny", &config())?;
    let tensors: HashMap<String, Tensor> = w.tensors().into_iter().collect();
    let cfg = workloads::models::bert::Config::tiny();
    let ours = workloads::models::bert::Bert::new(
        &cfg,
        VarBuilder::from_tensors(tensors.clone(), DType::F32, &Device::Cpu),
    )?;
    let ref_cfg = reference::bert::Config {
        vocab_size: cfg.vocab_size,
        hidden_size: cfg.hidden,
        num_hidden_layers: cfg.layers,
        num_attention_heads: cfg.heads,
        intermediate_size: cfg.intermediate,
        max_position_embeddings: cfg.max_position,
        type_vocab_size: cfg.type_vocab_size,
        layer_norm_eps: 1e-12,
        ..Default::default()
    };
    let theirs =
        reference::bert::BertModel::load(VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu), &ref_cfg)?;
    let batch = w.synthetic_batch(2, 5)?;
    let Inputs::Tokens {
        input_ids,
        token_type_ids,
        ..
    } = &batch.inputs
    else {
        panic!("tokens")
    };
    // The second sequence is padded after 10 tokens; only unpadded positions are compared, since
    // the two models' outputs at padded positions are both meaningless.
    let mask = Tensor::new(
        &[
            [1f32; 16],
            [[1f32; 10].as_slice(), &[0f32; 6]].concat().try_into().unwrap(),
        ],
        &Device::Cpu,
    )?;
    let a = ours.encode(input_ids, token_type_ids, &mask)?;
    let b = theirs.forward(input_ids, token_type_ids, Some(&mask))?;
    let d = max_abs_diff(&a.get(0)?, &b.get(0)?)?.max(max_abs_diff(
        &a.get(1)?.narrow(0, 0, 10)?,
        &b.get(1)?.narrow(0, 0, 10)?,
    )?);
    assert!(d < 1e-4, "sequence outputs differ by {d}");
    Ok(())
}
