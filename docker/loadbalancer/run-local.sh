#!/usr/bin/env bash
# Runs the shipped haproxy configuration (haproxy.cfg) on 127.0.0.1:PORT in front of the given replicas, in the
# foreground, logging one line per request to stdout. For bare hosts and tests; compose uses compose.cfg.
#
#   docker/loadbalancer/run-local.sh PORT HOST:PORT [HOST:PORT ...]
#   docker/loadbalancer/run-local.sh 8000 127.0.0.1:8001 127.0.0.1:8002
#
# Environment: STATS_PORT (Prometheus metrics on /metrics and the stats page on /stats, on 127.0.0.1; default
# 8404, haproxy's usual stats port, as in compose), HAPROXY (the binary; default haproxy, 2.6 or later). A stats
# port that is PORT or a local replica's port is refused: haproxy could not bind it, or would answer for it.
# Stop: SIGUSR1 lets open streams finish first (at most hard-stop-after, 40 s); SIGTERM or SIGINT stops at once.
set -euo pipefail

usage() {
    echo "usage: $0 PORT HOST:PORT [HOST:PORT ...]" >&2
    exit 2
}

port_number() {
    [[ $1 =~ ^[0-9]+$ ]] && ((10#$1 >= 1 && 10#$1 <= 65535))
}

[ $# -ge 2 ] || usage
port=$1
shift
port_number "$port" || usage
stats_port=${STATS_PORT:-8404}
port_number "$stats_port" || usage

is_local() {
    [[ $1 =~ ^(127\.[0-9.]+|localhost|0\.0\.0\.0|\[?::1?\]?)$ ]]
}

collides() {
    echo "$0: the stats port $stats_port is also $1; set STATS_PORT to a free port" >&2
    exit 2
}

((10#$stats_port != 10#$port)) || collides "the balancer's port"

# The backend section: one server line per replica (haproxy.cfg's defaults give them their checks).
backend="backend pagedserve"$'\n'
index=0
for replica in "$@"; do
    host=${replica%:*}
    if [ "$host" = "$replica" ] || [ -z "$host" ] || ! port_number "${replica##*:}"; then
        usage
    fi
    if is_local "$host" && ((10#${replica##*:} == 10#$stats_port)); then
        collides "the port of replica $replica"
    fi
    index=$((index + 1))
    backend+="    server replica${index} ${replica}"$'\n'
done

here=$(cd "$(dirname "$0")" && pwd)
export PAGEDSERVE_LB_BIND="127.0.0.1:${port}"
export PAGEDSERVE_LB_STATS_BIND="127.0.0.1:${stats_port}"
# -db: stay in the foreground; -W: master-worker, so signals reach the worker. The generated section is read
# from stdin, so nothing is left behind on disk.
exec "${HAPROXY:-haproxy}" -W -db -f "$here/haproxy.cfg" -f /dev/stdin <<<"$backend"
