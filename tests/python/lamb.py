#!/usr/bin/env python3
"""The Python side of tests/fused_lamb_test.cpp: LAMB written from the paper (You et al. 2019, arXiv 1904.00962,
Algorithm 2) as Apex's FusedLAMB computes it (apex/optimizers/fused_lamb.py, csrc/multi_tensor_lamb.cu), in fp32
in the kernel's order, with the norms taken in float64 and rounded to fp32 once.

  lamb.py DIR             # reads DIR/lamb_cases.pt (written by C++), writes DIR/lamb_reference.pt
  lamb.py roundtrip DIR   # checks DIR/lamb_cpp.pt (C++'s put_optimizer) has Apex FusedLAMB's state_dict layout,
                          # writes DIR/lamb_python.pt: the same state as a Python script would change it

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


def roundtrip(directory):
    sd = torch.load(os.path.join(directory, "lamb_cpp.pt"), weights_only=False)["optimizer"]
    groups = sd["param_groups"]
    expected = ["lr", "bias_correction", "betas", "eps", "weight_decay", "grad_averaging", "max_grad_norm", "step",
                "params"]
    assert list(groups[0].keys()) == expected, list(groups[0].keys())
    assert "step" not in groups[1], groups[1]  # never stepped: Apex adds 'step' at the first step
    g = groups[0]
    assert isinstance(g["step"], int) and g["step"] == 3, g["step"]
    assert isinstance(g["bias_correction"], bool) and isinstance(g["grad_averaging"], bool)
    assert isinstance(g["betas"], tuple) and len(g["betas"]) == 2
    for index in g["params"]:
        assert sorted(sd["state"][index].keys()) == ["exp_avg", "exp_avg_sq"], sd["state"][index].keys()
    g["step"] += 1
    g["lr"] = 0.25
    groups[1]["step"] = 7
    for index in g["params"]:
        sd["state"][index]["exp_avg"] = sd["state"][index]["exp_avg"] * 2
    torch.save({"optimizer": sd}, os.path.join(directory, "lamb_python.pt"))


if __name__ == "__main__":
    if sys.argv[1] == "roundtrip":
        roundtrip(sys.argv[2])
    else:
        main(sys.argv[1])
