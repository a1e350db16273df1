"""C++ against Python on the same torch wheel, in alternation: runs `amp_bench --section versus_python` and
`python_amp.py` one after the other, --rounds times, so a noisy machine's drift hits both sides alike, and prints
the median ms per step of each configuration and the C++ / Python ratios (medians over rounds).

    python3 bench/versus_python.py build/torch-2.13/bench/amp_bench --rounds 5 [--csv out.csv]
"""
import argparse
import csv
import io
import os
import statistics
import subprocess
import sys
import tempfile

MODELS = ("tiny_mlp", "mlp", "cnn", "transformer")
# (C++ configuration, the Python configuration it is compared with)
PAIRS = (("LibTorch O0", "O0"), ("amp O0", "O0"), ("torch.amp in C++ O1 bf16", "O1 bf16"),
         ("amp O1 bf16 native", "O1 bf16"), ("amp O1 bf16 apex", "O1 bf16"),
         ("amp O1 bf16 apex", "O1 bf16 apex"))
PYTHON = ("O0", "O1 bf16", "O1 bf16 apex")


def rows_of(text):
    return [r for r in csv.DictReader(io.StringIO(text))]


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("amp_bench")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3, help="repetitions per measurement inside each process")
    parser.add_argument("--csv", help="write section,name,config,metric,value rows here")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    here = os.path.dirname(os.path.abspath(__file__))
    cpp, py = {}, {}
    for r in range(args.rounds):
        with tempfile.NamedTemporaryFile(mode="r", suffix=".csv") as table:
            subprocess.run([args.amp_bench, "--section", "versus_python", "--reps", str(args.reps), "--csv", table.name],
                           env=env, check=True, capture_output=True)
            out = table.read()
        for row in rows_of(out):
            if row["section"] == "versus_python":
                cpp.setdefault((row["name"], row["config"]), []).append(float(row["value"]))
        out = subprocess.run([sys.executable, os.path.join(here, "python_amp.py"), "--reps", str(args.reps)], env=env,
                             check=True, capture_output=True, text=True).stdout
        for row in rows_of(out):
            py.setdefault((row["name"], row["config"]), []).append(float(row["value"]))
        print(f"round {r + 1} of {args.rounds} done", file=sys.stderr)
    print(f"## C++ versus Python (alternating processes, {args.rounds} rounds, medians; OMP_NUM_THREADS="
          f"{env['OMP_NUM_THREADS']})\n")
    print("| model | " + " | ".join(f"Python {c} ms" for c in PYTHON) + " | "
          + " | ".join(f"{c} ms (/ Python {p})" for c, p in PAIRS) + " |")
    print("|---|" + "---|" * (len(PYTHON) + len(PAIRS)))
    out_rows = []
    for name in MODELS:
        ref = {config: statistics.median(py[(name, config)]) for config in PYTHON}
        cells = []
        for config, py_config in PAIRS:
            ms = statistics.median(cpp[(name, config)])
            cells.append(f"{ms:.3f} ({ms / ref[py_config]:.2f})")
            if ("versus_python", name, config, "ms_per_step", ms) not in out_rows:
                out_rows.append(("versus_python", name, config, "ms_per_step", ms))
            out_rows.append(("versus_python", name, f"{config} / Python {py_config}", "over_python", ms / ref[py_config]))
        out_rows += [("python", name, config, "ms_per_step", ms) for config, ms in ref.items()]
        print(f"| {name} | " + " | ".join(f"{ms:.3f}" for ms in ref.values()) + " | " + " | ".join(cells) + " |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("section,name,config,metric,value\n")
            for row in out_rows:
                f.write(",".join(map(str, row)) + "\n")


if __name__ == "__main__":
    main()
