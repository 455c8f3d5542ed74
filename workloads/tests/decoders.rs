//! The decoder family against candle-transformers' Llama and Qwen2, an independent implementation,
//! from the same tensors on the CPU in f32: the prefill's logits, every greedy decode step's logits
//! and the tokens chosen; and a sequence decoded a token at a time against the same sequence
//! prefilled whole.

use candle_core::{DType, Device, IndexOp, Tensor, D};
use candle_nn::VarBuilder;
use workloads::models::decoder::{self, Config, Decoder, KvCache, KvStore, PagedKvCache};

const TOLERANCE: f32 = 1e-4;
const PROMPT: [[u32; 7]; 2] = [[1, 17, 250, 3, 99, 42, 7], [5, 5, 300, 12, 0, 64, 211]];
const STEPS: usize = 6;

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

fn argmax_last(logits: &Tensor) -> Tensor {
    // [batch, vocab] -> [batch, 1]
    logits.argmax(D::Minus1).unwrap().unsqueeze(1).unwrap()
}

/// The tiny preset's weights, as a VarBuilder both implementations read. The norms' weights and
/// the biases, ones and zeros as initialised, get random values, so that a norm or a bias wired to
/// the wrong place shows.
fn weights(cfg: &Config) -> VarBuilder<'static> {
    let mut w = decoder::random_weights(cfg, 11, &Device::Cpu, DType::F32).unwrap();
    for (name, t) in w.iter_mut() {
        let (mean, std) = match name {
            n if n.ends_with("norm.weight") => (1.0, 0.2),
            n if n.ends_with(".bias") => (0.0, 0.5),
            _ => continue,
        };
        let values = workloads::init::Rng::for_name(5, name).normal_vec(t.elem_count(), mean, std);
        *t = Tensor::from_vec(values, t.shape(), &Device::Cpu).unwrap();
    }
    VarBuilder::from_tensors(w, DType::F32, &Device::Cpu)
}

/// Runs both implementations greedily: `reference(ids, offset)` gives the oracle's logits of the
/// last position, [batch, vocab]. Returns every position's logits of ours, prefill and steps
/// concatenated along the tokens, and the tokens chosen.
fn greedy_against(
    model: &Decoder,
    mut reference: impl FnMut(&Tensor, usize) -> Tensor,
    name: &str,
) -> (Tensor, Tensor) {
    let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
    let mut cache = KvCache::new(model.config());
    let prefill = model.forward(&prompt, &mut cache).unwrap();
    let ours_last = prefill.i((.., PROMPT[0].len() - 1, ..)).unwrap();
    let theirs = reference(&prompt, 0);
    let d = max_diff(&ours_last, &theirs);
    assert!(d <= TOLERANCE, "{name}: prefill logits differ by {d}");
    let mut logits = vec![prefill];
    let mut tokens = vec![prompt.clone()];
    let mut next = argmax_last(&ours_last);
    assert_eq!(
        next.to_vec2::<u32>().unwrap(),
        argmax_last(&theirs).to_vec2::<u32>().unwrap(),
        "{name}: the first token"
    );
    for step in 0..STEPS {
        let offset = cache.len();
        let ours = model.forward(&next, &mut cache).unwrap();
        let theirs = reference(&next, offset);
        let ours_last = ours.i((.., 0, ..)).unwrap();
        let d = max_diff(&ours_last, &theirs);
        assert!(d <= TOLERANCE, "{name}: decode step {step} logits differ by {d}");
        tokens.push(next.clone());
        logits.push(ours);
        let (a, b) = (argmax_last(&ours_last), argmax_last(&theirs));
        assert_eq!(
            a.to_vec2::<u32>().unwrap(),
            b.to_vec2::<u32>().unwrap(),
            "{name}: token of step {step}"
        );
        next = a;
    }
    assert_eq!(cache.len(), PROMPT[0].len() + STEPS);
    (Tensor::cat(&logits, 1).unwrap(), Tensor::cat(&tokens, 1).unwrap())
}

