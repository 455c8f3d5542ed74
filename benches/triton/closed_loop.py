"""Triton's own client (tritonclient.http) in a closed loop: one process per request in flight, each
sending its next request when its last is answered, all measuring the same window. Prints
`concurrency requests_per_s p50_ms p99_ms`.

    python closed_loop.py --url localhost:8000 --model resnet50 --batch 8 --concurrency 1,2,3 --seconds 5
"""

import argparse
import multiprocessing as mp
import time

import numpy as np


def client(url, model, batch, seq_len, start, seconds, out):
    import tritonclient.http as http

    c = http.InferenceServerClient(url)
    if model == "resnet50":
        x = np.random.default_rng(0).random((batch, 3, 224, 224), dtype=np.float32)
        inputs = [http.InferInput("input", list(x.shape), "FP32")]
        inputs[0].set_data_from_numpy(x, binary_data=True)
        outputs = [http.InferRequestedOutput("output", binary_data=True)]
    else:
        ids = np.random.default_rng(0).integers(0, 2, (batch, seq_len), dtype=np.int64)
        inputs = [http.InferInput(n, list(ids.shape), "INT64") for n in ("input_ids", "attention_mask")]
        for i in inputs:
            i.set_data_from_numpy(ids, binary_data=True)
        outputs = [http.InferRequestedOutput("pooled", binary_data=True)]
    latencies = []
    while time.time() < start + seconds:
        t = time.perf_counter()
        c.infer(model, inputs, outputs=outputs).as_numpy(outputs[0].name())
        if time.time() >= start:
            latencies.append(time.perf_counter() - t)
    out.put(latencies)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="localhost:8000")
    p.add_argument("--model", default="resnet50")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--concurrency", default="1,2,3")
    p.add_argument("--seconds", type=float, default=5.0)
    a = p.parse_args()
    for n in [int(c) for c in a.concurrency.split(",")]:
        out = mp.Queue()
        start = time.time() + 2.0  # every client warms up for 2 s, then all measure the same window
        procs = [mp.Process(target=client, args=(a.url, a.model, a.batch, a.seq_len, start, a.seconds, out)) for _ in range(n)]
        [q.start() for q in procs]
        lat = sorted(sum((out.get() for _ in procs), []))
        [q.join() for q in procs]
        print(f"{n} {len(lat) / a.seconds:.1f} {lat[len(lat) // 2] * 1e3:.2f} {lat[int(len(lat) * 0.99)] * 1e3:.2f}", flush=True)


if __name__ == "__main__":
    main()
