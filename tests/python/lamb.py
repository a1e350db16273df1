#!/usr/bin/env python3
"""The Python side of tests/fused_lamb_test.cpp: LAMB written from the paper (You et al. 2019, arXiv 1904.00962,
Algorithm 2) as Apex's FusedLAMB computes it (apex/optimizers/fused_lamb.py, csrc/multi_tensor_lamb.cu), in fp32
in the kernel's order, with the norms taken in float64 and rounded to fp32 once.

  lamb.py DIR   # reads DIR/lamb_cases.pt (written by C++), writes DIR/lamb_reference.pt

lamb_cases.pt: {'params': [p0, ...], 'grads': [[g0, ...] per step], 'groups': [{'params': [indices], 'lr', 'beta1',
'beta2', 'eps', 'weight_decay', 'bias_correction', 'adam_w_mode', 'grad_averaging', 'use_nvlamb'}],
'max_grad_norm': float}. lamb_reference.pt: {'params': [...], 'exp_avg': [...], 'exp_avg_sq': [...], 'torch_version'} after all steps.
"""
import os
import struct
import sys

import torch


def f32(x):  # a Python float rounded to fp32, as pybind hands Apex's kernel its float arguments
    return struct.unpack("f", struct.pack("f", x))[0]


def norm(t):
    return t.double().pow(2).sum().sqrt().float()


def main(directory):
    cases = torch.load(os.path.join(directory, "lamb_cases.pt"), weights_only=False)
    params = [p.float().clone() for p in cases["params"]]
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    max_grad_norm = f32(cases["max_grad_norm"])
    steps = [0] * len(cases["groups"])
    one = torch.tensor(1.0)
    for grads in cases["grads"]:
        # Global norm of every gradient before any update; divide by norm / max where it exceeds max.
        total = torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt().float()
        clip = torch.where(total > max_grad_norm, total / max_grad_norm, one) if max_grad_norm > 0 else one
        for gi, group in enumerate(cases["groups"]):
            steps[gi] += 1
            beta1, beta2 = f32(group["beta1"]), f32(group["beta2"])
            lr, eps, wd = f32(group["lr"]), f32(group["eps"]), f32(group["weight_decay"])
            t = torch.tensor  # fp32 scalars, so every product below rounds to fp32 as the kernel's float math
            bc1 = t(1 - beta1 ** steps[gi]).float() if group["bias_correction"] else t(1.0)
            bc2 = t(1 - beta2 ** steps[gi]).float() if group["bias_correction"] else t(1.0)
            beta3 = (t(1.0) - t(beta1)) if group["grad_averaging"] else t(1.0)
            for i in group["params"]:
                p, g = params[i], grads[i].float()
                scaled = g / clip
                if not group["adam_w_mode"]:
                    scaled = scaled + t(wd) * p
                m[i] = m[i] * t(beta1) + beta3 * scaled
                v[i] = v[i] * t(beta2) + (t(1.0) - t(beta2)) * scaled * scaled
                update = (m[i] / bc1) / ((v[i] / bc2).sqrt() + t(eps))
                if group["adam_w_mode"]:
                    update = update + t(wd) * p
                ratio = t(lr)
                if group["use_nvlamb"] or wd != 0:
                    pn, un = norm(p), norm(update)
                    if pn != 0 and un != 0:
                        ratio = t(lr) * (pn / un)
                params[i] = p - ratio * update
    torch.save({"params": params, "exp_avg": m, "exp_avg_sq": v, "torch_version": torch.__version__},
               os.path.join(directory, "lamb_reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
