"""The Python twin's side of amp_bench --section o1_profile: torch.profiler over torch.amp's O1 bf16 step (autocast +
GradScaler, SGD with momentum) of a bench model, the self CPU time per step of every op and its call count, so the C++
profile can be read op by op beside it (which overloads each side calls, how many casts, where the time goes).

    python3 bench/o1_profile_python.py --model transformer [--steps 20] [--top 40] [--csv out.csv]
"""
import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from python_amp import MODELS  # noqa: E402  (the same models as bench/models.h)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="transformer", choices=("tiny_mlp", "mlp", "cnn", "transformer"))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--csv", help="write op,calls_per_step,self_ms_per_step rows here")
    args = parser.parse_args()
    torch.manual_seed(0)
    cls, make_input = MODELS[args.model]
    x = make_input()
    y = torch.randint(10, (x.shape[0],))
    model = cls()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu")

    def step():
        optimizer.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()

    for _ in range(3):
        step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    rows = []
    for e in prof.key_averages():
        rows.append((e.key, e.count / args.steps, e.self_cpu_time_total / 1e3 / args.steps))
    rows.sort(key=lambda r: -r[2])
    total = sum(r[2] for r in rows)
    print(f"## torch.amp O1 bf16, {args.model}: self CPU time per step by op (torch.profiler, {args.steps} steps, "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {torch.__version__})\n")
    print("| op | calls/step | self ms/step |\n|---|---|---|")
    for name, calls, ms in rows[: args.top]:
        print(f"| {name} | {calls:.1f} | {ms:.3f} |")
    print(f"| (all {len(rows)} ops) | | {total:.3f} |")
    if args.csv:
        with open(args.csv, "w") as f:
            f.write("op,calls_per_step,self_ms_per_step\n")
            for name, calls, ms in rows:
                f.write(f"{name},{calls},{ms}\n")


if __name__ == "__main__":
    main()
