#!/usr/bin/env python3
"""The PyTorch side of the migprof comparison: the same models (torchvision ResNet, ViT, Swin;
transformers BertForSequenceClassification), synthetic inputs, random weights, batch sizes, precision and
iteration counts, measured the way migprof measures (each step synchronised before the clock is read).

Precision policy, stated in every output row: f32 runs with TF32 off for matmuls and convolutions
(`allow_tf32 = False`), as migprof's f32; tf32 with it on for both, as migprof's `--dtype tf32`; bf16
and f16 run the model under autocast (half-precision matmuls and convolutions, f32 weights and
reductions where autocast keeps them). Training in bf16 and f16 is always autocast over f32 weights, as
users train (and as migprof trains by default, over f32 master weights); f16 training adds GradScaler's
dynamic loss scale. cudnn.benchmark on throughout.

Variants (`--variants`, each row says which), the ways a PyTorch user who wants speed runs a model:
  eager     as above (autocast for bf16 and f16; training with torch.optim.AdamW's default
            implementation): the default, what the comparison always measured
  bf16w     inference only: bf16 weights and inputs, no autocast (bf16 only)
  fused     training only: as eager, with AdamW(fused=True)
  cl        channels_last memory format for convolutional models (ResNet): in inference with bf16
            weights for bf16; in training over f32 weights under autocast with AdamW(fused=True)
  compile   torch.compile(mode="reduce-overhead": Inductor kernels and CUDA graphs) over the best eager
            form: in inference bf16 weights, in training the model under autocast with AdamW(fused=True),
            channels_last for ResNet in both. A fresh compile per cell (per shape); the compile (the
            first warm-up steps) is timed on its own as `compile_s`, never in the throughput. Inductor's
            cache goes to TORCHINDUCTOR_CACHE_DIR (default /tmp/migprof-inductor), so a second call
            reuses it.

Each row also says whether the GPU slowed its clocks while it was measured (`verdict`: throttled or ok,
`slowdown_share`), judged as migprof judges its own runs, so that a comparison made on a hot GPU says so.

usage: pytorch_reference.py --models resnet50,vit_b_16 --modes infer --dtypes f32,bf16 --batches 1,8
       [--variants eager,bf16w,fused,cl,compile] [--warmup 10] [--iters 50] [--seq-len 128] [--profile] > rows.jsonl
--profile brackets the measured iterations with cudaProfilerStart/Stop, as migprof does, for
`ncu --profile-from-start off` (benches/kernel_profile.sh "pytorch MODEL MODE DTYPE BATCH").
"""
import argparse
import ctypes
import gc
import json
import os
import statistics
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/migprof-inductor")

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


CONVOLUTIONAL = {"resnet18", "resnet34", "resnet50", "resnet101", "resnet152"}


def applies(variant, name, mode, dtype):
    """Whether a variant means anything for the cell (bf16 weights only in bf16 inference, a fused
    optimizer only in training, channels_last only for convolutional models)."""
    return {
        "eager": True,
        "bf16w": dtype == "bf16" and mode == "infer",
        "fused": mode == "train",
        "cl": name in CONVOLUTIONAL,
        "compile": True,
    }[variant]


class Slowdowns:
    """Whether the GPU slowed its clocks for reasons outside the workload while a cell was measured,
    judged as migprof's sampler judges its own runs (profiler/src/run/evidence.rs): NVML's
    clock-event reasons read after each measured step (outside its timing), a run `throttled` when
    thermal slowdowns (hardware or software), the hardware slowdown or the power brake show in at
    least 5% of the readings. Without NVML the rows say nothing (None), rather than `ok`."""

    BITS = 0x8 | 0x20 | 0x40 | 0x80  # HW slowdown, SW thermal, HW thermal, HW power brake
    SHARE = 0.05

    def __init__(self):
        self.get = None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            handle = ctypes.c_void_p()
            uuid = f"GPU-{torch.cuda.get_device_properties(0).uuid}".encode()
            reasons = nvml.nvmlDeviceGetCurrentClocksEventReasons
            if nvml.nvmlInit_v2() == 0 and nvml.nvmlDeviceGetHandleByUUID(uuid, ctypes.byref(handle)) == 0:
                self.get, self.handle, self.reasons = reasons, handle, ctypes.c_ulonglong()
        except (OSError, AttributeError):
            pass
        self.readings = []

    def read(self):
        if self.get is not None:
            if self.get(self.handle, ctypes.byref(self.reasons)) == 0:
                self.readings.append(self.reasons.value)

    def verdict(self):
        """(share of readings slowed, 'throttled' or 'ok'), or (None, None) when nothing was read."""
        if not self.readings:
            return None, None
        share = sum(1 for r in self.readings if r & self.BITS) / len(self.readings)
        return share, "throttled" if share >= self.SHARE else "ok"


