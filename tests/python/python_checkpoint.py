#!/usr/bin/env python3
"""The Python side of tests/python_checkpoint_test.cpp: mixed precision runs that hand checkpoints to C++ and back.

  python_checkpoint.py train  --case sgd-O2-bf16 --dir DIR   # N steps, save DIR/python.pt; resume it for M steps
  python_checkpoint.py resume --case sgd-O2-bf16 --dir DIR   # load DIR/cpp.pt (written by C++), train K steps
  python_checkpoint.py bad    --dir DIR                      # the malformed files of the error tests
  python_checkpoint.py corners --dir DIR                     # damaged zips, non-UTF-8 str, torch.Size
  python_checkpoint.py check_utf8 --dir DIR                  # does torch.load read DIR/cpp_text.pt (written by C++)

Levels, as a Python script would run them on the CPU:
  O1: torch.autocast('cpu', dtype) + torch.amp.GradScaler('cpu'); the checkpoint holds 'scaler'.
  O2: Apex's O2 written out in plain PyTorch (Apex itself is not installable here): the model cast to the
      low-precision dtype except BatchNorm, fp32 master weights in the optimizer, inputs cast in and outputs
      cast to fp32, dynamic loss scaling with skipped steps. The checkpoint has Apex's exact layout: 'model' is
      model.state_dict() through Apex's O2StateDictHook (low-precision tensors upcast to fp32), 'optimizer' the
      state of the optimizer over the masters, 'amp' an OrderedDict {'loss_scaler0': {'loss_scale', 'unskipped'}}.
Every step draws its batch from DIR/data.pt, which C++ reads too, so both sides see the same data in the same order.
"""
import argparse
import collections
import os
import struct
import zlib

import torch
import torch.nn.functional as F

N, M, K = 4, 4, 3          # steps before the first checkpoint, after it, after the C++ checkpoint
BATCH, FEATURES, CLASSES = 16, 8, 4
GROWTH_INTERVAL = 3        # small, so that the scale grows inside the test; C++ uses the same
OVERFLOW_STEP = 1          # an injected overflow (loss * inf) in the first phase: the scale drops to 32768


class Net(torch.nn.Module):  # tests/python_checkpoint_test.cpp's PyNet, same names
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(FEATURES, 16, bias=False)  # BatchNorm follows: a bias would get zero gradients
        self.bn = torch.nn.BatchNorm1d(16)
        self.fc2 = torch.nn.Linear(16, CLASSES)

    def forward(self, x):
        return self.fc2(F.relu(self.bn(self.fc1(x))))


def make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-4)
    return torch.optim.Adam(params, lr=0.01, betas=(0.8, 0.99), eps=1e-6)


