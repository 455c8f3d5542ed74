#!/usr/bin/env python3
"""Writes a tiny llama model with random weights as a GGUF file, for a real llama.cpp server
(scripts/setup-llama-server.sh) to serve on the CPU in the tests of `migprof load --protocol openai`.
Its answers are noise, but the server does all of its work: tokenizing, batching the slots, decoding
a token at a time and streaming it.

    python write_tiny_gguf.py PATH [--vocab test|llama] [--seed N]

Vocabularies:
  test   llama.cpp's "test" tokenizer (256 tokens; in llama.cpp since its PR #29084, 2026-09, so in
         the one setup-llama-server.sh builds). It has no end-of-text token, so the model always writes
         max_tokens tokens, and each token decodes to one or two hexadecimal digits, so each one
         arrives in a chunk of its own with non-empty text. Text is read five characters to a token.
  llama  a SentencePiece vocabulary (<unk>, <s>, </s>, the 256 byte tokens, printable ASCII and the
         word-start marker) that any llama.cpp loads. The model may sample </s> (stop it with
         ignore_eos) or bytes that are not whole UTF-8 characters (their chunk is held back).

Needs the `gguf` package (0.19.0) and numpy.
"""

import argparse

import gguf
import numpy as np


def write_tiny_gguf(path, vocab="test", seed=0, n_embd=64, n_head=4, n_layer=2, n_ff=128, n_ctx=4096):
    """Writes a llama model of n_layer blocks (n_embd wide, n_head attention heads, a feed-forward of
    n_ff) whose weights are drawn from N(0, 0.02²) by a generator seeded with `seed`, with norms of
    one, in FP32, declaring a context of n_ctx tokens. The same arguments write the same bytes."""
    rng = np.random.default_rng(seed)
    head_dim = n_embd // n_head
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_name(f"migprof tiny {vocab}")
    writer.add_context_length(n_ctx)
    writer.add_embedding_length(n_embd)
    writer.add_block_count(n_layer)
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_head)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens = add_vocabulary(writer, vocab)

    def random(*shape):
        return (rng.standard_normal(shape) * 0.02).astype(np.float32)

    def ones(n):
        return np.ones(n, dtype=np.float32)

    # A numpy array's shape is llama.cpp's ne[] reversed: ne {n_embd, n_vocab} is (n_vocab, n_embd).
    writer.add_tensor("token_embd.weight", random(len(tokens), n_embd))
    for i in range(n_layer):
        block = f"blk.{i}."
        writer.add_tensor(block + "attn_norm.weight", ones(n_embd))
        writer.add_tensor(block + "attn_q.weight", random(n_head * head_dim, n_embd))
        writer.add_tensor(block + "attn_k.weight", random(n_head * head_dim, n_embd))
        writer.add_tensor(block + "attn_v.weight", random(n_head * head_dim, n_embd))
        writer.add_tensor(block + "attn_output.weight", random(n_embd, n_head * head_dim))
        writer.add_tensor(block + "ffn_norm.weight", ones(n_embd))
        writer.add_tensor(block + "ffn_gate.weight", random(n_ff, n_embd))
        writer.add_tensor(block + "ffn_up.weight", random(n_ff, n_embd))
        writer.add_tensor(block + "ffn_down.weight", random(n_embd, n_ff))
    writer.add_tensor("output_norm.weight", ones(n_embd))
    writer.add_tensor("output.weight", random(len(tokens), n_embd))

    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_vocabulary(writer, vocab):
    """Adds the tokenizer's keys; returns the token list."""
    if vocab == "test":
        # The test tokenizer reads only the number of tokens: their text and scores are placeholders.
        tokens = [f"tok_{i}" for i in range(256)]
        writer.add_tokenizer_model("test")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        return tokens
    if vocab == "llama":
        kind = gguf.TokenType
        tokens = ["<unk>", "<s>", "</s>"]
        types = [kind.UNKNOWN, kind.CONTROL, kind.CONTROL]
        # Byte fallback: a character outside the vocabulary is written as its UTF-8 bytes, <0xXX> each.
        tokens += [f"<0x{b:02X}>" for b in range(256)]
        types += [kind.BYTE] * 256
        tokens += [chr(c) for c in range(0x21, 0x7F)] + ["\u2581"]
        types += [kind.NORMAL] * (0x7F - 0x21 + 1)
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        writer.add_token_types(types)
        writer.add_unk_token_id(0)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
        return tokens
    raise ValueError(f"unknown vocabulary {vocab!r}: test or llama")


def main():
    parser = argparse.ArgumentParser(description="Writes a tiny random-weight llama model as GGUF.")
    parser.add_argument("path")
    parser.add_argument("--vocab", choices=["test", "llama"], default="test")
    parser.add_argument("--seed", type=int, default=0)
    # Wider and deeper than the default where a test needs the server, not its client, to take the
    # time: a client's own milliseconds are then within the noise.
    parser.add_argument("--n-embd", type=int, default=64, help="width (a multiple of 4 heads)")
    parser.add_argument("--n-layer", type=int, default=2)
    args = parser.parse_args()
    write_tiny_gguf(
        args.path,
        vocab=args.vocab,
        seed=args.seed,
        n_embd=args.n_embd,
        n_layer=args.n_layer,
        n_ff=2 * args.n_embd,
    )


if __name__ == "__main__":
    main()