def measure(name, mode, dtype, batch, args, variant="eager"):
    device = torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    model, kind = build(name, args.seq_len)
    model = model.to(device)
    x, labels = inputs(kind, batch, args.seq_len, device, gen)
    half = {"bf16": torch.bfloat16, "f16": torch.float16}.get(dtype)
    # The fast inference forms hold half-precision weights and inputs themselves; eager is autocast,
    # and training always is (f32 weights, as users train).
    fast = mode == "infer" and variant in ("bf16w", "cl", "compile")
    if fast and half is not None:
        model = model.to(half)
        if kind == "image":
            x = (x[0].to(half),)
    if variant in ("cl", "compile") and name in CONVOLUTIONAL:
        model = model.to(memory_format=torch.channels_last)
        x = (x[0].contiguous(memory_format=torch.channels_last),)
    autocast = torch.autocast("cuda", dtype=half or torch.float32, enabled=(half is not None and not fast))
    torch.backends.cuda.matmul.allow_tf32 = dtype == "tf32"
    torch.backends.cudnn.allow_tf32 = dtype == "tf32"
    forward = torch.compile(model, mode="reduce-overhead") if variant == "compile" else model
    if mode == "infer":
        model.eval()

        def step():
            with torch.inference_mode(), autocast:
                logits_of(forward, kind, x)
    else:
        model.train()
        fused = variant in ("fused", "cl", "compile")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, fused=fused)
        # f16 trains with GradScaler's dynamic loss scale, as torch.amp documents it.
        scaler = torch.amp.GradScaler("cuda", init_scale=65536.0) if dtype == "f16" else None

        def step():
            with autocast:
                loss = F.cross_entropy(logits_of(forward, kind, x).float(), labels)
            opt.zero_grad(set_to_none=True)
            if scaler:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()

    # The compile happens in the first steps: timed apart from the measurement.
    t0 = time.perf_counter()
    for _ in range(args.warmup):
        step()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - t0
    if args.profile:
        torch.cuda.cudart().cudaProfilerStart()
    lat, slowdowns = [], Slowdowns()
    for _ in range(args.iters):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        lat.append((time.perf_counter() - t0) * 1e3)
        slowdowns.read()
    if args.profile:
        torch.cuda.cudart().cudaProfilerStop()
    # The device's used memory, as migprof's sampler reads it (NVML's used framebuffer): the CUDA
    # context, the libraries' workspaces and what PyTorch's caching allocator holds, which after the
    # steps is their peak (it keeps freed blocks). Earlier cells' memory was handed back before this one.
    free, total = torch.cuda.mem_get_info()
    mean = statistics.fmean(lat)
    slowdown_share, verdict = slowdowns.verdict()
    return {
        "framework": "pytorch", "model": name, "mode": mode, "dtype": dtype, "batch": batch,
        "seq_len": args.seq_len if kind == "tokens" else None, "iterations": len(lat),
        "mean_ms": mean, "p50_ms": statistics.median(lat), "throughput": 1000.0 / mean * batch,
        "precision": {"f32": "f32, TF32 off", "tf32": "f32, TF32 on"}.get(dtype, f"{dtype} weights" if fast else f"{dtype} autocast"),
        "variant": variant, "compile_s": warmup_s if variant == "compile" else None,
        "device_used_mib": (total - free) / 2**20,
        "slowdown_share": slowdown_share, "verdict": verdict,
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
    ap.add_argument("--variants", default="eager", help="eager, bf16w, cl, compile (comma-separated)")
    ap.add_argument("--profile", action="store_true", help="bracket the measured iterations for a profiler")
    args = ap.parse_args()
    torch.backends.cudnn.benchmark = True
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for name in args.models.split(","):
        for mode in args.modes.split(","):
            for dtype in args.dtypes.split(","):
                for batch in map(int, args.batches.split(",")):
                    for variant in args.variants.split(","):
                        if applies(variant, name, mode, dtype):
                            print(json.dumps(measure(name, mode, dtype, batch, args, variant)), flush=True)
                            # Nothing of this cell stays on the device for the next one to count:
                            # compiled graphs (and their CUDA-graph memory) live in dynamo's cache.
                            if variant == "compile":
                                torch._dynamo.reset()
                            gc.collect()
                            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
