#!/usr/bin/env bash
# The GPU check, one run on one GPU (7 to 10 minutes on an H200 or H100, a third of it
# fla autotuning its kernels on a fresh machine): every CUDA test,
# `atom generate --device cuda` in the default dtype with and without DSpark, DSpark
# vs target-only (bf16) offline and through `atom serve`, and the figures of
# benchmarks/bench_vs_transformers.py. Every command's whole output is printed (and
# kept in LOG_DIR); the run ends with one summary line per check and exits non-zero
# if any failed.
#
# Usage: bash benchmarks/gpu_check.sh [LOG_DIR]
# Wheels missing from the machine's image (flash-linear-attention, fastapi, ...)
# may sit in .whl/ at the repository root; they are installed to a side folder.
set -uo pipefail
log=${1:-/tmp/atom-gpu-check}
mkdir -p "$log"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
    --upgrade --target /tmp/atom-site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/atom-site:$PYTHONPATH
fi
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'" || exit 1

# Triton's autotuner (fla's KDA kernels) keeps its choices on disk, so only the
# first process on the machine pays for tuning a shape.
export TRITON_CACHE_AUTOTUNING=1

summary=()
failed=0

# GPU_CHECK_ONLY="cuda-tests vs-transformers" runs only the checks it names.
only=${GPU_CHECK_ONLY:-}

# Every printed line carries the wall-clock time (the kept logs stay unstamped).
stamp() {
  local line
  while IFS= read -r line; do printf '[%(%H:%M:%S)T] %s\n' -1 "$line"; done
}

# Each check stops after this many seconds (it then fails with exit 124), so one
# hung command cannot eat the whole run. The CUDA tests, the longest, took 312 s
# on an H100 (2026-12-06; 94 s of it fla's first autotuning) and pytest needs a
# few seconds more to exit.
limit=${GPU_CHECK_LIMIT_S:-450}

# check NAME FIGURE_SCRIPT COMMAND...: run COMMAND (output printed and kept in
# $log/NAME.log); FIGURE_SCRIPT reads that log and prints the summary figure.
check() {
  local name=$1 figure=$2
  shift 2
  if [ -n "$only" ] && [[ " $only " != *" $name "* ]]; then return; fi
  echo "=== $name: $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log/$name.log" | stamp
  local rc=${PIPESTATUS[0]}
  echo "=== $name: exit $rc after $((SECONDS - start)) s"
  local value
  value=$(bash -c "$figure" <"$log/$name.log" 2>/dev/null)
  local verdict=PASS
  if [ "$rc" -ne 0 ]; then verdict="FAIL (exit $rc)"; failed=1; fi
  summary+=("$verdict  $name: ${value:-no figure} [$((SECONDS - start)) s]")
}

# Every test file that asks for CUDA, and every Triton kernel test.
mapfile -t cuda_tests < <(grep -rlE "cuda.is_available\(\)|mark\.kernels" tests \
  --include='test_*.py' | sort)
echo "CUDA test files: ${cuda_tests[*]}"
# -v prints each test as it ends (stamped with the time), so a run stopped by the
# limit still shows how far it got and what each test cost; with pytest-timeout at
# hand, a test that hangs fails with its stack and the others still run.
per_test_limit=$(python3 -c "import pytest_timeout" 2>/dev/null && echo --timeout=150)
check cuda-tests "tail -n 1" \
  python3 -m pytest -v -rfEs --durations=25 -p no:cacheprovider \
  $per_test_limit "${cuda_tests[@]}"

# The default command (default dtype, graphs on), run as the module behind
# `atom generate` (the console script is not installed on the GPU machine). A graph
# that fails to capture is logged as a warning and that size runs eagerly: the
# figure counts them. bf16 with graphs and DSpark runs in dspark-vs-target below;
# two engines in one process in the CUDA tests.
for spec in "" "--method dspark --num-speculative-tokens 7"; do
  check "generate${spec:+-dspark}" \
    "log=\$(cat); echo \"\$(grep -o 'Generated.*' <<<\"\$log\");\
 graph captures failed: \$(grep -c 'runs eagerly' <<<\"\$log\")\"" \
    python3 -m atom.entrypoints.cli generate --device cuda --max-tokens 64 $spec
done

check dspark-vs-target "grep -E 'tok/s' | sed -E 's/ \(per position[^)]*\)//; s/greedy ids //; s/ identical to the first run/ same ids/' | tr '\n' ';'" \
  python3 benchmarks/bench_offline.py --device cuda --dtype bfloat16 \
  --model tiny-kimi-k3 --draft-model tiny-kimi-k3-dspark --layouts 1x1 \
  --num-prompts 16 --input-len 64 --output-len 128

# Issue 20's serving shape through `atom serve` (target-only, then DSpark): TPOT
# and DSpark's output throughput ratio, each from a second pass over warm servers.
check serving "grep -E '^(target-only|dspark)' | cut -d, -f1,2 | tr '\n' ';'" \
  python3 benchmarks/bench_serving_dspark.py --device cuda --dtype bfloat16 \
  --log-dir "$log"

# Last, as the longest: its first atom engine pays about 80 s of fla autotuning
# at the 2.6 B checkpoint's KDA widths.
check vs-transformers "grep -E '^batch' | sed -E 's/ +/ /g' | cut -d'|' -f1,3 | tr '\n' ';'" \
  python3 benchmarks/bench_vs_transformers.py --device cuda --batch-sizes 1,32,128

echo
echo "=== summary ($(python3 -c 'import torch; print(torch.cuda.get_device_name())'), $SECONDS s)"
printf '%s\n' "${summary[@]}"
exit $failed
