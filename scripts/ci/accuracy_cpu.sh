#!/usr/bin/env bash
# The CPU accuracy job: lm-eval against a real `atom serve` of the trained tiny Kimi-K3.
#
#   bash scripts/ci/accuracy_cpu.sh [OUT_DIR]        (default: accuracy_cpu)
#
# lm-eval's own local-completions model runs the kjv_next_word task
# (scripts/ci/tasks/kjv_next_word.yaml: held-out verses shipped in the repository,
# no download) three times, and the kjv_choice task (four-way multiple choice over
# the same documents, lm-eval's loglikelihood path) in the first two, against servers started by scripts/ci/serve.sh:
# target-only at pp1 x tp1, with the DSpark draft (T = 7) at pp2 x tp2, and P/D
# (docs/pd.md): a DSpark producer at pp2 x tp2 and a DSpark consumer at tp2 behind
# the router (scripts/ci/pd_proxy.sh), over Mooncake's tcp loopback.
# Gates (scripts/ci/gate.py):
#   - every score reaches twice the chance level the task states;
#   - kjv_choice scores the same target-only and with DSpark at pp2 x tp2;
#   - the DSpark and the P/D scores equal the target-only score (greedy speculation
#     is lossless, and so is moving the KV);
#   - DSpark and P/D (consumer) acceptance reach the recorded figure minus 2 points
#     (.github/accuracy/tiny_reference.json);
#   - start-up markers: 2 relay and 4 KDA rollback lines at pp2 x tp2, none without
#     speculation, 2 KDA rollback lines on the tp2 consumer; no missing-weight line
#     in any log; no P/D request fell back to a local prefill.
# Needs the [eval] extra. Logs, lm-eval results and gate summaries land in OUT_DIR.
# EXTRA_SERVE_ARGS: flags every server of the job also gets, e.g.
# EXTRA_SERVE_ARGS="--kv-cache-dtype fp8" (the same gates hold). With an online
# quantization config (ptpc_fp8) the target-only reference runs at tp2: each rank
# quantizes its slice of a row with its own scales, so fp8 numbers depend on the TP
# size (docs/accuracy.md), and the scores it is compared with come from tp2 ranks.
set -euo pipefail

cd "$(dirname "$0")/../.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python="${PYTHON:-python}"
out="${1:-accuracy_cpu}"
extra="${EXTRA_SERVE_ARGS:-}"

tiny_path() {
  "$python" -c 'import sys; from atom.models.tiny import resolve_model_path as r
print(r(sys.argv[1]))' "$1"
}
model="$(tiny_path tiny-kimi-k3)"
draft="$(tiny_path tiny-kimi-k3-dspark)"
num_docs="$("$python" -c 'import sys; sys.path.insert(0, "scripts/ci/tasks")
from kjv_next_word import held_out_verses, next_word_docs
print(len(next_word_docs(held_out_verses())))')"
free_port() {
  "$python" -c 'from atom.distributed.rank_process import free_port
print(free_port())'
}
port="$(free_port)"

evaluate() {
  local name="$1" flags="$2" tasks="$3" dir="$out/$1" start
  rm -rf "$dir"
  mkdir -p "$dir"
  start="$(date +%s)"
  bash scripts/ci/serve.sh --port "$port" --log "$dir/server.log" \
    --mtp-stats "$dir/mtp_stats.json" --ready-timeout 600 \
    --serve-args "--model $model --device cpu $flags $extra" -- \
    "$python" -m scripts.ci.watchdog --log "$dir/server.log" --idle 180 --limit 900 -- \
    "$python" -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,num_concurrent=64,max_retries=3,tokenized_requests=False,trust_remote_code=True" \
    --include_path scripts/ci/tasks --tasks "$tasks" \
    --output_path "$dir/lm_eval" --log_samples
  echo "accuracy_cpu: $name served and evaluated in $(($(date +%s) - start)) s"
}