/// The same tokens prefilled at once give the logits they got a token at a time.
fn prefilled_whole_equals_decoded(model: &Decoder, logits: &Tensor, tokens: &Tensor, name: &str) {
    let mut cache = KvCache::new(model.config());
    let whole = model.forward(tokens, &mut cache).unwrap();
    let d = max_diff(&whole, logits);
    assert!(d <= TOLERANCE, "{name}: prefilled whole differs from decoded by {d}");
    let cfg = model.config();
    assert_eq!(
        cache.bytes() as u64,
        cfg.kv_bytes_per_token(DType::F32) * tokens.elem_count() as u64
    );
}

#[test]
fn llama_matches_candle_transformers_llama() {
    use candle_transformers::models::llama;
    let json = decoder::PRESETS.iter().find(|(n, _)| *n == "llama_tiny").unwrap().1;
    let cfg = Config::from_json(json).unwrap();
    assert!(cfg.rope_scaling.is_some() && cfg.num_kv_heads < cfg.num_heads && !cfg.tie_word_embeddings);
    let vb = weights(&cfg);
    let ours = Decoder::new(&cfg, vb.clone()).unwrap();
    let theirs_cfg = serde_json::from_str::<llama::LlamaConfig>(json)
        .unwrap()
        .into_config(false);
    let theirs = llama::Llama::load(vb, &theirs_cfg).unwrap();
    let mut cache = llama::Cache::new(true, DType::F32, &theirs_cfg, &Device::Cpu).unwrap();
    let (logits, tokens) = greedy_against(
        &ours,
        |ids, offset| theirs.forward(ids, offset, &mut cache).unwrap(),
        "llama",
    );
    prefilled_whole_equals_decoded(&ours, &logits, &tokens, "llama");
}

#[test]
fn qwen2_matches_candle_transformers_qwen2() {
    use candle_transformers::models::qwen2;
    let json = decoder::PRESETS.iter().find(|(n, _)| *n == "qwen2_tiny").unwrap().1;
    let cfg = Config::from_json(json).unwrap();
    assert!(cfg.qkv_bias && cfg.tie_word_embeddings);
    let vb = weights(&cfg);
    let ours = Decoder::new(&cfg, vb.clone()).unwrap();
    let theirs_cfg: qwen2::Config = serde_json::from_str(json).unwrap();
    let mut theirs = qwen2::ModelForCausalLM::new(&theirs_cfg, vb).unwrap();
    let (logits, tokens) = greedy_against(
        &ours,
        |ids, offset| theirs.forward(ids, offset).unwrap().squeeze(1).unwrap(),
        "qwen2",
    );
    prefilled_whole_equals_decoded(&ours, &logits, &tokens, "qwen2");
}

#[test]
fn a_prompt_past_the_positions_or_a_failed_pass_is_an_error_not_a_wrong_answer() {
    let json = decoder::PRESETS.iter().find(|(n, _)| *n == "llama_tiny").unwrap().1;
    let cfg = Config::from_json(json).unwrap();
    let model = Decoder::new(&cfg, weights(&cfg)).unwrap();
    let ids = Tensor::zeros((1, cfg.max_position_embeddings + 1), DType::U32, &Device::Cpu).unwrap();
    let e = model.forward(&ids, &mut KvCache::new(&cfg)).unwrap_err().to_string();
    assert!(e.contains("exceed the model's 256 positions"), "{e}");
    // A pass that fails leaves the cache as it was.
    let mut cache = KvCache::new(&cfg);
    model
        .forward(&Tensor::new(&PROMPT, &Device::Cpu).unwrap(), &mut cache)
        .unwrap();
    let wrong = Tensor::zeros((3, 1), DType::U32, &Device::Cpu).unwrap();
    assert!(
        model.forward(&wrong, &mut cache).is_err(),
        "a batch of 3 against a cache of 2"
    );
    assert_eq!(cache.len(), PROMPT[0].len());
    model
        .forward(&Tensor::zeros((2, 1), DType::U32, &Device::Cpu).unwrap(), &mut cache)
        .unwrap();
    assert_eq!(cache.len(), PROMPT[0].len() + 1);
}

