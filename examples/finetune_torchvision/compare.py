#!/usr/bin/env python3
"""examples/finetune_torchvision side by side with Python: the same scripted torchvision model, data, batches and
optimizer, fine-tuned by the C++ program at an opt level and by Python doing what that level means
(torchvision_models.py reference), twice in Python: the second run adds each batch's gradient up from two halves, an
equally valid order of the same sums, so the two Python runs measure how far rounding alone moves a run.

  compare.py BINARY WORK_DIR [--steps 50] [--models resnet18,mobilenet_v3_small,vit] [--configs ...]
             [--timing-rounds 5] [--markdown table.md] [--plot curves.png]

Checks, for each model and configuration (exit 1 on the first failure, after the table):
- O0 with SGD runs the same ATen ops on both sides: every loss and every final weight bitwise equal;
- otherwise the largest gap between C++'s and Python's losses is at most twice the largest gap between the two Python
  runs (each side being one more equally valid order of the same sums: the triangle inequality's bound);
- the loss scale of every step and the skipped steps agree with Python's (GradScaler at O1, Apex's scaler at O2);
- BatchNorm's running statistics come back bitwise unchanged from C++ (its saved fp32 module) and from Python.
"""
import argparse
import csv
import math
import os
import statistics
import shutil
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torchvision_models as tvm  # noqa: E402

# (level, dtype, optimizer): what the C++ program runs and Python emulates
ALL_CONFIGS = [(level, dtype, optimizer) for level in ("O0", "O1", "O2", "O3") for dtype in ("bfloat16", "float16")
               for optimizer in ("sgd", "adamw") if not (level == "O0" and dtype == "float16")]
ALL_CONFIGS = [(level, "float32" if level == "O0" else dtype, optimizer) for level, dtype, optimizer in ALL_CONFIGS]


def loss_gap(a, b):
    """The largest |a[k] - b[k]|; steps where both are NaN agree (a run that diverged on both sides alike), a NaN on
    one side only is an infinite gap."""
    worst = 0.0
    for x, y in zip(a, b):
        if math.isnan(x) or math.isnan(y):
            if not (math.isnan(x) and math.isnan(y)):
                return math.inf
            continue
        worst = max(worst, abs(x - y))
    return worst


def parse_config(text):
    level, dtype, optimizer = text.split(":")
    return level, dtype, optimizer


def read_log(path):
    with open(path) as f:
        rows = list(csv.DictReader(f))
    return [float(r["loss"]) for r in rows], [float(r["loss_scale"]) for r in rows]


def run_cpp(binary, work, model, level, dtype, optimizer, steps, tag):
    prefix = os.path.join(work, f"cpp_{model}_{level}_{dtype}_{optimizer}{tag}")
    command = [binary, "--opt-level", level, "--verbosity", "0", "--model", os.path.join(work, f"{model}.pt"),
               "--data", os.path.join(work, "data.pt"), "--optimizer", optimizer, "--steps", str(steps),
               "--loss-log", prefix + ".csv", "--out", prefix + ".pt"]
    if level != "O0":
        command += ["--low-precision-dtype", dtype]
    if level == "O1":
        command += ["--cast-lists", "native"]  # torch.autocast's lists, as the Python run
    start = time.perf_counter()
    out = subprocess.run(command, capture_output=True, text=True)
    refusal = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("amp::initialize:")]
    if out.returncode == 1 and refusal:  # amp refuses the combination, saying why (docs/errors.md)
        return prefix, {"refused": refusal[0]}
    if out.returncode != 0:
        raise SystemExit(f"FAIL: {' '.join(command)} exited {out.returncode}:\n{out.stdout}{out.stderr}")
    fields = {}
    for line in out.stdout.splitlines():
        if ", LibTorch " in line:
            fields["libtorch"] = line.split(", LibTorch ")[-1].strip()
        if line.startswith("fine-tuned at"):
            fields["ms"] = float(line.split(" ms/step")[0].split()[-1])
            fields["mib"] = float(line.split(" MiB")[0].split()[-1])
            fields["skipped"] = int(line.split(" skipped steps")[0].split()[-1])
        if line.startswith("BatchNorm statistics unchanged"):
            fields["bn"] = line.endswith("yes")
    fields["wall"] = time.perf_counter() - start
    return prefix, fields


