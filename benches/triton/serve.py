"""A Triton Inference Server (PyTriton) with a PyTorch model inside, on the GPU: the server of the
study "Triton on a whole GPU against a slice", for `migprof load --endpoint` (benches/triton_slices.sh).

    python serve.py --model resnet50|bert_base [--http-port 8000 --grpc-port 8001 --metrics-port 8002]

resnet50: torchvision ResNet-50 (seeded random weights), fp16, channels_last; input FP32
[-1, 3, 224, 224], output FP32 [-1, 1000]. bert_base: Hugging Face BertModel (bert-base config,
seeded random weights), fp16; inputs INT64 input_ids and attention_mask [-1, -1], output FP32
pooled [-1, 768]. Dynamic batching up to 64, 100 us queue delay. SIGTERM stops it as Ctrl-C does.
"""

import argparse
import signal

import numpy as np
import torch
from pytriton.decorators import batch
from pytriton.model_config import DynamicBatcher, ModelConfig, Tensor
from pytriton.triton import Triton, TritonConfig, TritonSecurityConfig

signal.signal(signal.SIGTERM, signal.default_int_handler)


def resnet50():
    import torchvision

    torch.manual_seed(0)
    net = torchvision.models.resnet50(weights=None).cuda().eval().half().to(memory_format=torch.channels_last)

    @batch
    def infer(input):  # noqa: A002 (the tensor's name)
        x = torch.from_numpy(input).cuda(non_blocking=True).half().contiguous(memory_format=torch.channels_last)
        with torch.inference_mode():
            return {"output": net(x).float().cpu().numpy()}

    inputs = [Tensor(name="input", dtype=np.float32, shape=(3, 224, 224))]
    outputs = [Tensor(name="output", dtype=np.float32, shape=(1000,))]
    return infer, inputs, outputs


def bert_base():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    net = BertModel(BertConfig()).cuda().eval().half()

    @batch
    def infer(input_ids, attention_mask):
        ids = torch.from_numpy(input_ids).cuda(non_blocking=True)
        mask = torch.from_numpy(attention_mask).cuda(non_blocking=True)
        with torch.inference_mode():
            return {"pooled": net(input_ids=ids, attention_mask=mask).pooler_output.float().cpu().numpy()}

    inputs = [
        Tensor(name="input_ids", dtype=np.int64, shape=(-1,)),
        Tensor(name="attention_mask", dtype=np.int64, shape=(-1,)),
    ]
    outputs = [Tensor(name="pooled", dtype=np.float32, shape=(768,))]
    return infer, inputs, outputs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["resnet50", "bert_base"], default="resnet50")
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--access-token", default="migprof-bench", help="PyTriton's token for its restricted APIs (perf_analyzer needs it)")
    args = parser.parse_args()
    infer, inputs, outputs = {"resnet50": resnet50, "bert_base": bert_base}[args.model]()
    config = TritonConfig(http_port=args.http_port, grpc_port=args.grpc_port, metrics_port=args.metrics_port)
    try:
        with Triton(config=config, security_config=TritonSecurityConfig(access_token=args.access_token)) as triton:
            triton.bind(
                model_name=args.model,
                infer_func=infer,
                inputs=inputs,
                outputs=outputs,
                config=ModelConfig(max_batch_size=64, batcher=DynamicBatcher(max_queue_delay_microseconds=100)),
                strict=True,
            )
            print(f"serving {args.model} on port {args.http_port}", flush=True)
            triton.serve()
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