#[test]
fn a_hugging_face_folder_runs_without_a_preset_and_a_bad_one_says_why() {
    let json = decoder::PRESETS.iter().find(|(n, _)| *n == "qwen2_tiny").unwrap().1;
    let cfg = Config::from_json(json).unwrap();
    let tensors = decoder::random_weights(&cfg, 3, &Device::Cpu, DType::F32).unwrap();
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("config.json"), json).unwrap();
    candle_core::safetensors::save(&tensors, dir.path().join("model.safetensors")).unwrap();
    let from_folder = decoder::load_folder(dir.path(), &Device::Cpu, DType::F32).unwrap();
    let in_memory = Decoder::new(&cfg, VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu)).unwrap();
    let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
    let a = from_folder.forward(&prompt, &mut KvCache::new(&cfg)).unwrap();
    let b = in_memory.forward(&prompt, &mut KvCache::new(&cfg)).unwrap();
    assert_eq!(max_diff(&a, &b), 0.0);

    // Another architecture, named with the supported ones.
    let mut other: serde_json::Value = serde_json::from_str(json).unwrap();
    other["architectures"] = serde_json::json!(["GemmaForCausalLM"]);
    std::fs::write(dir.path().join("config.json"), other.to_string()).unwrap();
    let e = decoder::read_folder(dir.path()).unwrap_err().to_string();
    assert!(
        e.ends_with("config.json: architecture `GemmaForCausalLM` is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM"),
        "{e}"
    );
    // A field of the wrong type: said once, with the file (no error source to print it again).
    std::fs::write(
        dir.path().join("config.json"),
        r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": "x"}"#,
    )
    .unwrap();
    let e = decoder::read_folder(dir.path()).unwrap_err();
    let said = e.to_string();
    assert!(
        said.contains("config.json: invalid type") && said.matches("invalid type").count() == 1,
        "{said}"
    );
    assert!(std::error::Error::source(&e).is_none(), "{said}");
    // No weights, no config.
    std::fs::write(dir.path().join("config.json"), json).unwrap();
    std::fs::remove_file(dir.path().join("model.safetensors")).unwrap();
    let e = decoder::read_folder(dir.path()).unwrap_err().to_string();
    assert!(e.contains("no *.safetensors weights"), "{e}");
    let e = decoder::read_folder(&dir.path().join("missing"))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no readable config.json"), "{e}");
}

#[test]
fn the_generator_decodes_what_the_model_does_and_counts_its_cache() {
    // The generator's seeded weights are `random_weights` of its seed: the same model by hand.
    let cfg = decoder::preset("llama_tiny").unwrap();
    let wc = workloads::WorkloadConfig {
        device: Device::Cpu,
        dtype: DType::F32,
        mode: workloads::Mode::Generate,
        seed: 3,
        seq_len: None,
        weights: None,
        train: Default::default(),
        kernels: Default::default(),
    };
    let mut generator = workloads::Generator::build("llama_tiny", &wc, workloads::KvLayout::Contiguous).unwrap();
    let by_hand = Decoder::new(
        &cfg,
        VarBuilder::from_tensors(
            decoder::random_weights(&cfg, 3, &Device::Cpu, DType::F32).unwrap(),
            DType::F32,
            &Device::Cpu,
        ),
    )
    .unwrap();
    let prompts = generator.prompts(2, 9, 4).unwrap();
    assert_eq!(prompts.dims(), &[2, 9]);
    assert_eq!(
        prompts.to_vec2::<u32>().unwrap(),
        generator.prompts(2, 9, 4).unwrap().to_vec2::<u32>().unwrap(),
        "prompts follow their seed"
    );
    // Twice: a second generation starts from an empty cache, not after the first.
    for _ in 0..2 {
        let mut cache = KvCache::new(&cfg);
        let mut expected = argmax_last(&by_hand.forward(&prompts, &mut cache).unwrap().i((.., 8, ..)).unwrap());
        let mut got = generator.prefill(&prompts, 14).unwrap();
        for step in 0..5 {
            assert_eq!(
                got.to_vec2::<u32>().unwrap(),
                expected.to_vec2::<u32>().unwrap(),
                "token {step}"
            );
            let logits = by_hand.forward(&expected, &mut cache).unwrap();
            expected = argmax_last(&logits.i((.., 0, ..)).unwrap());
            got = generator.decode(&got).unwrap();
        }
        // 9 prompt tokens and 5 fed back, 2 sequences, at the preset's bytes a token.
        assert_eq!(generator.cache_len(), 14);
        assert_eq!(
            generator.cache_bytes() as u64,
            2 * 14 * cfg.kv_bytes_per_token(DType::F32)
        );
        // The room reserved is full: one more step is refused before it writes anything.
        let e = generator.decode(&got).unwrap_err().to_string();
        assert!(e.contains("room for 14 tokens"), "{e}");
        assert_eq!(generator.cache_len(), 14);
    }
    // Infer and train are not a language model's modes.
    let e = workloads::build("llama_tiny", &wc).err().unwrap().to_string();
    assert!(e.contains("generates through workloads::Generator"), "{e}");
}

