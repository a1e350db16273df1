"""Python's torch.optim.SGD, Adam and AdamW stepping bf16 and fp16 parameters, for tests/optimizer_test.cpp's
PythonOptimizersTest: amp steps LibTorch's SGD / Adam / AdamW on such parameters as Python does (NOTE [LibTorch's
optimizers on low-precision parameters] in src/optim/python_steps.cpp), so the parameters and state after STEPS steps
are Python's bit for bit.

    python_optimizers.py OUT_DIR     # writes OUT_DIR/python_optimizers.pt: {"<case>_<dtype>_<name>": tensor}

Each case's two parameters start as torch.manual_seed(0); randn(64, 32), randn(32) (fp32, then cast), and step k's
gradients are torch.manual_seed(100 + k); randn(...) * 0.01 in the parameters' dtype: the C++ test makes the same.
"""
import os
import sys

import torch

STEPS = 5
CASES = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd_nesterov_decay": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01),
    "sgd_dampening": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, dampening=0.1),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3),
    "adam_decay_amsgrad": lambda ps: torch.optim.Adam(ps, lr=0.01, eps=1e-3, weight_decay=0.01, amsgrad=True),
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=0.01, eps=1e-3),
    "adamw_amsgrad": lambda ps: torch.optim.AdamW(ps, lr=0.01, eps=1e-3, amsgrad=True),
}


def main():
    torch.set_num_threads(1)
    out = {"torch_version": torch.__version__}
    for case, make in CASES.items():
        for dtype in (torch.bfloat16, torch.float16):
            torch.manual_seed(0)
            params = [torch.randn(64, 32).to(dtype).requires_grad_(), torch.randn(32).to(dtype).requires_grad_()]
            optimizer = make(params)
            for k in range(STEPS):
                torch.manual_seed(100 + k)
                for p in params:
                    p.grad = (torch.randn(p.shape) * 0.01).to(dtype)
                optimizer.step()
            name = f"{case}_{str(dtype).replace('torch.', '')}"
            for i, p in enumerate(params):
                out[f"{name}_p{i}"] = p.detach().clone()
            state = optimizer.state[params[0]]
            for key in ("momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
                if key in state:
                    out[f"{name}_{key}"] = state[key].clone()
    torch.save(out, os.path.join(sys.argv[1], "python_optimizers.pt"))


if __name__ == "__main__":
    main()
