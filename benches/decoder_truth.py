"""migprof's Llama and Qwen2 decoders against transformers, from the same random weights.

For each model: transformers builds it from the preset's config.json (workloads/configs) with its own
seeded initialisation and saves it as a Hugging Face folder (nothing is downloaded); migprof loads
that folder (benches/decode_logits.rs) in f32 and bf16. Both sides run the same prompts and, for
the decode steps, the same tokens (the f64 run's greedy tokens), so their logits are of the same
history; each side also generates greedily on its own, migprof both step by step through the
model's `forward` and through the `Generator` that `migprof run --mode generate` times (CUDA graphs
replaying a contiguous cache's decode steps, every token held until the end). A model named
`PRESET-untied` is the preset with an output head of its own.

Printed per model and dtype: the largest logit difference between migprof and transformers at
that dtype (prefill and decode), each side's error against transformers in f64 (the largest
difference over the largest logit), and how many greedy tokens of each sequence agree with
transformers' at that dtype before the first that differs (with the reference's margin between its
top two logits there: a near tie is where low precision may choose either).

usage: python3 decoder_truth.py --bin DECODE_LOGITS --work DIR
       [--models llama_3_2_1b,qwen2_5_1_5b,qwen2_5_0_5b-untied]
       [--batch 2] [--prompt 32] [--steps 16]
"""

import argparse
import json
import os
import subprocess
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModelForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "..", "workloads", "configs")
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16}


def make_folder(name, work):
    """The preset with transformers' seeded random weights, saved as a folder migprof reads. A name
    ending in `-untied` is the preset with an output head of its own (tie_word_embeddings false)."""
    folder = os.path.join(work, name)
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    preset = name.removesuffix("-untied")
    spec = os.path.join(work, name + "-config")
    os.makedirs(spec, exist_ok=True)
    with open(os.path.join(CONFIGS, preset + ".json")) as f:
        config_json = json.load(f)
    if name.endswith("-untied"):
        config_json["tie_word_embeddings"] = False
    with open(os.path.join(spec, "config.json"), "w") as f:
        json.dump(config_json, f)
    config = AutoConfig.from_pretrained(spec)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return folder


