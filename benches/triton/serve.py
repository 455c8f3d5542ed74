"""A Triton Inference Server (PyTriton) with a PyTorch model inside, on the GPU: the server of the
study "Triton on a whole GPU against a slice", for `migprof load --endpoint` (benches/triton_slices.sh).

    python serve.py --model resnet50|bert_base [--http-port 8000 --grpc-port 8001 --metrics-port 8002]

resnet50: torchvision ResNet-50 (seeded random weights), fp16, channels_last; input FP32
[-1, 3, 224, 224], output FP32 [-1, 1000]. bert_base: BERT-base's encoder written in PyTorch
(embeddings of a 30522-token vocabulary, 12 post-norm layers of width 768, 12 heads, GELU MLP of
3072, the tanh pooler; seeded random weights), fp16, the attention through PyTorch's fused kernel
(scaled_dot_product_attention); inputs INT64 input_ids and attention_mask [-1, -1], output FP32
pooled [-1, 768]. Hugging Face's BertModel computes the same; it is not imported because PyTriton
0.7 needs numpy below 2, under which transformers 5.17 does not import it. Dynamic batching up to 64, 100 us queue delay. SIGTERM stops it as Ctrl-C does.
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


class Bert(torch.nn.Module):
    """BERT-base's encoder and pooler: the computation of Hugging Face's BertModel(BertConfig())."""

    def __init__(self, vocab=30522, width=768, layers=12, heads=12, mlp=3072, positions=512):
        super().__init__()
        self.heads = heads
        self.words = torch.nn.Embedding(vocab, width)
        self.positions = torch.nn.Embedding(positions, width)
        self.types = torch.nn.Embedding(2, width)
        self.norm = torch.nn.LayerNorm(width, eps=1e-12)
        self.layers = torch.nn.ModuleList(
            torch.nn.ModuleDict(
                {
                    "qkv": torch.nn.Linear(width, 3 * width),
                    "out": torch.nn.Linear(width, width),
                    "norm1": torch.nn.LayerNorm(width, eps=1e-12),
                    "up": torch.nn.Linear(width, mlp),
                    "down": torch.nn.Linear(mlp, width),
                    "norm2": torch.nn.LayerNorm(width, eps=1e-12),
                }
            )
            for _ in range(layers)
        )
        self.pool = torch.nn.Linear(width, width)

    def forward(self, ids, mask):
        b, n = ids.shape
        pos = torch.arange(n, device=ids.device)
        x = self.norm(self.words(ids) + self.positions(pos) + self.types(torch.zeros_like(ids)))
        # Padding keys are left out: -inf where the mask is 0 (BERT's extended attention mask).
        bias = (1.0 - mask[:, None, None, :].to(x.dtype)) * torch.finfo(x.dtype).min
        for layer in self.layers:
            q, k, v = layer["qkv"](x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=bias)
            x = layer["norm1"](x + layer["out"](a.transpose(1, 2).reshape(b, n, -1)))
            x = layer["norm2"](x + layer["down"](torch.nn.functional.gelu(layer["up"](x))))
        return torch.tanh(self.pool(x[:, 0]))


def bert_base():
    torch.manual_seed(0)
    net = Bert().cuda().eval().half()

    @batch
    def infer(input_ids, attention_mask):
        ids = torch.from_numpy(input_ids).cuda(non_blocking=True)
        mask = torch.from_numpy(attention_mask).cuda(non_blocking=True)
        with torch.inference_mode():
            return {"pooled": net(ids, mask).float().cpu().numpy()}

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
