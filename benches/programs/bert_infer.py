"""A user's BERT-base inference script as one writes it with Hugging Face transformers: BertModel of
bert-base-uncased's shape (random weights: no network here), bf16 weights, inference mode, batches of
--seq-len tokens. Each forward pass is reported to `migprof exec` through scripts/migprof_steps.py:
the first --warmup as warm-up, then infer steps until --steps or --seconds."""

import argparse
import os
import sys
import time

import torch
from transformers import BertConfig, BertModel

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import migprof_steps  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("--batch", type=int, default=32)
args.add_argument("--seq-len", type=int, default=128)
args.add_argument("--warmup", type=int, default=10)
args.add_argument("--steps", type=int, default=500)
args.add_argument("--seconds", type=float, default=10.0)
a = args.parse_args()

torch.manual_seed(0)
model = BertModel(BertConfig()).cuda().to(torch.bfloat16).eval()
ids = torch.randint(0, 30522, (a.batch, a.seq_len), device="cuda")
mask = torch.ones_like(ids)

with torch.inference_mode():
    for _ in range(a.warmup):
        with migprof_steps.step(items=a.batch, phase="warmup"):
            model(input_ids=ids, attention_mask=mask)
    start = time.perf_counter()
    for _ in range(a.steps):
        with migprof_steps.step(items=a.batch, phase="infer"):
            model(input_ids=ids, attention_mask=mask)
        if time.perf_counter() - start > a.seconds:
            break
print(f"bert_base infer batch {a.batch}: done")
