#!/usr/bin/env python3
"""The Python side of tests/fp8_recipes_test.cpp: the slice, tile and block FP8 recipes (amp/fp8.h) as their anchors
compute them, run here at test time on the same torch wheel.

  fp8_recipes.py DIR   # writes DIR/fp8_recipes.pt

- rowwise, rowwise_gw_hp: torchao's Float8Linear (convert_to_float8_training with
  Float8LinearConfig.from_recipe_name), which runs torch._scaled_mm on the CPU too.
- mxfp8: torchao's MXFP8Linear with KernelPreference.EMULATED and ScaleCalculationMode.FLOOR (to_mx's default).
- blockwise: torchao's torch references of DeepSeek-V3's quantization (torch_blockwise_scale_act_quant_lhs and
  torch_blockwise_scale_weight_quant, read from the installed torchao's source: their module imports triton, which
  the CPU wheel lacks), dequantized to bfloat16 and multiplied by torch.mm, as amp emulates it where the device
  has no blockwise kernel. The grad-weight GEMM quantizes g^T and x^T in 1x128 tiles along the batch, the batch
  padded with zeros to a multiple of 128 (torchao's kernels assert instead).

fp8_recipes.pt holds:
  torch_version, torchao_version
  quant/t                        a [256, 256] bfloat16 tensor, and its quantizations: quant/rowwise_dim{0,1},
                                 quant/tensorwise, quant/tiles, quant/blocks, quant/mx (values as float, scales)
  gemm/<recipe>/<shape>/...      one Linear(256, 128) forward and backward: x, g, y, grad_input, grad_weight,
                                 grad_bias (shape 2d: [64, 256]; 3d: [2, 48, 256])
  train/<recipe>/...             an MLP (128 -> 256 -> 128 -> 10; the head stays bfloat16) trained STEPS steps at
                                 O2 bfloat16 as tests/python/fp8.py trains: losses and the final fp32 masters

mlp_scripted.pt is that MLP, torch.jit.script'ed with the training cases' initial weights.
"""
import ast
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

from fp8 import BF16, train_o2

import torchao
from torchao.float8 import Float8LinearConfig, convert_to_float8_training
from torchao.float8.config import ScalingGranularity
from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
from torchao.float8.float8_training_tensor import LinearMMConfig
from torchao.float8.float8_utils import EPS
from torchao.prototype.moe_training.mxfp8_linear import MXFP8Linear
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_mx
from torchao.quantization.quantize_.common.kernel_preference import KernelPreference

STEPS = 5
E4M3 = torch.float8_e4m3fn
RECIPES = ("rowwise", "rowwise_gw_hp", "blockwise", "blockwise_pow2", "mxfp8")


def blockwise_references():
    """torchao's torch_blockwise_scale_act_quant_lhs and torch_blockwise_scale_weight_quant, from its source."""
    path = os.path.join(os.path.dirname(torchao.__file__), "prototype", "blockwise_fp8_training", "kernels.py")
    tree = ast.parse(open(path).read())
    wanted = {"torch_blockwise_scale_act_quant_lhs", "torch_blockwise_scale_weight_quant"}
    functions = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in wanted]
    assert {f.name for f in functions} == wanted, "torchao moved its blockwise references"
    namespace = {"torch": torch, "EPS": EPS, "e4m3_dtype": E4M3}
    exec(compile(ast.Module(body=functions, type_ignores=[]), path, "exec"), namespace)
    return namespace["torch_blockwise_scale_act_quant_lhs"], namespace["torch_blockwise_scale_weight_quant"]


ACT_QUANT, WEIGHT_QUANT = blockwise_references()


def pow2(scale):
    """power_of_2_scales: the multiplying scale down to a power of two (torchao's _round_scale_down_to_power_of_2)."""
    return torch.exp2(torch.floor(torch.log2(scale)))


def scales_of(amax, power_of_2):
    """The multiplying scale torchao's blockwise references compute, 448 / max(amax, EPS) in float64 then fp32; with
    power_of_2_scales, down to a power of two."""
    s = (torch.finfo(E4M3).max / torch.clamp(amax.to(torch.float64), min=EPS)).to(torch.float32)
    return pow2(s) if power_of_2 else s