def run(model, prompt, forced):
    """Logits of the prompt and of each forced token after it, and the greedy tokens from the prompt."""
    with torch.no_grad():
        out = model(prompt, use_cache=True)
        prefill = out.logits.float().cpu()
        cache = out.past_key_values
        decode = []
        for i in range(forced.shape[1]):
            out = model(forced[:, i : i + 1], past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            decode.append(out.logits[:, -1].float().cpu())
        out = model(prompt, use_cache=True)
        token = out.logits[:, -1].argmax(-1, keepdim=True)
        greedy = [token]
        cache = out.past_key_values
        for _ in range(forced.shape[1]):
            out = model(token, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            greedy.append(token)
    return prefill, torch.stack(decode), torch.cat(greedy, 1).cpu()


def agreeing_prefix(a, b, ref_logits):
    """Per sequence: tokens equal before the first that differs, and the reference's top-2 margin there."""
    out = []
    for s in range(a.shape[0]):
        n = 0
        while n < a.shape[1] and a[s, n] == b[s, n]:
            n += 1
        margin = None
        if n < a.shape[1] and ref_logits is not None and n >= 1 and n - 1 < ref_logits.shape[0]:
            top = ref_logits[n - 1, s].topk(2).values
            margin = float(top[0] - top[1])
        out.append((n, margin))
    return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--bin", required=True)
    p.add_argument("--work", required=True)
    p.add_argument("--models", default="llama_3_2_1b,qwen2_5_1_5b,qwen2_5_0_5b-untied")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--steps", type=int, default=16)
    a = p.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.makedirs(a.work, exist_ok=True)
    results = []
    for name in a.models.split(","):
        folder = make_folder(name, a.work)
        with open(os.path.join(folder, "config.json")) as f:
            saved = json.load(f)
        print(f"{name}: folder {folder}, config keys {sorted(saved)}", flush=True)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).cuda().eval()
        g = torch.Generator().manual_seed(1)
        prompt = torch.randint(0, model.config.vocab_size, (a.batch, a.prompt), generator=g).cuda()
        # The f64 run's greedy tokens are the history both sides decode.
        _, _, truth_greedy = run(model, prompt, torch.zeros((a.batch, a.steps), dtype=torch.long).cuda())
        forced = truth_greedy[:, : a.steps].cuda()
        truth = run(model, prompt, forced)
        tokens = os.path.join(a.work, name + "-tokens.safetensors")
        save_file({"prompt": prompt.cpu().contiguous(), "forced": forced.cpu().contiguous()}, tokens)
        scale = max(truth[0].abs().max().item(), truth[1].abs().max().item())
        for dtype, torch_dtype in DTYPES.items():
            model = model.to(torch_dtype)
            ref = run(model, prompt, forced)
            out = os.path.join(a.work, f"{name}-{dtype}-migprof.safetensors")
            subprocess.run([a.bin, folder, dtype, tokens, out], check=True)
            ours = load_file(out)
            ours_pre, ours_dec, ours_greedy = ours["prefill_logits"], ours["decode_logits"], ours["greedy"]

            def err(x, y):
                return float((x.double() - y.double()).abs().max())

            row = {
                "model": name,
                "dtype": dtype,
                "vs_transformers_prefill": err(ours_pre, ref[0]),
                "vs_transformers_decode": err(ours_dec, ref[1]),
                "migprof_vs_f64": max(err(ours_pre, truth[0]), err(ours_dec, truth[1])) / scale,
                "transformers_vs_f64": max(err(ref[0], truth[0]), err(ref[1], truth[1])) / scale,
                "logit_scale": scale,
                "greedy_tokens": ours_greedy.shape[1],
                "greedy_agree": agreeing_prefix(ours_greedy, ref[2], ref[1]),
                # The generator `migprof run` times (graphs on, its decode steps' own kernels): its
                # tokens against the model's own steps, and against transformers' (with the
                # reference's margin where they part: in bf16 a near tie may go either way).
                "generated_equal": bool((ours["generated"] == ours_greedy).all()),
                "generated_agree": agreeing_prefix(ours["generated"], ref[2], ref[1]),
                "transformers_greedy_vs_f64": agreeing_prefix(ref[2], truth[2], truth[1]),
            }
            row["error_ratio"] = row["migprof_vs_f64"] / max(row["transformers_vs_f64"], 1e-300)
            # The same with a paged cache (blocks of 16): the same logits, the same tokens.
            paged_out = os.path.join(a.work, f"{name}-{dtype}-migprof-paged.safetensors")
            ran = subprocess.run([a.bin, folder, dtype, tokens, paged_out, "16"])
            if ran.returncode == 0:
                paged = load_file(paged_out)
                row["paged_vs_contiguous"] = max(
                    err(paged["prefill_logits"], ours_pre), err(paged["decode_logits"], ours_dec)
                )
                row["paged_greedy_equal"] = bool((paged["greedy"] == ours_greedy).all())
                row["paged_generated_equal"] = bool((paged["generated"] == ours_greedy).all())
            else:
                row["paged_vs_contiguous"], row["paged_greedy_equal"] = float("nan"), f"failed ({ran.returncode})"
                row["paged_generated_equal"] = row["paged_greedy_equal"]
            results.append(row)
            print(json.dumps(row), flush=True)
        del model
        torch.cuda.empty_cache()
    print("\n| model | dtype | max |Δ| vs transformers, prefill | decode | migprof vs f64 | transformers vs f64 | ratio | greedy tokens equal (of n) | paged − contiguous max |Δ| | paged tokens equal | generator (run's path) tokens equal to transformers' (of n) | generator equal to the steps, contiguous / paged |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        agree = ", ".join(str(n) for n, _ in r["greedy_agree"])
        generated = ", ".join(str(n) for n, _ in r["generated_agree"])
        print(
            f"| {r['model']} | {r['dtype']} | {r['vs_transformers_prefill']:.2e} | {r['vs_transformers_decode']:.2e} | "
            f"{r['migprof_vs_f64']:.2e} | {r['transformers_vs_f64']:.2e} | {r['error_ratio']:.2f} | {agree} (of {r['greedy_tokens']}) | "
            f"{r['paged_vs_contiguous']:.2e} | {r['paged_greedy_equal']} | {generated} | {r['generated_equal']} / {r['paged_generated_equal']} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
