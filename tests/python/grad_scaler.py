#!/usr/bin/env python3
"""The Python side of GradScalerPythonTest (tests/sync_free_test.cpp): torch.amp.GradScaler on the CPU.

  grad_scaler.py DIR   # writes DIR/grad_scaler.pt

One fp32 weight w of 8 values, loss = (w * x).sum() * factor (factor inf on steps 1 and 5), SGD lr 0.1 without
momentum, GradScaler(init_scale=1000, growth_factor=1.5, backoff_factor=0.3, growth_interval=2): odd factors, so the
scale update's float rounding shows. grad_scaler.pt holds torch_version, the scale and growth tracker after each
update() ('scales' fp32, 'trackers' int64) and the final w.
"""
import os
import sys

import torch

FACTORS = [1.0, float("inf"), 1.0, 1.0, 1.0, float("inf"), 1.0, 1.0, 1.0, 1.0]


def main(directory):
    w = (torch.arange(8, dtype=torch.float32) / 8 + 0.5).requires_grad_(True)
    x = (torch.arange(8, dtype=torch.float32) - 3.5) / 4
    optimizer = torch.optim.SGD([w], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_factor=1.5, backoff_factor=0.3, growth_interval=2)
    scales, trackers = [], []
    for factor in FACTORS:
        optimizer.zero_grad()
        scaler.scale((w * x).sum() * factor).backward()
        scaler.step(optimizer)
        scaler.update()
        scales.append(scaler._scale.item())
        trackers.append(int(scaler._growth_tracker.item()))
    torch.save({"torch_version": torch.__version__, "scales": torch.tensor(scales, dtype=torch.float32),
                "trackers": torch.tensor(trackers, dtype=torch.int64), "w": w.detach().clone()},
               os.path.join(directory, "grad_scaler.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
