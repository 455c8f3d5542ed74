//! Training and inference behaviour of the workloads on CPU, with the tiny presets.

use candle_core::{DType, Device, Result, Tensor};
use workloads::{build, is_buffer, lookup, Mode, TrainConfig, Workload, WorkloadConfig};

fn config(mode: Mode, train: TrainConfig) -> WorkloadConfig {
    WorkloadConfig {
        device: Device::Cpu,
        dtype: DType::F32,
        mode,
        seed: 42,
        seq_len: None,
        weights: None,
        train,
        kernels: Default::default(),
    }
}

fn values(t: &Tensor) -> Result<Vec<f32>> {
    t.flatten_all()?.to_dtype(DType::F32)?.to_vec1()
}

fn trainable(w: &dyn Workload) -> Vec<(String, Tensor)> {
    w.tensors().into_iter().filter(|(n, _)| !is_buffer(n)).collect()
}

/// The test-size preset of every family that trains (language models generate).
fn tiny_presets() -> Vec<&'static str> {
    workloads::model_names()
        .into_iter()
        .filter(|n| workloads::lookup(n).is_ok_and(|(_, m)| m.tiny && !m.family.is_decoder()))
        .collect()
}

#[test]
fn every_family_has_a_tiny_preset() {
    assert_eq!(
        tiny_presets(),
        vec!["resnet_tiny", "vit_tiny", "swin_tiny", "bert_tiny"]
    );
}

#[test]
fn one_step_changes_every_parameter() -> Result<()> {
    for name in tiny_presets() {
        // No weight decay: a parameter then moves only if its gradient is non-zero.
        let mut w = build(
            name,
            &config(
                Mode::Train,
                TrainConfig {
                    lr: 1e-3,
                    weight_decay: 0.0,
                    ..TrainConfig::adamw()
                },
            ),
        )?;
        let batch = w.synthetic_batch(4, 1)?;
        let before: Vec<(String, Vec<f32>)> = trainable(w.as_ref())
            .iter()
            .map(|(n, t)| Ok((n.clone(), values(t)?)))
            .collect::<Result<_>>()?;
        assert!(
            before.len() > 10,
            "{name}: expected every weight tensor, got {}",
            before.len()
        );
        w.train_step(&batch)?;
        let after = trainable(w.as_ref());
        assert_eq!(before.len(), after.len());
        for ((name2, old), (_, new)) in before.iter().zip(&after) {
            let new = values(new)?;
            let moved = old.iter().zip(&new).filter(|(a, b)| a != b).count();
            assert!(
                moved > 0,
                "{name}: {name2} did not change after one step (zero gradient?)"
            );
        }
    }
    Ok(())
}

#[test]
fn loss_on_a_fixed_batch_falls_by_half() -> Result<()> {
    for name in tiny_presets() {
        let mut w = build(
            name,
            &config(
                Mode::Train,
                TrainConfig {
                    lr: 1e-2,
                    weight_decay: 0.0,
                    ..TrainConfig::adamw()
                },
            ),
        )?;
        let batch = w.synthetic_batch(8, 3)?;
        let first = w.train_step(&batch)?.to_scalar::<f32>()?;
        let mut last = first;
        for _ in 0..30 {
            last = w.train_step(&batch)?.to_scalar::<f32>()?;
            if last < first / 2.0 {
                break;
            }
        }
        assert!(
            last < first / 2.0,
            "{name}: loss went from {first} to {last} in 30 steps"
        );
    }
    Ok(())
}

#[test]
fn sgd_with_momentum_trains_every_parameter_and_lowers_the_loss() -> Result<()> {
    let mut w = build(
        "resnet_tiny",
        &config(
            Mode::Train,
            TrainConfig {
                lr: 0.05,
                ..TrainConfig::sgd()
            },
        ),
    )?;
    let batch = w.synthetic_batch(8, 3)?;
    let before: Vec<Vec<f32>> = trainable(w.as_ref())
        .iter()
        .map(|(_, t)| values(t))
        .collect::<Result<_>>()?;
    let first = w.train_step(&batch)?.to_scalar::<f32>()?;
    for ((name, t), old) in trainable(w.as_ref()).iter().zip(&before) {
        assert_ne!(&values(t)?, old, "{name} did not change");
    }
    let mut last = first;
    for _ in 0..30 {
        last = w.train_step(&batch)?.to_scalar::<f32>()?;
    }
    assert!(last < first / 2.0, "loss {first} -> {last}");
    Ok(())
}

