#!/usr/bin/env bash
# The GPU check, one run on one GPU (about 6 minutes on an H200): every CUDA test,
# `atom generate --device cuda` in fp32 (the default) and bf16 with and without
# DSpark, the figures of benchmarks/bench_vs_transformers.py and DSpark vs
# target-only. Every command's whole output is printed (and kept in LOG_DIR); the
# run ends with one summary line per check and exits non-zero if any failed.
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

summary=()
failed=0

# Each check stops after this many seconds (it then fails with exit 124), so one
# hung command cannot eat the whole run.
limit=${GPU_CHECK_LIMIT_S:-300}

# check NAME FIGURE_SCRIPT COMMAND...: run COMMAND (output printed and kept in
# $log/NAME.log); FIGURE_SCRIPT reads that log and prints the summary figure.
check() {
  local name=$1 figure=$2
  shift 2
  echo "=== $name: $*"
  local start=$SECONDS
  timeout -k 10 "$limit" "$@" 2>&1 | tee "$log/$name.log"
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
check cuda-tests "tail -n 1" \
  python3 -m pytest -q -rs --durations=15 -p no:cacheprovider "${cuda_tests[@]}"

# The default command (graphs on); a graph that fails to capture is logged as a
# warning and that size runs eagerly, so the figure counts those warnings.
for dtype in float32 bfloat16; do
  for spec in "" "--method dspark --num-speculative-tokens 7"; do
    check "generate-$dtype${spec:+-dspark}" \
      "log=\$(cat); echo \"\$(grep -o 'Generated.*' <<<\"\$log\");\
 graph captures failed: \$(grep -c 'runs eagerly' <<<\"\$log\")\"" \
      atom generate --device cuda --dtype "$dtype" \
      --max-tokens 64 $spec
  done
done

check two-engines "grep -o 'same ids: .*'" python3 - <<'PY'
from atom import LLMEngine, SamplingParams

params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
ids = []
for _ in range(2):
    llm = LLMEngine("tiny-kimi-k3", device="cuda")
    ids.append(llm.generate([[5, 6, 7, 8]], params)[0]["token_ids"])
    llm.close()
assert ids[0] == ids[1], ids
print(f"same ids: {len(ids[0])} tokens from both engines")
PY

check vs-transformers "grep -E '^batch' | sed -E 's/ +/ /g' | cut -d'|' -f1,3 | tr '\n' ';'" \
  python3 benchmarks/bench_vs_transformers.py --device cuda --batch-sizes 1,32,128

check dspark-vs-target "grep -E 'tok/s' | sed -E 's/;.*//; s/ \(per position.*//' | tr '\n' ';'" \
  python3 benchmarks/bench_offline.py --device cuda --dtype bfloat16 \
  --model tiny-kimi-k3 --draft-model tiny-kimi-k3-dspark --layouts 1x1 \
  --num-prompts 16 --input-len 64 --output-len 128

echo
echo "=== summary ($(python3 -c 'import torch; print(torch.cuda.get_device_name())'), $SECONDS s)"
printf '%s\n' "${summary[@]}"
exit $failed
