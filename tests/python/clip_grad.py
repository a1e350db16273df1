#!/usr/bin/env python3
"""The Python side of tests/clip_grad_test.cpp: torch.nn.utils.clip_grad_norm_ on the gradients C++ saw.

  clip_grad.py DIR   # reads DIR/cases.pt (written by C++), writes DIR/reference.pt

cases.pt holds {'cases': {name: [grad, ...]}, 'max_norm': {name: float}}. For each case and norm type (2, 1, inf)
reference.pt holds, under 'name/norm', torch's norm and clipped gradients on the gradients as given ('norm',
'clipped') and on fp32 copies of them ('norm_fp32', 'clipped_fp32': for bf16/fp16 gradients torch rounds each
tensor's norm to that dtype, amp accumulates in fp32).
"""
import math
import os
import sys

import torch


def clip(grads, max_norm, norm_type):
    params = []
    for g in grads:
        p = torch.zeros_like(g, requires_grad=True)
        p.grad = g.clone()
        params.append(p)
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    return norm.float(), [p.grad for p in params]


def main(directory):
    cases = torch.load(os.path.join(directory, "cases.pt"), weights_only=False)
    out = {}
    for name, grads in cases["cases"].items():
        max_norm = cases["max_norm"][name]
        for label, norm_type in (("2", 2.0), ("1", 1.0), ("inf", math.inf)):
            norm, clipped = clip(grads, max_norm, norm_type)
            norm32, clipped32 = clip([g.float() for g in grads], max_norm, norm_type)
            out[f"{name}/{label}"] = {"norm": norm, "clipped": clipped, "norm_fp32": norm32,
                                      "clipped_fp32": [c.to(g.dtype) for c, g in zip(clipped32, grads)]}
    torch.save(out, os.path.join(directory, "reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
