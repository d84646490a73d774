"""What every torch.distributed benchmark worker starts with: its arguments and its process group.

    p = _torch_group.parser()             # --backend --rank --world --port --out
    p.add_argument("--steps", type=int)
    a = p.parse_args()
    _torch_group.join(a)                  # one thread, the group on a.backend
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist


def parser() -> argparse.ArgumentParser:
    """A parser holding every worker's arguments: the backend, this rank, the world size, the
    rendezvous port on 127.0.0.1 and the file rank 0 writes its results to."""
    p = argparse.ArgumentParser()
    p.add_argument("--backend", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", required=True)
    return p


def join(a: argparse.Namespace) -> None:
    """Run torch on one thread and join the group of ``a.world`` ranks on ``a.backend``."""
    torch.set_num_threads(1)
    if a.backend == "ringcomm":
        import ringcomm_torch.distributed  # noqa: F401  (registers the backend)
    dist.init_process_group(a.backend, init_method=f"tcp://127.0.0.1:{a.port}", rank=a.rank, world_size=a.world)
