#!/usr/bin/env python3
"""Reads back what examples/finetune_torchscript saved: Python's torch.jit.load runs the fine-tuned module (fp32
weights) on the digits 5-9 validation split and prints its accuracy.

  evaluate.py DIGITS_CSV FINETUNED.pt
"""
import sys

import torch

from pretrain import read_digits, split


def main(digits, path):
    module = torch.jit.load(path).eval()
    dtypes = {p.dtype for p in module.parameters()}
    assert dtypes == {torch.float32}, f"expected fp32 weights, found {dtypes}"
    _, _, vx, vy = split(*read_digits(digits), low=False)
    with torch.no_grad():
        accuracy = (module(vx).argmax(1) == vy).float().mean().item()
    print(f"Python torch.jit.load of {path}: fp32 weights, {100 * accuracy:.2f}% validation accuracy on digits 5-9")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