#[test]
fn batch_norm_running_statistics_update_only_when_training() -> Result<()> {
    let mut w = build("resnet_tiny", &config(Mode::Train, TrainConfig::default()))?;
    let batch = w.synthetic_batch(4, 1)?;
    let mean = |w: &dyn Workload| -> Result<Vec<f32>> {
        let t = w
            .tensors()
            .into_iter()
            .find(|(n, _)| n == "bn1.running_mean")
            .expect("bn1.running_mean")
            .1;
        values(&t)
    };
    let m0 = mean(w.as_ref())?;
    w.infer(&batch)?;
    assert_eq!(mean(w.as_ref())?, m0, "inference must not touch running statistics");
    w.train_step(&batch)?;
    assert_ne!(mean(w.as_ref())?, m0, "training must update running statistics");
    Ok(())
}

#[test]
fn inference_builds_no_gradient_graph_and_has_the_right_shape() -> Result<()> {
    for name in tiny_presets() {
        let w = build(name, &config(Mode::Infer, TrainConfig::default()))?;
        let batch = w.synthetic_batch(3, 1)?;
        let logits = w.infer(&batch)?;
        assert_eq!(logits.dims(), &[3, w.info().num_classes], "{name}");
        assert!(!logits.track_op(), "{name}: inference logits carry a gradient graph");
    }
    Ok(())
}

#[test]
fn half_precision_training_runs_on_cpu_where_candle_has_kernels() -> Result<()> {
    // candle's CPU matmul has f16 kernels (not bf16); batch norm keeps f32 statistics.
    for name in tiny_presets() {
        let mut cfg = config(Mode::Train, TrainConfig::default());
        cfg.dtype = DType::F16;
        let mut w = build(name, &cfg)?;
        let batch = w.synthetic_batch(4, 1)?;
        let loss = w.train_step(&batch)?.to_scalar::<f32>()?;
        assert!(loss.is_finite() && loss > 0.0, "{name}: loss {loss}");
    }
    Ok(())
}

