#!/usr/bin/env python3
"""How far a half-precision training step's update lies from the exact one: PyTorch autocast (bf16, and
f16 with GradScaler) against migprof's bf16/f16 training over f32 master weights and without them,
each measured against an f64 run of the same steps from the same weights on the same batch.

For each model: PyTorch's seeded initialisation is saved as safetensors (f32) with a fixed batch; PyTorch
runs SGD (lr 0.01, momentum 0.9, no weight decay) in f64, in f32 (TF32 off) and under autocast;
migprof's `update_steps` example runs the same steps from the same file. After 1 and 3 steps, each
trainable tensor's update (weights after minus weights before) is compared with the f64 run's:
|update - exact| / |exact| (Frobenius norms), and the median over tensors is reported. Nothing is
downloaded.

usage: update_error.py --bin PATH/update_steps [--models resnet50,vit_b_16,swin_t,bert_base] [--batch 8]
       [--work DIR]      measures, each model's rows to DIR/update-error-MODEL.jsonl as it finishes (with
                         every step's losses and the gradients GradScaler found not finite) and each
                         tensor's error to DIR/update-tensors-MODEL.jsonl
       update_error.py --report [--work DIR] [--markdown]      the tables of every model measured in DIR:
                         the medians, the losses, and the error by kind of tensor
"""
import glob
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from compare import print_table

try:
    import torch
    import torch.nn.functional as F
    from safetensors.torch import load_file, save_file

    from pytorch_reference import BERT, build, inputs, logits_of

    HALF = {"bf16": torch.bfloat16, "f16": torch.float16}
except ImportError:  # --report reads measured rows and needs no PyTorch
    torch = None

LR, MOMENTUM = 0.01, 0.9


def reference_model(name):
    """The model as migprof trains it: no dropout, no stochastic depth (torchvision's Swin drops paths
    in training by default)."""
    model, kind = build(name, 128)
    from torchvision.ops import StochasticDepth

    for m in model.modules():
        if isinstance(m, StochasticDepth):
            m.p = 0.0
    return model, kind


def migprof_name(name, key):
    # migprof's BERT is Hugging Face's BertModel plus the classifier: no `bert.` prefix.
    return key[len("bert."):] if name in BERT and key.startswith("bert.") else key


