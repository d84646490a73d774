"""Synthetic training benchmark in the style of Horovod's pytorch_synthetic_benchmark.py.

    ringcomm-run -np 2 python examples/torch_synthetic_benchmark.py --model cnn --batch-size 32

Random 32x32x3 images and labels, a fixed model, ``DistributedOptimizer``; after
warm-up, each iteration times ``--num-batches-per-iter`` training steps.  Rank 0
prints img/s per iteration, then per rank and in total as mean +- 1.96 std.
``--model`` is ``cnn`` (small CNN), ``mlp``, or any torchvision model name when
torchvision is installed.
"""

from __future__ import annotations

import argparse
import timeit

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import ringcomm_torch as hvd


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description="PyTorch synthetic benchmark (ringcomm_torch)",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression during allreduce")
    p.add_argument("--model", type=str, default="cnn", help="cnn, mlp, or a torchvision model name")
    p.add_argument("--batch-size", type=int, default=32, help="input batch size per rank")
    p.add_argument("--num-warmup-batches", type=int, default=10, help="number of warm-up batches that don't count")
    p.add_argument("--num-batches-per-iter", type=int, default=10, help="number of batches per benchmark iteration")
    p.add_argument("--num-iters", type=int, default=10, help="number of benchmark iterations")
    p.add_argument("--num-threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
    return p.parse_args()


class SmallCNN(nn.Module):
    """Two conv blocks and two dense layers for 32x32x3 inputs (about 0.55 M parameters)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 32, 3, padding=1)
        self.conv2 = nn.Conv2d(32, 64, 3, padding=1)
        self.fc1 = nn.Linear(64 * 8 * 8, 128)
        self.fc2 = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def build_model(name: str) -> tuple[nn.Module, int]:
    """The model and the input image side it expects."""
    if name == "cnn":
        return SmallCNN(), 32
    if name == "mlp":
        return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 512), nn.ReLU(), nn.Linear(512, 256),
                             nn.ReLU(), nn.Linear(256, 10)), 32
    try:
        from torchvision import models
    except ImportError:
        raise SystemExit(f"--model {name}: unknown model (cnn, mlp; others need torchvision)") from None
    return getattr(models, name)(), 224


def main() -> None:
    args = parse_args()
    hvd.init()
    torch.set_num_threads(args.num_threads)
    cuda = not args.no_cuda and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(hvd.local_rank())
    device_kind = "GPU" if cuda else "CPU"

    model, side = build_model(args.model)
    if cuda:
        model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * hvd.size())
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    data = torch.randn(args.batch_size, 3, side, side)
    target = torch.randint(0, 10, (args.batch_size,))
    if cuda:
        data, target = data.cuda(), target.cuda()

    def benchmark_step() -> None:
        optimizer.zero_grad()
        loss = F.cross_entropy(model(data), target)
        loss.backward()
        optimizer.step()

    def log(text: str) -> None:
        if hvd.rank() == 0:
            print(text, flush=True)

    nparams = sum(p.numel() for p in model.parameters())
    log(f"Model: {args.model} ({nparams / 1e6:.2f} M parameters)")
    log(f"Batch size: {args.batch_size}")
    log(f"Number of {device_kind}s: {hvd.size()}")
    log("Running warmup...")
    timeit.timeit(benchmark_step, number=args.num_warmup_batches)
    log("Running benchmark...")
    img_secs = []
    for i in range(args.num_iters):
        seconds = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
        img_sec = args.batch_size * args.num_batches_per_iter / seconds
        log(f"Iter #{i}: {img_sec:.1f} img/sec per {device_kind}")
        img_secs.append(img_sec)
    mean, conf = float(np.mean(img_secs)), float(1.96 * np.std(img_secs))
    # every rank's own rate, so stragglers show up
    per_rank = hvd.allgather_object(round(mean, 1))
    log(f"Img/sec per {device_kind}: {mean:.1f} +-{conf:.1f}  (each rank: {per_rank})")
    log(f"Total img/sec on {hvd.size()} {device_kind}(s): {hvd.size() * mean:.1f} +-{hvd.size() * conf:.1f}")


if __name__ == "__main__":
    main()
