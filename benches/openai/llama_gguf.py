"""Write a GGUF with Llama-3.2-1B's shape and random f16 weights, for llama-server.

Usage: python3 llama_gguf.py OUT.gguf [--ctx 131072] [--layers 16] [--seed 0]

Needs the `gguf` package (pure Python) and numpy. The tokenizer is llama.cpp's "test" one:
text is cut into 5-character chunks hashed to ids, and an id decodes to its hex digits, so
every generated token is one non-empty text chunk. It has no EOS, so a request always runs
to max_tokens. Token-id prompts (ids < 128256) are the exact way to set the prompt length.
"""
import argparse
import os
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import gguf

N_VOCAB = 128256
N_EMBD = 2048
N_HEAD = 32
N_HEAD_KV = 8
HEAD_DIM = 64
N_FF = 8192


def tensors(n_layer):
    # (name, numpy shape, is_norm). numpy shape is llama.cpp's ne[] reversed.
    # No output.weight: Llama-3.2-1B ties it to token_embd, and llama.cpp does the same.
    yield "token_embd.weight", (N_VOCAB, N_EMBD), False
    for i in range(n_layer):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (N_EMBD,), True
        yield p + "attn_q.weight", (N_HEAD * HEAD_DIM, N_EMBD), False
        yield p + "attn_k.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD), False
        yield p + "attn_v.weight", (N_HEAD_KV * HEAD_DIM, N_EMBD), False
        yield p + "attn_output.weight", (N_EMBD, N_HEAD * HEAD_DIM), False
        yield p + "ffn_norm.weight", (N_EMBD,), True
        yield p + "ffn_gate.weight", (N_FF, N_EMBD), False
        yield p + "ffn_up.weight", (N_FF, N_EMBD), False
        yield p + "ffn_down.weight", (N_EMBD, N_FF), False
    yield "output_norm.weight", (N_EMBD,), True


def make(seed, i, shape, norm):
    if norm:
        return np.ones(shape, dtype=np.float32)
    # Small weights (std 0.02, as in a fresh init) keep activations finite in f16.
    t = np.random.default_rng([seed, i]).standard_normal(shape, dtype=np.float32)
    t *= 0.02
    return t.astype(np.float16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t0 = time.time()

    w = gguf.GGUFWriter(a.out, "llama")
    w.add_name("llama-3.2-1b-shape-random")
    w.add_context_length(a.ctx)
    w.add_embedding_length(N_EMBD)
    w.add_block_count(a.layers)
    w.add_feed_forward_length(N_FF)
    w.add_head_count(N_HEAD)
    w.add_head_count_kv(N_HEAD_KV)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(500000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(N_VOCAB)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    w.add_tokenizer_model("test")
    w.add_token_list([f"tok_{i}" for i in range(N_VOCAB)])
    w.add_token_scores([0.0] * N_VOCAB)

    # Stream the tensors: declare them all first, then write them one by one, so only a few
    # are in memory at a time instead of the whole 2.5 GB model.
    specs = list(tensors(a.layers))
    for name, shape, norm in specs:
        dtype = np.float32 if norm else np.float16
        w.add_tensor_info(name, shape, np.dtype(dtype), int(np.prod(shape)) * np.dtype(dtype).itemsize)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    # numpy's generators release the GIL, so a few threads fill the next tensors while
    # this one is written; at most `ahead` tensors are held at once.
    ahead = min(8, os.cpu_count() or 1)
    with ThreadPoolExecutor(ahead) as pool:
        pending = deque()
        for i, (name, shape, norm) in enumerate(specs):
            pending.append(pool.submit(make, a.seed, i, shape, norm))
            if len(pending) >= ahead:
                w.write_tensor_data(pending.popleft().result())
        while pending:
            w.write_tensor_data(pending.popleft().result())
    w.close()
    n = sum(int(np.prod(s)) for _, s, _ in specs)
    print(f"wrote {a.out}: {n / 1e9:.3f} B parameters in {time.time() - t0:.1f} s")


if __name__ == "__main__":
    main()
