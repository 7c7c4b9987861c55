#!/usr/bin/env bash
# A multi-node Ray cluster on one machine, for trying multi-node training without a cloud.
#
#   infra/local_cluster.sh [--workers N] [--cpus C] [--head-cpus H] [--port P] -- COMMAND [ARGS...]
#
# Starts a head (H logical CPUs, default C; 0 keeps trainings off it, as the cloud configs'
# CPU-only head) and N worker nodes (C logical CPUs each), runs COMMAND with RAY_ADDRESS set,
# then stops exactly the processes it started, by PID: never `ray stop`, which would kill
# every Ray process on the machine. All nodes live in a private network namespace whose
# only interface is loopback, so nothing listens beyond 127.0.0.1 and several nodes can
# share the one address. Token authentication is on, with a token private to this cluster.
set -euo pipefail

workers=1 cpus=2 head_cpus="" port=6380
object_store=$((200 * 1024 * 1024)) memory=$((2 * 1024 * 1024 * 1024))
while [[ $# -gt 0 ]]; do
  case "$1" in
    --workers) workers=$2; shift 2 ;;
    --cpus) cpus=$2; shift 2 ;;
    --head-cpus) head_cpus=$2; shift 2 ;;
    --port) port=$2; shift 2 ;;
    --) shift; break ;;
    *) echo "local_cluster.sh: unknown option $1 (see the header of $0)" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "local_cluster.sh: give a command after --" >&2; exit 2; }
command -v ray >/dev/null || { echo "local_cluster.sh: no \`ray\` on PATH; activate the project's environment (. .venv/bin/activate)" >&2; exit 2; }

if [[ -z "${HIERTX_CLUSTER_NETNS:-}" ]]; then
  # Re-enter in a fresh network namespace (root: plain; otherwise a user namespace).
  flags=(-n); [[ $(id -u) -eq 0 ]] || flags=(-r -n)
  HIERTX_CLUSTER_NETNS=1 exec unshare "${flags[@]}" "$0" --workers "$workers" --cpus "$cpus" \
    --head-cpus "${head_cpus:-$cpus}" --port "$port" -- "$@"
fi
ip link set lo up

workdir=$(mktemp -d "${TMPDIR:-/tmp}/hiertx-cluster.XXXXXX")
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH="$workdir/token"
python3 -c 'import secrets; print(secrets.token_hex(32))' >"$RAY_AUTH_TOKEN_PATH"
chmod 600 "$RAY_AUTH_TOKEN_PATH"
export RAY_ADDRESS="127.0.0.1:$port"
node_flags=(--node-ip-address=127.0.0.1 --object-store-memory="$object_store"
  --memory="$memory" --disable-usage-stats --block)

pids=()
cleanup() {
  local status=$?
  for pid in "${pids[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for _ in $(seq 60); do
    alive=0; for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && break; sleep 1
  done
  for pid in "${pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
  rm -rf "$workdir"
  exit "$status"
}
trap cleanup EXIT INT TERM

started() {  # started LOG PID: wait until that `ray start` says its node is up, while PID lives
  # ("Ray runtime started." comes once the node is registered with the GCS: Ray waits for
  # that first). Reading the log costs nothing; `ray status` is a Python CLI per call.
  for _ in $(seq 1500); do
    grep -qF "Ray runtime started." "$1" && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}

start_node() {  # start_node LOG ARGS...: one `ray start`, twice if the first fails to join
  local log=$1; shift
  for attempt in 1 2; do
    ray start "$@" "${node_flags[@]}" >"$log" 2>&1 &
    pids+=($!)
    started "$log" "$!" && return 0
    echo "local_cluster.sh: a node did not start (attempt $attempt), log $log:" >&2
    tail -n 3 "$log" >&2
  done
  exit 1
}

# One node at a time: several starting at once on a small machine time out joining.
start_node "$workdir/head.log" --head --port="$port" --temp-dir="$workdir/ray" \
  --include-dashboard=true --dashboard-host=127.0.0.1 --num-cpus="${head_cpus:-$cpus}"
for i in $(seq "$workers"); do
  start_node "$workdir/worker-$i.log" --address="$RAY_ADDRESS" --num-cpus="$cpus"
done
echo "local_cluster.sh: $((workers + 1)) nodes up at $RAY_ADDRESS; running: $*" >&2
"$@"
