"""The layering docs/architecture.md states, as a test: every #include in src/, opt_levels/ and include/amp/ must
point at its own layer or one below it. The layers run one way: core, options, interception, casting, scaling, optim,
interop, parallel, features, then initialize.

    python3 tests/layering/check_layering.py <source dir>     # exits 1 and lists each include that runs up
    python3 tests/layering/check_layering.py --self-test      # the check catches what it should, on a planted tree

A public header (amp/...) sits in the layer that implements it; the vocabulary headers `Options` is made of (the
enums and option structs option_fields.h includes) sit with options, since every user of options sees them.
"""
import os
import re
import subprocess
import sys
import tempfile

LAYERS = ("core", "options", "interception", "casting", "scaling", "optim", "interop", "parallel", "features", "initialize")

PUBLIC = {
    # what Options is made of
    "opt_level.h": "options", "loss_scale.h": "options", "properties.h": "options", "options.h": "options",
    "option_fields.h": "options", "master_weights.h": "options", "optimizer_state_format.h": "options",
    "cast_policy.h": "options", "precision_policy.h": "options", "fp8.h": "options",
    # the forward's casts
    "autocast_guard.h": "casting", "batchnorm.h": "casting", "checkpoint.h": "casting",
    "custom_function.h": "casting", "model.h": "casting", "torchscript_model.h": "casting",
    # the backward protocol
    "loss_scaler.h": "scaling", "overflow_report.h": "scaling",
    # the optimizer and what it steps
    "optimizer.h": "optim", "scale_loss.h": "optim", "fused_optimizers.h": "optim", "fused_optimizer.h": "optim",
    "fused_muon.h": "optim", "grad_scaler.h": "optim", "graph_capture.h": "optim",
    "clip_grad.h": "optim", "memory.h": "optim",
    # formats shared with other programs
    "config.h": "interop", "load_weights.h": "interop", "python_checkpoint.h": "interop", "tensorboard.h": "interop",
    "parallel.h": "parallel", "initialize.h": "initialize", "torchscript.h": "initialize", "amp.h": "initialize",
}

INCLUDE = re.compile(r'^\s*#\s*include\s+[<"]([^">]+)[">]')


def layer_of_file(relative):
    """The layer of a file under src/, opt_levels/ or include/amp/ (a path relative to the source directory)."""
    parts = relative.split("/")
    if parts[0] == "opt_levels":
        return "options"  # the levels as data, read by options/
    if parts[0] == "include":
        return layer_of_include("/".join(parts[1:]))
    if len(parts) == 2:
        return "initialize"
    if parts[1] not in LAYERS:
        raise SystemExit(f"tests/layering/check_layering.py: src/{parts[1]}/ is no layer of docs/architecture.md: "
                         "add it to LAYERS where it belongs")
    return parts[1]


def layer_of_include(target):
    """The layer an include points at, or None for a header outside amp (LibTorch, the standard library)."""
    if target.startswith("amp/parallel/"):
        return "parallel"
    if target.startswith("amp/"):
        name = target[len("amp/"):]
        if name not in PUBLIC:
            raise SystemExit(f"tests/layering/check_layering.py: amp/{name} has no layer: add it to PUBLIC")
        return PUBLIC[name]
    folder = target.split("/")[0]
    if folder in LAYERS and "/" in target:
        return folder
    return None


def self_test():
    """Runs the check on planted trees: an upward include, a folder of no layer, a public header of no layer, and a
    tree that keeps the order (which must pass)."""
    cases = {
        "keeps the order": ({"src/optim/a.cpp": '#include "amp/loss_scaler.h"\n#include "scaling/b.h"\n',
                             "src/casting/c.cpp": '#include "core/host_sync.h"\n#include <vector>\n'}, 0, "checked"),
        "an upward include": ({"src/casting/a.cpp": '#include "amp/optimizer.h"\n'}, 1,
                              "src/casting/a.cpp:1: casting/ includes amp/optimizer.h (optim/, above it)"),
        "an upward internal include": ({"src/scaling/a.h": '  #  include "parallel/zero.h"\n'}, 1,
                                       "scaling/ includes parallel/zero.h (parallel/, above it)"),
        "a folder of no layer": ({"src/misc/a.cpp": '#include "amp/options.h"\n'}, 1, "src/misc/ is no layer"),
        "a public header of no layer": ({"include/amp/new_thing.h": "#pragma once\n"}, 1, "amp/new_thing.h has no layer"),
    }
    failures = 0
    for name, (files, code, text) in cases.items():
        with tempfile.TemporaryDirectory() as root:
            os.makedirs(os.path.join(root, "include", "amp"))
            for path, content in files.items():
                os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
                with open(os.path.join(root, path), "w", encoding="utf-8") as f:
                    f.write(content)
            run = subprocess.run([sys.executable, __file__, root], capture_output=True, text=True)
            output = run.stdout + run.stderr
            if run.returncode != code or text not in output:
                failures += 1
                print(f"self-test '{name}': exit {run.returncode} (expected {code}), output:\n{output}")
    print(f"{len(cases) - failures} of {len(cases)} planted trees judged as expected")
    return 1 if failures else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "..")
    for name in os.listdir(os.path.join(root, "include", "amp")):
        if name.endswith(".h") and name not in PUBLIC:
            raise SystemExit(f"tests/layering/check_layering.py: include/amp/{name} has no layer: add it to PUBLIC")
    violations, checked = [], 0
    for top in ("src", "opt_levels", "include"):
        for directory, _, files in os.walk(os.path.join(root, top)):
            for name in sorted(files):
                if not name.endswith((".h", ".cpp")):
                    continue
                path = os.path.join(directory, name)
                relative = os.path.relpath(path, root).replace(os.sep, "/")
                own = layer_of_file(relative)
                with open(path, encoding="utf-8") as f:
                    for number, line in enumerate(f, 1):
                        match = INCLUDE.match(line)
                        if not match:
                            continue
                        target = layer_of_include(match.group(1))
                        if target is None:
                            continue
                        checked += 1
                        if LAYERS.index(target) > LAYERS.index(own):
                            violations.append(f"{relative}:{number}: {own}/ includes {match.group(1)} ({target}/, "
                                              "above it)")
    print(f"{checked} includes of amp's own headers checked against the order "
          f"{' < '.join(LAYERS)} (docs/architecture.md)")
    for v in violations:
        print(v)
    if violations:
        print(f"{len(violations)} includes run up the layers: move what the lower layer needs down, or pass it in")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
