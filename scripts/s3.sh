#!/usr/bin/env bash
# Starts, stops or checks a local S3 store (SeaweedFS `weed mini`) on
# 127.0.0.1:8333 with the buckets `tansu` and `lancedb`, its data under
# .tools/run/s3 (kept across restarts). The reliability tests run Tansu and
# LanceDB on it; any S3 endpoint works the same way in production.
#   scripts/s3.sh start    idempotent
#   scripts/s3.sh stop
#   scripts/s3.sh status
# Clients: AWS_ENDPOINT=http://127.0.0.1:8333 AWS_ALLOW_HTTP=true, any key pair.
set -euo pipefail
cd "$(dirname "$0")/.."
TOOLS="${STEAMRF_TOOLS:-$PWD/.tools}"
PORT=8333
RUN="$TOOLS/run"; mkdir -p "$RUN/s3"
PIDFILE="$RUN/weed.pid"; LOG="$RUN/weed.log"

up() { curl -fsS -o /dev/null "http://127.0.0.1:$PORT/lancedb" 2>/dev/null; }

case "${1:-}" in
  start)
    if up; then echo "s3: already up on 127.0.0.1:$PORT"; exit 0; fi
    [ -x "$TOOLS/bin/weed" ] || scripts/tools.sh
    setsid "$TOOLS/bin/weed" mini -dir="$RUN/s3" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -bucket=tansu,lancedb -admin.ui=false >"$LOG" 2>&1 < /dev/null &
    echo $! > "$PIDFILE"
    for _ in $(seq 1 300); do up && { echo "s3: up on 127.0.0.1:$PORT (pid $(cat "$PIDFILE"))"; exit 0; }; sleep 0.1; done
    echo "s3: did not start; log follows" >&2; tail -50 "$LOG" >&2; exit 1 ;;
  stop)
    if [ -f "$PIDFILE" ]; then kill "$(cat "$PIDFILE")" 2>/dev/null || true; rm -f "$PIDFILE"; fi
    for _ in $(seq 1 100); do up || { echo "s3: stopped"; exit 0; }; sleep 0.1; done
    echo "s3: still up on $PORT (not started by this script?)" >&2; exit 1 ;;
  status)
    if up; then echo "s3: up on 127.0.0.1:$PORT"; else echo "s3: down"; exit 1; fi ;;
  *) echo "usage: $0 start|stop|status" >&2; exit 2 ;;
esac
