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
         ("amp O1 bf16 native", "O1 bf16"), ("amp O1 bf16 apex", "O1 bf16"))


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
    print("| model | Python O0 ms | Python O1 bf16 ms | " + " | ".join(f"{c} ms (/ Python)" for c, _ in PAIRS) + " |")
    print("|---|---|---|" + "---|" * len(PAIRS))
    out_rows = []
    for name in MODELS:
        p0, p1 = statistics.median(py[(name, "O0")]), statistics.median(py[(name, "O1 bf16")])
        cells = []
        for config, py_config in PAIRS:
            ms = statistics.median(cpp[(name, config)])
            ref = p0 if py_config == "O0" else p1
            cells.append(f"{ms:.3f} ({ms / ref:.2f})")
            out_rows.append(("versus_python", name, config, "ms_per_step", ms))
            out_rows.append(("versus_python", name, config, "over_python", ms / ref))
        out_rows += [("python", name, "O0", "ms_per_step", p0), ("python", name, "O1 bf16", "ms_per_step", p1)]
        print(f"| {name} | {p0:.3f} | {p1:.3f} | " + " | ".join(cells) + " |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("section,name,config,metric,value\n")
            for row in out_rows:
                f.write(",".join(map(str, row)) + "\n")


if __name__ == "__main__":
    main()
