#!/usr/bin/env python3
"""The Python side of tests/state_format_test.cpp: torchao 0.18.0's AdamW8bit / Adam8bit (torchao/optim/adam.py,
subclass_8bit.py, quant_utils.py), the reference for amp's optimizer_state_format 8bit.

torchao compiles its step with torch.compile; here it runs eagerly, op for op the function it compiles
(single_param_adam): the arithmetic torchao defines, without a C++ toolchain and minutes of compiling per test.

  state_formats.py maps DIR    # writes DIR/maps.pt: torchao's signed and unsigned quantization maps
  state_formats.py steps DIR   # reads DIR/steps_in.pt: cases of one step each from a given 8-bit state; writes
                               # DIR/steps_out.pt: torchao's codes, scales and parameters after that step
  state_formats.py run DIR     # reads DIR/run_in.pt: a regression run (20 steps of AdamW8bit); writes DIR/run_out.pt
  state_formats.py resume DIR  # reads DIR/cpp.pt (PythonCheckpoint::put_model / put_optimizer of a C++ run), continues
                               # it one step with torch.optim.AdamW, writes DIR/python.pt
"""
import os
import sys

import torch

try:
    import torchao
    from torchao.optim import adam as ao_adam
    from torchao.optim.subclass_8bit import OptimState8bit, get_qmap_signed, get_qmap_unsigned
except ImportError as e:  # the C++ test skips with this message
    print(f"torchao is not importable: {e}; scripts/setup.sh installs torchao==0.18.0", file=sys.stderr)
    sys.exit(3)


def eager(fn, **kwargs):
    return fn


def maps(directory):
    torch.save({"signed": torch.tensor(get_qmap_signed(), dtype=torch.float32),
                "unsigned": torch.tensor(get_qmap_unsigned(), dtype=torch.float32),
                "torch_version": str(torch.__version__), "torchao_version": str(torchao.__version__)},
               os.path.join(directory, "maps.pt"))


def state_of(entry, key, signed, shape):
    """A moment as torchao holds it: OptimState8bit from codes and scales, or a plain fp32 tensor."""
    if entry[key + "_codes"] is not None:
        qmap = torch.tensor(get_qmap_signed() if signed else get_qmap_unsigned(), dtype=torch.float32)
        return OptimState8bit(entry[key + "_codes"].view(shape).clone(), entry[key + "_scales"].clone(), qmap, signed)
    return entry[key].clone()


def steps(directory):
    cases = torch.load(os.path.join(directory, "steps_in.pt"), weights_only=False)
    out = []
    for case in cases["cases"]:
        p = case["param"].clone()
        m = state_of(case, "exp_avg", True, p.shape)
        v = state_of(case, "exp_avg_sq", False, p.shape)
        vmax = state_of(case, "max_exp_avg_sq", False, p.shape) if case["amsgrad"] else None
        ao_adam.single_param_adam(p, case["grad"], torch.tensor(float(case["step"])), m, v, vmax,
                                  torch.tensor(case["lr"], dtype=torch.float32), case["beta1"], case["beta2"],
                                  case["weight_decay"], case["eps"], case["adamw"], False)
        result = {"param": p}
        for key, moment in (("exp_avg", m), ("exp_avg_sq", v), ("max_exp_avg_sq", vmax)):
            if isinstance(moment, OptimState8bit):
                result[key + "_codes"] = moment.codes.reshape(-1).clone()
                result[key + "_scales"] = moment.scale.clone()
            elif moment is not None:
                result[key] = moment.clone()
        out.append(result)
    torch.save({"results": out, "torch_version": str(torch.__version__)}, os.path.join(directory, "steps_out.pt"))


def run(directory):
    spec = torch.load(os.path.join(directory, "run_in.pt"), weights_only=False)
    torch.compile = eager  # AdamW8bit.step compiles single_param_adam; run it as written
    weight = torch.nn.Parameter(spec["weight"].clone())
    bias = torch.nn.Parameter(spec["bias"].clone())
    optimizer = ao_adam.AdamW8bit([weight, bias], lr=spec["lr"], weight_decay=spec["weight_decay"])
    x, y = spec["x"], spec["y"]
    losses = []
    for _ in range(spec["steps"]):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(torch.nn.functional.linear(x, weight, bias), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    torch.save({"weight": weight.detach(), "bias": bias.detach(), "losses": torch.tensor(losses, dtype=torch.float64),
                "exp_avg_codes": optimizer.state[weight]["exp_avg"].codes.reshape(-1).clone()},
               os.path.join(directory, "run_out.pt"))


def resume(directory):
    saved = torch.load(os.path.join(directory, "cpp.pt"), weights_only=False)
    model = torch.nn.Linear(128, 64)
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    optimizer.load_state_dict(saved["optimizer"])
    for state in optimizer.state.values():  # torch.optim's layout: fp32 moments of the parameter's shape
        for key in ("exp_avg", "exp_avg_sq"):
            assert state[key].dtype == torch.float32, f"{key} is {state[key].dtype}, not torch.float32"
    for p in model.parameters():
        assert optimizer.state[p]["exp_avg"].shape == p.shape
    model.weight.grad = saved["grad_weight"].clone()
    model.bias.grad = saved["grad_bias"].clone()
    optimizer.step()
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, os.path.join(directory, "python.pt"))


if __name__ == "__main__":
    {"maps": maps, "steps": steps, "run": run, "resume": resume}[sys.argv[1]](sys.argv[2])
