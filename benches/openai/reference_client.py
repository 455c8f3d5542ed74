#!/usr/bin/env python3
"""A reference load client for OpenAI-compatible LLM servers, on the official `openai` package, to
check that `migprof load --protocol openai` measures what a user's own client would.

    python reference_client.py --base-url http://127.0.0.1:8080/v1 [--model M] [--api completions|chat]
        [--concurrency 4] [--duration 10] [--warmup 2] [--prompt-len 32] [--output-len 32]
        [--vocab 1000] [--seed 0]

A closed loop, as migprof's: --concurrency clients, each sending its next streaming request as soon
as its last one has ended, for --warmup then --duration seconds; the requests in flight at the end
are waited for. Each request asks for exactly --output-len tokens (max_tokens, with vLLM's and
llama.cpp's ignore_eos and vLLM's min_tokens) and for the usage chunk (stream_options include_usage).
Prompts:
  completions  --prompt-len token ids drawn uniformly from [0, --vocab), new for each request (a
               repeated prompt would be served from the server's prefix cache).
  chat         one user message of --prompt-len short words; the server's chat template adds tokens,
               and its tokenizer decides how many tokens the words are.

Per request, times are taken from just before the request is sent:
  TTFT  to the first chunk with non-empty text (completions: choices[0].text; chat:
        choices[0].delta.content), so a chat's role-only first chunk does not count;
  E2E   to the last chunk with non-empty text;
  TPOT  (E2E - TTFT) / (output tokens - 1), for requests of more than one token;
output tokens being usage.completion_tokens from the stream (or, where a server sends no usage, the
number of chunks with text, counted in no_usage).

Requests sent during the warm-up are not measured. The window runs from the warm-up's end to the last
measured answer, as migprof's does; requests_per_s and output_tokens_per_s are the measured requests
answered, and their output tokens, over it. Percentiles are nearest-rank: sorted[round((n - 1) q)].

Prints one JSON object: concurrency, requests (measured and answered), ttft_p50_ms, ttft_p99_ms,
tpot_p50_ms, e2e_p50_ms, requests_per_s, output_tokens_per_s, short (answered with fewer than
--output-len tokens), failed (measured requests that raised or streamed no text), no_usage and
window_s. The first failures' reasons go to stderr. Exits with 1 when no measured request was
answered.
"""

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time

from openai import AsyncOpenAI

# Short English words for chat prompts.
WORDS = (
    "the cat sat on a mat and ran to see the dog by an old red barn in low sun as we all "
    "went home for tea with milk but not too much yet so it was fine you know how far one "
    "can go when day is done"
).split()


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", required=True, help="the server's OpenAI base URL, e.g. http://127.0.0.1:8080/v1")
    parser.add_argument("--model", help="the model to ask for; the first one /v1/models lists if not given")
    parser.add_argument("--api", choices=["completions", "chat"], default="completions")
    parser.add_argument("--concurrency", type=int, default=1)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds of measured requests")
    parser.add_argument("--warmup", type=float, default=2.0, help="seconds of requests not measured, first")
    parser.add_argument("--prompt-len", type=int, default=32, help="token ids (completions) or words (chat)")
    parser.add_argument("--output-len", type=int, default=32, help="tokens asked for")
    parser.add_argument("--vocab", type=int, default=1000, help="completions prompts' ids are drawn from [0, vocab)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY", "none"))
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    args = parser.parse_args()
    if args.concurrency < 1 or args.prompt_len < 1 or args.output_len < 1 or args.vocab < 1:
        parser.error("--concurrency, --prompt-len, --output-len and --vocab must be at least 1")
    if args.duration <= 0 or args.warmup < 0:
        parser.error("--duration must be above 0 and --warmup at least 0")
    return args


def make_prompt(args, rng):
    if args.api == "completions":
        return [rng.randrange(args.vocab) for _ in range(args.prompt_len)]
    return " ".join(rng.choice(WORDS) for _ in range(args.prompt_len))


