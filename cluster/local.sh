#!/usr/bin/env bash
# A local multi-node Ray cluster on one machine, for developing what runs on `ray_cluster.yaml`:
# a head node plus a second raylet, each with its own custom resource (node_head / node_worker),
# every service on 127.0.0.1, token authentication on, conservative object stores (24 GiB box).
#
#   cluster/local.sh up       start head + worker, print the environment clients need
#   cluster/local.sh status   what is running, and the environment again
#   cluster/local.sh down     stop exactly what `up` started; fail if anything is left behind
#
# Settings (environment):
#   LOCAL_CLUSTER_DIR        state dir: pids, logs, token, Ray temp dir  (default ./workdir/local_cluster)
#   LOCAL_CLUSTER_GCS_PORT   head GCS port                 (default 6379)
#   LOCAL_CLUSTER_DASHBOARD_PORT  dashboard + job server  (default 8265)
#   LOCAL_CLUSTER_CLIENT_PORT     Ray client server        (default 10001)
#   LOCAL_CLUSTER_AGENT_PORT      head's dashboard agent, which runs submitted jobs; the worker's is the
#                            next port (default 52465: not Ray's 52365, which any `ray.init()` on this
#                            machine takes, leaving the head without a job agent)
#   LOCAL_CLUSTER_CPUS       logical CPUs per node         (default 2: one training worker or trial per
#                            node plus one for Ray Data; fewer starves the pipeline's data stages)
#   LOCAL_CLUSTER_OBJECT_STORE_MB  object store per node   (default 1024)
#   LOCAL_CLUSTER_WORKER_PRIVATE  a directory the worker node does not see, as a second machine would not: the
#                            worker starts in its own mount namespace with an empty tmpfs over it (needs root;
#                            default unset: both nodes see every directory)
#   RAY                      the `ray` binary              (default <repo>/.venv/bin/ray)
#
# `down` never uses `ray stop` (it would stop every Ray of this user on a shared machine): it
# signals the two process sessions `up` created, then anything still running from the state dir
# (job drivers run in their own session, with their working directory under the Ray temp dir).
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE=${LOCAL_CLUSTER_DIR:-$PWD/workdir/local_cluster}
GCS_PORT=${LOCAL_CLUSTER_GCS_PORT:-6379}
DASH_PORT=${LOCAL_CLUSTER_DASHBOARD_PORT:-8265}
CLIENT_PORT=${LOCAL_CLUSTER_CLIENT_PORT:-10001}
AGENT_PORT=${LOCAL_CLUSTER_AGENT_PORT:-52465}
CPUS=${LOCAL_CLUSTER_CPUS:-2}
OBJ_MB=${LOCAL_CLUSTER_OBJECT_STORE_MB:-1024}
RAY=${RAY:-$REPO/.venv/bin/ray}
PRIVATE=${LOCAL_CLUSTER_WORKER_PRIVATE:+$(realpath -m "$LOCAL_CLUSTER_WORKER_PRIVATE")}
IP=127.0.0.1

die() { echo "error: $*" >&2; exit 2; }

[ -x "$RAY" ] || die "no ray binary at $RAY; run 'make install' or set RAY=/path/to/ray"
mkdir -p "$STATE"
STATE=$(cd "$STATE" && pwd)
# Ray temp dirs (sessions, logs, sockets, unpacked job working dirs), one per node: raylets sharing one
# would garbage-collect each other's runtime envs (a job's working dir vanishing under its driver) and
# both log monitors would forward every worker's output twice.
TMP=$STATE/ray
TMP_WORKER=$STATE/rw
TOKEN=$STATE/auth_token

