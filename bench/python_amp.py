"""The Python side of the comparison: the models of bench/models.h, stepped with torch.amp (autocast +
GradScaler, and with Apex O1's fp32 rows patched in: `apex_o1_rows`) on the same torch whose LibTorch amp builds
against. Prints one CSV row per measurement:
section,name,config,metric,value (section "python", or "python_gpu" with --device).

    python3 bench/python_amp.py --reps 7                 # the CPU models (bench/run.sh)
    python3 bench/python_amp.py --device cuda --reps 3   # the GPU models (scripts/gpu-check.sh)
"""
import argparse
import contextlib
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


class TransformerBlock(nn.Module):
    def __init__(self, d, heads, ff):
        super().__init__()
        self.d, self.heads = d, heads
        self.ln1, self.qkv, self.proj = nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.ln2, self.ff1, self.ff2 = nn.LayerNorm(d), nn.Linear(d, ff), nn.Linear(ff, d)

    def forward(self, x):
        b, s, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        attention = torch.softmax(torch.matmul(qkv[0], qkv[1].transpose(-2, -1)) / math.sqrt(d // self.heads), -1)
        h = x + self.proj(torch.matmul(attention, qkv[2]).transpose(1, 2).reshape(b, s, d))
        return h + self.ff2(F.gelu(self.ff1(self.ln2(h))))


class Transformer(nn.Module):
    def __init__(self, d=256, heads=4, ff=1024, blocks=1):
        super().__init__()
        self.blocks = nn.ModuleList([TransformerBlock(d, heads, ff) for _ in range(blocks)])
        self.head = nn.Linear(d, 10)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(1))


class GpuCnn(nn.Module):
    def __init__(self):
        super().__init__()
        channels, strides, layers = (3, 64, 128, 256, 256), (1, 2, 2, 1), []
        for i in range(4):
            layers += [nn.Conv2d(channels[i], channels[i + 1], 3, stride=strides[i], padding=1, bias=False),
                       nn.BatchNorm2d(channels[i + 1]), nn.ReLU()]
        self.features, self.fc = nn.Sequential(*layers), nn.Linear(256, 10)

    def forward(self, x):
        return self.fc(self.features(x).mean((2, 3)))


MODELS = {"tiny_mlp": (TinyMlp, lambda: torch.randn(32, 32)), "mlp": (Mlp, lambda: torch.randn(128, 784)), "cnn": (Cnn, lambda: torch.randn(32, 3, 32, 32)),
          "transformer": (Transformer, lambda: torch.randn(16, 64, 256)),
          "gpu_cnn": (GpuCnn, lambda: torch.randn(128, 3, 64, 64)),
          "gpu_transformer": (lambda: Transformer(512, 8, 2048, 4), lambda: torch.randn(32, 256, 512))}


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


def gpu_main(args):
    """The twin of amp_gpu_bench: same models, timing (median of --reps runs of --steps synchronized steps) and
    peak (allocated bytes over one step), torch.amp autocast + GradScaler for O1 and plain fp32 for O0."""
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("python_amp.py: no CUDA device (torch.cuda.is_available() is False); --device cpu checks the logic")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = True

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    print("section,name,config,metric,value")
    for name in args.models.split(","):
        cls, make_input = MODELS[name]
        torch.manual_seed(0)
        x = make_input()
        x = x[: args.batch or x.shape[0]].to(device)
        y = torch.randint(10, (x.shape[0],)).to(device)
        for config, dtype in (("O0 fp32", None), ("O1 fp16", torch.float16), ("O1 bf16", torch.bfloat16)):
            if args.configs != "all" and config not in args.configs.split(","):
                continue
            torch.manual_seed(0)
            model = cls().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            scaler = torch.amp.GradScaler(device.type, enabled=dtype is not None)

            def step():
                optimizer.zero_grad()
                with torch.autocast(device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
                    out = model(x)
                loss = F.cross_entropy(out.float(), y)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()

            step()
            sync()
            if device.type == "cuda":
                before = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                step()
                sync()
                print(f"python_gpu,{name},{config},peak_MiB,{(torch.cuda.max_memory_allocated(device) - before) / 2**20}")
            for _ in range(3):
                step()
            sync()
            samples = []
            for _ in range(args.reps):
                start = time.perf_counter()
                for _ in range(args.steps):
                    step()
                sync()
                samples.append((time.perf_counter() - start) / args.steps)
            print(f"python_gpu,{name},{config},ms_per_step,{1e3 * statistics.median(samples)}")
            sys.stdout.flush()


@contextlib.contextmanager
def apex_o1_rows():
    """Apex O1's fp32 rows for the functions the bench models call (apex/amp/lists/functional_overrides.py:
    gelu, softmax, layer_norm), patched in as Apex patched them: floating arguments cast to fp32 and the function
    run without autocast. autocast keeps casting the GEMMs and convolutions (Apex's FP16_FUNCS), so this twin is
    Apex's arithmetic without the cost of Apex's Python wrappers around those."""
    def fp32(function):
        def cast(v):
            return v.float() if torch.is_tensor(v) and v.is_floating_point() else v

        def run(*args, **kwargs):
            with torch.autocast("cpu", enabled=False):
                return function(*map(cast, args), **{k: cast(v) for k, v in kwargs.items()})
        return run

    patched = ((F, "gelu"), (F, "layer_norm"), (torch, "softmax"))
    saved = [getattr(module, name) for module, name in patched]
    for module, name in patched:
        setattr(module, name, fp32(getattr(module, name)))
    try:
        yield
    finally:
        for (module, name), function in zip(patched, saved):
            setattr(module, name, function)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--device", help="cuda: the GPU twin of amp_gpu_bench (cpu: check its logic)")
    parser.add_argument("--steps", type=int, default=20, help="with --device: steps per timed run")
    parser.add_argument("--models", default="gpu_cnn,gpu_transformer", help="with --device: comma-separated models")
    parser.add_argument("--batch", type=int, default=0, help="with --device: a smaller batch (logic checks on a CPU)")
    parser.add_argument("--configs", default="all", help='with --device: all, or comma-separated from "O0 fp32,O1 fp16,O1 bf16"')
    args = parser.parse_args()
    if args.device:
        return gpu_main(args)
    print("section,name,config,metric,value")
    for name, (cls, make_input) in MODELS.items():
        if name.startswith("gpu_"):
            continue
        for config in ("O0", "O1 bf16", "O1 bf16 apex"):
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

            with apex_o1_rows() if config.endswith("apex") else contextlib.nullcontext():
                ms = 1e3 * time_per_call(step, args.reps)
            print(f"python,{name},{config},ms_per_step,{ms}")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
