"""A user's ResNet-50 training script as one writes it with torchvision: AdamW, bf16 autocast over
f32 weights, cuDNN's autotuner on, synthetic ImageNet-shaped batches. Each step is reported to
`migprof exec` through scripts/migprof_steps.py: the first --warmup steps as warm-up, then train
steps until --steps or --seconds."""

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F
import torchvision

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "scripts"))
import migprof_steps  # noqa: E402

args = argparse.ArgumentParser()
args.add_argument("--batch", type=int, default=32)
args.add_argument("--warmup", type=int, default=10)
args.add_argument("--steps", type=int, default=200)
args.add_argument("--seconds", type=float, default=15.0)
a = args.parse_args()

torch.backends.cudnn.benchmark = True
model = torchvision.models.resnet50().cuda().train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
x = torch.randn(a.batch, 3, 224, 224, device="cuda")
y = torch.randint(0, 1000, (a.batch,), device="cuda")


def step():
    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(x), y)
    loss.backward()
    opt.step()


for _ in range(a.warmup):
    with migprof_steps.step(items=a.batch, phase="warmup"):
        step()
start = time.perf_counter()
for _ in range(a.steps):
    with migprof_steps.step(items=a.batch, phase="train"):
        step()
    if time.perf_counter() - start > a.seconds:
        break
print(f"resnet50 train batch {a.batch}: done")
