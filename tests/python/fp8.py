#!/usr/bin/env python3
"""The Python side of tests/fp8_test.cpp: amp's FP8 recipe (amp/fp8.h) written with torch._scaled_mm.

  fp8.py DIR   # writes DIR/fp8.pt

The recipe, as DESIGN.md and docs/fp8.md state it: per tensor, amax = t.abs().amax() in fp32; scale =
448 (e4m3) or 57344 (e5m2) / max(amax, 1e-12) / 2^margin; quantized = (t.float() * scale).clamp(-max, max).to(fp8);
the three GEMMs of a Linear through torch._scaled_mm with the inverse scales (forward x_e4m3 @ w_e4m3^T with the
bias, grad input g @ w, grad weight g^T @ x with the batch padded to a multiple of 16). Delayed scaling keeps a ring
of amax_history_len committed amaxes per tensor, commits after each taken step, and scales the first step by its
own amax. Each scale is multiplied by (amax * 0 + 1), which makes it NaN for a non-finite tensor.

mlp_scripted.pt is the MLP below, torch.jit.script'ed with the training cases' initial weights.

fp8.pt holds:
  torch_version
  gemm/...          one Linear(32, 48) forward and backward, 2-d (addmm) and 3-d (matmul, bias added after) inputs,
                    hybrid and e4m3: inputs, weights, outputs and gradients
  train/<case>/...  an MLP (32 -> 64 -> 64 -> 10; the last layer stays bf16) trained STEPS steps at O2 bf16 with SGD
                    (LibTorch's, op for op), dynamic loss scale 65536: losses, per-step scales of each FP8 layer as
                    amp::fp8_layers reports them, the final fp32 masters
"""
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F


E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAXIMA = {E4M3: 448.0, E5M2: 57344.0}
STEPS = 6
LR = 0.05
MOMENTUM = 0.9
SCALE = 65536.0
BF16 = torch.bfloat16


def amax_of(t):
    return t.abs().amax().to(torch.float32)


def quantize(t, scale, dtype):
    m = MAXIMA[dtype]
    return t.to(torch.float32).mul(scale).clamp(-m, m).to(dtype).contiguous()


def column_major(t):
    return t.t().contiguous().t()


def pad16(t, dim):
    n = t.size(dim)
    padded = (n + 15) // 16 * 16
    if n == padded:
        return t
    sizes = list(t.shape)
    sizes[dim] = padded
    out = torch.zeros(sizes, dtype=t.dtype)
    out.narrow(dim, 0, n).copy_(t)
    return out


class Recipe:
    """amp's Fp8State for the layers of one model: slots layer * 3 + (input, weight, grad)."""

    def __init__(self, layers, fmt="hybrid", scaling="dynamic", history_len=1024, algo="max", margin=0, pow2=False):
        self.fmt, self.scaling, self.algo, self.margin, self.pow2 = fmt, scaling, algo, margin, pow2
        s = layers * 3
        self.scales = torch.ones(s)
        self.used = torch.ones(s)
        self.history_amax = torch.zeros(s)
        self.history = torch.zeros(s, history_len if scaling == "delayed" else 0)
        self.maxima = torch.tensor([self.max_of(i % 3) for i in range(s)], dtype=torch.float32)
        self.position = 0
        self.pending = [None] * s

    def dtype_of(self, kind):
        return E5M2 if kind == 2 and self.fmt == "hybrid" else E4M3

    def max_of(self, kind):
        return MAXIMA[self.dtype_of(kind)]

    def rounded(self, scale):
        """power_of_2_scales: down to a power of two."""
        return torch.exp2(torch.floor(torch.log2(scale))) if self.pow2 else scale

    def scale_from(self, amax, m):
        return self.rounded(torch.full((), m).div(amax.clamp_min(1e-12)).div(2.0 ** self.margin))

    def forward_scale(self, slot, amax):
        scale = self.scale_from(amax, self.max_of(slot % 3))
        if self.scaling == "delayed":
            scale = torch.where(self.history_amax[slot] > 0, self.scales[slot], scale)
        scale = scale.mul(amax.mul(0).add(1))
        self.used[slot] = scale
        return scale

    def record(self, slot, amax):
        p = self.pending[slot]
        self.pending[slot] = amax.clone() if p is None else torch.maximum(p, amax)

    def end_step(self, taken):
        pending, self.pending = self.pending, [None] * len(self.pending)
        if not taken or all(p is None for p in pending) or self.scaling != "delayed":
            return
        zero = torch.zeros(())
        amax = torch.stack([zero if p is None else p for p in pending])
        amax = torch.where(torch.isfinite(amax), amax, zero)
        self.history[:, self.position] = amax
        self.position = (self.position + 1) % self.history.size(1)
        h = self.history.amax(1) if self.algo == "max" else amax
        nxt = self.rounded(self.maxima.div(h.clamp_min(1e-12)).div(2.0 ** self.margin))
        self.scales = torch.where(h > 0, nxt, self.scales)
        self.history_amax = h.clone()

    def report(self):
        return (self.scales if self.scaling == "delayed" else self.used).clone()


class Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, b, recipe, layer):
        base = layer * 3
        x2 = x.reshape(-1, w.size(1))
        x_amax, w_amax = amax_of(x2), amax_of(w)
        x_scale = recipe.forward_scale(base, x_amax)
        w_scale = recipe.forward_scale(base + 1, w_amax)
        x8 = quantize(x2, x_scale, recipe.dtype_of(0))
        w8 = quantize(w, w_scale, recipe.dtype_of(1))
        y = torch._scaled_mm(x8, w8.t(), x_scale.reciprocal(), w_scale.reciprocal(),
                             bias=None if b is None else b.to(BF16), out_dtype=BF16)
        recipe.record(base, x_amax)
        recipe.record(base + 1, w_amax)
        ctx.save_for_backward(x8, w8, x_scale, w_scale)
        ctx.recipe, ctx.layer, ctx.has_bias = recipe, layer, b is not None
        ctx.dtypes = (x.dtype, w.dtype, None if b is None else b.dtype)
        return y.view(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad):
        x8, w8, x_scale, w_scale = ctx.saved_tensors
        recipe, slot = ctx.recipe, ctx.layer * 3 + 2
        g = grad.reshape(-1, w8.size(0))
        g_amax = amax_of(g)
        g_scale = recipe.forward_scale(slot, g_amax)
        recipe.record(slot, g_amax)
        g8 = quantize(g, g_scale, recipe.dtype_of(2))
        g_inv = g_scale.reciprocal()
        grad_input = torch._scaled_mm(g8, column_major(w8), g_inv, w_scale.reciprocal(), out_dtype=ctx.dtypes[0])
        grad_weight = torch._scaled_mm(pad16(g8.t().contiguous(), 1), column_major(pad16(x8, 0)), g_inv,
                                       x_scale.reciprocal(), out_dtype=ctx.dtypes[1])
        grad_bias = g.sum(0).to(ctx.dtypes[2]) if ctx.has_bias else None
        return grad_input.view(*grad.shape[:-1], w8.size(1)), grad_weight, grad_bias, None, None


def fp8_linear(x, layer_module, recipe, index):
    """LibTorch's F::linear with amp's FP8 GEMM: addmm (bias inside) on 2-d inputs, matmul then `+= bias` on others."""
    if x.dim() == 2:
        return Fp8LinearFn.apply(x, layer_module.weight, layer_module.bias, recipe, index)
    y = Fp8LinearFn.apply(x, layer_module.weight, None, recipe, index)
    return y + layer_module.bias


def gemm_cases(out):
    torch.manual_seed(1)
    lin = nn.Linear(32, 48)
    out["gemm/weight"] = lin.weight.detach().clone()
    out["gemm/bias"] = lin.bias.detach().clone()
    for shape_name, shape in (("2d", (20, 32)), ("3d", (2, 10, 32))):
        x = torch.randn(*shape) * 3.0
        g = torch.randn(*shape[:-1], 48) * 1e-3
        out[f"gemm/{shape_name}/x"] = x
        out[f"gemm/{shape_name}/g"] = g
        for fmt in ("hybrid", "e4m3"):
            m = nn.Linear(32, 48).to(BF16)
            with torch.no_grad():
                m.weight.copy_(lin.weight)
                m.bias.copy_(lin.bias)
            recipe = Recipe(1, fmt=fmt)
            xb = x.to(BF16).requires_grad_(True)
            y = fp8_linear(xb, m, recipe, 0)
            y.float().backward(g)  # amp::Model casts the output to fp32; the gradient comes back through the cast
            key = f"gemm/{shape_name}/{fmt}"
            out[key + "/y"] = y.detach().float()
            out[key + "/grad_input"] = xb.grad.float()
            out[key + "/grad_weight"] = m.weight.grad.float()
            out[key + "/grad_bias"] = m.bias.grad.float()
            out[key + "/scales"] = recipe.report()


class PlainMlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(32, 64)
        self.fc2 = nn.Linear(64, 64)
        self.head = nn.Linear(64, 10)  # 10: no multiple of 16, stays bf16

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


class Mlp(PlainMlp):
    """PlainMlp with amp's FP8 GEMMs in fc1 and fc2 (PlainMlp is what the C++ side runs, scripted or not)."""

    def forward(self, x, recipe=None):
        x = F.relu(fp8_linear(x, self.fc1, recipe, 0))
        x = F.relu(fp8_linear(x, self.fc2, recipe, 1))
        return self.head(x)


TRAIN_CASES = {
    "dynamic": dict(),
    "delayed_max": dict(scaling="delayed", history_len=3),
    "delayed_recent_margin": dict(scaling="delayed", algo="most_recent", margin=1),
    "e4m3_delayed": dict(fmt="e4m3", scaling="delayed", history_len=4),
    "dynamic_pow2": dict(pow2=True),
    "delayed_pow2": dict(scaling="delayed", history_len=2, pow2=True),
}


def train_o2(model, forward, xs, ys, steps, end_step):
    """amp's O2 with bfloat16 as amp_test::train_step takes it: fp32 masters stepped by SGD (LibTorch's and Python's agree on fp32), a dynamic
    loss scale starting at SCALE; `end_step(taken)` after each step. Returns the losses and the masters."""
    params = list(model.named_parameters())
    masters = {n: p.detach().clone().requires_grad_(True) for n, p in params}
    for _, p in params:
        p.data = p.data.to(BF16)
    opt = torch.optim.SGD([masters[n] for n, _ in params], lr=LR, momentum=MOMENTUM)
    losses = []
    scale = SCALE
    for step in range(steps):
        for n, p in params:
            p.grad = None
            masters[n].grad = None
        logits = forward(xs[step].to(BF16)).float()
        loss = F.cross_entropy(logits, ys[step])
        losses.append(loss.item())
        (loss * scale).backward()
        for n, p in params:
            masters[n].grad = p.grad.float()
        grads = [masters[n].grad for n, _ in params]
        found_inf = torch.zeros(1)
        torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, torch.full((1,), 1.0 / scale))
        if found_inf.item() > 0:
            scale /= 2.0
            end_step(False)
        else:
            opt.step()
            with torch.no_grad():
                for n, p in params:
                    p.copy_(masters[n])
            end_step(True)
    return losses, {n: masters[n].detach().clone() for n, _ in params}


def train(out, init, xs, ys, case, recipe_args):
    model = Mlp()
    model.load_state_dict(init)
    recipe = Recipe(2, **recipe_args)
    scales = []

    def end_step(taken):
        recipe.end_step(taken)
        scales.append(recipe.report())

    losses, masters = train_o2(model, lambda x: model(x, recipe), xs, ys, STEPS, end_step)
    key = f"train/{case}"
    out[key + "/losses"] = torch.tensor(losses, dtype=torch.float64)
    out[key + "/scales"] = torch.stack(scales)
    for n, t in masters.items():
        out[f"{key}/master/{n}"] = t


def main(directory):
    out = {"torch_version": str(torch.__version__)}
    gemm_cases(out)
    torch.manual_seed(2)
    init = Mlp().state_dict()
    scripted = PlainMlp()
    scripted.load_state_dict(init)
    torch.jit.script(scripted).save(os.path.join(directory, "mlp_scripted.pt"))
    for n, t in init.items():
        out[f"train/init/{n}"] = t.clone()
    xs = [torch.randn(24, 32) * (1.0 + step) for step in range(STEPS)]
    ys = [torch.randint(0, 10, (24,)) for _ in range(STEPS)]
    out["train/x"] = torch.stack(xs)
    out["train/y"] = torch.stack(ys)
    for case, args in TRAIN_CASES.items():
        train(out, init, xs, ys, case, args)
    torch.save(out, os.path.join(directory, "fp8.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
