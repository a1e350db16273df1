#!/usr/bin/env python3
"""The Python side of tests/pickle_test.cpp: pickles written by Python's own pickle module, for amp's codec.

  pickles.py DIR    # writes DIR/values_p{2,3,4,5}.pkl, DIR/objects_p{2,4}.pkl, DIR/shared.pt

values: the structure tests/pickle_test.cpp rebuilds in C++ and compares with (keep the two in step).
objects: Python objects C++ keeps opaque (a set, a frozenset, an argparse.Namespace, a class).
shared.pt: torch.save of two tensors over one storage and one tensor saved twice.
"""
import argparse
import os
import pickle
import sys

import torch


def values():
    shared = [1, 2]
    return {
        "ints": [0, 1, 255, 256, 65535, 65536, -1, -256, -2**31, 2**31 - 1, 2**31, 2**62, -2**63, 2**63 - 1],
        "floats": [0.0, 0.5, -1e300, 1e-310, float("inf")],
        "strs": ["", "a", "caf\u00e9", "\u2713\U0001F600", "x" * 300],
        "bools": [True, False, None],
        "tuples": [(), (1,), (1, 2), (1, 2, 3), (1, 2, 3, 4), ((1,), ((2,),))],
        "nested": {"empty_list": [], "empty_dict": {}, "list_of_lists": [[1], [2, [3]]]},
        "int_keys": {1: "one", 2: "two"},
        "float_keys": {0.5: "half"},
        "shared": [shared, shared],
        "many": list(range(2000)),  # APPENDS in batches of 1000
        "bigdict": {str(i): i for i in range(1500)},  # SETITEMS in batches
    }


def main():
    out = sys.argv[1]
    for protocol in (2, 3, 4, 5):
        with open(os.path.join(out, f"values_p{protocol}.pkl"), "wb") as f:
            pickle.dump(values(), f, protocol=protocol)
    objects = {"set": {1, 2}, "frozenset": frozenset([3]), "namespace": argparse.Namespace(lr=0.1),
               "class": argparse.Namespace, "after": 7}
    for protocol in (2, 4):
        with open(os.path.join(out, f"objects_p{protocol}.pkl"), "wb") as f:
            pickle.dump(objects, f, protocol=protocol)
    base = torch.arange(6, dtype=torch.float32)
    torch.save({"base": base, "view": base[2:5], "again": base, "other": torch.ones(2)}, os.path.join(out, "shared.pt"))


if __name__ == "__main__":
    main()