def steps(model, kind, x, labels, mode, counts):
    """SGD steps of `model` under `mode` (f64, f32, autocast-bf16, autocast-f16); the trainable weights
    (f64, on the host) after each step count in `counts`, the steps GradScaler had skipped by then, the
    loss of every step, and for each step GradScaler skipped the parameters whose gradient was not finite."""
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    half = HALF.get(mode.removeprefix("autocast-")) if mode.startswith("autocast-") else None
    scaler = torch.amp.GradScaler("cuda", init_scale=65536.0) if mode == "autocast-f16" else None
    model.train()
    out, skipped, skips = {}, 0, {}
    losses, overflowed = [], {}
    for step in range(1, max(counts) + 1):
        with torch.autocast("cuda", dtype=half or torch.float32, enabled=half is not None):
            logits = logits_of(model, kind, x)
            # The exact run keeps its loss in f64 too; the others compute it in f32, as autocast does.
            loss = F.cross_entropy(logits.double() if mode == "f64" else logits.float(), labels)
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if scaler:
            before = scaler.get_scale()
            scaler.scale(loss).backward()
            bad = [k for k, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
            if bad:
                overflowed[step] = bad
            scaler.step(opt)
            scaler.update()
            skipped += scaler.get_scale() < before
        else:
            loss.backward()
            opt.step()
        if step in counts:
            out[step] = {k: v.detach().double().cpu() for k, v in model.named_parameters()}
            skips[step] = skipped
    return out, skips, losses, overflowed


def errors(origin, start, after, exact):
    """Each tensor's |update - exact update| / |exact update| (see `error`), by name."""
    if set(after) != set(exact):
        raise SystemExit(f"the runs name their tensors differently: {sorted(set(after) ^ set(exact))[:5]}")
    out = {}
    for k, e in exact.items():
        d_exact = e - origin[k]
        norm = d_exact.norm().item()
        if norm != 0.0:
            out[k] = ((after[k] - start[k]) - d_exact).norm().item() / norm
    return out


def median(errs):
    """The median of tensors' errors (`errors`), nan where no tensor moved."""
    return statistics.median(errs.values()) if errs else float("nan")


def error(origin, start, after, exact):
    """Median over tensors of |update - exact update| / |exact update|: the update from `start` (the
    weights the steps began from) to `after`, the exact one from `origin` (the f32 weights the f64 run
    began from) to `exact`."""
    return median(errors(origin, start, after, exact))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", help="migprof's update_steps example")
    ap.add_argument("--report", action="store_true", help="print the table of what DIR holds")
    ap.add_argument("--models", default="resnet50,vit_b_16,swin_t,bert_base")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--work", default="/tmp/migprof-update-error")
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    os.makedirs(args.work, exist_ok=True)
    if args.report:
        return report(args.work, args.markdown)
    if not args.bin:
        raise SystemExit("--bin names migprof's update_steps example")
    if torch is None:
        raise SystemExit("measuring needs PyTorch, torchvision, transformers and safetensors")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    counts = (1, 3)
    for name in args.models.split(","):
        records, t0 = [], time.perf_counter()
        torch.manual_seed(0)
        model, kind = reference_model(name)
        state = {migprof_name(name, k): v.float().contiguous() for k, v in model.state_dict().items()
                 if v.is_floating_point()}
        weights = f"{args.work}/{name}-weights.safetensors"
        save_file(state, weights)
        gen = torch.Generator(device="cuda").manual_seed(1)
        x, labels = inputs(kind, args.batch, 128, torch.device("cuda"), gen)
        batch = {"labels": labels.cpu()}
        if kind == "image":
            batch["pixels"] = x[0].cpu()
        else:
            ids, mask, types = x
            batch.update(input_ids=ids.cpu(), attention_mask=mask.cpu(), token_type_ids=types.contiguous().cpu())
        batch_file = f"{args.work}/{name}-batch.safetensors"
        save_file(batch, batch_file)
        before = {migprof_name(name, k): v.detach().double().cpu() for k, v in model.named_parameters()}

        def run(mode):
            m, _ = reference_model(name)
            m.load_state_dict(model.state_dict())
            m = m.cuda()
            xs = x
            if mode == "f64":
                m = m.double()
                xs = tuple(t.double() if t.is_floating_point() else t for t in x)
            got, skipped, losses, overflowed = steps(m, kind, xs, labels, mode, counts)
            named = {s: {migprof_name(name, k): v for k, v in w.items()} for s, w in got.items()}
            overflowed = {s: [migprof_name(name, k) for k in ks] for s, ks in overflowed.items()}
            return named, skipped, losses, overflowed

        exact, _, exact_losses, _ = run("f64")
        f32, _, _, _ = run("f32")
        tensors = []
        for dtype in ("bf16", "f16"):
            auto, auto_skipped, auto_losses, auto_overflowed = run(f"autocast-{dtype}")
            theirs = {n: errors(before, before, auto[n], exact[n]) for n in counts}
            ours, our_losses = {}, {}
            for masters in ("f32", "none"):
                prefix = f"{args.work}/{name}-{dtype}-{masters}"
                p = subprocess.run([args.bin, name, dtype, masters, ",".join(map(str, counts)), weights, batch_file,
                                    prefix], capture_output=True, text=True)
                if p.returncode != 0:
                    raise SystemExit(f"update_steps {name} {dtype} {masters}:\n{p.stderr}")
                # "step N: loss X" after each step.
                our_losses[masters] = [float(l.split("loss ")[1]) for l in p.stderr.splitlines()
                                       if l.startswith("step ") and ": loss " in l]
                for n in counts:
                    # "after step N: ScaleReading { scale: …, skipped: K, … }" where training keeps masters.
                    skipped = next((int(l.split("skipped: ")[1].split(",")[0]) for l in p.stderr.splitlines()
                                    if l.startswith(f"after step {n}:") and "skipped: " in l), 0)
                    got = {k: v.double() for k, v in load_file(f"{prefix}-{n}.safetensors").items()}
                    # Without masters the steps start from the weights rounded to the dtype.
                    start = before if masters == "f32" else {k: v.to(HALF[dtype]).double() for k, v in before.items()}
                    mine = errors(before, start, got, exact[n])
                    ours[masters, n] = (median(mine), skipped)
                    if masters == "f32":
                        for k, e in mine.items():
                            tensors.append({"model": name, "dtype": dtype, "steps": n, "tensor": k,
                                            "kind": tensor_kind(k, before[k].dim()), "pytorch_autocast": theirs[n][k],
                                            "migprof_masters": e})
            for n in counts:
                e_f32, e_auto = error(before, before, f32[n], exact[n]), median(theirs[n])
                mine, none = ours["f32", n], ours["none", n]
                ratio = mine[0] / e_auto
                rec = {"model": name, "dtype": dtype, "steps": n, "pytorch_f32": e_f32, "pytorch_autocast": e_auto,
                       "migprof_masters": mine[0], "ratio": ratio, "migprof_none": none[0],
                       "skipped_pytorch": auto_skipped[n], "skipped_migprof": mine[1],
                       "loss_f64": exact_losses[:n], "loss_pytorch_autocast": auto_losses[:n],
                       "loss_migprof_masters": our_losses["f32"][:n],
                       "overflowed_pytorch": {str(s): ks for s, ks in auto_overflowed.items() if s <= n}}
                records.append(rec)
                print(json.dumps(rec), flush=True)
            del auto
        torch.cuda.empty_cache()
        with open(f"{args.work}/update-error-{name}.jsonl", "w") as f:
            for r in records:
                f.write(json.dumps(r) + "\n")
        with open(f"{args.work}/update-tensors-{name}.jsonl", "w") as f:
            for r in tensors:
                f.write(json.dumps(r) + "\n")
        print(f"{name}: {time.perf_counter() - t0:.0f} s", file=sys.stderr)


def report(work, markdown):
    head = ["model", "dtype", "steps", "pytorch f32", "pytorch autocast", "migprof masters", "masters / autocast",
            "migprof none", "skipped (pytorch, migprof)", "judged"]
    records = [json.loads(line) for path in sorted(glob.glob(f"{work}/update-error-*.jsonl")) for line in open(path)]
    rows = [[r["model"], r["dtype"], str(r["steps"]), f"{r['pytorch_f32']:.2g}", f"{r['pytorch_autocast']:.2g}",
             f"{r['migprof_masters']:.2g}", f"{r['ratio']:.2f}", f"{r['migprof_none']:.2g}",
             f"{r['skipped_pytorch']}, {r['skipped_migprof']}", "yes" if judged(r) else "no"] for r in records]
    print_table(head, rows, markdown)
    kept = [r for r in records if judged(r)]
    met = sum(r["ratio"] <= 2.0 for r in kept)
    print(f"\n{met} of {len(kept)} judged cells within 2x PyTorch autocast's own update error; "
          f"{len(records) - len(kept)} not judged (a step skipped, or f32's own error within 10x of autocast's)")
    for r in records:
        if "loss_f64" in r and r["steps"] == max(x["steps"] for x in records if x["model"] == r["model"]):
            losses = ", ".join(f"{k.removeprefix('loss_')} {' '.join(f'{v:.4g}' for v in r[k])}"
                               for k in ("loss_f64", "loss_pytorch_autocast", "loss_migprof_masters"))
            print(f"{r['model']} {r['dtype']} losses by step: {losses}")
            for step, names in r.get("overflowed_pytorch", {}).items():
                print(f"  step {step} skipped by GradScaler: {len(names)} gradients not finite, e.g. {names[:4]}")
    report_tensors(work, markdown)


def tensor_kind(name, dims):
    """Where a tensor sits, for the error by kind: what autocast keeps in f32 (layer norms,
    embeddings) apart from the products' weights and biases it computes in half precision."""
    lower = name.lower()
    if "norm" in lower or ".ln" in lower or lower.startswith("ln"):
        return "layer norm"
    if "embedding" in lower or "class_token" in lower:
        return "embedding"
    if dims >= 2:
        return "weight"
    return "bias"


def report_tensors(work, markdown):
    """Each kind of tensor's median error on both sides, and the tensors furthest from autocast's."""
    rows = [json.loads(line) for path in sorted(glob.glob(f"{work}/update-tensors-*.jsonl")) for line in open(path)]
    if not rows:
        return
    groups = {}
    for r in rows:
        groups.setdefault((r["model"], r["dtype"], r["steps"], r["kind"]), []).append(r)
    table = []
    for (model, dtype, n, kind), rs in sorted(groups.items()):
        auto = statistics.median(r["pytorch_autocast"] for r in rs)
        mine = statistics.median(r["migprof_masters"] for r in rs)
        worst = max(rs, key=lambda r: r["migprof_masters"] / max(r["pytorch_autocast"], 1e-30))
        table.append([model, dtype, str(n), kind, str(len(rs)), f"{auto:.2g}", f"{mine:.2g}", f"{mine / auto:.2f}",
                      f"{worst['tensor']} ({worst['migprof_masters'] / max(worst['pytorch_autocast'], 1e-30):.1f}x)"])
    print()
    print_table(["model", "dtype", "steps", "kind", "tensors", "autocast median", "masters median",
                 "masters / autocast", "furthest from autocast"], table, markdown)


def judged(r):
    """Whether a cell says anything about half precision: no step skipped on either side (a skipped
    step's error is 1 whatever the precision) and f32's own error well below autocast's (else the
    steps diverge from f64 whatever the precision: a randomly initialised ResNet-50's do)."""
    return (r["skipped_pytorch"] == 0 and r["skipped_migprof"] == 0
            and r["pytorch_f32"] * 10 <= r["pytorch_autocast"])


if __name__ == "__main__":
    main()
