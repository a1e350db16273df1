"""Merges amp_bench's and python_amp.py's CSV into bench/results/<date>.md and <date>.csv, adding the
C++ / Python ratios and each target's verdict. Called by bench/run.sh; with --gpu first, merges
amp_gpu_bench's and python_amp.py --device's the same way (scripts/gpu-check.sh)."""
import csv
import sys


def load(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def write(lines, rows, out_md, out_csv):
    with open(out_md, "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["section", "name", "config", "metric", "value"])
        writer.writeheader()
        writer.writerows(rows)
    print("\n".join(lines))


def main(cpp_csv, py_csv, cpp_md, out_md, out_csv):
    rows = load(cpp_csv) + load(py_csv)
    value = {(r["section"], r["name"], r["config"], r["metric"]): float(r["value"]) for r in rows}
    lines = [open(cpp_md).read().rstrip(), "", "## Versus Python torch.amp (autocast + GradScaler, same torch 2.13 wheel)", "",
             "| model | config | amp C++ ms | Python ms | C++ / Python | target |", "|---|---|---|---|---|---|"]
    for name in ("tiny_mlp", "mlp", "cnn", "transformer"):
        for config in ("O0", "O1 bf16"):
            cpp = value.get(("steps", name, config, "ms_per_step"))
            py = value.get(("python", name, config, "ms_per_step"))
            if cpp is None or py is None:
                continue
            target = 0.7 if name in ("tiny_mlp", "mlp") else 1.0
            verdict = "met" if cpp / py <= target else "missed"
            lines.append(f"| {name} | {config} | {cpp:.3f} | {py:.3f} | {cpp / py:.2f} | <= {target} ({verdict}) |")
            rows.append({"section": "versus_python", "name": name, "config": config, "metric": "ratio", "value": cpp / py})
        cpp = value.get(("o1_lists", name, "O1 bf16 native", "ms_per_step"))
        py = value.get(("python", name, "O1 bf16", "ms_per_step"))
        if cpp is not None and py is not None:  # torch.amp's lists on both sides (amp_bench --section o1)
            verdict = "met" if cpp / py <= 1.0 else "missed"
            lines.append(f"| {name} | O1 bf16 native | {cpp:.3f} | {py:.3f} | {cpp / py:.2f} | <= 1.0 ({verdict}) |")
            rows.append({"section": "versus_python", "name": name, "config": "O1 bf16 native", "metric": "ratio",
                         "value": cpp / py})
    lines += ["", "## Targets", ""]
    overhead = [(k, v) for k, v in value.items() if k[0] == "overhead" and k[3] == "ratio"]
    for (_, name, config, _), v in sorted(overhead):
        lines.append(f"- overhead {name} {config}: {v:.3f} (target <= 1.02: {'met' if v <= 1.02 else 'missed'})")
    for (_, label, config, _), v in sorted((k, v) for k, v in value.items() if k[0] == "unscale" and k[3] == "ratio"):
        target = 1.2 if "->" in config else 1.25
        lines.append(f"- unscale {label} {config}: {v:.2f}x the bound (target <= {target}: {'met' if v <= target else 'missed'})")
    for (_, name, config, _), v in sorted((k, v) for k, v in value.items() if k[0] == "fused_steps" and k[3] == "fused_over_hand"):
        lines.append(f"- fused optimizer, whole step {name} {config}: {v:.3f}x the hand-written loop (target <= 1.00: "
                     f"{'met' if v <= 1.0 else 'missed'})")
    syncs = [v for k, v in value.items() if k[3].startswith("host_syncs")]
    if syncs:
        lines.append(f"- host syncs per step/call: at most {max(syncs):.0f} (target <= 1: {'met' if max(syncs) <= 1 else 'missed'})")
    write(lines, rows, out_md, out_csv)


def gpu_main(cpp_csv, py_csv, cpp_md, out_md, out_csv):
    rows = load(cpp_csv) + load(py_csv)
    value = {(r["section"], r["name"], r["config"], r["metric"]): float(r["value"]) for r in rows}
    lines = [open(cpp_md).read().rstrip(), "", "## Versus Python torch.amp (autocast + GradScaler, same torch)", "",
             "| model | config | amp C++ ms | Python ms | C++ / Python | amp peak MiB | Python peak MiB |",
             "|---|---|---|---|---|---|---|"]
    for name in sorted({r["name"] for r in rows}):
        for config in ("O0 fp32", "O1 fp16", "O1 bf16"):
            cpp = value.get(("gpu", name, config, "ms_per_step"))
            py = value.get(("python_gpu", name, config, "ms_per_step"))
            if cpp is None or py is None:
                continue
            peaks = [value.get((section, name, config, "peak_MiB")) for section in ("gpu", "python_gpu")]
            peak_text = ["" if p is None else f"{p:.0f}" for p in peaks]
            lines.append(f"| {name} | {config} | {cpp:.3f} | {py:.3f} | {cpp / py:.2f} | {peak_text[0]} | {peak_text[1]} |")
            rows.append({"section": "gpu_versus_python", "name": name, "config": config, "metric": "ratio", "value": cpp / py})
    write(lines, rows, out_md, out_csv)


if __name__ == "__main__":
    if sys.argv[1] == "--gpu":
        gpu_main(*sys.argv[2:])
    else:
        main(*sys.argv[1:])
