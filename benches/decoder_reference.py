#!/usr/bin/env python3
"""PyTorch's decoders beside migprof's generate runs: the Llama and Qwen2 presets (their config.json in
workloads/configs), seeded random weights built on the GPU (nothing is downloaded), bf16 weights, a
prompt of --prompt tokens and --output new tokens per sequence (the first from the prefill, every other
from a decode step, as migprof counts them), greedy, every sequence of the batch decoding to the end.

Variants (`--variants`, each row says which), the ways a PyTorch user runs a decoder:
  eager     transformers' `generate` with its default dynamic cache
  static    transformers' `generate` with `cache_implementation="static"`: a static KV cache and the
            decode step compiled by transformers (torch.compile, fullgraph, mode "reduce-overhead": CUDA
            graphs), as transformers documents for speed
  gptfast   a compiled decode loop of the gpt-fast kind: the same weights in a plain PyTorch decoder
            with fused q/k/v and gate/up projections and a static KV cache, written in place at the
            step's positions; the decode step torch.compile'd (fullgraph, mode "reduce-overhead") and the
            prefill compiled apart; checked against transformers' logits first (`check_*` in its row)

Timing, each step synchronised before the clock is read, as migprof measures: for `gptfast` every decode
step is timed; for `eager` and `static`, whose loop is transformers' own, a generate of 1 token (the time
to the first token) and one of all of them, the decode step being their difference over the decode steps.
A fresh compile per batch (per shape); the compile (the warm-up generations) is timed apart as `compile_s`.

Rows (JSON lines): model, mode "generate", dtype, batch, prompt_len, output_len, variant, ttft_p50_ms,
decode_step_p50_ms, decode_step_mean_ms, decode_tokens_per_s (batch x 1000 / the mean step: migprof's
`decode_tokens_per_s`), throughput (the same, for compare.py), compile_s, device_used_mib, verdict.

usage: decoder_reference.py --models llama_3_2_1b --batches 1,8,32 [--prompt 512] [--output 128]
       [--variants eager,static,gptfast] [--generations 3] > rows.jsonl
"""
import argparse
import gc
import json
import os
import statistics
import sys
import time

os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", "/tmp/migprof-inductor")

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytorch_reference import Slowdowns  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "workloads", "configs")


def build(name):
    """The preset's model with transformers' seeded initialisation, in bf16 on the GPU."""
    cfg = AutoConfig.from_pretrained(os.path.join(CONFIGS, f"{name}.json"))
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


def prompts(cfg, batch, length):
    gen = torch.Generator(device="cuda").manual_seed(1)
    return torch.randint(0, cfg.vocab_size, (batch, length), device="cuda", generator=gen)


def synced():
    torch.cuda.synchronize()
    return time.perf_counter()


