#!/usr/bin/env python3
"""The Python side of ZeroTest.MatchesFsdp2: PyTorch's FSDP2 (fully_shard on each Linear and the root, with
MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32, output_dtype=fp32)) on Gloo, the reference amp's ZeRO at O2
bf16 with allreduce_always_fp32 is compared with.

  fsdp2.py DIR [WORLD]   # writes DIR/fsdp2.pt

Two optimizers step the fp32 shards: torch.optim.Adam (foreach=False), and LibTorch's Adam op for op (exp_avg.mul_
.add_, where torch.optim.Adam lerps), the optimizer the C++ side runs; each from the same start. fsdp2.pt holds
'torch_version', 'model' (the initial state_dict of zero.py's 12 -> 32 -> 32 -> 5 MLP), 'x' and 'y' (the global batch of every
step), 'lr', and for each optimizer ('torch_adam', 'libtorch_adam') NAME_final, the full parameters after the
steps, and NAME_losses, each rank's losses.
"""
import math
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from zero import GLOBAL, LR, batches, make_mlp, spawn_ranks


def libtorch_adam_step(params, states, step, lr, beta1=0.9, beta2=0.999, eps=1e-8):
    """torch::optim::Adam::step (torch/csrc/api/src/optim/adam.cpp) for weight_decay 0, op for op."""
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    for p in params:
        if p.grad is None:
            continue
        state = states.setdefault(p, {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)})
        grad = p.grad
        state["exp_avg"].mul_(beta1).add_(grad, alpha=1 - beta1)
        state["exp_avg_sq"].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (state["exp_avg_sq"].sqrt() / math.sqrt(bias_correction2)).add_(eps)
        p.addcdiv_(state["exp_avg"], denom, value=-(lr / bias_correction1))


def train(rank, world, optimizer_name):
    model = make_mlp()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    params = list(model.parameters())
    torch_adam = torch.optim.Adam(params, lr=LR, foreach=False) if optimizer_name == "torch_adam" else None
    states = {}
    xs, ys = batches()
    rows = GLOBAL // world
    losses = []
    for step, (x, y) in enumerate(zip(xs, ys), start=1):
        for p in params:
            p.grad = None
        loss = torch.nn.functional.cross_entropy(model(x[rank * rows:(rank + 1) * rows]), y[rank * rows:(rank + 1) * rows])
        loss.backward()
        losses.append(loss.item())
        with torch.no_grad():
            if torch_adam is not None:
                torch_adam.step()
            else:
                libtorch_adam_step(params, states, step, LR)
    final = {name: p.full_tensor().detach().clone() for name, p in model.named_parameters()}
    return final, losses


def run(rank, world, port, directory):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    out = {}
    for name in ("torch_adam", "libtorch_adam"):
        final, losses = train(rank, world, name)
        every_rank = [None] * world
        dist.all_gather_object(every_rank, losses)
        out[name + "_final"], out[name + "_losses"] = final, every_rank
    if rank == 0:
        xs, ys = batches()
        torch.save({"model": make_mlp().state_dict(), "x": xs, "y": ys, "lr": LR, "torch_version": torch.__version__, **out},
                   os.path.join(directory, "fsdp2.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    spawn_ranks(run, sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2)