#[test]
fn training_an_inference_workload_is_a_clear_error() -> Result<()> {
    let mut w = build("resnet_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let batch = w.synthetic_batch(2, 1)?;
    let err = w.train_step(&batch).unwrap_err().to_string();
    assert!(err.contains("built for inference"), "{err}");
    Ok(())
}

#[test]
fn same_seed_same_weights_and_logits() -> Result<()> {
    let a = build("resnet_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let b = build("resnet_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let batch = a.synthetic_batch(2, 9)?;
    assert_eq!(values(&a.infer(&batch)?)?, values(&b.infer(&batch)?)?);
    Ok(())
}

#[test]
fn built_models_hold_exactly_the_counted_parameters() -> Result<()> {
    for name in [
        "resnet_tiny",
        "resnet18",
        "resnet50",
        "vit_tiny",
        "vit_b_16",
        "swin_tiny",
        "swin_t",
        "bert_tiny",
        "bert_base",
    ] {
        let w = build(name, &config(Mode::Infer, TrainConfig::default()))?;
        let (_, info) = lookup(name).unwrap();
        let held: u64 = trainable(w.as_ref()).iter().map(|(_, t)| t.elem_count() as u64).sum();
        assert_eq!(held, info.params, "{name}");
    }
    Ok(())
}

#[test]
fn torchvision_resnet_parameter_names() -> Result<()> {
    let w = build("resnet50", &config(Mode::Infer, TrainConfig::default()))?;
    let names: Vec<String> = w.tensors().into_iter().map(|(n, _)| n).collect();
    for want in [
        "conv1.weight",
        "bn1.running_var",
        "layer1.0.conv3.weight",
        "layer1.0.downsample.0.weight",
        "layer1.0.downsample.1.bias",
        "layer4.2.bn3.weight",
        "fc.weight",
        "fc.bias",
    ] {
        assert!(names.iter().any(|n| n == want), "missing {want}");
    }
    assert!(!names.iter().any(|n| n.starts_with("layer1.1.downsample")));
    Ok(())
}

#[test]
fn torchvision_vit_parameter_names() -> Result<()> {
    let w = build("vit_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let names: Vec<String> = w.tensors().into_iter().map(|(n, _)| n).collect();
    let want = [
        "class_token",
        "conv_proj.bias",
        "conv_proj.weight",
        "encoder.layers.encoder_layer_1.self_attention.in_proj_weight",
        "encoder.layers.encoder_layer_1.self_attention.out_proj.bias",
        "encoder.layers.encoder_layer_0.mlp.3.weight",
        "encoder.layers.encoder_layer_0.ln_2.bias",
        "encoder.ln.weight",
        "encoder.pos_embedding",
        "heads.head.weight",
    ];
    for n in want {
        assert!(names.iter().any(|x| x == n), "missing {n} in {names:?}");
    }
    Ok(())
}

#[test]
fn hugging_face_bert_parameter_names() -> Result<()> {
    let w = build("bert_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let names: Vec<String> = w.tensors().into_iter().map(|(n, _)| n).collect();
    for n in [
        "embeddings.word_embeddings.weight",
        "embeddings.position_embeddings.weight",
        "embeddings.token_type_embeddings.weight",
        "embeddings.LayerNorm.weight",
        "encoder.layer.1.attention.self.query.weight",
        "encoder.layer.1.attention.self.value.bias",
        "encoder.layer.0.attention.output.dense.weight",
        "encoder.layer.0.attention.output.LayerNorm.bias",
        "encoder.layer.0.intermediate.dense.weight",
        "encoder.layer.0.output.dense.bias",
        "encoder.layer.0.output.LayerNorm.weight",
        "pooler.dense.weight",
        "classifier.weight",
    ] {
        assert!(names.iter().any(|x| x == n), "missing {n} in {names:?}");
    }
    Ok(())
}

#[test]
fn sequence_length_changes_inputs_and_flops_and_is_checked() -> Result<()> {
    let (_, at16) = workloads::lookup("bert_tiny").unwrap();
    let (_, at32) = workloads::lookup_with("bert_tiny", Some(32)).unwrap();
    assert_eq!(at16.input.seq_len(), Some(16));
    assert_eq!(at32.input.seq_len(), Some(32));
    assert!(at32.flops_per_sample > 2 * at16.flops_per_sample - at16.flops_per_sample / 4);
    let mut cfg = config(Mode::Infer, TrainConfig::default());
    cfg.seq_len = Some(32);
    let w = build("bert_tiny", &cfg)?;
    let batch = w.synthetic_batch(2, 0)?;
    let workloads::Inputs::Tokens {
        input_ids,
        token_type_ids,
        ..
    } = &batch.inputs
    else {
        panic!("tokens")
    };
    assert_eq!(input_ids.dims(), &[2, 32]);
    assert_eq!(
        token_type_ids.get(0)?.to_vec1::<u32>()?,
        [vec![0u32; 16], vec![1u32; 16]].concat()
    );
    let too_long = workloads::lookup_with("bert_tiny", Some(65)).unwrap_err().to_string();
    assert!(too_long.contains("1 to 64"), "{too_long}");
    let image = workloads::lookup_with("resnet18", Some(128)).unwrap_err().to_string();
    assert!(image.contains("token models"), "{image}");
    Ok(())
}

#[test]
fn unknown_model_names_the_valid_ones() {
    let err = lookup("resnet19").unwrap_err().to_string();
    assert!(
        err.contains("resnet19") && err.contains("resnet18") && err.contains("resnet152"),
        "{err}"
    );
}

fn save(tensors: Vec<(String, Tensor)>, path: &std::path::Path) -> Result<()> {
    let map: std::collections::HashMap<String, Tensor> = tensors.into_iter().collect();
    candle_core::safetensors::save(&map, path)
}

#[test]
fn weights_load_from_safetensors_in_place_of_the_seed() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    for name in ["resnet_tiny", "swin_tiny", "bert_tiny"] {
        let source = build(name, &config(Mode::Infer, TrainConfig::default()))?; // seed 42
        let file = dir.path().join(format!("{name}.safetensors"));
        save(source.tensors(), &file)?;
        for mode in [Mode::Infer, Mode::Train] {
            let mut cfg = config(mode, TrainConfig::default());
            cfg.seed = 1;
            let seeded = build(name, &cfg)?;
            cfg.weights = Some(file.clone());
            let loaded = build(name, &cfg)?;
            let batch = source.synthetic_batch(2, 0)?;
            let want = values(&source.infer(&batch)?)?;
            let got = values(&loaded.infer(&batch)?)?;
            if mode == Mode::Infer {
                assert_eq!(got, want, "{name} {mode:?}: loaded weights give the source's logits");
            } else {
                // Trainable weights take the unfolded batch-norm and unfused kernels: equal to rounding.
                let close = got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| (a - b).abs() <= 1e-5 * (1.0 + b.abs()));
                assert!(
                    close,
                    "{name} {mode:?}: loaded weights give the source's logits: {got:?} vs {want:?}"
                );
            }
            assert_ne!(values(&seeded.infer(&batch)?)?, want, "{name}: seed 1 alone differs");
        }
    }
    Ok(())
}

#[test]
fn weights_that_do_not_fit_name_every_missing_and_misshaped_tensor() -> Result<()> {
    let dir = tempfile::tempdir().unwrap();
    let source = build("resnet_tiny", &config(Mode::Infer, TrainConfig::default()))?;
    let mut tensors = source.tensors();
    tensors.retain(|(n, _)| n != "fc.bias" && n != "layer2.0.bn1.running_var");
    for (n, t) in tensors.iter_mut() {
        if n == "conv1.weight" {
            *t = Tensor::zeros((8, 3, 3, 3), DType::F32, &Device::Cpu)?;
        }
    }
    let file = dir.path().join("bad.safetensors");
    save(tensors, &file)?;
    let mut cfg = config(Mode::Infer, TrainConfig::default());
    cfg.weights = Some(file);
    let err = build("resnet_tiny", &cfg)
        .err()
        .expect("a misfit checkpoint is an error")
        .to_string();
    assert!(err.contains("3 tensor(s) missing or misshaped"), "{err}");
    assert!(
        err.contains("fc.bias: missing") && err.contains("layer2.0.bn1.running_var: missing"),
        "{err}"
    );
    assert!(
        err.contains("conv1.weight: [8, 3, 3, 3] in the file, [8, 3, 7, 7] in the model"),
        "{err}"
    );

    cfg.weights = Some(dir.path().join("nope.safetensors"));
    let err = build("resnet_tiny", &cfg).err().unwrap().to_string();
    assert!(
        err.contains("cannot read the weights file") && err.contains("nope.safetensors"),
        "{err}"
    );
    Ok(())
}

#[test]
fn the_returned_loss_holds_no_graph() -> Result<()> {
    let mut w = build("resnet_tiny", &config(Mode::Train, TrainConfig::default()))?;
    let batch = w.synthetic_batch(2, 0)?;
    assert!(
        !w.train_step(&batch)?.track_op(),
        "the loss keeps the step's activations alive"
    );
    Ok(())
}

#[test]
fn off_a_gpu_steps_never_replay_graphs_and_say_so() -> Result<()> {
    use workloads::kernels::options::CudaGraphs;
    for mode in [Mode::Infer, Mode::Train] {
        let cfg = WorkloadConfig {
            kernels: workloads::kernels::KernelOptions {
                graphs: CudaGraphs::On,
                ..Default::default()
            },
            ..config(mode, TrainConfig::adamw())
        };
        let mut w = build("resnet_tiny", &cfg)?;
        let batch = w.synthetic_batch(2, 1)?;
        for _ in 0..3 {
            match mode {
                Mode::Infer => drop(w.infer(&batch)?),
                Mode::Train => drop(w.train_step(&batch)?),
                Mode::Generate => unreachable!("only infer and train are listed"),
            }
        }
        assert_eq!(w.steps_to_steady(), 1, "{mode:?}: nothing to capture on the CPU");
        assert_eq!(w.graph_stats(), workloads::GraphStats::default());
        assert!(w.graph_refusals().is_empty());
    }
    Ok(())
}
