"""A real Triton Inference Server (PyTriton's bundled tritonserver) serving small NumPy models on the
CPU, for the tests of `migprof load --endpoint` and for measuring migprof's client against Triton's.

    python triton_server.py --http-port 8000 [--delay-ms 2] [--models dense,tokens]

Models:
  dense   FP32 [-1, 16] -> FP32 [-1, 4]: a product with a fixed matrix, then --delay-ms of sleep
          (a server whose time per request is known).
  tokens  INT64 input_ids and attention_mask [-1, -1] -> FP32 pooled [-1, 8] (a BERT-shaped
          signature, whose sequence length the client gives).
  half    FP16 [-1, 8] -> FP16 [-1, 8] (travels only through the binary extension).
  broken  FP32 [-1, 16] -> FP32 [-1, 4] declared, but answers [-1, 3]: a server whose answers do
          not match its own metadata.

Stops cleanly on SIGTERM and SIGINT (PyTriton unloads its models and stops tritonserver).
"""

import argparse
import signal
import time

import numpy as np
from pytriton.decorators import batch
from pytriton.model_config import ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--delay-ms", type=float, default=0.0)
    parser.add_argument("--models", default="dense")
    parser.add_argument("--instances", type=int, default=4)
    args = parser.parse_args()
    # A SIGTERM ends the process as a Ctrl-C does: PyTriton's context manager then stops the server.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    weights = np.random.default_rng(0).standard_normal((16, 4)).astype(np.float32)

    @batch
    def dense(x):
        if args.delay_ms > 0:
            time.sleep(args.delay_ms / 1000.0)
        return {"y": x @ weights}

    @batch
    def tokens(input_ids, attention_mask):
        pooled = (input_ids * attention_mask).sum(axis=1, keepdims=True).astype(np.float32)
        return {"pooled": np.repeat(pooled, 8, axis=1)}

    @batch
    def half(x):
        return {"y": (x * 2).astype(np.float16)}

    @batch
    def broken(x):
        return {"y": (x @ weights)[:, :3]}

    models = {
        "dense": (dense, [Tensor(name="x", dtype=np.float32, shape=(16,))], [Tensor(name="y", dtype=np.float32, shape=(4,))]),
        "tokens": (
            tokens,
            [Tensor(name="input_ids", dtype=np.int64, shape=(-1,)), Tensor(name="attention_mask", dtype=np.int64, shape=(-1,))],
            [Tensor(name="pooled", dtype=np.float32, shape=(8,))],
        ),
        "half": (half, [Tensor(name="x", dtype=np.float16, shape=(8,))], [Tensor(name="y", dtype=np.float16, shape=(8,))]),
        "broken": (broken, [Tensor(name="x", dtype=np.float32, shape=(16,))], [Tensor(name="y", dtype=np.float32, shape=(4,))]),
    }
    config = TritonConfig(http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    try:
        with Triton(config=config) as triton:
            for name in args.models.split(","):
                fn, inputs, outputs = models[name]
                triton.bind(
                    model_name=name,
                    infer_func=[fn] * args.instances,
                    inputs=inputs,
                    outputs=outputs,
                    config=ModelConfig(max_batch_size=64),
                )
            print(f"serving {args.models} on port {args.http_port}", flush=True)
            triton.serve()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
