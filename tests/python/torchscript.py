#!/usr/bin/env python3
"""The Python side of tests/torchscript_test.cpp: TorchScript models, and Python's training of them.

  torchscript.py DIR   # writes DIR/*.pt (scripted and traced modules), DIR/data.pt and DIR/reference.pt

Models (all pretrained for a few fp32 steps here, so BatchNorm statistics are not the initial 0/1):
  resnet_scripted.pt   a small ResNet (conv + BatchNorm2d members, residual blocks), torch.jit.script, train mode
  resnet_traced.pt     the same network traced in eval mode (BatchNorm's training=False baked in)
  resnet_traced_train.pt  traced in train mode (training=True baked in: freeze_batchnorm refuses it)
  loop.pt              blocks in an nn.ModuleList called in a loop (Linear + LayerNorm), scripted
  dict.pt              a forward returning a dict of tensors, scripted
  frozen.pt            torch.jit.freeze'd (no parameters left), half.pt (saved after .half()),
  no_grad.pt           parameters saved with requires_grad False

reference.pt holds, per case "<level>_<dtype>" ("O0"; "traced/O1_bf16" for the traced module), the parameters
after STEPS steps (Python state_dict order; O2's fp32 masters) and the losses, of Python's eager step on the network
Python scripted, with BatchNorm frozen, each level written out as its own loop: O0 fp32; O1 torch.autocast + a
dynamic loss scale (65536, halved and the step skipped on inf/NaN); O2 model in low precision but BatchNorm, fp32
master weights, inputs cast, logits cast to fp32; O3 everything in low precision but the frozen BatchNorm, loss
scale 1. The optimizer is Python's torch.optim.SGD: amp steps LibTorch's SGD as Python's on bf16/fp16 parameters
(NOTE [LibTorch's optimizers on low-precision parameters] in src/optim/python_steps.cpp).
"""
import copy
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


STEPS = 4
LR = 0.05
MOMENTUM = 0.9
SCALE = 65536.0


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


class ResNet(nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Conv2d(1, 8, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(8)
        self.layer1 = Block(8, 8, 1)
        self.layer2 = Block(8, 16, 2)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


class LoopNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(16, 32)
        self.blocks = nn.ModuleList([nn.ModuleDict({"fc": nn.Linear(32, 32), "norm": nn.LayerNorm(32)})
                                     for _ in range(3)])
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + F.gelu(block["norm"](block["fc"](x)))
        return self.head(x)


class DictNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(16, 32)
        self.head = nn.Linear(32, 4)

    def forward(self, x):
        features = torch.relu(self.body(x))
        return {"logits": self.head(features), "features": features}


def pretrain(model, x, y, steps=5):
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    model.train()
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()


def freeze_bn(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)


def freeze_scripted_bn(model):
    for m in model.modules():
        if m.original_name == "BatchNorm2d":
            m.eval()
            for p in m.parameters():
                p.requires_grad_(False)


def train_reference(model, x, y, level, dtype, bn_params):
    """Python's step at `level`, BatchNorm frozen; returns (state_dict, losses). `model` is the eager network, or a
    TorchScript module (run op by op, as amp::Model runs it)."""
    scripted = isinstance(model, torch.jit.ScriptModule)
    if not scripted:
        model = copy.deepcopy(model)
    model.train()
    (freeze_scripted_bn if scripted else freeze_bn)(model)
    is_bn_param = lambda model, name: name in bn_params
    params = [(n, p) for n, p in model.named_parameters()]
    losses = []
    scale = SCALE if level in ("O1", "O2") else 1.0
    if level == "O2":
        masters = {}
        for n, p in params:
            if not is_bn_param(model, n):
                masters[n] = p.detach().clone().requires_grad_(True)
                p.data = p.data.to(dtype)
        step_params = [masters.get(n, p) for n, p in params]
    elif level == "O3":
        for n, p in params:
            if not is_bn_param(model, n):
                p.data = p.data.to(dtype)
        step_params = [p for _, p in params]
    else:
        step_params = [p for _, p in params]
    opt = torch.optim.SGD(step_params, lr=LR, momentum=MOMENTUM)
    for _ in range(STEPS):
        opt.zero_grad()
        for _, p in params:
            p.grad = None
        if level == "O1":
            with torch.autocast("cpu", dtype=dtype):
                out = model(x)
        elif level in ("O2", "O3"):
            out = model(x.to(dtype))
        else:
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        losses.append(loss.item())
        (loss * scale).backward()
        if level == "O2":
            for n, p in params:
                if n in masters and p.grad is not None:
                    masters[n].grad = p.grad.float()
        grads = [p.grad for p in step_params if p.grad is not None]
        found_inf = torch.zeros(1)
        if scale != 1.0:
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 1.0 / scale))
        if found_inf.item() > 0:
            scale /= 2.0
            continue
        opt.step()
        if level == "O2":
            with torch.no_grad():
                for n, p in params:
                    if n in masters:
                        p.copy_(masters[n])
    state = {}
    for n, p in params:
        state[n] = (masters[n] if level == "O2" and n in masters else p).detach().clone()
    for n, b in model.named_buffers():
        state[n] = b.detach().clone()
    return state, losses


def main(directory):
    torch.manual_seed(0)
    x = torch.randn(16, 1, 8, 8)
    y = torch.randint(0, 10, (16,))
    net = ResNet()
    pretrain(net, x * 2.0 + 0.5, y)
    torch.jit.script(copy.deepcopy(net).train()).save(os.path.join(directory, "resnet_scripted.pt"))
    traced = copy.deepcopy(net).eval()
    torch.jit.trace(traced, x).save(os.path.join(directory, "resnet_traced.pt"))
    torch.jit.trace(copy.deepcopy(net).train(), x).save(os.path.join(directory, "resnet_traced_train.pt"))
    torch.save({"x": x, "y": y, "state": net.state_dict()}, os.path.join(directory, "data.pt"))

    torch.jit.script(LoopNet()).save(os.path.join(directory, "loop.pt"))
    torch.jit.script(DictNet()).save(os.path.join(directory, "dict.pt"))
    torch.jit.freeze(torch.jit.script(DictNet().eval())).save(os.path.join(directory, "frozen.pt"))
    torch.jit.script(DictNet().half()).save(os.path.join(directory, "half.pt"))
    no_grad = DictNet()
    no_grad.requires_grad_(False)
    torch.jit.script(no_grad).save(os.path.join(directory, "no_grad.pt"))

    reference = {"torch_version": str(torch.__version__)}
    bn_params = {n for n, _ in net.named_parameters() if "bn" in n or "down.1" in n}
    for level in ("O0", "O1", "O2", "O3"):
        for label, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
            if level == "O0" and label == "fp16":
                continue
            # Eager nn.Module (the network Python scripted): the reference the C++ run of the scripted and the
            # traced module must equal.
            state, losses = train_reference(net, x, y, level, dtype, bn_params)
            name = "O0" if level == "O0" else f"{level}_{label}"
            reference[name] = {"state": state, "losses": losses}
    # A traced graph calls aten::_convolution, on no autocast list: at O1 its convolutions run as traced, in fp32.
    # The reference is the traced module itself under torch.autocast, run op by op.
    with torch.jit.optimized_execution(False):
        traced = torch.jit.load(os.path.join(directory, "resnet_traced.pt"))
        state, losses = train_reference(traced, x, y, "O1", torch.bfloat16, bn_params)
    reference["traced/O1_bf16"] = {"state": state, "losses": losses}
    torch.save(reference, os.path.join(directory, "reference.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
