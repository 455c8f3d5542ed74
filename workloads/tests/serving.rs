//! A language model serving sequences that come and go (`workloads::serving`): what a continuous
//! batcher's iterations make of each sequence is what the model makes of it alone, and the blocks of
//! its pool are taken and given back as sequences grow, finish and are preempted.

use candle_core::{DType, Device, Tensor};
use workloads::models::decoder::{self, Decoder, KvCache, KvPool};
use workloads::serving::{PagedModel, Prefill};
use workloads::WorkloadConfig;

fn config(seed: u64) -> WorkloadConfig {
    config_on(seed, &Device::Cpu)
}

fn config_on(seed: u64, device: &Device) -> WorkloadConfig {
    WorkloadConfig {
        device: device.clone(),
        dtype: DType::F32,
        mode: workloads::Mode::Generate,
        seed,
        seq_len: None,
        weights: None,
        train: Default::default(),
        kernels: Default::default(),
    }
}

/// The model's own greedy continuation of `prompt` for `n` tokens, alone, over a contiguous cache.
fn alone(model: &Decoder, prompt: &[u32], n: usize, device: &Device) -> Vec<u32> {
    let mut cache = KvCache::new(model.config());
    let ids = Tensor::from_vec(prompt.to_vec(), (1, prompt.len()), device).unwrap();
    let mut logits = model.forward_last(&ids, &mut cache).unwrap();
    let mut out = Vec::new();
    for _ in 0..n {
        let next = workloads::generation::greedy(&logits)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<u32>()
            .unwrap()[0];
        out.push(next);
        if out.len() == n {
            break;
        }
        let t = Tensor::from_vec(vec![next], (1, 1), device).unwrap();
        logits = model.forward(&t, &mut cache).unwrap();
    }
    out
}

fn chunk(id: usize, start: usize, len: usize, last: bool) -> Prefill {
    Prefill { id, start, len, last }
}

#[test]
fn sequences_served_together_in_blocks_generate_what_each_does_alone() {
    served_together_and_alone(&Device::Cpu);
}

/// On a GPU in f32: the pool's writes (`kernels::prefill::write_rows`) and gathers, candle's ops
/// around them, against each sequence alone over a contiguous cache.
#[cfg(feature = "cuda")]
#[test]
#[ignore = "needs a CUDA GPU"]
fn on_the_gpu_sequences_served_together_in_blocks_generate_what_each_does_alone() {
    let gpu = Device::new_cuda(0).unwrap_or_else(|e| panic!("this test needs a CUDA GPU and found none: {e}"));
    served_together_and_alone(&gpu);
}

fn served_together_and_alone(device: &Device) {
    let wc = config_on(5, device);
    let cfg = decoder::preset("llama_tiny").unwrap();
    let reference = Decoder::from_tensors(
        &cfg,
        decoder::random_weights(&cfg, 5, device, DType::F32).unwrap(),
        device,
        DType::F32,
    )
    .unwrap();
    // Blocks of 4: every sequence crosses several, taken in turns, so that no table is in order.
    let mut model = PagedModel::build("llama_tiny", &wc, 64, 4).unwrap();
    let free = model.pool().blocks_free();
    // Sequence 0 alone; 1 chunked over two iterations beside 0's decodes; 2 joins; 1 is preempted
    // after two tokens and prefilled again over its prompt and them; 0 finishes.
    let mut produced: std::collections::HashMap<usize, Vec<u32>> = Default::default();
    let mut record = |out: Vec<(usize, u32)>| {
        for (id, t) in out {
            produced.entry(id).or_default().push(t);
        }
    };
    record(model.run(&[chunk(0, 0, 7, true)], &[]).unwrap());
    record(model.run(&[chunk(1, 0, 5, false)], &[0]).unwrap());
    record(model.run(&[chunk(1, 5, 6, true), chunk(2, 0, 3, true)], &[0]).unwrap());
    for _ in 0..2 {
        record(model.run(&[], &[0, 1, 2]).unwrap());
    }
    // Sequence 1 holds 11 prompt tokens and 3 generated (the last not yet fed back).
    model.preempt(1);
    record(model.run(&[], &[2, 0]).unwrap());
    record(model.run(&[chunk(1, 0, 8, false)], &[0, 2]).unwrap());
    record(model.run(&[chunk(1, 8, 6, true)], &[2, 0]).unwrap());
    for _ in 0..3 {
        record(model.run(&[], &[1, 0, 2]).unwrap());
    }
    let (p0, p1, p2) = (7, 11, 3);
    let prompts: Vec<Vec<u32>> = [(0, p0), (1, p1), (2, p2)]
        .iter()
        .map(|&(id, p)| model.tokens(id).unwrap()[..p].to_vec())
        .collect();
    for (id, prompt) in prompts.iter().enumerate() {
        let got = &produced[&id];
        assert_eq!(
            &alone(&reference, prompt, got.len(), device),
            got,
            "sequence {id}: served together and alone"
        );
        assert_eq!(&model.tokens(id).unwrap()[prompt.len()..], got.as_slice());
    }
    assert_eq!((produced[&0].len(), produced[&1].len(), produced[&2].len()), (11, 7, 9));
    // Sequence 0 holds its 7 prompt tokens and 10 fed back: 5 blocks of 4, free again once it
    // finishes.
    let held = free - model.pool().blocks_free();
    model.finish(0);
    assert_eq!(free - model.pool().blocks_free(), held - 5);
    model.finish(1);
    model.finish(2);
    assert_eq!(model.pool().blocks_free(), free);
    assert_eq!(model.sequences(), 0);
}

