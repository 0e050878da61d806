#!/usr/bin/env bash
# Train every tiny model on one CUDA GPU (preset h200) and write the shipped weights.
#
#   bash tools/train_all.sh OUT_DIR [bible-kjv-text .deb]
#
# The Kimi Linear target trains in a second process beside the K3 target (the tiny
# models leave the GPU mostly idle); the DSpark draft is then distilled from the K3
# target. OUT_DIR receives tiny-kimi-k3.safetensors, tiny-kimi-linear.safetensors,
# tiny-kimi-k3-dspark.safetensors, report.json, report-linear.json and the two logs;
# copy the three .safetensors to atom/models/tiny/trained/ to ship them.
# Without internet, place the .deb (apt-get download bible-kjv-text) in the repository
# root or pass it; extra arguments after it go to both trainings (e.g. --set ...).
set -euo pipefail
out=${1:?usage: bash tools/train_all.sh OUT_DIR [DEB] [train_tiny options]}
deb=${2:-$(ls bible-kjv-text_*_all.deb 2>/dev/null | head -n 1 || true)}
shift $(( $# >= 2 ? 2 : 1 ))
if [[ -z "$deb" || ! -f "$deb" ]]; then
  echo "no bible-kjv-text .deb: run 'apt-get download bible-kjv-text' here or pass it" >&2
  exit 2
fi
python - <<'PY'
import importlib, sys
missing = [m for m in ("torch", "tokenizers", "safetensors", "tqdm", "transformers")
           if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"missing Python packages: {', '.join(missing)} (pip install them)")
import torch
if not torch.cuda.is_available():
    sys.exit("no CUDA device: train_all.sh is the GPU run (the CPU uses --config cpu)")
PY
mkdir -p "$out/linear"
export PYTHONUNBUFFERED=1
start=$(date +%s)
python -m tools.train_tiny --config h200 --stages linear --out "$out/linear" \
  --corpus-deb "$deb" "$@" >"$out/train-linear.log" 2>&1 &
linear=$!
python -m tools.train_tiny --config h200 --stages k3,draft --out "$out" \
  --corpus-deb "$deb" "$@" 2>&1 | tee "$out/train-k3-draft.log"
wait $linear || { echo "the Kimi Linear run failed: see $out/train-linear.log" >&2; exit 1; }
mv "$out/linear/tiny-kimi-linear.safetensors" "$out/"
mv "$out/linear/report.json" "$out/report-linear.json"
rmdir "$out/linear"
echo "done in $(( $(date +%s) - start )) s; weights in $out"
