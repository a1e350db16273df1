#!/usr/bin/env python3
"""Python's half of examples/finetune_torchvision: torchvision's own models, "pretrained" briefly here and saved with
torch.jit.script for the C++ program to fine-tune, and the Python runs it is compared with.

  torchvision_models.py prepare DIR [--pretrain-steps N]
      DIR/<model>.pt for resnet18, mobilenet_v3_small and vit (torch.jit.script, fp32, a fresh head) and DIR/data.pt
      (the fine-tuning images and labels, generated: a TorchScript module holding them as attributes)
  torchvision_models.py reference DIR MODEL LEVEL DTYPE OPTIMIZER STEPS OUT_PREFIX [--micro-batches 2]
      trains DIR/MODEL.pt's weights in Python as the C++ program does (the same data, batches and optimizer, BatchNorm
      frozen) at LEVEL: O0 (fp32), O1 (torch.autocast + GradScaler), O2 (Apex's O2: the model in DTYPE but BatchNorm,
      fp32 master weights, dynamic loss scaling) or O3 (the model in DTYPE but its frozen BatchNorm, which amp keeps
      in fp32 at every level, torch.optim on it); writes
      OUT_PREFIX.csv (step,loss,loss_scale) and OUT_PREFIX.pt (the final fp32 weights, torch.save of a state dict).
      --micro-batches 2: each batch as two halves whose gradients add up (the same sum, another order of operations:
      how far two equally valid Python runs drift apart).

torchvision==0.28.0 is installed with --no-deps next to the torch==2.13.0 CPU wheel: that torchvision wheel is built
for CUDA, so its C++ operators (detection's nms, roi_align) cannot load; the classification models never call them,
and an empty torchvision._meta_registrations keeps the import from registering them.
"""
import argparse
import os
import sys
import time
import types

import torch
import torch.nn as nn
import torch.nn.functional as F

MODELS = ("resnet18", "mobilenet_v3_small", "vit")
CLASSES = 10
IMAGES = 512        # fine-tuning images (32 x 32, 3 channels)
BATCH = 16
LR = {"sgd": 0.002, "adamw": 3e-4}


def import_torchvision():
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    import torchvision  # noqa: E402  (after the stub)
    return torchvision


def build(name):
    tv = import_torchvision()
    if name == "resnet18":
        return tv.models.resnet18(num_classes=CLASSES)
    if name == "mobilenet_v3_small":
        return tv.models.mobilenet_v3_small(num_classes=CLASSES)
    if name == "vit":
        return tv.models.vision_transformer.VisionTransformer(image_size=32, patch_size=8, num_layers=2, num_heads=2,
                                                              hidden_dim=64, mlp_dim=128, num_classes=CLASSES)
    raise SystemExit(f"unknown model '{name}': one of {', '.join(MODELS)}")


def head_of(model):
    """The classifier a fine-tuning run replaces: (parent module, attribute name or index)."""
    if hasattr(model, "fc"):
        return model, "fc"
    if hasattr(model, "heads"):
        return model.heads, "head"
    return model.classifier, 3


def generate(seed, n):
    """Images and the labels of one random teacher that sees 4 x 4 average-pooled colours: learnable by every model,
    and what pretraining learned (on other images) helps the fine-tuning."""
    images = torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))
    teacher = torch.randn(48, CLASSES, generator=torch.Generator().manual_seed(1000))
    labels = (F.avg_pool2d(images, 8).flatten(1) @ teacher).argmax(1)
    return images, labels


class Data(nn.Module):
    def __init__(self, images, labels):
        super().__init__()
        self.images = images
        self.labels = labels

    def forward(self):
        return self.images