#[test]
fn paged_and_contiguous_caches_give_the_same_logits_and_tokens() {
    // Blocks of 3 tokens: the prompt of 7 spans three blocks, and decode steps cross block ends.
    // The pool has spare blocks, handed out in an order unlike the sequences' own.
    let cfg = decoder::preset("qwen2_tiny").unwrap();
    let model = Decoder::new(&cfg, weights(&cfg)).unwrap();
    let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
    let mut contiguous = KvCache::new(&cfg);
    let mut paged = PagedKvCache::new(&cfg, 2, 12, 3, DType::F32, &Device::Cpu).unwrap();
    let a = model.forward(&prompt, &mut contiguous).unwrap();
    let b = model.forward(&prompt, &mut paged).unwrap();
    assert!(max_diff(&a, &b) < TOLERANCE, "prefill: {}", max_diff(&a, &b));
    let (mut ta, mut tb) = (
        argmax_last(&a.i((.., 6, ..)).unwrap()),
        argmax_last(&b.i((.., 6, ..)).unwrap()),
    );
    for step in 0..STEPS {
        assert_eq!(
            ta.to_vec2::<u32>().unwrap(),
            tb.to_vec2::<u32>().unwrap(),
            "token {step}"
        );
        let a = model.forward(&ta, &mut contiguous).unwrap();
        let b = model.forward(&tb, &mut paged).unwrap();
        assert!(max_diff(&a, &b) < TOLERANCE, "step {step}: {}", max_diff(&a, &b));
        ta = argmax_last(&a.i((.., 0, ..)).unwrap());
        tb = argmax_last(&b.i((.., 0, ..)).unwrap());
    }
    // 13 tokens a sequence: 5 blocks of 3 each, 10 of the 12 taken, each sequence's its own.
    assert_eq!(paged.len(), 13);
    assert_eq!(paged.blocks_free(), 2);
    let tables = paged.block_tables();
    assert!(tables.iter().all(|t| t.len() == 5));
    let mut all: Vec<u32> = tables.iter().flatten().copied().collect();
    all.sort();
    all.dedup();
    assert_eq!(all.len(), 10, "no block is held twice: {tables:?}");
    // Whole blocks count: 15 slots a sequence. The contiguous cache, made without room reserved,
    // grew from the prompt's 7 to 14 at the first decode step and holds 14.
    assert_eq!((contiguous.len(), contiguous.capacity()), (13, 14));
    assert_eq!(paged.bytes() * 14, contiguous.bytes() * 15);
}