#[test]
fn a_plan_the_model_cannot_follow_is_refused_before_it_runs() {
    let mut model = PagedModel::build("llama_tiny", &config(1), 4, 4).unwrap();
    let e = model.run(&[], &[3]).unwrap_err().to_string();
    assert!(e.contains("without a finished prefill"), "{e}");
    let e = model.run(&[chunk(0, 2, 3, true)], &[]).unwrap_err().to_string();
    assert!(e.contains("where it holds 0"), "{e}");
    // 4 blocks of 4 hold 16 tokens: a prompt of 17 does not fit, and the pool is as it was.
    let e = model.run(&[chunk(0, 0, 17, true)], &[]).unwrap_err().to_string();
    assert!(e.contains("blocks"), "{e}");
    assert_eq!(model.pool().blocks_free(), 4);
    model.run(&[chunk(0, 0, 16, true)], &[]).unwrap();
    assert_eq!(model.pool().blocks_free(), 0);
    let e = model.run(&[], &[0]).unwrap_err().to_string();
    assert!(e.contains("free"), "{e}");
}

#[test]
fn a_pool_covers_tables_from_its_free_blocks_and_takes_them_back() {
    let cfg = decoder::preset("llama_tiny").unwrap();
    let mut pool = KvPool::new(&cfg, 5, 8, DType::F32, &Device::Cpu).unwrap();
    let (mut a, mut b) = (Vec::new(), Vec::new());
    pool.cover(&mut a, 9).unwrap();
    pool.cover(&mut b, 8).unwrap();
    pool.cover(&mut a, 17).unwrap();
    assert_eq!((a.len(), b.len(), pool.blocks_free()), (3, 1, 1));
    assert!(pool.cover(&mut b, 25).is_err());
    assert_eq!(b.len(), 1, "a table the pool cannot cover is left as it was");
    // Position 9 of head 1 lies in a's second block, slot 1.
    let heads = cfg.num_kv_heads;
    assert_eq!(pool.row(&a, 1, 9) as usize, (a[1] as usize * heads + 1) * 8 + 1);
    pool.give_back(&mut a);
    assert!(a.is_empty());
    assert_eq!(pool.blocks_free(), 4);
    assert_eq!(
        pool.bytes(),
        5 * 8 * cfg.num_layers * 2 * heads * cfg.head_dim * 4,
        "every block counted"
    );
}

#[test]
fn a_resized_pool_keeps_its_block_size() {
    let mut model = PagedModel::build("llama_tiny", &config(1), 4, 8).unwrap();
    let bytes = model.block_bytes();
    model.resize_pool(10).unwrap();
    assert_eq!(
        (model.pool().blocks(), model.pool().block_size(), model.block_bytes()),
        (10, 8, bytes)
    );
}
