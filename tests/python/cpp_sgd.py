"""LibTorch's torch::optim::SGD, op for op, for the Python references of tests/torchscript_test.cpp and
tests/fp8_test.cpp (imported from the scripts beside it)."""
import torch


class CppSGD:
    """LibTorch's torch::optim::SGD (momentum, no dampening or decay), op for op. Its buf.mul_(momentum) is
    aten::mul_.Scalar, which rounds the momentum to a bf16/fp16 buffer's dtype before multiplying; Python's SGD
    passes a wrapped number and does not, so Python's own optimizer would differ from C++'s at O3."""

    def __init__(self, params, lr, momentum):
        self.params = list(params)
        self.bufs = [None] * len(self.params)
        self.lr, self.momentum = lr, momentum

    def zero_grad(self):
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self):
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            if self.bufs[i] is None:
                self.bufs[i] = p.grad.detach().clone()
            else:
                torch.ops.aten.mul_.Scalar(self.bufs[i], self.momentum).add_(p.grad, alpha=1.0)
            p.add_(self.bufs[i], alpha=-self.lr)
