#!/usr/bin/env python3
"""Writes the pickle fuzzer's seed corpus (fuzz/pickle_corpus/): the data.pkl of real torch.save files of the
kinds tests/python/ writes (a model's state_dict, SGD and Adam state, a GradScaler, Apex's amp state, an
argparse.Namespace, torch.Size, nested containers), at pickle protocols 2 and 4.

  python3 fuzz/make_pickle_corpus.py     # run from anywhere; rewrites fuzz/pickle_corpus
"""
import argparse
import collections
import hashlib
import io
import os
import zipfile

import torch


def checkpoints():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8, bias=False), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    sgd = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    adam = torch.optim.Adam(net.parameters(), lr=1e-3)
    net(torch.randn(3, 4)).sum().backward()
    sgd.step()
    adam.step()
    yield "state_dict", net.state_dict()
    yield "training", {"model": net.state_dict(), "optimizer": sgd.state_dict(), "epoch": 3, "best_acc": 0.5}
    yield "adam", {"optimizer": adam.state_dict(), "scaler": torch.amp.GradScaler("cpu").state_dict()}
    yield "apex", {"amp": collections.OrderedDict(loss_scaler0={"loss_scale": 32768.0, "unskipped": 2})}
    yield "objects", {"args": argparse.Namespace(lr=0.1, name="caf\u00e9"), "shape": torch.randn(2, 3).shape,
                      "set": {1, 2}, "nested": [(1, 2.5, None, True), {"k": [b"raw", "text"]}],
                      "half": torch.ones(3, dtype=torch.float16), "view": torch.arange(6.0)[2:5],
                      "version": torch.__version__}


def main():
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pickle_corpus")
    os.makedirs(out, exist_ok=True)
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))
    for name, obj in checkpoints():
        for protocol in (2, 4):
            buffer = io.BytesIO()
            torch.save(obj, buffer, pickle_protocol=protocol)
            with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as z:
                pkl = next(n for n in z.namelist() if n.endswith("/data.pkl"))
                data = z.read(pkl)
            with open(os.path.join(out, hashlib.sha1(data).hexdigest()), "wb") as f:
                f.write(data)
    print(f"make_pickle_corpus: {len(os.listdir(out))} seeds in {out}")


if __name__ == "__main__":
    main()
