#!/usr/bin/env bash
# The main job: installs and builds only what it needs (the torch==2.13.0 wheel, a compiler, Boost, the library
# and examples/train; the test command installs the rest), then trains the digits classifier at the opt level
# of a config file. Extra arguments go to the trainer (they override the config):
#   scripts/train.sh                                   # examples/configs/O2_bf16.ini
#   scripts/train.sh --config examples/configs/O1_bf16.ini --epochs 3
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p build/data
start=$(date +%s)
./scripts/setup.sh --main
set_up=$(date +%s)
echo "train.sh: set up in $((set_up - start)) s; building amp and examples/train (build/main: about 2 minutes on a fresh machine, seconds after)"
./scripts/build.sh main > build/main.build.log 2>&1 || { tail -n 50 build/main.build.log; exit 1; }
echo "train.sh: built in $(( $(date +%s) - set_up )) s"

# scikit-learn's digits, as Debian's python3-sklearn ships them: 1797 8x8 images, 10 classes. Read from the
# installed package where the test command installed it, else from the package file itself (2 MB, not installed).
if [ ! -s build/data/digits.csv ]; then
  digits=usr/lib/python3/dist-packages/sklearn/datasets/data/digits.csv.gz
  if [ -f "/$digits" ]; then
    gzip -dc "/$digits" > build/data/digits.csv.tmp
  else
    (cd build/data && { apt-get download -qq python3-sklearn 2> /dev/null ||
                        { apt-get update -qq && apt-get download -qq python3-sklearn 2> /dev/null; }; })
    dpkg-deb --fsys-tarfile build/data/python3-sklearn_*.deb | tar -xO "./$digits" | gzip -dc > build/data/digits.csv.tmp
    rm -f build/data/python3-sklearn_*.deb
  fi
  mv build/data/digits.csv.tmp build/data/digits.csv
fi
echo "train.sh: ready in $(( $(date +%s) - start )) s"

args=("$@")
printf '%s\n' "${args[@]}" | grep -q -- '^--config' || args=(--config examples/configs/O2_bf16.ini "${args[@]}")
exec env OMP_NUM_THREADS="${OMP_NUM_THREADS:-2}" build/main/examples/train --data build/data/digits.csv "${args[@]}"
