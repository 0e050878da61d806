#!/usr/bin/env bash
# One GPU catalog entry end to end: serve it, run its lm-eval command under the
# no-progress watchdog, gate the outcome.
#
#   bash scripts/ci/accuracy_entry.sh "Kimi-K3 DSpark PP2" [OUT_DIR]
#
# The entry's checkpoints must sit under $ATOM_MODELS_DIR (default /models) in
# folders named by their Hugging Face ids; `python -m scripts.ci.fetch --entry NAME`
# puts them there. The command is ROCm/ATOM's: lm-eval's local-completions model on
# all of GSM8K, 3-shot, 65 concurrent requests (or the entry's client_command).
# The watchdog stops the client after 3 minutes without a finished request, or
# after $ATOM_EVAL_LIMIT_S seconds in all (default 1800). OUT_DIR (default
# accuracy/<entry>) receives the server log, /debug/mtp_stats, lm-eval's results
# and gate.json. $ATOM_CATALOG names another catalog file. Exit status: the
# gate's, or the failing step's.
set -euo pipefail

cd "$(dirname "$0")/../.."
python="${PYTHON:-python}"
catalog="${ATOM_CATALOG:-.github/accuracy/catalog.json}"
name="${1:?usage: accuracy_entry.sh NAME [OUT_DIR]}"
models_dir="${ATOM_MODELS_DIR:-/models}"
port="${ATOM_PORT:-8000}"
out="${2:-accuracy/$("$python" -m scripts.ci.catalog --catalog "$catalog" slug "$name")}"
mkdir -p "$out"

model_path="$("$python" -m scripts.ci.catalog --catalog "$catalog" model-path "$name" --models-dir "$models_dir")"
scratch="$(mktemp)"
"$python" -m scripts.ci.catalog --catalog "$catalog" client-command "$name" --model-path "$model_path" \
  --base-url "http://127.0.0.1:$port" --output-path "$out/lm_eval" > "$scratch"
mapfile -d '' -t client < "$scratch"
rm -f "$scratch"

bash scripts/ci/serve.sh --catalog "$catalog" --entry "$name" --models-dir "$models_dir" --port "$port" \
  --log "$out/server.log" --mtp-stats "$out/mtp_stats.json" -- \
  "$python" -m scripts.ci.watchdog --log "$out/server.log" --idle 180 \
  --limit "${ATOM_EVAL_LIMIT_S:-1800}" -- "${client[@]}"

"$python" -m scripts.ci.gate --catalog "$catalog" --entry "$name" --results "$out/lm_eval" \
  --server-log "$out/server.log" --mtp-stats "$out/mtp_stats.json" \
  --summary "$out/gate.json"
