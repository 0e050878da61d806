#!/usr/bin/env bash
# Serve atom, wait until it answers, run a command against it, then stop it.
#
#   scripts/ci/serve.sh [options] -- COMMAND [ARG...]
#
#   --entry NAME        serve a catalog entry: its model_path, extraArgs and env_vars,
#                       Hugging Face ids read as folders under --models-dir
#   --side SIDE         of a P/D entry, serve the producer or the consumer: its own
#                       flags, kv_transfer_config and GPUs are added
#   --catalog FILE      default .github/accuracy/catalog.json
#   --models-dir DIR    default $ATOM_MODELS_DIR, else /models
#   --serve-args FLAGS  more `atom serve` flags, whitespace-separated (no quoting)
#   --port N            default 8000; the server listens on 127.0.0.1 only
#   --log FILE          the server's stdout and stderr (default atom_server.log)
#   --mtp-stats FILE    after COMMAND, save GET /debug/mtp_stats here
#   --ready-timeout S   seconds to wait for /health (default 2700, as ROCm/ATOM)
#
# COMMAND runs once /health answers and a one-token warm-up succeeded, with
# ATOM_SERVER_URL and ATOM_SERVED_MODEL (the --model value, which the server serves
# under) in its environment. On exit, whatever the cause, the server is stopped by
# its PID: SIGTERM, then SIGKILL after 60 s; its rank processes die with it.
# Everything runs in the repository root: relative paths are taken from there.
# Exit status: COMMAND's, 3 if the server never became ready, 2 on bad usage.
set -euo pipefail

cd "$(dirname "$0")/../.."
python="${PYTHON:-python}"
port=8000
log=atom_server.log
mtp_stats=""
entry=""
side=()
catalog=.github/accuracy/catalog.json
models_dir="${ATOM_MODELS_DIR:-/models}"
extra=""
ready_timeout=2700
stop_grace_s=60

usage() {
  sed -n '4,23p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

while [ $# -gt 0 ]; do
  case "$1" in
    --entry) entry="$2"; shift 2 ;;
    --side) side=(--side "$2"); shift 2 ;;
    --catalog) catalog="$2"; shift 2 ;;
    --models-dir) models_dir="$2"; shift 2 ;;
    --serve-args) extra="$2"; shift 2 ;;
    --port) port="$2"; shift 2 ;;
    --log) log="$2"; shift 2 ;;
    --mtp-stats) mtp_stats="$2"; shift 2 ;;
    --ready-timeout) ready_timeout="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "serve.sh: unknown option '$1'" >&2; usage ;;
  esac
done
[ $# -gt 0 ] || { echo "serve.sh: no COMMAND after --" >&2; usage; }

serve_args=()
server_env=()
[ -n "$entry" ] || [ ${#side[@]} -eq 0 ] || { echo "serve.sh: --side needs --entry" >&2; usage; }
if [ -n "$entry" ]; then
  scratch="$(mktemp)"
  "$python" -m scripts.ci.catalog --catalog "$catalog" serve-args "$entry" \
    --models-dir "$models_dir" ${side[@]+"${side[@]}"} > "$scratch"
  mapfile -d '' -t serve_args < "$scratch"
  "$python" -m scripts.ci.catalog --catalog "$catalog" env "$entry" \
    ${side[@]+"${side[@]}"} > "$scratch"
  mapfile -d '' -t server_env < "$scratch"
  rm -f "$scratch"
fi
if [ -n "$extra" ]; then
  read -r -a more <<< "$extra"
  serve_args+=("${more[@]}")
fi
[ ${#serve_args[@]} -gt 0 ] || { echo "serve.sh: give --entry or --serve-args" >&2; usage; }

model=""
for ((i = 0; i < ${#serve_args[@]}; i++)); do
  case "${serve_args[$i]}" in
    --model) model="${serve_args[$((i + 1))]:-}" ;;
    --model=*) model="${serve_args[$i]#--model=}" ;;
  esac
done
[ -n "$model" ] || { echo "serve.sh: the server flags name no --model" >&2; exit 2; }

# A PID stays valid until its parent reaps it; a zombie counts as stopped.
running() {
  [ -r "/proc/$1/stat" ] && ! awk '{ exit ($3 == "Z") ? 0 : 1 }' "/proc/$1/stat"
}

server_pid=""
stop_server() {
  [ -n "$server_pid" ] || return 0
  if running "$server_pid"; then
    kill -TERM "$server_pid" 2>/dev/null || true
    for ((waited = 0; waited < stop_grace_s; waited++)); do
      running "$server_pid" || break
      sleep 1
    done
    if running "$server_pid"; then
      echo "serve.sh: the server ignored SIGTERM for ${stop_grace_s} s; SIGKILL" >&2
      kill -KILL "$server_pid" 2>/dev/null || true
    fi
  fi
  wait "$server_pid" 2>/dev/null || true
  echo "serve.sh: server (pid $server_pid) stopped; log in $log"
}
trap stop_server EXIT
trap 'exit 130' INT TERM

mkdir -p "$(dirname "$log")"
echo "serve.sh: atom serve ${serve_args[*]} --host 127.0.0.1 --server-port $port"
env ${server_env[@]+"${server_env[@]}"} "$python" -m atom.entrypoints.cli serve \
  "${serve_args[@]}" --host 127.0.0.1 --server-port "$port" > "$log" 2>&1 &
server_pid=$!

url="http://127.0.0.1:$port"
if ! "$python" -m scripts.ci.server_probe wait-ready --url "$url" \
  --pid "$server_pid" --model "$model" --timeout "$ready_timeout"; then
  echo "serve.sh: the server did not become ready; the end of $log:" >&2
  tail -n 60 "$log" >&2
  exit 3
fi

set +e
ATOM_SERVER_URL="$url" ATOM_SERVED_MODEL="$model" "$@"
status=$?
set -e
if [ -n "$mtp_stats" ]; then
  mkdir -p "$(dirname "$mtp_stats")"
  "$python" -m scripts.ci.server_probe save --url "$url" --path /debug/mtp_stats \
    --out "$mtp_stats" || echo "serve.sh: could not save /debug/mtp_stats" >&2
fi
exit "$status"