async def one_request(client, args, prompt, t0):
    """Sends one streaming request; returns its times (seconds from t0), output tokens and failure."""
    kwargs = dict(
        model=args.model,
        max_tokens=args.output_len,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "min_tokens": args.output_len},
    )
    r = {"sent": time.perf_counter() - t0, "first": None, "last": None, "tokens": None, "chunks": 0, "failure": None}
    try:
        if args.api == "completions":
            stream = await client.completions.create(prompt=prompt, **kwargs)
        else:
            stream = await client.chat.completions.create(messages=[{"role": "user", "content": prompt}], **kwargs)
        async for chunk in stream:
            now = time.perf_counter() - t0
            # llama.cpp puts usage in the last choice's chunk of a completion, OpenAI and vLLM in a
            # chunk of its own with no choices: take it wherever it is.
            if chunk.usage is not None:
                r["tokens"] = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice = chunk.choices[0]
            text = choice.text if args.api == "completions" else (choice.delta.content if choice.delta else None)
            if text:
                r["chunks"] += 1
                if r["first"] is None:
                    r["first"] = now
                r["last"] = now
        if r["first"] is None:
            r["failure"] = "no text in the answer"
    except Exception as e:  # every failure is counted alike
        r["failure"] = f"{type(e).__name__}: {e}"
    r["done"] = time.perf_counter() - t0
    return r


async def worker(index, client, args, t0, results):
    """One client of the closed loop: a request at a time until warm-up plus duration have passed."""
    rng = random.Random(args.seed * 1_000_003 + index)
    end = args.warmup + args.duration
    while time.perf_counter() - t0 < end:
        prompt = make_prompt(args, rng)
        results.append(await one_request(client, args, prompt, t0))


def nearest_rank(values, q):
    """sorted(values)[round((n - 1) q)], rounding halves up as migprof does; None if empty."""
    if not values:
        return None
    values = sorted(values)
    return values[math.floor((len(values) - 1) * q + 0.5)]


def ms(seconds):
    return None if seconds is None else round(seconds * 1e3, 3)


def summarize(args, results):
    measured = [r for r in results if r["sent"] >= args.warmup]
    ok = [r for r in measured if r["failure"] is None]
    failed = [r for r in measured if r["failure"] is not None]
    no_usage = 0
    for r in ok:
        if r["tokens"] is None:
            r["tokens"] = r["chunks"]
            no_usage += 1
    ttft = [r["first"] - r["sent"] for r in ok]
    e2e = [r["last"] - r["sent"] for r in ok]
    tpot = [(r["last"] - r["first"]) / (r["tokens"] - 1) for r in ok if r["tokens"] > 1]
    window = max((r["done"] for r in ok), default=args.warmup) - args.warmup
    tokens = sum(r["tokens"] for r in ok)
    for r in failed[:3]:
        print(f"failed: {r['failure']}", file=sys.stderr)
    return {
        "concurrency": args.concurrency,
        "requests": len(ok),
        "ttft_p50_ms": ms(nearest_rank(ttft, 0.5)),
        "ttft_p99_ms": ms(nearest_rank(ttft, 0.99)),
        "tpot_p50_ms": ms(nearest_rank(tpot, 0.5)),
        "e2e_p50_ms": ms(nearest_rank(e2e, 0.5)),
        "requests_per_s": round(len(ok) / window, 3) if window > 0 else None,
        "output_tokens_per_s": round(tokens / window, 3) if window > 0 else None,
        "short": sum(1 for r in ok if r["tokens"] < args.output_len),
        "failed": len(failed),
        "no_usage": no_usage,
        "window_s": round(window, 3),
    }


async def run(args):
    # No retries: a failed request is counted, not silently sent again with its time lost.
    client = AsyncOpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=args.timeout)
    async with client:
        if args.model is None:
            try:
                args.model = (await client.models.list()).data[0].id
            except Exception as e:
                sys.exit(f"could not list the server's models (give --model): {type(e).__name__}: {e}")
        results = []
        t0 = time.perf_counter()
        await asyncio.gather(*(worker(i, client, args, t0, results) for i in range(args.concurrency)))
    return results


def main():
    args = parse_args()
    results = asyncio.run(run(args))
    summary = summarize(args, results)
    print(json.dumps(summary))
    if summary["requests"] == 0:
        sys.exit("no measured request was answered")


if __name__ == "__main__":
    main()