def frozen_batchnorm(model):
    """What amp::freeze_batchnorm does: BatchNorm layers in eval mode with their parameters' gradients off."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)


def prepare(args):
    os.makedirs(args.dir, exist_ok=True)
    images, labels = generate(1, IMAGES)
    torch.jit.script(Data(images, labels)).save(os.path.join(args.dir, "data.pt"))
    pre_images, pre_labels = generate(0, 1024)
    for name in MODELS:
        torch.manual_seed(0)
        model = build(name)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
        model.train()
        start = time.time()
        for step in range(args.pretrain_steps):
            index = torch.arange(step * 32, step * 32 + 32) % pre_images.shape[0]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(pre_images[index]), pre_labels[index])
            loss.backward()
            optimizer.step()
        # The running statistics of the final weights (a cumulative average over 8 batches), as a pretrained
        # checkpoint's are: frozen BatchNorm normalizes with them.
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.reset_running_stats()
                    m.momentum = None
            for k in range(8):
                model(pre_images[k * 64:(k + 1) * 64])
            for m in model.modules():
                if isinstance(m, nn.modules.batchnorm._BatchNorm):
                    m.momentum = 0.1
        parent, key = head_of(model)
        old = parent[key] if isinstance(key, int) else getattr(parent, key)
        fresh = nn.Linear(old.in_features, CLASSES)  # a new task: a fresh head, the body keeps what it learned
        if isinstance(key, int):
            parent[key] = fresh
        else:
            setattr(parent, key, fresh)
        torch.jit.script(model.train()).save(os.path.join(args.dir, f"{name}.pt"))
        print(f"{name}: {sum(p.numel() for p in model.parameters())} parameters, pretrained {args.pretrain_steps} "
              f"steps in Python (last loss {loss.item():.4f}, {time.time() - start:.1f} s), saved {name}.pt")


def load(directory, name):
    """The eager torchvision model with the weights of DIR/NAME.pt (what C++ fine-tunes)."""
    scripted = torch.jit.load(os.path.join(directory, f"{name}.pt"))
    model = build(name)
    parent, key = head_of(model)
    if isinstance(key, int):
        parent[key] = nn.Linear(parent[key].in_features, CLASSES)
    else:
        setattr(parent, key, nn.Linear(getattr(parent, key).in_features, CLASSES))
    model.load_state_dict(scripted.state_dict())
    return model


def batch_of(step, n):
    return torch.arange(step * BATCH, step * BATCH + BATCH) % n


def cast_all_but_batchnorm(model, dtype):
    """Every floating parameter and buffer to `dtype` but BatchNorm's (the same Parameter objects, as an optimizer
    built on them expects)."""
    for m in model.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            continue
        for p in m.parameters(recurse=False):
            p.data = p.data.to(dtype)
        for name, b in m.named_buffers(recurse=False):
            if b.is_floating_point():
                setattr(m, name, b.to(dtype))


class ApexO2:
    """Apex's O2 in a few lines: the model in `dtype` but BatchNorm, fp32 masters the optimizer steps, inputs cast,
    the loss scaled dynamically (init 2^16, halved on an overflow and the step skipped, doubled after 2000 clean
    steps), gradients unscaled into the masters by multiplying with 1 / scale, masters copied back after a step.
    The masters copy the fp32 weights before the cast, as amp's do (Apex copied the cast ones: docs/opt-levels.md)."""

    def __init__(self, model, dtype, make_optimizer):
        self.model, self.dtype = model, dtype
        originals = {id(p): p.detach().clone() for p in model.parameters()}
        cast_all_but_batchnorm(model, dtype)
        self.pairs = [(p, originals[id(p)]) for p in model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer([master for _, master in self.pairs])
        self.scale, self.clean = 65536.0, 0

    def input(self, x):
        return x.to(self.dtype)

    def step(self):
        inv = 1.0 / self.scale
        finite = True
        for p, master in self.pairs:
            master.grad = None if p.grad is None else p.grad.float() * inv
            if master.grad is not None:
                finite = finite and bool(torch.isfinite(master.grad).all())
        if not finite:
            self.scale, self.clean = self.scale / 2, 0
            return
        self.optimizer.step()
        with torch.no_grad():
            for p, master in self.pairs:
                p.copy_(master)
        self.clean += 1
        if self.clean == 2000:
            self.scale, self.clean = self.scale * 2, 0


def reference(args):
    torch.set_num_threads(1)
    data = torch.jit.load(os.path.join(args.dir, "data.pt"))
    images, labels = data.images, data.labels
    model = load(args.dir, args.model)
    model.train()
    frozen_batchnorm(model)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]

    def make_optimizer(params):
        if args.optimizer == "sgd":
            return torch.optim.SGD(params, lr=LR["sgd"], momentum=0.9)
        return torch.optim.AdamW(params, lr=LR["adamw"])

    trainable = [p for p in model.parameters() if p.requires_grad]
    apex = None
    if args.level == "O2":
        apex = ApexO2(model, dtype, make_optimizer)
    elif args.level == "O3":
        cast_all_but_batchnorm(model, dtype)  # frozen BatchNorm stays fp32 at every level in amp (docs/batchnorm.md)
        optimizer = make_optimizer(trainable)
    else:
        optimizer = make_optimizer(trainable)
    scaler = torch.amp.GradScaler("cpu", enabled=args.level == "O1")
    torch.manual_seed(0)  # dropout's draws, as the C++ program seeds them
    rows = []
    start = time.perf_counter()
    for step in range(args.steps):
        index = batch_of(step, images.shape[0])
        x, y = images[index], labels[index]
        (apex.optimizer if apex else optimizer).zero_grad()
        for p in model.parameters():
            p.grad = None
        total = 0.0
        for part in torch.chunk(torch.arange(BATCH), args.micro_batches):
            xs, ys = x[part], y[part]
            with torch.autocast("cpu", dtype=dtype, enabled=args.level == "O1"):
                out = model(apex.input(xs) if apex else xs.to(dtype) if args.level == "O3" else xs)
            loss = F.cross_entropy(out.float(), ys) * (len(part) / BATCH)
            total += loss.item()
            if apex:
                (loss * apex.scale).backward()
            else:
                scaler.scale(loss).backward()
        if apex:
            apex.step()
            scale = apex.scale
        else:
            scaler.step(optimizer)
            scaler.update()
            scale = scaler.get_scale() if args.level == "O1" else 1.0
        rows.append((step, total, scale))
    seconds = (time.perf_counter() - start) / args.steps
    with open(args.out + ".csv", "w") as f:
        f.write("step,loss,loss_scale\n")
        for step, loss, scale in rows:
            f.write(f"{step},{loss!r},{scale!r}\n")
    weights = {k: (v.float() if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    if apex:  # the fp32 masters are the weights
        names = {id(p): k for k, p in model.named_parameters()}
        for p, master in apex.pairs:
            weights[names[id(p)]] = master.detach().clone()
    torch.save(weights, args.out + ".pt")
    print(f"{args.model} {args.level} {args.dtype} {args.optimizer}: loss {rows[-1][1]:.6f} after {args.steps} steps, "
          f"{1e3 * seconds:.2f} ms/step")
    return 1e3 * seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("dir")
    p.add_argument("--pretrain-steps", type=int, default=20)
    r = sub.add_parser("reference")
    for name in ("dir", "model", "level", "dtype", "optimizer"):
        r.add_argument(name)
    r.add_argument("steps", type=int)
    r.add_argument("out")
    r.add_argument("--micro-batches", type=int, default=1)
    args = parser.parse_args()
    prepare(args) if args.command == "prepare" else reference(args)


if __name__ == "__main__":
    main()
