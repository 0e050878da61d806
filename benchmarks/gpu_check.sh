#!/usr/bin/env bash
# CUDA proof and GPU figures on one GPU: greedy ids across layouts (several ranks share
# the GPU over gloo), DSpark vs target-only, a scaled K3-layout model, and the server
# with the benchmark client. Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -uo pipefail
out=${1:-/tmp/atom-gpu}
mkdir -p "$out"
export ATOM_LOG_LEVEL=WARNING PYTHONUNBUFFERED=1

echo "== tiny K3 and K3.1 + DSpark (fp32), layouts pp x tp"
for m in k3 k31; do
  python benchmarks/bench_offline.py --device cuda --model tiny-kimi-$m \
    --draft-model tiny-kimi-$m-dspark --layouts 1x1,2x1,2x4 \
    --num-prompts 16 --input-len 32 --output-len 128 2>&1 | grep "tok/s"
done

echo "== scaled K3 layout (bf16), target-only"
python benchmarks/bench_offline.py --device cuda --scaled-k3 2048 --layouts 1x1,2x1 \
  --prompts random --num-prompts 32 --input-len 256 --output-len 64 2>&1 | grep "tok/s"

echo "== server + benchmark client (tiny K3, with and without DSpark)"
for spec in "" "--method dspark --num-speculative-tokens 7"; do
  python -m atom.entrypoints.openai_server --model tiny-kimi-k3 --device cuda \
    --server-port 8011 $spec >"$out/server.log" 2>&1 &
  pid=$!
  for _ in $(seq 120); do curl -sf localhost:8011/health >/dev/null && break; sleep 1; done
  python -m atom.benchmarks.benchmark_serving --model tiny-kimi-k3 \
    --base-url http://127.0.0.1:8011 --num-prompts 64 --random-input-len 128 \
    --random-output-len 64 --max-concurrency 16 --ignore-eos 2>&1 | tail -n 25
  curl -s localhost:8011/debug/mtp_stats; echo
  kill $pid; wait $pid 2>/dev/null
done

echo "== tiny MiniMax-M3 + Qwen3 DSpark (fp32, block-sparse attention), layouts pp x tp"
python benchmarks/bench_offline.py --device cuda --model tiny-minimax-m3 \
  --draft-model tiny-minimax-m3-dspark --layouts 1x1,2x1,2x4 \
  --num-prompts 16 --input-len 64 --output-len 64 2>&1 | grep "tok/s"
