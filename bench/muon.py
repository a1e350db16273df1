"""FusedMuon's figures beside torch.optim.Muon on the same wheel (docs/benchmarks.md, "FusedMuon").

    python3 bench/muon.py build/torch-2.13/bench/amp_muon_bench [--rounds 5] [--steps 300] [--plot docs/images/muon_loss_curves.png]

1. Step time: `amp_muon_bench --section step` (FusedMuon and FusedAdamW over the bench transformer's four hidden
   matrices, fp32) and this script's --python-side (torch.optim.Muon and torch.optim.AdamW over the same tensors) in
   alternating processes, --rounds times, OMP_NUM_THREADS=1 unless set; medians over rounds.
2. Bytes per parameter of the Muon + AdamW pair at O2 bf16 with each momentum format (amp::state_bytes).
3. The bench transformer trained --steps steps at O2 bf16 on a random teacher's labels, a fresh batch each step, Muon +
   AdamW against AdamW alone; with --plot, the two loss curves drawn by gnuplot.
"""
import argparse
import csv
import io
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

SHAPES = [(768, 256), (256, 256), (1024, 256), (256, 1024)]  # amp_muon_bench's matrices_with_grads()


def python_side(reps):
    import torch
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    def matrices():
        torch.manual_seed(0)
        out = []
        for shape in SHAPES:
            p = torch.randn(shape).mul_(0.02).requires_grad_()
            p.grad = torch.randn(shape).mul_(1e-3)
            out.append(p)
        return out

    muon = torch.optim.Muon(matrices(), lr=0.02)
    adamw = torch.optim.AdamW(matrices(), lr=1e-3)
    steps = [muon.step, adamw.step]
    for _ in range(2):
        for step in steps:
            step()
    start = time.perf_counter()
    steps[0]()
    k = max(1, int(0.3 / max(time.perf_counter() - start, 1e-7)))
    samples = [[], []]
    for _ in range(reps):
        for j, step in enumerate(steps):
            start = time.perf_counter()
            for _ in range(k):
                step()
            samples[j].append((time.perf_counter() - start) / k)
    print("section,name,config,metric,value")
    print(f"muon_step,transformer matrices,torch.optim.Muon,ms_per_step,{1e3 * statistics.median(samples[0]):.6f}")
    print(f"muon_step,transformer matrices,torch.optim.AdamW,ms_per_step,{1e3 * statistics.median(samples[1]):.6f}")


def rows(text):
    return list(csv.DictReader(io.StringIO(text)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("amp_muon_bench", nargs="?")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--plot", help="PNG of the loss curves (needs gnuplot)")
    parser.add_argument("--python-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.python_side:
        return python_side(args.reps)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    times = {}
    for r in range(args.rounds):
        for command in ([args.amp_muon_bench, "--section", "step", "--reps", str(args.reps)],
                        [sys.executable, os.path.abspath(__file__), "--python-side", "--reps", str(args.reps)]):
            out = subprocess.run(command, env=env, check=True, capture_output=True, text=True).stdout
            for row in rows(out):
                times.setdefault(row["config"], []).append(float(row["value"]))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    ms = {config: statistics.median(values) for config, values in times.items()}
    print(f"## FusedMuon's step against torch.optim.Muon ({args.rounds} alternating rounds, medians; "
          f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']})\n")
    print("| optimizer | ms/step | / torch.optim.Muon | / FusedAdamW |\n|---|---|---|---|")
    for config in ("FusedMuon", "torch.optim.Muon", "FusedAdamW", "torch.optim.AdamW"):
        print(f"| {config} | {ms[config]:.3f} | {ms[config] / ms['torch.optim.Muon']:.2f} | "
              f"{ms[config] / ms['FusedAdamW']:.2f} |")

    out = subprocess.run([args.amp_muon_bench, "--section", "bytes"], env=env, check=True, capture_output=True,
                         text=True).stdout
    by = {}
    for row in rows(out):
        by.setdefault(row["config"], {})[row["metric"]] = float(row["value"])
    print("\n## Bytes per parameter, Muon + AdamW on the bench transformer at O2 bf16 (amp::state_bytes)\n")
    print("| momentum format | Muon's state / Muon param | Muon's total / Muon param | pair's total / param |\n"
          "|---|---|---|---|")
    for config, m in by.items():
        print(f"| {config} | {m['muon_state_bytes_per_muon_param']:.2f} | {m['muon_total_bytes_per_muon_param']:.2f} | "
              f"{m['pair_total_bytes_per_param']:.2f} |")
    share = next(iter(by.values()))["muon_share_of_params"]
    print(f"\nMuon steps {100 * share:.1f}% of the parameters.")

    out = subprocess.run([args.amp_muon_bench, "--section", "train", "--steps", str(args.steps)], env=env, check=True,
                         capture_output=True, text=True).stdout
    curves = {}
    for row in rows(out):
        curves.setdefault(row["config"], []).append(float(row["value"]))
    window = 20
    marks = [m for m in (20, 50, 100, 200, 300) if m <= args.steps]
    print(f"\n## The bench transformer at O2 bf16, {args.steps} steps on a random teacher's labels (fresh batches)\n")
    print(f"Mean loss of the {window} steps up to each mark (each step's batch is new: the loss is held-out).\n")
    print("| optimizer | " + " | ".join(f"steps {m - window}-{m - 1}" for m in marks) + " |\n|---|" + "---|" * len(marks))
    for config, losses in curves.items():
        print(f"| {config} | " + " | ".join(f"{statistics.mean(losses[m - window:m]):.4f}" for m in marks) + " |")
    if args.plot:
        if shutil.which("gnuplot") is None:
            print("(no gnuplot: no plot)", file=sys.stderr)
            return
        with tempfile.TemporaryDirectory() as tmp:
            files = []
            for i, (config, losses) in enumerate(curves.items()):
                path = os.path.join(tmp, f"{i}.dat")
                with open(path, "w") as f:
                    f.writelines(f"{s} {v}\n" for s, v in enumerate(losses))
                files.append((path, config))
            plots = ", ".join(f"'{p}' with lines lw 2 title '{c}'" for p, c in files)
            script = (f"set terminal pngcairo size 800,450; set output '{args.plot}'; set logscale y; "
                      f"set xlabel 'step'; set ylabel 'loss'; set title 'bench transformer, O2 bf16, teacher labels'; plot {plots}")
            subprocess.run(["gnuplot", "-e", script], check=True)


if __name__ == "__main__":
    main()
