#!/usr/bin/env python3
"""The PyTorch side of the migprof comparison: the same models (torchvision ResNet, ViT, Swin;
transformers BertForSequenceClassification), synthetic inputs, random weights, batch sizes, precision and
iteration counts, measured the way migprof measures (each step synchronised before the clock is read).

Precision policy, stated in every output row: f32 runs with TF32 off for matmuls and convolutions
(`allow_tf32 = False`), as migprof's f32; tf32 with it on for both, as migprof's `--dtype tf32`; bf16
runs the model under autocast (bf16 matmuls and convolutions, f32 weights and reductions where autocast
keeps them). cudnn.benchmark on throughout.

usage: pytorch_reference.py --models resnet50,vit_b_16 --modes infer --dtypes f32,bf16 --batches 1,8
       [--warmup 10] [--iters 50] [--seq-len 128] [--profile] > rows.jsonl
--profile brackets the measured iterations with cudaProfilerStart/Stop, as migprof does, for
`ncu --profile-from-start off` (benches/kernel_profile.sh "pytorch MODEL MODE DTYPE BATCH").
"""
import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

TORCHVISION = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "vit_b_16", "swin_t", "swin_s", "swin_b"}
BERT = {"bert_base": "bert-base-uncased", "bert_large": "bert-large-uncased"}


def build(name, seq_len):
    if name in TORCHVISION:
        import torchvision.models as tvm

        return getattr(tvm, name)(weights=None, num_classes=1000), "image"
    if name in BERT:
        from transformers import BertConfig, BertForSequenceClassification

        big = name == "bert_large"
        cfg = BertConfig(hidden_size=1024 if big else 768, num_hidden_layers=24 if big else 12,
                         num_attention_heads=16 if big else 12, intermediate_size=4096 if big else 3072,
                         num_labels=2, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
        return BertForSequenceClassification(cfg), "tokens"
    raise SystemExit(f"no PyTorch reference for {name}")


def inputs(kind, batch, seq_len, device, gen):
    if kind == "image":
        x = torch.randn(batch, 3, 224, 224, device=device, generator=gen)
        return (x,), torch.randint(0, 1000, (batch,), device=device, generator=gen)
    ids = torch.randint(0, 30522, (batch, seq_len), device=device, generator=gen)
    types = (torch.arange(seq_len, device=device) >= seq_len // 2).long().expand(batch, seq_len)
    mask = torch.ones(batch, seq_len, device=device, dtype=torch.long)
    return (ids, mask, types), torch.randint(0, 2, (batch,), device=device, generator=gen)


def logits_of(model, kind, x):
    if kind == "image":
        return model(*x)
    ids, mask, types = x
    return model(input_ids=ids, attention_mask=mask, token_type_ids=types).logits


def measure(name, mode, dtype, batch, args):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    model, kind = build(name, args.seq_len)
    model = model.to(device)
    x, labels = inputs(kind, batch, args.seq_len, device, gen)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=(dtype == "bf16"))
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    torch.backends.cudnn.allow_tf32 = dtype == "tf32"
    if mode == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), autocast:
                logits_of(model, kind, x)
    else:
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)

        def step():
            with autocast:
                loss = F.cross_entropy(logits_of(model, kind, x).float(), labels)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()

    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    if args.profile:
        torch.cuda.cudart().cudaProfilerStart()
    lat = []
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        lat.append((time.perf_counter() - t0) * 1e3)
    if args.profile:
        torch.cuda.cudart().cudaProfilerStop()
    mean = statistics.fmean(lat)
    return {
        "framework": "pytorch", "model": name, "mode": mode, "dtype": dtype, "batch": batch,
        "seq_len": args.seq_len if kind == "tokens" else None, "iterations": len(lat),
        "mean_ms": mean, "p50_ms": statistics.median(lat), "throughput": 1000.0 / mean * batch,
        "precision": {"f32": "f32, TF32 off", "tf32": "f32, TF32 on"}.get(dtype, "bf16 autocast"),
        "torch": torch.__version__, "gpu": torch.cuda.get_device_name(0),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--modes", default="infer")
    ap.add_argument("--dtypes", default="f32")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="bracket the measured iterations for a profiler")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for dtype in args.dtypes.split(","):
                for batch in map(int, args.batches.split(",")):
                    print(json.dumps(measure(name, mode, dtype, batch, args)), flush=True)
                    torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
