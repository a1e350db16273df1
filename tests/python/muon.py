"""torch.optim.Muon (its single-tensor path, the only one torch 2.13 has) for tests/fused_muon_test.cpp.

    muon.py OUT_DIR              # writes OUT_DIR/muon.pt: {"<case>_p<i>": tensor, "<case>_buf<i>": tensor, ...}
    muon.py resume OUT_DIR       # reads OUT_DIR/cpp.pt (a C++ FusedMuon's state_dict and parameters after RESUME_AT
                                 # steps), loads it into torch.optim.Muon, takes the remaining steps, writes
                                 # OUT_DIR/resumed.pt

Parameters: torch.manual_seed(0); randn(64, 32), randn(32, 96), randn(48, 48) (tall, wide, square), then cast to the
case's dtype. Step k's gradients: torch.manual_seed(100 + k); randn(shape) * 0.01 each, in the parameter's dtype; the
"holes" case gives parameter 2 a zero gradient at step 0 (the norm is clamped to eps) and parameter 1 no gradient at
step 1. The C++ test builds the same tensors with LibTorch's generator.
"""
import os
import sys

import torch

STEPS = 5
RESUME_AT = 2
SHAPES = [(64, 32), (32, 96), (48, 48)]

CASES = {
    "default": dict(lr=0.02),
    "plain_momentum": dict(lr=0.02, nesterov=False),
    "match_rms_adamw": dict(lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
    "custom": dict(lr=0.05, momentum=0.9, ns_coefficients=(2.0, -1.5, 0.5), ns_steps=3, eps=1e-3, weight_decay=0.0),
    "holes": dict(lr=0.02),
    "groups": None,  # two groups: parameter 0 with the defaults (lr 0.02), 1 and 2 with lr 0.05, match_rms_adamw
}


def make_params(dtype):
    torch.manual_seed(0)
    return [torch.randn(*s).to(dtype).requires_grad_() for s in SHAPES]


def make_optimizer(case, params):
    if case == "groups":
        return torch.optim.Muon([{"params": [params[0]]},
                                 {"params": params[1:], "lr": 0.05, "adjust_lr_fn": "match_rms_adamw"}], lr=0.02)
    return torch.optim.Muon(params, **CASES[case])


def set_grads(case, params, k, dtype):
    torch.manual_seed(100 + k)
    for i, p in enumerate(params):
        p.grad = (torch.randn(p.shape) * 0.01).to(dtype)
    if case == "holes" and k == 0:
        params[2].grad = torch.zeros_like(params[2])
    if case == "holes" and k == 1:
        params[1].grad = None


def reference(out_dir):
    torch.set_num_threads(1)
    out = {"torch_version": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        for case in CASES:
            params = make_params(dtype)
            optimizer = make_optimizer(case, params)
            for k in range(STEPS):
                set_grads(case, params, k, dtype)
                optimizer.step()
            name = f"{case}_{str(dtype).replace('torch.', '')}"
            for i, p in enumerate(params):
                out[f"{name}_p{i}"] = p.detach().clone()
                out[f"{name}_buf{i}"] = optimizer.state[p]["momentum_buffer"].clone()
    torch.save(out, os.path.join(out_dir, "muon.pt"))


def resume(out_dir):
    torch.set_num_threads(1)
    saved = torch.load(os.path.join(out_dir, "cpp.pt"), weights_only=False)
    params = make_params(torch.float32)
    with torch.no_grad():
        for i, p in enumerate(params):
            p.copy_(saved[f"p{i}"])
    optimizer = make_optimizer("groups", params)
    optimizer.load_state_dict(saved["optimizer"])
    for k in range(RESUME_AT, STEPS):
        set_grads("groups", params, k, torch.float32)
        optimizer.step()
    out = {f"p{i}": p.detach().clone() for i, p in enumerate(params)}
    out["optimizer"] = optimizer.state_dict()
    torch.save(out, os.path.join(out_dir, "resumed.pt"))


if __name__ == "__main__":
    if sys.argv[1] == "resume":
        resume(sys.argv[2])
    else:
        reference(sys.argv[1])
