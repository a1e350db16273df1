#!/usr/bin/env python3
"""The Python side of ZeroTest.MatchesPythonZeroRedundancyOptimizer: torch's DDP + ZeroRedundancyOptimizer(Adam) at
fp32 on Gloo, the reference amp's ZeRO (O0) is compared with.

  zero.py DIR [WORLD]   # writes DIR/reference.pt

reference.pt holds 'model' (the initial state_dict of a 12 -> 32 -> 32 -> 5 MLP), 'x' and 'y' (the global batch of
every step), 'lr', and 'final' (rank 0's state_dict after the steps; ranks are identical under DDP).
"""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel

STEPS = 5
GLOBAL = 16
LR = 1e-2


def make_mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, 5))


def batches():
    g = torch.Generator().manual_seed(1)
    return ([torch.randn(GLOBAL, 12, generator=g) for _ in range(STEPS)],
            [torch.randint(0, 5, (GLOBAL,), generator=g) for _ in range(STEPS)])


def run(rank, world, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    model = make_mlp()
    ddp = DistributedDataParallel(model)
    optimizer = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.Adam, lr=LR)
    xs, ys = batches()
    rows = GLOBAL // world
    for x, y in zip(xs, ys):
        optimizer.zero_grad()
        out = ddp(x[rank * rows:(rank + 1) * rows])
        torch.nn.functional.cross_entropy(out, y[rank * rows:(rank + 1) * rows]).backward()
        optimizer.step()
    if rank == 0:
        xs, ys = batches()
        torch.save({"model": make_mlp().state_dict(), "x": xs, "y": ys, "lr": LR,
                    "final": {k: v.detach().clone() for k, v in model.state_dict().items()}},
                   os.path.join(directory, "reference.pt"))
    dist.barrier()
    dist.destroy_process_group()


def _rank_entry(rank, rank_main, world, port, directory):
    rank_main(rank, world, port, directory)
    # Leave without tearing down: Gloo's threads now and then abort a process at interpreter exit ("terminate called
    # without an active exception") after everything was written, which would fail the reference for nothing.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(rank_main, directory, world):
    """Runs rank_main(rank, world, port, directory) in `world` processes on a free port of 127.0.0.1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank_entry, args=(rank_main, world, port, directory), nprocs=world, join=True)


if __name__ == "__main__":
    spawn_ranks(run, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