# Unix socket paths (<temp>/session_<date>_<pid>/sockets/plasma_store.N) must stay under 107 bytes.
[ ${#TMP} -le 48 ] || die "state dir $STATE is too long for Ray's socket paths; set LOCAL_CLUSTER_DIR to a shorter path (e.g. /tmp/lc)"
if [ -n "$PRIVATE" ]; then
    [ "$(id -u)" = 0 ] || die "LOCAL_CLUSTER_WORKER_PRIVATE needs root (a mount namespace and a tmpfs); unset it"
    for d in "$STATE" "$REPO" "$(dirname "$RAY")"; do  # the worker runs from these
        case "$d/" in "${PRIVATE%/}/"*) die "LOCAL_CLUSTER_WORKER_PRIVATE=$PRIVATE would hide $d from the worker node; name a directory outside it" ;; esac
    done
fi

# Daemons and clients share these; the job entrypoint `python` must be the venv's.
export RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=$TOKEN RAY_USAGE_STATS_ENABLED=0
# SIGTERM to `ray start --block` then stops its node at once (no 30 s drain for Serve replicas).
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S=0
export PATH="$(dirname "$RAY"):$PATH"

print_env() {
    cat <<EOF
# local Ray cluster: dashboard and job server http://$IP:$DASH_PORT, GCS $IP:$GCS_PORT
export RAY_ADDRESS=http://$IP:$DASH_PORT
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN_PATH=$TOKEN
EOF
}

# A port something already listens on would leave a node half up (Ray logs the bind failure and carries on).
check_ports() {
    local spec port var
    for spec in "$GCS_PORT:LOCAL_CLUSTER_GCS_PORT" "$DASH_PORT:LOCAL_CLUSTER_DASHBOARD_PORT" \
                "$CLIENT_PORT:LOCAL_CLUSTER_CLIENT_PORT" "$AGENT_PORT:LOCAL_CLUSTER_AGENT_PORT" \
                "$((AGENT_PORT + 1)):LOCAL_CLUSTER_AGENT_PORT (+1, the worker's agent)"; do
        port=${spec%%:*} var=${spec#*:}
        if (exec 3<>"/dev/tcp/$IP/$port") 2>/dev/null; then
            die "port $port on $IP is in use (another Ray or service); stop it or set $var to a free port"
        fi
    done
}

alive() { [ -n "${1:-}" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { cat "$STATE/$1.pid" 2>/dev/null || true; }

# Processes in the sessions `up` created (setsid: session id == recorded pid).
session_pids() {
    local sids=" $(pid_of head) $(pid_of worker) "
    ps -e -o pid=,sid= | while read -r pid sid; do
        case "$sids" in *" $sid "*) echo "$pid" ;; esac
    done
}

# Ray processes of this cluster outside those sessions (job drivers get their own session): their
# command line names one of our Ray temp dirs, or they run inside a job's unpacked working_dir.
# A shell or `tail -f` on the state dir's logs is not matched; neither is this script or its parents.
stray_pids() {
    local p pid cwd ancestors=" " a=$$
    while [ -n "$a" ] && [ "$a" != 0 ] && [ "$a" != 1 ]; do
        ancestors+="$a "
        a=$(ps -o ppid= -p "$a" 2>/dev/null | tr -d ' ')
    done
    for p in /proc/[0-9]*; do
        pid=${p#/proc/}
        case "$ancestors" in *" $pid "*) continue ;; esac
        cwd=$(readlink "$p/cwd" 2>/dev/null || true)
        case "$cwd" in "$TMP"/*/runtime_resources/* | "$TMP_WORKER"/*/runtime_resources/*) echo "$pid"; continue ;; esac
        if { tr '\0' '\n' <"$p/cmdline"; } 2>/dev/null | grep -qE -- "^--?[a-z_-]+=($TMP|$TMP_WORKER)/|^($TMP|$TMP_WORKER)/"; then
            echo "$pid"
        fi
    done
}

wait_gone() {  # wait_gone SECONDS: until no session or stray process remains
    local i
    for ((i = 0; i < $1 * 2; i++)); do
        [ -z "$(session_pids)$(stray_pids)" ] && return 0
        sleep 0.5
    done
    return 1
}

start_node() {  # start_node NAME TEMP_DIR ARGS...: `ray start --block` in its own session, pid recorded
    local name=$1 temp=$2 hide=(); shift 2
    if [ "$name" = worker ] && [ -n "$PRIVATE" ]; then
        # exec all the way down (setsid, unshare, sh, ray): the recorded pid stays the session's; the raylet and its
        # workers inherit the namespace, and the tmpfs goes with its last process
        hide=(unshare --mount --propagation private sh -c 'mkdir -p "$0" && mount -t tmpfs tmpfs "$0" && exec "$@"'
              "$PRIVATE")
    fi
    # RAY_ADDRESS: Ray processes that look the cluster up (Train's placement-group cleaner, state API)
    # would otherwise scan for GCS processes and find other people's clusters on a shared machine.
    RAY_ADDRESS=$IP:$GCS_PORT setsid "${hide[@]}" "$RAY" start --block --disable-usage-stats --node-ip-address "$IP" --temp-dir "$temp" \
        --num-cpus "$CPUS" --num-gpus 0 --object-store-memory $((OBJ_MB * 1024 * 1024)) "$@" \
        >"$STATE/$name.log" 2>&1 </dev/null &
    echo $! >"$STATE/$name.pid"
}

wait_nodes() {  # wait_nodes N: until N nodes are alive (ray start --block only returns on exit)
    local i
    for ((i = 0; i < 120; i++)); do
        for n in head worker; do
            if [ -f "$STATE/$n.pid" ] && ! alive "$(pid_of "$n")"; then
                echo "error: the $n node exited; last lines of $STATE/$n.log:" >&2
                tail -n 20 "$STATE/$n.log" >&2
                return 1
            fi
        done
        if [ "$("$RAY" status --address "$IP:$GCS_PORT" 2>/dev/null | grep -cE '^ *1 node_[0-9a-f]{40,}$')" -ge "$1" ]; then
            return 0
        fi
        sleep 1
    done
    echo "error: cluster did not reach $1 node(s) in 120 s; see $STATE/*.log" >&2
    return 1
}

up() {
    if alive "$(pid_of head)"; then
        echo "already up (head pid $(pid_of head)); 'cluster/local.sh down' first" >&2
        print_env
        return 0
    fi
    check_ports
    rm -f "$STATE"/*.pid
    [ -s "$TOKEN" ] || (umask 077 && "$(dirname "$RAY")/python" -c \
        'import secrets; print(secrets.token_hex(32), end="")' >"$TOKEN")
    start_node head "$TMP" --head --port "$GCS_PORT" --ray-client-server-port "$CLIENT_PORT" \
        --include-dashboard true --dashboard-host "$IP" --dashboard-port "$DASH_PORT" \
        --dashboard-agent-listen-port "$AGENT_PORT" --min-worker-port 10100 --max-worker-port 10599 \
        --resources '{"node_head": 1}'
    wait_nodes 1 || { down >/dev/null 2>&1 || true; return 1; }
    start_node worker "$TMP_WORKER" --address "$IP:$GCS_PORT" \
        --dashboard-agent-listen-port "$((AGENT_PORT + 1))" --min-worker-port 10600 --max-worker-port 11099 \
        --resources '{"node_worker": 1}'
    wait_nodes 2 || { down >/dev/null 2>&1 || true; return 1; }
    echo "local Ray cluster up: 2 nodes (node_head, node_worker), $CPUS CPU and ${OBJ_MB} MiB object store each; state in $STATE" >&2
    [ -z "$PRIVATE" ] || echo "the worker node sees an empty $PRIVATE (LOCAL_CLUSTER_WORKER_PRIVATE)" >&2
    print_env
}

down() {
    local n pids
    # `ray start --block` stops its own node's processes on SIGTERM: worker first, then head.
    for n in worker head; do
        if alive "$(pid_of "$n")"; then
            kill -TERM "$(pid_of "$n")" 2>/dev/null || true
            for ((i = 0; i < 60 && $(alive "$(pid_of "$n")" && echo 1 || echo 0); i++)); do sleep 0.5; done
        fi
    done
    # Then whatever outlived them (job drivers, workers in their own sessions): TERM, then KILL.
    pids=$( (session_pids; stray_pids) | sort -u)
    if [ -n "$pids" ]; then
        kill -TERM $pids 2>/dev/null || true
        if ! wait_gone 15; then
            pids=$( (session_pids; stray_pids) | sort -u)
            [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
            wait_gone 10 || true
        fi
    fi
    pids=$( (session_pids; stray_pids) | sort -u)
    if [ -n "$pids" ]; then
        echo "error: processes still running after down: $pids" >&2
        return 1
    fi
    rm -f "$STATE"/*.pid
    echo "local Ray cluster down; no process left (state kept in $STATE)" >&2
}

status() {
    local n ok=0
    for n in head worker; do
        if alive "$(pid_of "$n")"; then echo "$n: running (pid $(pid_of "$n"))"; else echo "$n: stopped"; ok=1; fi
    done
    if [ $ok = 0 ]; then
        "$RAY" status --address "$IP:$GCS_PORT" || ok=1
        print_env
    fi
    return $ok
}

case "${1:-}" in
    up) up ;;
    down) down ;;
    status) status ;;
    *) echo "usage: $0 up|down|status   (state dir: \$LOCAL_CLUSTER_DIR, default ./workdir/local_cluster)" >&2; exit 2 ;;
esac