def rms_norm(x, weight, eps):
    """transformers' RMSNorm: in f32, back to the input's dtype, then the weight."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class FastDecoder(torch.nn.Module):
    """The model's weights in a decoder of the gpt-fast kind: a static KV cache of `batch` x `length`
    positions, written at the step's positions, attention over the whole cache behind a mask."""

    def __init__(self, model, batch, length):
        super().__init__()
        c = model.config
        self.eps, self.heads, self.kv_heads = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        m = model.model

        def param(t):
            # Parameters and buffers, not plain attributes: compiled CUDA graphs take those as static
            # and would copy anything else into the graph's inputs at every replay.
            return torch.nn.Parameter(t, requires_grad=False)

        self.embed = param(m.embed_tokens.weight)
        self.norm = param(m.norm.weight)
        self.lm_head = param(model.lm_head.weight)
        self.layers = torch.nn.ModuleList()
        for layer in m.layers:
            a, p = layer.self_attn, layer.mlp
            w = torch.nn.ParameterDict(dict(
                ln1=param(layer.input_layernorm.weight), ln2=param(layer.post_attention_layernorm.weight),
                wqkv=param(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                wo=param(a.o_proj.weight), wgu=param(torch.cat([p.gate_proj.weight, p.up_proj.weight])),
                wd=param(p.down_proj.weight),
            ))
            if a.q_proj.bias is not None:
                w["bqkv"] = param(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            self.layers.append(w)
        shape = (c.num_hidden_layers, batch, self.kv_heads, length, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=torch.bfloat16, device="cuda"), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=torch.bfloat16, device="cuda"), persistent=False)
        # transformers' own rotary tables (its frequency scaling included) for every position.
        positions = torch.arange(length, device="cuda")[None]
        probe = torch.zeros(1, length, self.head_dim, dtype=torch.bfloat16, device="cuda")
        cos, sin = m.rotary_emb(probe, positions)
        self.register_buffer("cos", cos[0].contiguous(), persistent=False)
        self.register_buffer("sin", sin[0].contiguous(), persistent=False)
        allowed = torch.tril(torch.ones(length, length, dtype=torch.bool, device="cuda"))
        self.register_buffer("allowed", allowed, persistent=False)

    def forward(self, tokens, pos):
        b, t = tokens.shape
        x = F.embedding(tokens, self.embed)
        cos, sin = self.cos[pos][None, None], self.sin[pos][None, None]
        mask = self.allowed[pos][None, None]
        q_dim, kv_dim = self.heads * self.head_dim, self.kv_heads * self.head_dim
        for i, w in enumerate(self.layers):
            qkv = F.linear(rms_norm(x, w["ln1"], self.eps), w["wqkv"], w["bqkv"] if "bqkv" in w else None)
            q, k, v = qkv.split([q_dim, kv_dim, kv_dim], dim=-1)
            q = q.view(b, t, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(b, t, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            self.k_cache[i].index_copy_(2, pos, k)
            self.v_cache[i].index_copy_(2, pos, v)
            y = F.scaled_dot_product_attention(q, self.k_cache[i], self.v_cache[i], attn_mask=mask, enable_gqa=True)
            x = x + F.linear(y.transpose(1, 2).reshape(b, t, q_dim), w["wo"])
            gate, up = F.linear(rms_norm(x, w["ln2"], self.eps), w["wgu"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w["wd"])
        return F.linear(rms_norm(x, self.norm, self.eps), self.lm_head)


def check_fast(model):
    """The gpt-fast decoder against transformers on one short prompt: the largest logit difference over
    the largest logit, prefill and 8 decode steps, and the greedy tokens that agree before the first
    that differs."""
    cfg = model.config
    ids = prompts(cfg, 1, 32)
    fast = FastDecoder(model, 1, 64)
    with torch.inference_mode():
        ref = model.generate(ids, max_new_tokens=9, min_new_tokens=9, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, pad_token_id=0)
        ref_logits = torch.stack(ref.logits, 1)[0].float()
        got = [fast(ids, torch.arange(32, device="cuda"))[:, -1]]
        tokens = ref.sequences[0, 32:]
        for s in range(8):
            got.append(fast(tokens[s:s + 1][None], torch.tensor([32 + s], device="cuda"))[:, -1])
        got = torch.cat(got).float()
    rel = ((got - ref_logits).abs().max() / ref_logits.abs().max()).item()
    agree = 0
    for a, b in zip(got.argmax(-1).tolist(), tokens.tolist()):
        if a != b:
            break
        agree += 1
    del fast
    return {"check_rel_logit_diff": rel, "check_tokens_agree": f"{agree}/9"}


def run_generate(model, ids, new_tokens, static):
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    if static:
        kwargs["cache_implementation"] = "static"
    with torch.inference_mode():
        t0 = synced()
        model.generate(ids, **kwargs)
        return (synced() - t0) * 1e3


def measure_transformers(model, batch, args, variant):
    ids = prompts(model.config, batch, args.prompt)
    static = variant == "static"
    t0 = synced()
    run_generate(model, ids, 1, static)
    run_generate(model, ids, args.output, static)
    warmup_s = synced() - t0
    firsts, wholes, slowdowns = [], [], Slowdowns()
    for _ in range(args.generations):
        firsts.append(run_generate(model, ids, 1, static))
        wholes.append(run_generate(model, ids, args.output, static))
        slowdowns.read()
    ttft = statistics.median(firsts)
    step = (statistics.median(wholes) - ttft) / (args.output - 1)
    return ttft, step, step, warmup_s, slowdowns


def measure_fast(model, batch, args):
    length = args.prompt + args.output - 1
    fast = FastDecoder(model, batch, length)

    # Two functions, so that each compile keeps its own cache (a prompt's shape, and a token's).
    def prefill_pass(tokens, pos):
        return fast(tokens, pos)

    def decode_pass(tokens, pos):
        return fast(tokens, pos)

    prefill = torch.compile(prefill_pass, fullgraph=True)
    decode = torch.compile(decode_pass, mode="reduce-overhead", fullgraph=True)
    ids = prompts(model.config, batch, args.prompt)
    prompt_pos = torch.arange(args.prompt, device="cuda")

    def generation(steps_ms):
        with torch.inference_mode():
            t0 = synced()
            token = prefill(ids, prompt_pos)[:, -1].argmax(-1, keepdim=True)
            ttft = (synced() - t0) * 1e3
            for s in range(args.output - 1):
                pos = torch.tensor([args.prompt + s], device="cuda")
                t0 = synced()
                token = decode(token, pos)[:, -1].argmax(-1, keepdim=True).clone()
                steps_ms.append((synced() - t0) * 1e3)
        return ttft

    t0 = synced()
    for _ in range(2):
        generation([])
    warmup_s = synced() - t0
    firsts, steps, slowdowns = [], [], Slowdowns()
    for _ in range(args.generations):
        firsts.append(generation(steps))
        slowdowns.read()
    del fast, prefill, decode
    return statistics.median(firsts), statistics.median(steps), statistics.fmean(steps), warmup_s, slowdowns


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--batches", default="1")
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--variants", default="eager,static,gptfast")
    ap.add_argument("--generations", type=int, default=3)
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    for name in args.models.split(","):
        model = build(name)
        check = check_fast(model) if "gptfast" in args.variants else {}
        print(f"# {name}: gpt-fast decoder against transformers: {check}", file=sys.stderr, flush=True)
        for batch in map(int, args.batches.split(",")):
            for variant in args.variants.split(","):
                row = {"framework": "pytorch", "model": name, "mode": "generate", "dtype": "bf16", "batch": batch,
                       "prompt_len": args.prompt, "output_len": args.output, "variant": variant}
                try:
                    if variant == "gptfast":
                        ttft, p50, mean, warmup_s, slowdowns = measure_fast(model, batch, args)
                        row.update(check)
                    else:
                        ttft, p50, mean, warmup_s, slowdowns = measure_transformers(model, batch, args, variant)
                except Exception as e:  # a variant this torch or transformers cannot run: said, not fatal
                    row["error"] = f"{type(e).__name__}: {e}"[:500]
                    print(json.dumps(row), flush=True)
                    torch._dynamo.reset()
                    gc.collect()
                    torch.cuda.empty_cache()
                    continue
                free, total = torch.cuda.mem_get_info()
                share, verdict = slowdowns.verdict()
                row.update({
                    "ttft_p50_ms": ttft, "decode_step_p50_ms": p50, "decode_step_mean_ms": mean,
                    "decode_tokens_per_s": batch * 1000.0 / mean, "throughput": batch * 1000.0 / mean,
                    "compile_s": warmup_s if variant != "eager" else None, "device_used_mib": (total - free) / 2**20,
                    "slowdown_share": share, "verdict": verdict, "torch": torch.__version__,
                    "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(0),
                })
                print(json.dumps(row), flush=True)
                # Nothing of this cell stays for the next to count: compiled graphs and their memory.
                torch._dynamo.reset()
                gc.collect()
                torch.cuda.empty_cache()
        del model
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
