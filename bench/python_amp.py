"""The Python side of the comparison: the models of bench/models.h, stepped with torch.amp (autocast +
GradScaler) on the same torch 2.13 wheel whose LibTorch amp builds against. Prints one CSV row per
measurement: section,name,config,metric,value (section "python").

    python3 bench/python_amp.py --reps 7
"""
import argparse
import math
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class TinyMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(784, 512), nn.Linear(512, 512), nn.Linear(512, 10)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Cnn(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(3, 32, 3, padding=1), nn.BatchNorm2d(32)
        self.conv2, self.bn2 = nn.Conv2d(32, 64, 3, padding=1), nn.BatchNorm2d(64)
        self.fc = nn.Linear(64 * 8 * 8, 10)

    def forward(self, x):
        h = F.max_pool2d(torch.relu(self.bn1(self.conv1(x))), 2)
        h = F.max_pool2d(torch.relu(self.bn2(self.conv2(h))), 2)
        return self.fc(h.flatten(1))


class Transformer(nn.Module):
    d, heads, ff = 256, 4, 1024

    def __init__(self):
        super().__init__()
        d = self.d
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.ff1, self.ff2 = nn.LayerNorm(d), nn.Linear(d, self.ff), nn.Linear(self.ff, d)
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(torch.matmul(qkv[0], qkv[1].transpose(-2, -1)) / math.sqrt(d // self.heads), -1)
        h = x + self.proj(torch.matmul(attention, qkv[2]).transpose(1, 2).reshape(b, s, d))
        h = h + self.ff2(F.gelu(self.ff1(self.ln2(h))))
        return self.head(h.mean(1))


MODELS = {"tiny_mlp": (TinyMlp, lambda: torch.randn(32, 32)), "mlp": (Mlp, lambda: torch.randn(128, 784)), "cnn": (Cnn, lambda: torch.randn(32, 3, 32, 32)),
          "transformer": (Transformer, lambda: torch.randn(16, 64, 256))}


def time_per_call(f, reps, rep_seconds=0.3):
    f()
    start = time.perf_counter()
    f()
    once = time.perf_counter() - start
    k = max(1, min(2000, int(rep_seconds / max(once, 1e-7))))
    samples = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(k):
            f()
        samples.append((time.perf_counter() - start) / k)
    return statistics.median(samples)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    args = parser.parse_args()
    print("section,name,config,metric,value")
    for name, (cls, make_input) in MODELS.items():
        for config in ("O0", "O1 bf16"):
            torch.manual_seed(0)
            x = make_input()
            y = torch.randint(10, (x.shape[0],))
            model = cls()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            amp = config != "O0"
            scaler = torch.amp.GradScaler("cpu", enabled=amp)

            def step():
                optimizer.zero_grad()
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()

            ms = 1e3 * time_per_call(step, args.reps)
            print(f"python,{name},{config},ms_per_step,{ms}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
