#!/usr/bin/env python3
"""Python's half of examples/finetune_torchscript: define a small ResNet in Python, pretrain it in fp32 on digits
0-4, give it a fresh head for the new task and save it with torch.jit.script, as a pretrained model comes out of a
Python codebase.

  pretrain.py DIGITS_CSV OUT.pt [--epochs N]

DIGITS_CSV is scikit-learn's digits.csv (64 pixels 0..16 and the label per line); the C++ program fine-tunes the
saved module on digits 5-9 with its BatchNorm frozen, and evaluate.py reads the result back.
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, cin, cout, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        identity = x if self.down is None else self.down(x)
        return F.relu(out + identity)


class SmallResNet(nn.Module):
    def __init__(self, classes=5):
        super().__init__()
        self.stem = nn.Conv2d(1, 16, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(16)
        self.layer1 = Block(16, 16, 1)
        self.layer2 = Block(16, 32, 2)
        self.head = nn.Linear(32, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        return self.head(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def read_digits(path):
    rows = [list(map(float, line.split(","))) for line in open(path) if line.strip()]
    data = torch.tensor(rows)
    return (data[:, :64] / 16.0).reshape(-1, 1, 8, 8), data[:, 64].long()


def split(images, labels, low):
    """Digits 0-4 (low) or 5-9 relabelled 0-4: the first 80% to train, the rest to validate (as the C++ side)."""
    mask = labels < 5 if low else labels >= 5
    x, y = images[mask], labels[mask] - (0 if low else 5)
    n = x.shape[0] * 4 // 5
    return x[:n], y[:n], x[n:], y[n:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("digits")
    parser.add_argument("out")
    parser.add_argument("--epochs", type=int, default=4)
    args = parser.parse_args()
    torch.manual_seed(0)
    x, y, vx, vy = split(*read_digits(args.digits), low=True)
    net = SmallResNet()
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    for _ in range(args.epochs):
        net.train()
        order = torch.randperm(x.shape[0])
        for start in range(0, x.shape[0], 32):
            index = order[start:start + 32]
            opt.zero_grad()
            F.cross_entropy(net(x[index]), y[index]).backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        accuracy = (net(vx).argmax(1) == vy).float().mean().item()
    print(f"pretrained in Python (fp32) on digits 0-4: {100 * accuracy:.2f}% validation accuracy")
    net.head = nn.Linear(32, 5)  # a fresh head for the new task (digits 5-9); the body keeps what it learned
    torch.jit.script(net.train()).save(args.out)
    print(f"saved with torch.jit.script: {args.out}")


if __name__ == "__main__":
    main()
