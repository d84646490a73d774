"""An elastic training job for the tests: prints a hash of the model and optimizer state at each sync/commit.

Lines (each prefixed by the launcher with ``[worker]<stdout>:``)::

    SYNC worker=W rank=R size=N step=S hash=H     after every (re)start of train(), once synced
    COMMIT worker=W rank=R size=N step=S hash=H   after each commit's save (every --commit-every steps
                                                  and at each epoch's end)
    DONE worker=W rank=R size=N step=S hash=H epochs=E

--kill-rank R --kill-step S: the worker that is rank R of the first world kills itself (SIGKILL) before
step S, once (a marker file), after removing its host from --hosts-file (the host is gone).
--grow-host H --grow-step S: rank 0 appends H:1 to --hosts-file after step S, and training goes on
(epoch by epoch, at most 50) until the world has --grow-to workers.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import time

import torch

import ringcomm_torch as hvd


def digest(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().numpy().tobytes())
    for pid, st in sorted(optimizer.state_dict()["state"].items()):
        for key, value in sorted(st.items()):
            h.update(f"{pid}.{key}".encode())
            h.update(value.detach().contiguous().numpy().tobytes() if torch.is_tensor(value) else repr(value).encode())
    return h.hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--commit-every", type=int, default=4)
    p.add_argument("--sleep", type=float, default=0.0)
    p.add_argument("--kill-rank", type=int, default=-1)
    p.add_argument("--kill-step", type=int, default=-1)
    p.add_argument("--marker", default="")
    p.add_argument("--hosts-file", default="")
    p.add_argument("--grow-host", default="")
    p.add_argument("--grow-step", type=int, default=-1)
    p.add_argument("--grow-to", type=int, default=0)
    args = p.parse_args()
    wid = os.environ.get("RINGCOMM_ELASTIC_WORKER", "?")

    torch.manual_seed(0)
    hvd.init()
    first_rank, first_size = hvd.rank(), hvd.size()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(192, 8, generator=g)
    y = x @ torch.arange(8.0).unsqueeze(1) + 0.1 * torch.randn(192, 1, generator=g)
    dataset = torch.utils.data.TensorDataset(x, y)
    sampler = hvd.elastic.ElasticSampler(dataset, shuffle=True, seed=3)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    torch.manual_seed(100 + int(wid) if wid.isdigit() else 0)  # workers start different: sync must fix it
    model = torch.nn.Linear(8, 1)
    optimizer = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
                                         named_parameters=model.named_parameters())
    state = hvd.elastic.TorchState(model, optimizer, sampler=sampler, epoch=0, step=0)

    def line(kind: str) -> str:
        return (f"{kind} worker={wid} rank={hvd.rank()} size={hvd.size()} step={state.step} "
                f"hash={digest(model, optimizer)}")

    def commit() -> None:  # state.commit(), printing the committed state's hash in between
        state.save()
        print(line("COMMIT"), flush=True)
        state.check_host_updates()

    @hvd.elastic.run
    def train(state: hvd.elastic.TorchState) -> None:
        print(line("SYNC"), flush=True)
        while state.epoch < args.epochs or (hvd.size() < args.grow_to and state.epoch < 50):
            for i, (xb, yb) in enumerate(loader):
                if (state.step == args.kill_step and first_rank == args.kill_rank and first_size == hvd.size()
                        and not os.path.exists(args.marker)):
                    host = os.environ["RINGCOMM_HOSTNAME"]
                    with open(args.hosts_file) as f:
                        kept = [h for h in f.read().splitlines() if h.split(":")[0] != host]
                    with open(args.hosts_file, "w") as f:
                        f.write("\n".join(kept) + "\n")
                    open(args.marker, "w").close()
                    print(f"KILL worker={wid} rank={hvd.rank()} step={state.step}", flush=True)
                    os.kill(os.getpid(), 9)
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(xb), yb).backward()
                optimizer.step()
                state.step += 1
                state.sampler.record_batch(i, loader.batch_size)
                if state.step % args.commit_every == 0:
                    commit()
                if args.grow_host and hvd.rank() == 0 and state.step == args.grow_step:
                    with open(args.hosts_file, "a") as f:
                        f.write(f"{args.grow_host}:1\n")
                time.sleep(args.sleep)
            state.epoch += 1
            state.sampler.set_epoch(state.epoch)
            commit()

    train(state)
    print(line("DONE") + f" epochs={state.epoch}", flush=True)


if __name__ == "__main__":
    main()