# The consumer's log is server.log: it serves the completions the watchdog counts
# and the acceptance the gate reads.
evaluate_pd() {
  local dir="$out/pd" start producer_port consumer_port spec
  rm -rf "$dir"
  mkdir -p "$dir"
  start="$(date +%s)"
  producer_port="$(free_port)" consumer_port="$(free_port)"
  spec="--model $model --device cpu --method dspark --draft-model $draft --num-speculative-tokens 7 $extra"
  bash scripts/ci/serve.sh --port "$producer_port" --log "$dir/producer.log" \
    --ready-timeout 600 --serve-args \
    "$spec -pp 2 -tp 2 --kv-transfer-config {\"kv_role\":\"kv_producer\"}" -- \
    bash scripts/ci/serve.sh --port "$consumer_port" --log "$dir/server.log" \
    --mtp-stats "$dir/mtp_stats.json" --ready-timeout 600 --serve-args \
    "$spec -tp 2 --kv-transfer-config {\"kv_role\":\"kv_consumer\"}" -- \
    bash scripts/ci/pd_proxy.sh "http://127.0.0.1:$producer_port" \
    "http://127.0.0.1:$consumer_port" "$port" "$model" "$dir/proxy.log" -- \
    "$python" -m scripts.ci.watchdog --log "$dir/server.log" --idle 180 --limit 900 -- \
    "$python" -m lm_eval --model local-completions \
    --model_args "model=$model,base_url=http://127.0.0.1:$port/v1/completions,num_concurrent=64,max_retries=3,tokenized_requests=False,trust_remote_code=True" \
    --include_path scripts/ci/tasks --tasks kjv_next_word \
    --output_path "$dir/lm_eval" --log_samples
  echo "accuracy_cpu: pd served and evaluated in $(($(date +%s) - start)) s"
}

# kjv_choice (loglikelihood, through echo with prompt logprobs) beside the
# generation task; P/D runs generation only (it moves a sequence to decode).
target_tp=1
case "$extra" in *online_quant_config* | *online-quant-config*) target_tp=2 ;; esac
evaluate target "-tp $target_tp" kjv_next_word,kjv_choice
evaluate dspark "-pp 2 -tp 2 --method dspark --draft-model $draft --num-speculative-tokens 7" \
  kjv_next_word,kjv_choice
evaluate_pd

common=(--task kjv_next_word --metric "exact_match,first-word" --num-fewshot 0
  --num-samples "$num_docs" --min-over-chance 2)
status=0
"$python" -m scripts.ci.gate --name "tiny-kimi-k3 target-only pp1 x tp$target_tp" \
  --results "$out/target/lm_eval" "${common[@]}" \
  --server-log "$out/target/server.log" --mtp-stats "$out/target/mtp_stats.json" \
  --expect-marker relay=0 --expect-marker kda_rollback=0 \
  --summary "$out/target/gate.json" || status=1
"$python" -m scripts.ci.gate --name "tiny-kimi-k3 DSpark pp2 x tp2" \
  --results "$out/dspark/lm_eval" "${common[@]}" \
  --same-score-as "$out/target/lm_eval" \
  --acceptance-reference .github/accuracy/tiny_reference.json \
  --server-log "$out/dspark/server.log" --mtp-stats "$out/dspark/mtp_stats.json" \
  --expect-marker relay=2 --expect-marker kda_rollback=4 \
  --summary "$out/dspark/gate.json" || status=1
"$python" -m scripts.ci.gate --name "tiny-kimi-k3 DSpark P/D pp2 x tp2 -> tp2" \
  --results "$out/pd/lm_eval" "${common[@]}" \
  --same-score-as "$out/target/lm_eval" \
  --acceptance-reference .github/accuracy/tiny_reference.json \
  --server-log "$out/pd/server.log" --mtp-stats "$out/pd/mtp_stats.json" \
  --expect-marker relay=0 --expect-marker kda_rollback=2 --no-pd-fallback \
  --summary "$out/pd/gate.json" || status=1
choice=(--task kjv_choice --metric "acc,none" --num-fewshot 0
  --num-samples "$num_docs" --min-over-chance 2)
"$python" -m scripts.ci.gate --name "tiny-kimi-k3 kjv_choice target-only pp1 x tp$target_tp" \
  --results "$out/target/lm_eval" "${choice[@]}" \
  --summary "$out/target/gate_choice.json" || status=1
"$python" -m scripts.ci.gate --name "tiny-kimi-k3 kjv_choice DSpark pp2 x tp2" \
  --results "$out/dspark/lm_eval" "${choice[@]}" \
  --same-score-as "$out/target/lm_eval" \
  --summary "$out/dspark/gate_choice.json" || status=1
exit "$status"
