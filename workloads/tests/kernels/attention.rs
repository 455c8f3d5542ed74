//! Attention: the op and the fused kernel against the CPU.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn attention_op_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::{attention, ScoreBias};
    // ViT's 197 tokens (padded to 200 on the GPU), 3 heads of 8.
    let qkv = random(&[2, 197, 72], 200);
    matches_cpu(
        "attention vit-like",
        &|a| attention(a[0], 3, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // Rows longer than the kernels keep in registers (300 keys, padded to 304).
    let qkv = random(&[1, 300, 24], 204);
    matches_cpu(
        "attention long rows",
        &|a| attention(a[0], 2, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // BERT: a key mask (-10000 on the last 3 keys of sequence 1), 12 tokens, 2 heads of 4.
    let mut mask = vec![0f32; 24];
    mask[21..].iter_mut().for_each(|m| *m = -10000.0);
    let mask = Tensor::from_vec(mask, (2, 12), &Device::Cpu).unwrap();
    let qkv = random(&[2, 12, 24], 201);
    let f = move |a: &[&Tensor]| {
        let m = mask.to_device(a[0].device()).unwrap().to_dtype(a[0].dtype()).unwrap();
        attention(a[0], 2, ScoreBias::Keys(&m)).unwrap()
    };
    matches_cpu("attention bert-like", &f, &[qkv], [1e-5, 3e-2, 5e-3]);
    // Swin: 8 windows of 49 tokens, a [4, heads, 49, 49] bias repeating every 4 windows, with its
    // gradient.
    let qkv = random(&[8, 49, 24], 202);
    let bias = random(&[4, 2, 49, 49], 203);
    matches_cpu(
        "attention swin-like",
        &|a| attention(a[0], 2, ScoreBias::Scores(a[1])).unwrap(),
        &[qkv, bias],
        [1e-5, 3e-2, 5e-3],
    );
}

#[test]
#[ignore = "needs a CUDA GPU"]
fn fused_attention_matches_the_cpu_forward_and_backward() {
    use workloads::kernels::attention::runs_fused;
    let gpu = gpu();
    // The shapes below take a fused kernel in bf16 and f16, and in f32 but for heads of 128 (the
    // f32 kernel keeps a head in registers); heads of 8 compose in every dtype.
    for (shape, heads) in [([2usize, 197, 384], 2usize), ([1, 70, 384], 1), ([8, 49, 192], 2)] {
        let x = Tensor::zeros(&shape[..], DType::BF16, &gpu).unwrap();
        assert!(
            runs_fused(&x, heads).unwrap() && runs_fused(&x.to_dtype(DType::F16).unwrap(), heads).unwrap(),
            "{shape:?}"
        );
        assert_eq!(
            runs_fused(&x.to_dtype(DType::F32).unwrap(), heads).unwrap(),
            heads != 1,
            "{shape:?} f32"
        );
    }
    assert!(!runs_fused(&Tensor::zeros((2, 197, 72), DType::BF16, &gpu).unwrap(), 3).unwrap());
    assert!(!runs_fused(&Tensor::zeros((2, 197, 72), DType::F32, &gpu).unwrap(), 3).unwrap());
    // The kernel option `attention=composed` turns every fused launch off.
    {
        use workloads::kernels::{options::Attention, KernelOptions};
        let _composed = KernelOptions {
            attention: Attention::Composed,
            ..KernelOptions::default()
        }
        .enter();
        assert!(!runs_fused(&Tensor::zeros((2, 197, 384), DType::BF16, &gpu).unwrap(), 2).unwrap());
    }
    // The f32 kernels come in several sizes of block, each shape's first launch timing them: every
    // size is checked on its own (pinned: the pin, not a timing, picks the kernel), then the timed
    // choice, which the pinned launches left untimed.
    use workloads::kernels::attention::{fused_f32_queries, with_fused_f32_queries, FUSED_F32_QUERIES};
    let vit_like = Tensor::zeros((2, 197, 384), DType::F32, &gpu).unwrap();
    assert_eq!(
        fused_f32_queries(&vit_like, 2).unwrap(),
        None,
        "not timed before its first launch"
    );
    for q in FUSED_F32_QUERIES {
        let tag = format!("{q} queries a block");
        with_fused_f32_queries(q, || {
            assert_eq!(fused_f32_queries(&vit_like, 2).unwrap(), Some(q), "{tag}");
            fused_attention_cases(&tag)
        })
        .unwrap();
    }
    assert_eq!(
        fused_f32_queries(&vit_like, 2).unwrap(),
        None,
        "pinned launches time nothing"
    );
    fused_attention_cases("timed");
    let timed = fused_f32_queries(&vit_like, 2).unwrap();
    assert!(timed.is_some_and(|q| FUSED_F32_QUERIES.contains(&q)), "{timed:?}");
    // The pin refuses a size there is no kernel of.
    let refused = with_fused_f32_queries(48, || ()).unwrap_err().to_string();
    assert!(refused.contains("[128, 64, 32, 16]"), "{refused}");
}

/// The fused attention forward and backward against the CPU's, in f32, bf16 and f16, over shapes that
/// take the fused kernels: every bias mode, heads of 32 and 64, partial tiles, an offset projection.
fn fused_attention_cases(tag: &str) {
    use workloads::kernels::{attention, ScoreBias};
    // ViT-B-like: 197 tokens (four tiles of 64 keys, the last of 5), 2 heads of 64.
    let qkv = random(&[2, 197, 384], 210);
    matches_cpu(
        &format!("fused attention vit-like, {tag}"),
        &|a| attention(a[0], 2, ScoreBias::None).unwrap(),
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // One head of 128 (f32 composes) or two of 64 over 70 tokens, the projection starting 70·384
    // elements into its buffer.
    let qkv = random(&[2, 70, 384], 211);
    for heads in [1, 2] {
        let f = move |a: &[&Tensor]| attention(&a[0].narrow(0, 1, 1).unwrap(), heads, ScoreBias::None).unwrap();
        matches_cpu(
            &format!("fused attention d={} at an offset, {tag}", 128 / heads),
            &f,
            std::slice::from_ref(&qkv),
            [1e-5, 3e-2, 5e-3],
        );
    }
    // BERT-like: 128 tokens, a key mask (-10000 on the last 40 keys of sequence 1), 2 heads of 64.
    let mut mask = vec![0f32; 256];
    mask[216..].iter_mut().for_each(|m| *m = -10000.0);
    let mask = Tensor::from_vec(mask, (2, 128), &Device::Cpu).unwrap();
    let qkv = random(&[2, 128, 384], 212);
    let f = move |a: &[&Tensor]| {
        let m = mask.to_device(a[0].device()).unwrap().to_dtype(a[0].dtype()).unwrap();
        attention(a[0], 2, ScoreBias::Keys(&m)).unwrap()
    };
    matches_cpu(
        &format!("fused attention bert-like, {tag}"),
        &f,
        &[qkv],
        [1e-5, 3e-2, 5e-3],
    );
    // Swin-T-like: 8 windows of 49 tokens, heads of 32, a bias repeating every 4 windows.
    let qkv = random(&[8, 49, 192], 213);
    let bias = random(&[4, 2, 49, 49], 214);
    matches_cpu(
        &format!("fused attention swin-like, {tag}"),
        &|a| attention(a[0], 2, ScoreBias::Scores(a[1])).unwrap(),
        &[qkv, bias],
        [1e-5, 3e-2, 5e-3],
    );
}
