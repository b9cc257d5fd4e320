#!/usr/bin/env bash
# The MLflow tracking server + model registry of a cluster (runs on the head node; see ray_cluster.yaml).
#
#   cluster/mlflow_server.sh start    start it in its own session, wait until it answers, print the URI
#   cluster/mlflow_server.sh status   running or not, and the URI
#   cluster/mlflow_server.sh stop     stop what `start` started (recorded pid), nothing else
#
# Settings (environment):
#   MLFLOW_SERVER_DIR        pid, log, default sqlite db and artifacts     (default ./workdir/mlflow_server)
#   MLFLOW_SERVER_HOST       interface to bind                             (default 127.0.0.1)
#   MLFLOW_SERVER_PORT       port                                          (default 5000)
#   MLFLOW_BACKEND_STORE_URI runs + registry store   (default sqlite:///$MLFLOW_SERVER_DIR/mlflow.db;
#                            use postgresql://... when several people share the server)
#   MLFLOW_ARTIFACTS_DESTINATION  artifact root, proxied by the server     (default $MLFLOW_SERVER_DIR/artifacts;
#                            an NFS/EFS path or s3://bucket/prefix on a cluster)
#   MLFLOW                   the `mlflow` binary                           (default <repo>/.venv/bin/mlflow)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
DIR=${MLFLOW_SERVER_DIR:-$PWD/workdir/mlflow_server}
HOST=${MLFLOW_SERVER_HOST:-127.0.0.1}
PORT=${MLFLOW_SERVER_PORT:-5000}
MLFLOW=${MLFLOW:-$REPO/.venv/bin/mlflow}

die() { echo "error: $*" >&2; exit 2; }

[ -x "$MLFLOW" ] || die "no mlflow binary at $MLFLOW; run 'make install' or set MLFLOW=/path/to/mlflow"
mkdir -p "$DIR"
DIR=$(cd "$DIR" && pwd)
BACKEND=${MLFLOW_BACKEND_STORE_URI:-sqlite:///$DIR/mlflow.db}
ARTIFACTS=${MLFLOW_ARTIFACTS_DESTINATION:-$DIR/artifacts}
URI=http://$HOST:$PORT
PIDFILE=$DIR/server.pid

pid() { cat "$PIDFILE" 2>/dev/null || true; }
alive() { local p; p=$(pid); [ -n "$p" ] && kill -0 "$p" 2>/dev/null; }
answers() { "$(dirname "$MLFLOW")/python" -c "import urllib.request as u; u.urlopen('$URI/health', timeout=2)" 2>/dev/null; }

start() {
    if alive; then echo "$URI"; return 0; fi
    case "$ARTIFACTS" in *://*) ;; *) mkdir -p "$ARTIFACTS" ;; esac
    # Job execution (MLflow's background job runner) is not used and would start extra workers.
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false setsid "$MLFLOW" server --host "$HOST" --port "$PORT" --workers 2 \
        --backend-store-uri "$BACKEND" --artifacts-destination "$ARTIFACTS" \
        >"$DIR/server.log" 2>&1 </dev/null &
    echo $! >"$PIDFILE"
    for ((i = 0; i < 240; i++)); do
        answers && { echo "mlflow server up at $URI (store $BACKEND, artifacts $ARTIFACTS)" >&2; echo "$URI"; return 0; }
        alive || { tail -n 20 "$DIR/server.log" >&2; die "mlflow server exited; log: $DIR/server.log"; }
        sleep 0.5
    done
    stop >/dev/null 2>&1 || true
    die "mlflow server did not answer on $URI within 120 s; log: $DIR/server.log"
}

stop() {
    local p sid i
    p=$(pid)
    if [ -n "$p" ]; then
        # The server (gunicorn/uvicorn + workers) runs in the session setsid gave it: sid == recorded pid.
        sid_pids() { ps -e -o pid=,sid= | awk -v s="$p" '$2 == s {print $1}'; }
        kill -TERM $(sid_pids) 2>/dev/null || true
        for ((i = 0; i < 40; i++)); do [ -z "$(sid_pids)" ] && break; sleep 0.5; done
        [ -n "$(sid_pids)" ] && kill -KILL $(sid_pids) 2>/dev/null || true
    fi
    rm -f "$PIDFILE"
    echo "mlflow server stopped" >&2
}

status() {
    if alive && answers; then echo "running (pid $(pid)) at $URI"; else echo "stopped"; return 1; fi
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    status) status ;;
    *) echo "usage: $0 start|stop|status   (MLFLOW_SERVER_DIR, MLFLOW_SERVER_HOST, MLFLOW_SERVER_PORT, ...)" >&2; exit 2 ;;
esac