def plot(curves, png):
    """One panel per model: each AdamW run's loss per step, C++ as lines and Python as points."""
    data, script = png + ".dat", png + ".gp"
    models = []
    with open(data, "w") as f:
        for block, (name, cpp_loss, py_loss) in enumerate(curves):
            f.write(f"# {name}\n" + "".join(f"{k} {a!r} {b!r}\n" for k, (a, b) in enumerate(zip(cpp_loss, py_loss))))
            f.write("\n\n")
            if name.split()[0] not in models:
                models.append(name.split()[0])
    with open(script, "w") as f:
        f.write(f"set terminal pngcairo size 1500,480 noenhanced\nset output '{png}'\n"
                f"set multiplot layout 1,{len(models)}\nset xlabel 'step'\nset ylabel 'cross-entropy'\n"
                "set key top right font ',8'\n")
        for model in models:
            runs = [(i, name) for i, (name, _, _) in enumerate(curves) if name.startswith(model + " ") and
                    name.endswith(" adamw")]
            f.write(f"set title '{model}: AdamW, C++ (lines) and Python (points)'\nplot " + ", ".join(
                f"'{data}' index {i} using 1:2 with lines lc {k + 1} title '{' '.join(name.split()[1:3])}', "
                f"'{data}' index {i} using 1:3 with points pt 7 ps 0.4 lc {k + 1} notitle"
                for k, (i, name) in enumerate(runs)) + "\n")
        f.write("unset multiplot\n")
    ok = subprocess.run(["gnuplot", script]).returncode == 0 if shutil.which("gnuplot") else False
    print(f"loss curves: {png}" if ok else f"gnuplot failed or is missing; the curves are in {data}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("binary")
    parser.add_argument("work")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--models", default=",".join(tvm.MODELS))
    parser.add_argument("--configs", default="all", help='all, or comma-separated LEVEL:DTYPE:OPTIMIZER')
    parser.add_argument("--pretrain-steps", type=int, default=30, help="Python's pretraining, when WORK_DIR has no models")
    parser.add_argument("--timing-rounds", type=int, default=1, help="alternating C++ / Python runs timed (median)")
    parser.add_argument("--markdown", help="write the table here")
    parser.add_argument("--plot", help="draw the AdamW runs' loss curves, C++ against Python, into this PNG (gnuplot)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(args.work, exist_ok=True)
    if not all(os.path.exists(os.path.join(args.work, f)) for f in ("data.pt", *(f"{m}.pt" for m in tvm.MODELS))):
        tvm.prepare(argparse.Namespace(dir=args.work, pretrain_steps=args.pretrain_steps))
    configs = ALL_CONFIGS if args.configs == "all" else [parse_config(c) for c in args.configs.split(",")]
    failures, rows, curves, refusals = [], [], [], []
    for model in args.models.split(","):
        pretrained = {k: v for k, v in torch.jit.load(os.path.join(args.work, f"{model}.pt")).state_dict().items()
                      if "running" in k}
        for level, dtype, optimizer in configs:
            name = f"{model} {level} {dtype if level != 'O0' else 'fp32'} {optimizer}"
            cpp_ms, py_ms = [], []
            ref = os.path.join(args.work, f"py_{model}_{level}_{dtype}_{optimizer}")
            for r in range(args.timing_rounds):
                prefix, cpp = run_cpp(args.binary, args.work, model, level, dtype, optimizer, args.steps, "")
                if cpp.get("libtorch", torch.__version__).split("+")[0] != torch.__version__.split("+")[0]:
                    print(f"skipped: the program runs LibTorch {cpp['libtorch']}, Python torch {torch.__version__}: "
                          "the same ops need the same build")
                    return 77
                py_ms.append(tvm.reference(argparse.Namespace(dir=args.work, model=model, level=level, dtype=dtype,
                                                              optimizer=optimizer, steps=args.steps, out=ref,
                                                              micro_batches=1)))
                if "refused" in cpp:
                    break
                cpp_ms.append(cpp["ms"])
            if "refused" in cpp:
                py_loss, _ = read_log(ref + ".csv")
                outcome = "goes to NaN" if any(x != x for x in py_loss) else f"ends at loss {py_loss[-1]:.4f}"
                refusals.append(f"{name}: {cpp['refused']} (Python's run {outcome} in {args.steps} steps)")
                print(f"{name}: refused by amp: {cpp['refused']} (Python's run {outcome})", flush=True)
                continue
            tvm.reference(argparse.Namespace(dir=args.work, model=model, level=level, dtype=dtype, optimizer=optimizer,
                                             steps=args.steps, out=ref + "_halves", micro_batches=2))
            cpp_loss, cpp_scale = read_log(prefix + ".csv")
            py_loss, py_scale = read_log(ref + ".csv")
            py2_loss, _ = read_log(ref + "_halves.csv")
            gap, spread = loss_gap(cpp_loss, py_loss), loss_gap(py_loss, py2_loss)
            cpp_weights = torch.jit.load(prefix + ".pt").state_dict()
            py_weights = torch.load(ref + ".pt")
            problems = []
            if level == "O0" and optimizer == "sgd":
                if gap != 0:
                    problems.append(f"losses differ from Python's (O0 SGD runs the same ops): largest gap {gap:.3g}")
                differing = [k for k, v in py_weights.items() if not torch.equal(cpp_weights[k], v)]
                if differing:
                    problems.append(f"weights differ from Python's: {', '.join(differing[:5])}")
            elif gap > 2 * spread:
                problems.append(f"losses {gap:.3g} from Python's, more than twice the {spread:.3g} two Python runs "
                                "differ by")
            if cpp_scale != py_scale:
                first = next(i for i, (a, b) in enumerate(zip(cpp_scale, py_scale)) if a != b)
                problems.append(f"loss scale differs from Python's at step {first}: {cpp_scale[first]} against "
                                f"{py_scale[first]}")
            if not cpp.get("bn", False):
                problems.append("C++ changed BatchNorm's running statistics")
            for k, v in pretrained.items():
                if not torch.equal(cpp_weights[k].float(), v.float()) or not torch.equal(py_weights[k].float(), v.float()):
                    problems.append(f"running statistics '{k}' changed (C++ or Python)")
                    break
            py_skipped = sum(1 for i in range(1, len(py_scale)) if py_scale[i] < py_scale[i - 1])
            bitwise = all(torch.equal(cpp_weights[k], v) for k, v in py_weights.items())
            rows.append((name, cpp_loss[-1], py_loss[-1], gap, spread, bitwise, statistics.median(cpp_ms),
                         statistics.median(py_ms), cpp["mib"], cpp["skipped"], py_skipped))
            curves.append((name, cpp_loss, py_loss))
            status = "ok" if not problems else "FAIL: " + "; ".join(problems)
            print(f"{name}: C++ {cpp_loss[-1]:.6f} Python {py_loss[-1]:.6f} after {args.steps} steps, gap {gap:.3g} "
                  f"(Python's own spread {spread:.3g}), {cpp['skipped']} skipped: {status}", flush=True)
            failures += [f"{name}: {p}" for p in problems]
    table = [f"| model, level, dtype, optimizer | C++ loss | Python loss | max gap C++ - Python | max gap Python - Python "
             f"(halves) | weights bitwise Python's | C++ ms/step | Python ms/step | C++ / Python | C++ peak tensor MiB | "
             f"skipped C++ / Python |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, cl, pl, gap, spread, bitwise, cms, pms, mib, cs, ps in rows:
        table.append(f"| {name} | {cl:.4f} | {pl:.4f} | {gap:.2g} | {spread:.2g} | {'yes' if bitwise else 'no'} | "
                     f"{cms:.1f} | {pms:.1f} | {cms / pms:.2f} | {mib:.1f} | {cs} / {ps} |")
    if refusals:
        table += ["", "Refused by amp, with the reason it gives:", ""] + [f"- {r}" for r in refusals]
    print("\n" + "\n".join(table))
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write("\n".join(table) + "\n")
    if args.plot:
        plot(curves, args.plot)
    if failures:
        print("\n" + "\n".join("FAIL: " + f for f in failures))
        return 1
    print(f"\nall {len(rows)} runs agree with Python")
    return 0


if __name__ == "__main__":
    sys.exit(main())