#[test]
fn a_decode_step_of_fixed_shapes_gives_the_logits_of_the_pass_it_replaces() {
    // The step a CUDA graph replays (attention over every slot of a reserved cache, the later
    // ones masked, the new keys and values scattered at the step's position) against the model's
    // forward pass over a cache that holds only the tokens so far; Qwen2's biases and grouped
    // heads, and Llama's, with room to spare after the last step.
    for name in ["qwen2_tiny", "llama_tiny"] {
        let cfg = decoder::preset(name).unwrap();
        let model = Decoder::new(&cfg, weights(&cfg)).unwrap();
        let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
        let mut pass = KvCache::new(&cfg);
        let mut fixed = KvCache::new(&cfg);
        fixed.reserve(2, 7 + STEPS + 3, DType::F32, &Device::Cpu).unwrap();
        let a = model.forward(&prompt, &mut pass).unwrap();
        let b = model.forward(&prompt, &mut fixed).unwrap();
        assert!(max_diff(&a, &b) < TOLERANCE, "{name} prefill: {}", max_diff(&a, &b));
        let mut tokens = argmax_last(&a.i((.., 6, ..)).unwrap());
        for step in 0..STEPS {
            let pos = Tensor::new(&[fixed.len() as u32], &Device::Cpu).unwrap();
            let b = model.decode_step(&tokens, &pos, &fixed).unwrap();
            fixed.advance(1).unwrap();
            let a = model.forward(&tokens, &mut pass).unwrap();
            assert!(max_diff(&a, &b) < TOLERANCE, "{name} step {step}: {}", max_diff(&a, &b));
            tokens = argmax_last(&a.i((.., 0, ..)).unwrap());
        }
        assert_eq!(
            (fixed.len(), fixed.capacity(), fixed.allocations()),
            (7 + STEPS, 7 + STEPS + 3, 1)
        );
        // A step past the room it reserved is refused before it writes, the cache left as it was.
        fixed.advance(3).unwrap();
        assert!(fixed.advance(1).unwrap_err().to_string().contains("no room"));
        let pos = Tensor::new(&[fixed.len() as u32], &Device::Cpu).unwrap();
        let e = model.decode_step(&tokens, &pos, &fixed).unwrap_err().to_string();
        assert!(e.contains("no room for a decode step"), "{e}");
        assert_eq!(fixed.len(), 7 + STEPS + 3);
        let e = model.decode_step(&prompt, &pos, &fixed).unwrap_err().to_string();
        assert!(e.contains("one token of each"), "{e}");
    }
}

#[test]
fn a_full_pool_refuses_a_pass_and_keeps_what_it_held() {
    let cfg = decoder::preset("llama_tiny").unwrap();
    let model = Decoder::new(&cfg, weights(&cfg)).unwrap();
    let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
    // 7 tokens in blocks of 4: 2 blocks a sequence, 4 in all; a pool of 5 cannot take the ninth
    // token of both.
    let mut paged = PagedKvCache::new(&cfg, 2, 5, 4, DType::F32, &Device::Cpu).unwrap();
    let logits = model.forward(&prompt, &mut paged).unwrap();
    let next = argmax_last(&logits.i((.., 6, ..)).unwrap());
    model.forward(&next, &mut paged).unwrap();
    assert_eq!((paged.len(), paged.blocks_free()), (8, 1));
    let before = paged.block_tables().to_vec();
    let e = model.forward(&next, &mut paged).unwrap_err().to_string();
    assert!(e.contains("blocks of 4 tokens are all held"), "{e}");
    // The block the first sequence took before the pool ran dry went back.
    assert_eq!((paged.len(), paged.blocks_free()), (8, 1));
    assert_eq!(paged.block_tables(), &before[..]);
}

