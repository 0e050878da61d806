#!/usr/bin/env bash
# One GPU catalog entry end to end: serve it, run its lm-eval command under the
# no-progress watchdog, gate the outcome.
#
#   bash scripts/ci/accuracy_entry.sh [--dry-run] "Kimi-K3 DSpark PP2" [OUT_DIR]
#
# The entry's checkpoints must sit under $ATOM_MODELS_DIR (default /models) in
# folders named by their Hugging Face ids; `python -m scripts.ci.fetch --entry NAME`
# puts them there. The command is ROCm/ATOM's: lm-eval's local-completions model on
# all of GSM8K, 3-shot, 65 concurrent requests (or the entry's client_command),
# against port $ATOM_PORT (default 8000).
# A P/D entry (one with a `pd` block) starts its producer on the runner's first GPUs
# and port + 1, its consumer on the next GPUs and port + 2, and the router
# (scripts/ci/pd_proxy.sh) on the port; the client talks to the router.
# The watchdog stops the client after 3 minutes without a finished request, or
# after $ATOM_EVAL_LIMIT_S seconds in all (default 1800). OUT_DIR (default
# accuracy/<entry>) receives the server log (P/D: the consumer's, beside
# producer.log and proxy.log), /debug/mtp_stats, lm-eval's results and gate.json.
# $ATOM_CATALOG names another catalog file. --dry-run prints the two commands (serve
# and evaluate, then gate), shell-quoted, one a line, and runs neither.
# Exit status: the gate's, or the failing step's.
set -euo pipefail

cd "$(dirname "$0")/../.."
python="${PYTHON:-python}"
dry_run=false
if [ "${1:-}" = --dry-run ]; then
  dry_run=true
  shift
fi
catalog="${ATOM_CATALOG:-.github/accuracy/catalog.json}"
name="${1:?usage: accuracy_entry.sh [--dry-run] NAME [OUT_DIR]}"
models_dir="${ATOM_MODELS_DIR:-/models}"
port="${ATOM_PORT:-8000}"
out="${2:-accuracy/$("$python" -m scripts.ci.catalog --catalog "$catalog" slug "$name")}"

run() {
  if [ "$dry_run" = true ]; then
    printf '%q ' "$@" | sed 's/ $//'
    echo
  else
    "$@"
  fi
}

model_path="$("$python" -m scripts.ci.catalog --catalog "$catalog" model-path "$name" --models-dir "$models_dir")"
scratch="$(mktemp)"
"$python" -m scripts.ci.catalog --catalog "$catalog" client-command "$name" --model-path "$model_path" \
  --base-url "http://127.0.0.1:$port" --output-path "$out/lm_eval" > "$scratch"
mapfile -d '' -t client < "$scratch"
rm -f "$scratch"

# server.log is the log of the server that answers the client's completions (for
# P/D the consumer: the router sends decoding there): the watchdog counts them in
# it, and the gate reads acceptance and markers from it.
serve=(bash scripts/ci/serve.sh --catalog "$catalog" --entry "$name" --models-dir "$models_dir")
if [ -n "$("$python" -m scripts.ci.catalog --catalog "$catalog" sides "$name")" ]; then
  producer_port=$((port + 1))
  consumer_port=$((port + 2))
  servers=("${serve[@]}" --side producer --port "$producer_port" --log "$out/producer.log" --
    "${serve[@]}" --side consumer --port "$consumer_port" --log "$out/server.log"
    --mtp-stats "$out/mtp_stats.json" --
    bash scripts/ci/pd_proxy.sh "http://127.0.0.1:$producer_port"
    "http://127.0.0.1:$consumer_port" "$port" "$model_path" "$out/proxy.log" --)
  producer_log=(--producer-log "$out/producer.log")
else
  servers=("${serve[@]}" --port "$port" --log "$out/server.log" --mtp-stats "$out/mtp_stats.json" --)
  producer_log=()
fi

[ "$dry_run" = true ] || mkdir -p "$out"
run "${servers[@]}" "$python" -m scripts.ci.watchdog --log "$out/server.log" --idle 180 \
  --limit "${ATOM_EVAL_LIMIT_S:-1800}" -- "${client[@]}"

run "$python" -m scripts.ci.gate --catalog "$catalog" --entry "$name" --results "$out/lm_eval" \
  --server-log "$out/server.log" ${producer_log[@]+"${producer_log[@]}"} \
  --mtp-stats "$out/mtp_stats.json" --summary "$out/gate.json"
