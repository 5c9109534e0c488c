#!/usr/bin/env bash
# Starts, stops or checks the local Kafka-protocol broker (Tansu) on 127.0.0.1.
#   scripts/broker.sh start    idempotent: does nothing if it is already up
#   scripts/broker.sh stop
#   scripts/broker.sh status
# STEAMRF_BROKER_PORT (default 9092), STEAMRF_BROKER_STORAGE (default memory://tansu/).
# Production points steamrf at any Kafka cluster instead; see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
PORT="${STEAMRF_BROKER_PORT:-9092}"
STORAGE="${STEAMRF_BROKER_STORAGE:-memory://tansu/}"
RUN="$TOOLS/run"; mkdir -p "$RUN"
PIDFILE="$RUN/tansu-$PORT.pid"; LOG="$RUN/tansu-$PORT.log"

up() { (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; }

case "${1:-}" in
  start)
    if up; then echo "broker: already listening on 127.0.0.1:$PORT"; exit 0; fi
    [ -x "$TOOLS/bin/tansu" ] || scripts/tools.sh
    setsid "$TOOLS/bin/tansu" broker \
      --listener-url "tcp://127.0.0.1:$PORT" \
      --advertised-listener-url "tcp://127.0.0.1:$PORT" \
      --storage-engine "$STORAGE" >"$LOG" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 100); do up && { echo "broker: up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"))"; exit 0; }; sleep 0.1; done
    echo "broker: did not start; log follows" >&2; cat "$LOG" >&2; exit 1 ;;
  stop)
    if [ -f "$PIDFILE" ]; then kill "$(cat "$PIDFILE")" 2>/dev/null || true; rm -f "$PIDFILE"; fi
    for _ in $(seq 1 50); do up || { echo "broker: stopped"; exit 0; }; sleep 0.1; done
    echo "broker: still listening on $PORT (not started by this script?)" >&2; exit 1 ;;
  status)
    if up; then echo "broker: up on 127.0.0.1:$PORT"; else echo "broker: down"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