def tiles(x, power_of_2):
    """x in 1x128 tiles along its last dimension: (fp8 values, multiplying scales [R, C/128])."""
    r, c = x.shape
    t = x.contiguous().reshape(r, c // 128, 128)
    s = scales_of(t.abs().amax(2), power_of_2)
    q = (t.float() * s.unsqueeze(2)).clamp(-448, 448).to(E4M3).reshape(r, c)
    if not power_of_2:  # the same as torchao's reference, which returns 1 / s
        ref_q, ref_inverse = ACT_QUANT(x.contiguous(), 128)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(1.0 / s, ref_inverse)
    return q, s


def blocks(w, power_of_2):
    """w in 128x128 blocks: (fp8 values, multiplying scales [R/128, C/128])."""
    r, c = w.shape
    b = w.contiguous().reshape(r // 128, 128, c // 128, 128)
    s = scales_of(b.abs().amax((1, 3)), power_of_2)
    q = (b.float() * s.reshape(r // 128, 1, c // 128, 1)).clamp(-448, 448).to(E4M3).reshape(r, c)
    if not power_of_2:
        ref_q, ref_inverse = WEIGHT_QUANT(w.contiguous(), 128)
        assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8)) and torch.equal(1.0 / s, ref_inverse)
    return q, s


def dequantize(q, scale, rows, cols):
    """amp's emulation: values times 1 / scale in fp32 (torchao's `1.0 / s`), then bfloat16."""
    r, c = q.shape
    inverse = (1.0 / scale).reshape(r // rows, 1, c // cols, 1)
    return (q.float().reshape(r // rows, rows, c // cols, cols) * inverse).reshape(r, c).to(BF16)


def pad_rows(t, multiple):
    n = t.size(0)
    padded = (n + multiple - 1) // multiple * multiple
    return t if n == padded else torch.cat([t, t.new_zeros(padded - n, t.size(1))])


class BlockwiseFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, power_of_2):
        ctx.save_for_backward(x, w)
        ctx.power_of_2 = power_of_2
        x2 = x.reshape(-1, w.size(1))
        xq, xs = tiles(x2, power_of_2)
        wq, ws = blocks(w, power_of_2)
        y = torch.mm(dequantize(xq, xs, 1, 128), dequantize(wq, ws, 128, 128).t())
        return y.reshape(*x.shape[:-1], w.size(0))

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        p2 = ctx.power_of_2
        g = grad.reshape(-1, w.size(0))
        x2 = x.reshape(-1, w.size(1))
        gq, gs = tiles(g, p2)
        wq, ws = blocks(w, p2)
        grad_input = torch.mm(dequantize(gq, gs, 1, 128), dequantize(wq, ws, 128, 128))
        gtq, gts = tiles(pad_rows(g, 128).t().contiguous(), p2)
        xtq, xts = tiles(pad_rows(x2, 128).t().contiguous(), p2)
        grad_weight = torch.mm(dequantize(gtq, gts, 1, 128), dequantize(xtq, xts, 1, 128).t())
        return grad_input.reshape(x.shape), grad_weight, None


class BlockwiseLinear(nn.Linear):
    """DeepSeek-V3's blockwise recipe as amp emulates it; the bias added after, as torchao's linears do."""

    def __init__(self, *args, power_of_2=False, **kwargs):
        super().__init__(*args, **kwargs)
        self.power_of_2 = power_of_2

    def forward(self, x):
        out = BlockwiseFn.apply(x, self.weight, self.power_of_2)
        return out + self.bias.to(out.dtype)


def recipe_linear(recipe, source):
    """`source` (an nn.Linear) as `recipe`'s FP8 linear, with its weights (fp32: the training masters start exact)."""
    if recipe in ("rowwise", "rowwise_gw_hp"):
        wrapper = nn.Sequential(nn.Linear(source.in_features, source.out_features))
        wrapper[0].load_state_dict(source.state_dict())
        name = {"rowwise": "rowwise", "rowwise_gw_hp": "rowwise_with_gw_hp"}[recipe]  # torchao's names
        convert_to_float8_training(wrapper, config=Float8LinearConfig.from_recipe_name(name))
        return wrapper[0]
    if recipe == "mxfp8":
        m = MXFP8Linear(source.in_features, source.out_features, kernel_preference=KernelPreference.EMULATED,
                        scale_calculation_mode=ScaleCalculationMode.FLOOR)
    else:
        m = BlockwiseLinear(source.in_features, source.out_features, power_of_2=recipe == "blockwise_pow2")
    m.load_state_dict(source.state_dict())
    return m


def quant_cases(out):
    torch.manual_seed(3)
    t = (torch.randn(256, 256) * torch.logspace(-3, 3, 256).unsqueeze(1)).to(BF16)
    out["quant/t"] = t
    cfg = Float8LinearConfig.from_recipe_name("rowwise")
    for dim in (0, -1):
        f8 = hp_tensor_to_float8_dynamic(t, E4M3, LinearMMConfig(), scaling_granularity=ScalingGranularity.AXISWISE,
                                         axiswise_dim=dim, round_scales_to_power_of_2=cfg.round_scales_to_power_of_2)
        out[f"quant/rowwise_dim{dim % 2}/values"] = f8._data.float()
        out[f"quant/rowwise_dim{dim % 2}/scales"] = f8._scale
    f8 = hp_tensor_to_float8_dynamic(t, E4M3, LinearMMConfig(), scaling_granularity=ScalingGranularity.TENSORWISE,
                                     round_scales_to_power_of_2=True)
    out["quant/tensorwise/values"] = f8._data.float()
    out["quant/tensorwise/scales"] = f8._scale
    for power_of_2 in (False, True):
        suffix = "_pow2" if power_of_2 else ""
        q, s = tiles(t, power_of_2)
        out[f"quant/tiles{suffix}/values"], out[f"quant/tiles{suffix}/scales"] = q.float(), s
        q, s = blocks(t, power_of_2)
        out[f"quant/blocks{suffix}/values"], out[f"quant/blocks{suffix}/scales"] = q.float(), s
    scale, data = to_mx(t, E4M3, 32, ScaleCalculationMode.FLOOR)
    out["quant/mx/values"] = data.float()
    out["quant/mx/scales"] = scale.view(torch.uint8)


def gemm_cases(out):
    torch.manual_seed(1)
    source = nn.Linear(256, 128)
    out["gemm/weight"] = source.weight.detach().clone()
    out["gemm/bias"] = source.bias.detach().clone()
    for shape_name, shape in (("2d", (64, 256)), ("3d", (2, 48, 256))):
        x = torch.randn(*shape) * 3.0
        g = torch.randn(*shape[:-1], 128) * 1e-3
        out[f"gemm/{shape_name}/x"] = x
        out[f"gemm/{shape_name}/g"] = g
        for recipe in RECIPES:
            m = recipe_linear(recipe, source).to(BF16)
            xb = x.to(BF16).requires_grad_(True)
            y = m(xb)
            y.float().backward(g)  # amp::Model casts the output to fp32; the gradient comes back through the cast
            key = f"gemm/{recipe}/{shape_name}"
            out[key + "/y"] = y.detach().float()
            out[key + "/grad_input"] = xb.grad.float()
            out[key + "/grad_weight"] = m.weight.grad.float()
            out[key + "/grad_bias"] = m.bias.grad.float()


class Mlp(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(128, 256)
        self.fc2 = nn.Linear(256, 128)
        self.head = nn.Linear(128, 10)  # 10: no multiple of any block, stays bfloat16

    def forward(self, x):
        return self.head(F.relu(self.fc2(F.relu(self.fc1(x)))))


def train_cases(out, directory):
    torch.manual_seed(4)
    init = Mlp().state_dict()
    for n, t in init.items():
        out[f"train/init/{n}"] = t.clone()
    xs = [torch.randn(64, 128) * (1.0 + step) for step in range(STEPS)]
    ys = [torch.randint(0, 10, (64,)) for _ in range(STEPS)]
    out["train/x"] = torch.stack(xs)
    out["train/y"] = torch.stack(ys)
    scripted = Mlp()
    scripted.load_state_dict(init)
    torch.jit.script(scripted).save(os.path.join(directory, "mlp_scripted.pt"))
    for recipe in RECIPES:
        model = Mlp()
        model.load_state_dict(init)
        model.fc1 = recipe_linear(recipe, model.fc1)
        model.fc2 = recipe_linear(recipe, model.fc2)
        losses, masters = train_o2(model, model, xs, ys, STEPS, lambda taken: None)
        out[f"train/{recipe}/losses"] = torch.tensor(losses, dtype=torch.float64)
        for n, t in masters.items():
            out[f"train/{recipe}/master/{n}"] = t


def main(directory):
    out = {"torch_version": str(torch.__version__), "torchao_version": str(torchao.__version__)}
    quant_cases(out)
    gemm_cases(out)
    train_cases(out, directory)
    torch.save(out, os.path.join(directory, "fp8_recipes.pt"))


if __name__ == "__main__":
    main(sys.argv[1])
