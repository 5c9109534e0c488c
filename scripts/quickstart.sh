#!/usr/bin/env bash
# One command from a fresh Debian 12 machine to a populated memory store:
# installs the tools, starts a local Kafka-protocol broker on 127.0.0.1:9092,
# builds steamrf, produces the shipped sample events through Kafka, runs the
# pipeline into ./data/lancedb until the topic is drained, and queries it.
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${HOME:-/root}/.cache/steamrf/target}"
scripts/tools.sh
scripts/broker.sh start
cargo build --locked --bin steamrf
steamrf="$CARGO_TARGET_DIR/debug/steamrf"

.tools/venv/bin/python scripts/produce.py --topic steamrf-events --partitions 4 examples/sample-events.jsonl
"$steamrf" validate examples/quickstart.toml >/dev/null
# Runs until 5 s without new records, then drains, commits and exits 0.
# Without --exit-when-idle it runs until SIGTERM, like in production.
"$steamrf" run --config examples/quickstart.toml --exit-when-idle 5s

q() { echo; echo "\$ steamrf sql \"$1\""; "$steamrf" sql --config examples/quickstart.toml "$1"; }
q "SELECT kind, count(*) AS events, count(DISTINCT user_id) AS users FROM interactions GROUP BY kind ORDER BY kind"
q "SELECT i.user_id, it.title, it.categories FROM interactions i JOIN items it ON i.item_id = it.item_id WHERE i.kind = 'purchase' ORDER BY i.timestamp"
q "SELECT user_id, role, text FROM interactions WHERE kind = 'dialogue_turn' ORDER BY timestamp LIMIT 4"
# Dialogue turns and items carry all-MiniLM-L6-v2 embeddings (a turn's in turn_vectors); clicks and purchases do not.
q "SELECT i.kind, count(*) AS events, count(v.event_id) AS embedded FROM interactions i LEFT JOIN turn_vectors v ON v.event_id = i.event_id GROUP BY i.kind ORDER BY i.kind"
# STEAM memories (docs/steam.md): one per interest per user, linked across users.
q "SELECT user_id, support, content FROM memories ORDER BY user_id, support DESC"
q "SELECT from_user, to_user, round(score, 3) AS score FROM memory_links ORDER BY score DESC LIMIT 5"
echo
echo "Dead letters (malformed sample events) are on topic steamrf-dead-letters:"
.tools/bin/kcat -b 127.0.0.1:9092 -C -t steamrf-dead-letters -o beginning -e -q \
  -f '  %h\n    payload: %s\n' 2>/dev/null || true

# The retrieval service (docs/retrieval.md) over the same tables: RF-Mem over
# alice's memories, dialogue turns and interactions, then her community.
echo
"$steamrf" serve --config examples/quickstart.toml --listen 127.0.0.1:8090 2>/dev/null &
serve_pid=$!
trap 'kill $serve_pid 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf 127.0.0.1:8090/readyz >/dev/null && break; sleep 0.2; done
# Pretty-prints the first N lines of the answer (no `| head`: under pipefail
# the closed pipe would fail the script).
ask() {
  echo; echo "\$ curl 127.0.0.1:8090$1 -d '$2'"
  curl -s "127.0.0.1:8090$1" -d "$2" | .tools/venv/bin/python -c '
import json, sys
lines = json.dumps(json.load(sys.stdin), indent=2, ensure_ascii=False).splitlines()
n = int(sys.argv[1])
print("\n".join(lines[:n]) + ("\n  ..." if len(lines) > n else ""))' "${3:-40}"
}
ask /v1/retrieve '{"user_id": "alice", "query": "modern jazz records", "k": 3}' 60
ask /v1/recommend '{"user_id": "alice", "candidates": ["cd-002", "cd-004", "cd-005", "cd-008"]}' 40
kill $serve_pid 2>/dev/null || true
