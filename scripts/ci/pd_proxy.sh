#!/usr/bin/env bash
# Run the P/D router in front of a producer and a consumer, wait until a one-token
# warm-up passes through it, run a command against it, then stop it.
#
#   scripts/ci/pd_proxy.sh PREFILL_URL DECODE_URL PORT MODEL LOG -- COMMAND [ARG...]
#
# Meant to run inside two scripts/ci/serve.sh, which start (and stop) the producer
# and the consumer. Exit status: COMMAND's, 3 if the router never became ready.
set -euo pipefail

cd "$(dirname "$0")/../.."
python="${PYTHON:-python}"
[ $# -gt 6 ] && [ "$6" = "--" ] || { sed -n '5p' "$0" >&2; exit 2; }
prefill="$1" decode="$2" port="$3" model="$4" log="$5"
shift 6

"$python" -m atom.entrypoints.pd_proxy --prefill "$prefill" --decode "$decode" \
  --port "$port" > "$log" 2>&1 &
proxy_pid=$!
trap 'kill -TERM "$proxy_pid" 2>/dev/null || true; wait "$proxy_pid" 2>/dev/null || true' EXIT

url="http://127.0.0.1:$port"
if ! "$python" -m scripts.ci.server_probe wait-ready --url "$url" --pid "$proxy_pid" \
  --model "$model" --timeout 120; then
  tail -n 40 "$log" >&2
  exit 3
fi
set +e
ATOM_SERVER_URL="$url" "$@"
status=$?
set -e
exit "$status"