#[test]
fn the_generator_s_paged_cache_decodes_as_its_contiguous_one() {
    let wc = workloads::WorkloadConfig {
        device: Device::Cpu,
        dtype: DType::F32,
        mode: workloads::Mode::Generate,
        seed: 5,
        seq_len: None,
        weights: None,
        train: Default::default(),
        kernels: Default::default(),
    };
    let tokens = |layout| {
        let mut g = workloads::Generator::build("qwen2_tiny", &wc, layout).unwrap();
        let prompts = g.prompts(3, 10, 1).unwrap();
        // Twice: the second generation reuses the first one's pool, emptied.
        let mut runs = Vec::new();
        for _ in 0..2 {
            let mut t = g.prefill(&prompts, 16).unwrap();
            let mut out = vec![t.to_vec2::<u32>().unwrap()];
            for _ in 0..6 {
                t = g.decode(&t).unwrap();
                out.push(t.to_vec2::<u32>().unwrap());
            }
            runs.push(out);
        }
        assert_eq!(runs[0], runs[1], "{layout:?}: a second generation decodes as the first");
        (runs.remove(0), g.cache_bytes())
    };
    let (contiguous, bytes) = tokens(workloads::KvLayout::Contiguous);
    let (paged, paged_bytes) = tokens(workloads::KvLayout::Paged {
        block_size: workloads::BlockSize::new(4).unwrap(),
    });
    assert_eq!(contiguous, paged);
    // 16 tokens a sequence: exactly 4 blocks of 4, so the paged cache holds no more.
    assert_eq!(bytes, paged_bytes);
}

#[test]
fn a_pass_s_mlp_in_slices_of_rows_gives_the_logits_of_one_slice() {
    // 2 sequences × 7 prompt tokens are 14 rows: slices of 4 make three whole slices and one of 2.
    for preset in ["llama_tiny", "qwen2_tiny"] {
        let cfg = decoder::preset(preset).unwrap();
        let whole = Decoder::new(&cfg, weights(&cfg)).unwrap();
        let sliced = Decoder::new(&cfg, weights(&cfg)).unwrap().with_mlp_rows(4);
        let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
        let (mut a, mut b) = (KvCache::new(&cfg), KvCache::new(&cfg));
        let (la, lb) = (
            whole.forward(&prompt, &mut a).unwrap(),
            sliced.forward(&prompt, &mut b).unwrap(),
        );
        assert_eq!(la.dims(), [2, 7, cfg.vocab_size]);
        let d = max_diff(&la, &lb);
        assert!(d < 1e-5, "{preset}: prefill logits differ by {d}");
        // A step after it reads the caches both wrote.
        let next = argmax_last(&la.i((.., 6, ..)).unwrap());
        let d = max_diff(
            &whole.forward(&next, &mut a).unwrap(),
            &sliced.forward(&next, &mut b).unwrap(),
        );
        assert!(d < 1e-5, "{preset}: the next step's logits differ by {d}");
    }
}

#[test]
fn a_model_from_owned_tensors_is_the_model_from_a_var_builder() {
    // The generator builds its seeded models from the tensors themselves, dropping each as it is
    // stacked; the model is the one a VarBuilder over the same tensors makes.
    let cfg = decoder::preset("qwen2_tiny").unwrap();
    let tensors = decoder::random_weights(&cfg, 5, &Device::Cpu, DType::F32).unwrap();
    let built = Decoder::new(
        &cfg,
        VarBuilder::from_tensors(tensors.clone(), DType::F32, &Device::Cpu),
    )
    .unwrap();
    let owned = Decoder::from_tensors(&cfg, tensors.clone(), &Device::Cpu, DType::F32).unwrap();
    let prompt = Tensor::new(&PROMPT, &Device::Cpu).unwrap();
    let (a, b) = (
        built.forward(&prompt, &mut KvCache::new(&cfg)).unwrap(),
        owned.forward(&prompt, &mut KvCache::new(&cfg)).unwrap(),
    );
    assert_eq!(max_diff(&a, &b), 0.0);
    // A tensor of the wrong shape is named.
    let mut wrong = tensors;
    wrong.insert(
        "model.layers.0.mlp.up_proj.weight".into(),
        Tensor::zeros((3, 3), DType::F32, &Device::Cpu).unwrap(),
    );
    let e = Decoder::from_tensors(&cfg, wrong, &Device::Cpu, DType::F32)
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("model.layers.0.mlp.up_proj.weight") && e.contains("[3, 3]"),
        "{e}"
    );
}