class O1:
    """torch.autocast + GradScaler, as torch.amp's documentation writes it."""

    def __init__(self, model, kind, dtype):
        self.model, self.dtype = model, dtype
        self.optimizer = make_optimizer(kind, model.parameters())
        self.scaler = torch.amp.GradScaler("cpu", growth_interval=GROWTH_INTERVAL)

    def step(self, x, y, overflow=False):
        self.optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=self.dtype):
            out = self.model(x)
        loss = F.cross_entropy(out.float(), y)
        if overflow:
            loss = loss * float("inf")
        self.scaler.scale(loss).backward()
        self.scaler.step(self.optimizer)
        self.scaler.update()

    def fp32_state(self):
        return {k: v.detach().clone() for k, v in self.model.state_dict().items()}

    def checkpoint(self):
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict()}

    def load(self, ck):  # after construction, as a resuming script does
        self.model.load_state_dict(ck["model"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.scaler.load_state_dict(ck["scaler"])

    def scale_state(self):
        return self.scaler.get_scale(), self.scaler._get_growth_tracker()


class O2:
    """Apex's O2: low-precision model (BatchNorm fp32), fp32 masters stepped by the optimizer."""

    def __init__(self, model, kind, dtype):
        self.model, self.dtype = model, dtype
        self.pairs = []  # (model parameter, master): the master is the parameter itself where it stays fp32
        for module in model.modules():
            keep = isinstance(module, torch.nn.modules.batchnorm._BatchNorm)
            for p in module.parameters(recurse=False):
                if keep:
                    self.pairs.append((p, p))
                else:
                    master = p.detach().clone().float().requires_grad_(True)  # from the fp32 value
                    p.data = p.data.to(dtype)
                    self.pairs.append((p, master))
        # masters in the model's parameter order, as Apex's param_groups
        order = {id(p): i for i, p in enumerate(model.parameters())}
        self.pairs.sort(key=lambda pm: order[id(pm[0])])
        self.optimizer = make_optimizer(kind, [m for _, m in self.pairs])
        self.scale, self.unskipped = 65536.0, 0

    def step(self, x, y, overflow=False):
        for p, m in self.pairs:
            p.grad = None
            m.grad = None
        out = self.model(x.to(self.dtype)).float()
        loss = F.cross_entropy(out, y)
        if overflow:
            loss = loss * float("inf")
        (loss.float() * self.scale).backward()
        inv = 1.0 / self.scale
        finite = True
        for p, m in self.pairs:
            if p.grad is None:
                continue
            if m is p:
                p.grad.mul_(inv)
            else:
                m.grad = p.grad.float() * inv
                p.grad = None
            finite = finite and bool(torch.isfinite(m.grad).all())
        if not finite:  # Apex: skip the step, halve the scale
            self.scale, self.unskipped = self.scale * 0.5, 0
            return
        self.unskipped += 1
        if self.unskipped == GROWTH_INTERVAL:
            self.scale, self.unskipped = self.scale * 2.0, 0
        self.optimizer.step()
        with torch.no_grad():
            for p, m in self.pairs:
                if m is not p:
                    p.copy_(m)

    def fp32_state(self):
        master_of = {id(p): m for p, m in self.pairs}
        out = {}
        for name, t in self.model.state_dict(keep_vars=True).items():
            out[name] = master_of.get(id(t), t).detach().float().clone() if t.is_floating_point() else t.detach().clone()
        return out

    def checkpoint(self):
        # Apex's O2StateDictHook: the model's low-precision tensors upcast to fp32 (not the masters).
        model = collections.OrderedDict((k, v.float() if v.dtype in (torch.float16, torch.bfloat16) else v)
                                        for k, v in self.model.state_dict().items())
        amp = collections.OrderedDict(loss_scaler0={"loss_scale": self.scale, "unskipped": self.unskipped})
        return {"model": model, "optimizer": self.optimizer.state_dict(), "amp": amp}

    @staticmethod
    def resume(ck, kind, dtype):
        # initialize, then load: the masters take the checkpoint's fp32 values.
        model = Net()
        model.load_state_dict(ck["model"])
        run = O2(model, kind, dtype)
        run.optimizer.load_state_dict(ck["optimizer"])
        run.scale = float(ck["amp"]["loss_scaler0"]["loss_scale"])
        run.unskipped = int(ck["amp"]["loss_scaler0"]["unskipped"])
        return run

    def scale_state(self):
        return self.scale, self.unskipped


def parse_case(case):
    kind, level, dtype = case.split("-")
    return kind, level, {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]


def resume_run(ck, kind, level, dtype):
    if level == "O1":
        run = O1(Net(), kind, dtype)
        run.load(ck)
        return run
    return O2.resume(ck, kind, dtype)


def result(run, step):
    scale, unskipped = run.scale_state()
    return {"params": run.fp32_state(), "scale": float(scale), "unskipped": int(unskipped), "step": step,
            "torch_version": torch.__version__}


def train(args):
    kind, level, dtype = parse_case(args.case)
    torch.manual_seed(0)
    data = {"x": torch.randn(N + M + K, BATCH, FEATURES), "y": torch.randint(0, CLASSES, (N + M + K, BATCH))}
    torch.save(data, os.path.join(args.dir, "data.pt"))
    torch.manual_seed(1)
    run = (O1 if level == "O1" else O2)(Net(), kind, dtype)
    run.model.train()
    for i in range(N):
        run.step(data["x"][i], data["y"][i], overflow=(i == OVERFLOW_STEP))
    ck = run.checkpoint()
    ck["step"] = N
    ck["args"] = argparse.Namespace(case=args.case)  # a Python object C++ cannot rebuild: the rest stays readable
    torch.save(ck, os.path.join(args.dir, "python.pt"))

    # Python's own continuation, from the file, in fresh objects.
    ck = torch.load(os.path.join(args.dir, "python.pt"), weights_only=False)
    run = resume_run(ck, kind, level, dtype)
    run.model.train()
    for i in range(N, N + M):
        run.step(data["x"][i], data["y"][i])
    torch.save(result(run, N + M), os.path.join(args.dir, "python_continued.pt"))


def resume(args):
    kind, level, dtype = parse_case(args.case)
    data = torch.load(os.path.join(args.dir, "data.pt"))
    ck = torch.load(os.path.join(args.dir, "cpp.pt"))  # weights_only=True, torch's default: plain data only
    assert set(ck["model"]) == set(Net().state_dict()), sorted(ck["model"])
    assert all(v.dtype != torch.bfloat16 and v.dtype != torch.float16 for v in ck["model"].values())
    run = resume_run(ck, kind, level, dtype)
    run.model.train()
    start = int(ck["step"])
    for i in range(start, start + K):
        run.step(data["x"][i], data["y"][i])
    torch.save(result(run, start + K), os.path.join(args.dir, "python_from_cpp.pt"))


def bad(args):
    d = args.dir
    net = Net()
    sgd = make_optimizer("sgd", net.parameters())
    torch.save(torch.zeros(3), os.path.join(d, "tensor.pt"))
    torch.save({"model": torch.zeros(3)}, os.path.join(d, "model_is_tensor.pt"))
    state = net.state_dict()
    missing = collections.OrderedDict((k, v) for k, v in state.items() if k != "fc2.bias")
    torch.save({"model": missing}, os.path.join(d, "missing_key.pt"))
    wrong = collections.OrderedDict(state)
    wrong["fc2.weight"] = torch.zeros(CLASSES, 5)  # the last layer: nothing before it may be written
    torch.save({"model": wrong}, os.path.join(d, "wrong_shape.pt"))
    ddp = collections.OrderedDict(("module." + k, v) for k, v in state.items())
    torch.save({"model": ddp}, os.path.join(d, "ddp.pt"))
    torch.save(state, os.path.join(d, "bare_state_dict.pt"))
    adam = make_optimizer("adam", net.parameters())
    net(torch.randn(4, FEATURES)).sum().backward()
    adam.step()
    torch.save({"optimizer": adam.state_dict()}, os.path.join(d, "adam.pt"))
    sgd.step()
    sgd_state = sgd.state_dict()
    torch.save({"optimizer": sgd_state}, os.path.join(d, "sgd.pt"))
    sgd_state["state"][3]["momentum_buffer"] = torch.zeros(7)  # fc2.weight, after three good ones
    torch.save({"optimizer": sgd_state}, os.path.join(d, "sgd_wrong_shape.pt"))
    scaler = torch.amp.GradScaler("cpu").state_dict()
    del scaler["_growth_tracker"]
    torch.save({"scaler": scaler}, os.path.join(d, "scaler_missing_field.pt"))
    torch.save({"scaler": torch.amp.GradScaler("cpu", growth_interval=100).state_dict()},
               os.path.join(d, "scaler_interval.pt"))
    odd = torch.amp.GradScaler("cpu").state_dict()
    odd["backoff_factor"] = 2.0
    torch.save({"scaler": odd}, os.path.join(d, "scaler_bad_backoff.pt"))
    torch.save({"model": state}, os.path.join(d, "protocol4.pt"), pickle_protocol=4)


def zip_entries(data):
    """(offset of the central directory header, name) of every entry of a torch.save zip."""
    out, pos = [], 0
    while True:
        p = data.find(b"PK\x01\x02", pos)
        if p < 0:
            return out
        name_len = struct.unpack_from("<H", data, p + 28)[0]
        out.append((p, data[p + 46:p + 46 + name_len].decode()))
        pos = p + 46


def patch_record(data, suffix, patch):
    hits = [p for p, name in zip_entries(data) if name.endswith(suffix)]
    assert len(hits) == 1, (suffix, zip_entries(data))
    patch(data, hits[0])


def replace_in_pickle(data, old, new):
    """Rewrites bytes of data.pkl in place (same length) and fixes its CRC-32 in both zip headers."""
    assert len(old) == len(new)
    (cd, name), = [(p, n) for p, n in zip_entries(data) if n.endswith("/data.pkl")]
    local = struct.unpack_from("<I", data, cd + 42)[0]
    start = local + 30 + sum(struct.unpack_from("<HH", data, local + 26))
    size = struct.unpack_from("<I", data, cd + 24)[0]
    pickle = bytes(data[start:start + size])
    assert pickle.count(old) == 1, (old, pickle)
    pickle = pickle.replace(old, new)
    data[start:start + size] = pickle
    crc = zlib.crc32(pickle)
    struct.pack_into("<I", data, cd + 16, crc)
    struct.pack_into("<I", data, local + 14, crc)


def corners(args):
    d = args.dir
    values = {"w": torch.tensor([-0.1, 0.0, 0.1]), "b": torch.tensor([1.0, 2.0])}
    clean = os.path.join(d, "clean.pt")
    torch.save(values, clean)
    raw = bytearray(open(clean, "rb").read())

    def damaged(name, suffix, patch):
        data = bytearray(raw)
        patch_record(data, suffix, patch)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)

    # The directory bit (0x10) of the external attributes of w's storage: miniz then extracts nothing.
    damaged("directory_bit.pt", "/data/0", lambda data, p: data.__setitem__(p + 38, data[p + 38] | 0x10))
    # A compressed size of 0 in the central directory: miniz extracts nothing either.
    damaged("compressed_size.pt", "/data/0", lambda data, p: struct.pack_into("<I", data, p + 20, 0))
    # A wrong CRC-32: the bytes are not the ones written.
    damaged("crc.pt", "/data/0", lambda data, p: data.__setitem__(p + 16, data[p + 16] ^ 0xff))
    # torch's own reader, for the record: no error for the first, so C++ must not rely on it.
    try:
        loaded = torch.load(os.path.join(d, "directory_bit.pt"))
        print("torch.load(directory_bit.pt) returned", loaded["w"].tolist(), "without an error")
    except Exception as e:  # noqa: BLE001 - only informative
        print("torch.load(directory_bit.pt) raised", type(e).__name__)

    # A str that is not UTF-8, made by rewriting the pickle's bytes (Python cannot pickle one); Python refuses it.
    torch.save({"path": "/data/cafe.csv", "epoch": 3}, os.path.join(d, "text.pt"))
    data = bytearray(open(os.path.join(d, "text.pt"), "rb").read())
    replace_in_pickle(data, b"cafe", b"caf\xe9")
    with open(os.path.join(d, "latin1.pt"), "wb") as f:
        f.write(data)
    try:
        torch.load(os.path.join(d, "latin1.pt"))
        raise SystemExit("torch.load accepted a str that is not UTF-8")
    except UnicodeDecodeError:
        pass
    # Non-ASCII text that is UTF-8, and a lone surrogate, which pickle writes and reads with 'surrogatepass'.
    torch.save({"name": "caf\u00e9 \u2713 \U0001F600", "surrogate": "a\udc80b"}, os.path.join(d, "unicode.pt"))

    # torch.Size, as real checkpoints hold it.
    x = torch.randn(2, 3, 4)
    torch.save({"input_shape": x.shape, "empty_shape": torch.Size([]), "shapes": [x.shape, x[0].shape]},
               os.path.join(d, "size.pt"))


def check_utf8(args):
    ck = torch.load(os.path.join(args.dir, "cpp_text.pt"))
    assert ck["name"] == "caf\u00e9 \u2713", ck


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["train", "resume", "bad", "corners", "check_utf8"])
    parser.add_argument("--case", default="sgd-O1-bf16")
    parser.add_argument("--dir", required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    {"train": train, "resume": resume, "bad": bad, "corners": corners, "check_utf8": check_utf8}[args.mode](args)


if __name__ == "__main__":
    main()
