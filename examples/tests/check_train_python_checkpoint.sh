#!/usr/bin/env bash
# Exercises examples/train's Python checkpoints (--save-python, --resume-python):
#  1. a run stopped after epoch 2 with --save-python and resumed with --resume-python continues bitwise
#     like the run that never stopped (every metric but wall time equal to the last printed digit);
#  2. Python reads that file with the standard calls (torch.load with weights_only=True, a torch.nn model's
#     load_state_dict, torch.optim.SGD's load_state_dict, Apex's loss_scaler0 into a torch.amp.GradScaler),
#     saves the state_dicts of its own objects (OrderedDicts, GradScaler's format), and C++ resumes from
#     that file, again bitwise like the uninterrupted run.
# Part 2 needs python3 with torch; without it the test reports itself skipped (exit 77) after part 1.
#   check_train_python_checkpoint.sh TRAIN_BINARY WORK_DIR CONFIG
set -euo pipefail
train=$1 work=$2 config=$3
rm -rf "$work" && mkdir -p "$work"
digits_gz=/usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
data="$work/digits.csv"
[ -f "$digits_gz" ] && gzip -dc "$digits_gz" > "$data"
common=(--config "$config" --data "$data" --verbosity 0 --seed 3)
strip_time() { cut -d, -f1-7 "$1"; }

"$train" "${common[@]}" --epochs 4 --metrics "$work/a.csv" > "$work/a.log"
"$train" "${common[@]}" --epochs 2 --save-python "$work/b.pt" --metrics "$work/b.csv" > "$work/b.log"
"$train" "${common[@]}" --epochs 4 --resume-python "$work/b.pt" --metrics "$work/b.csv" > "$work/b2.log"
grep -q "resumed from Python checkpoint" "$work/b2.log" || { echo "FAIL: no resume message"; cat "$work/b2.log"; exit 1; }
if ! diff <(strip_time "$work/a.csv") <(strip_time "$work/b.csv"); then
  echo "FAIL: the run resumed from --save-python's file differs from the uninterrupted one"; exit 1
fi
echo "ok: --save-python / --resume-python resume bitwise"

python=${AMP_PYTHON:-python3}
if ! "$python" -c 'import torch' > /dev/null 2>&1; then
  echo "SKIPPED: $python -c 'import torch' failed; the Python half needs the torch wheel"; exit 77
fi
"$python" - "$work/b.pt" "$work/c.pt" <<'EOF'
import collections, sys
import torch

class DigitsNet(torch.nn.Module):  # examples/train's network, same names
    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(1, 16, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(16)
        self.conv2 = torch.nn.Conv2d(16, 32, 3, padding=1)
        self.bn2 = torch.nn.BatchNorm2d(32)
        self.fc = torch.nn.Linear(32 * 4 * 4, 10)

ck = torch.load(sys.argv[1])  # weights_only=True: plain data only
model = DigitsNet()
model.load_state_dict(ck["model"])
assert all(v.dtype in (torch.float32, torch.int64) for v in model.state_dict().values())
optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-4)
optimizer.load_state_dict(ck["optimizer"])
assert len(optimizer.state) == len(list(model.parameters()))
apex = ck["amp"]["loss_scaler0"]
scaler = torch.amp.GradScaler("cpu")
scaler.load_state_dict({"scale": apex["loss_scale"], "growth_factor": 2.0, "backoff_factor": 0.5,
                        "growth_interval": 2000, "_growth_tracker": apex["unskipped"]})
assert ck["epoch"] == 2, ck["epoch"]
torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "scaler": scaler.state_dict(),
            "epoch": ck["epoch"]}, sys.argv[2])
print("python: loaded epoch %d, loss scale %g, %d optimizer states; saved its own state_dicts"
      % (ck["epoch"], scaler.get_scale(), len(optimizer.state)))
EOF
"$train" "${common[@]}" --epochs 2 --metrics "$work/c.csv" > /dev/null
"$train" "${common[@]}" --epochs 4 --resume-python "$work/c.pt" --metrics "$work/c.csv" > "$work/c2.log"
if ! diff <(strip_time "$work/a.csv") <(strip_time "$work/c.csv"); then
  echo "FAIL: the run resumed from Python's re-saved checkpoint differs from the uninterrupted one"; exit 1
fi
echo "ok: Python loads the checkpoint with load_state_dict, and C++ resumes bitwise from Python's own save"
