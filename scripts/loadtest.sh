#!/usr/bin/env bash
# Load test of `steamrf serve` with wrk (Debian package) at 32 connections.
#
# Builds a corpus through the real path: generated events (one user with
# USER_TURNS dialogue turns and clicks, plus 50 other users) go through the
# local broker and `steamrf run` (embeddings, STEAM) into a temp LanceDB
# directory; then `steamrf serve` answers POST /v1/retrieve for 20 s with
# random query vectors (the RF-Mem path, no embedding) and for 20 s with
# text queries (the embedding included). wrk runs on the same machine as the
# service, so both share its cores.
#
#   scripts/loadtest.sh            # USER_TURNS=10000 by default
set -euo pipefail
cd "$(dirname "$0")/.."
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-${HOME:-/root}/.cache/steamrf/target}"
turns="${USER_TURNS:-10000}"
command -v wrk >/dev/null || apt-get install -y -q wrk >/dev/null
scripts/broker.sh status >/dev/null 2>&1 || scripts/broker.sh start
cargo build --locked --bin steamrf
steamrf="$CARGO_TARGET_DIR/debug/steamrf"
work=$(mktemp -d)
trap 'kill ${serve_pid:-} 2>/dev/null || true; rm -rf "$work"' EXIT
topic="loadtest-$$"

.tools/venv/bin/python - "$work/events.jsonl" "$turns" <<'PY'
import json, random, sys
out, turns = sys.argv[1], int(sys.argv[2])
random.seed(7)
genres = ["jazz", "rock", "classical", "hip hop", "electronic", "folk", "soul", "metal"]
words = ["album", "live", "record", "tour", "vinyl", "band", "singer", "piano",
         "guitar", "drums", "concert", "playlist", "remaster", "debut", "song"]
ev, n = [], 0
def add(**e):
    global n
    n += 1
    e.update(schema_version=1, event_id=f"lt-{n}", timestamp=1764000000000 + n * 1000)
    ev.append(e)
for i in range(400):
    g = genres[i % len(genres)]
    add(type="item", item_id=f"i{i}", title=f"{g.title()} {random.choice(words)} {i}", categories=[g])
for u in ["power-user"] + [f"u{k}" for k in range(50)]:
    k = turns if u == "power-user" else 100
    for t in range(k):
        if t % 2:
            add(type="click", user_id=u, item_id=f"i{random.randrange(400)}")
        else:
            g = random.choice(genres)
            text = f"I want {g} " + " ".join(random.choice(words) for _ in range(8))
            add(type="dialogue_turn", user_id=u, session_id=f"{u}-{t // 20}", role="user", text=text)
with open(out, "w") as f:
    f.write("\n".join(json.dumps(e) for e in ev) + "\n")
PY

cat > "$work/steamrf.toml" <<TOML
[kafka]
group_id = "$topic"
topics = ["$topic"]
dead_letter_topic = "$topic-dlq"
[lancedb]
uri = "$work/lancedb"
[steam]
enabled = true
[serve]
listen = "127.0.0.1:8091"
TOML
.tools/venv/bin/python scripts/produce.py --topic "$topic" --partitions 1 "$work/events.jsonl"
echo "loadtest: ingesting $(wc -l < "$work/events.jsonl") events (embeddings + STEAM)..."
"$steamrf" run --config "$work/steamrf.toml" --metrics-addr 127.0.0.1:0 --exit-when-idle 5s 2>/dev/null
"$steamrf" serve --config "$work/steamrf.toml" 2>"$work/serve.log" &
serve_pid=$!
for _ in $(seq 300); do curl -sf 127.0.0.1:8091/readyz >/dev/null && break; sleep 0.2; done
rows=$(curl -s 127.0.0.1:8091/metrics | awk '/^steamrf_serve_snapshot_rows /{print $2}')
echo "loadtest: serving $rows rows"

cat > "$work/vector.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
request = function()
  local v = {}
  for i = 1, 384 do v[i] = string.format("%.4f", math.random() - 0.5) end
  local u = "power-user"
  if math.random() < 0.5 then u = "u" .. math.random(0, 49) end
  return wrk.format(nil, "/v1/retrieve", nil,
    '{"user_id":"' .. u .. '","query_vector":[' .. table.concat(v, ",") .. '],"k":10}')
end
LUA
cat > "$work/text.lua" <<'LUA'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
local q = {"jazz piano records", "a live rock concert", "classical playlist", "new hip hop album",
           "electronic remaster", "folk guitar", "soul singer tour", "metal drums"}
request = function()
  return wrk.format(nil, "/v1/retrieve", nil,
    '{"user_id":"power-user","query":"' .. q[math.random(#q)] .. '","k":10}')
end
LUA
for kind in vector text; do
  echo "loadtest: $kind queries, 32 connections, 20 s"
  wrk -t2 -c32 -d20s --latency -s "$work/$kind.lua" http://127.0.0.1:8091 | tee "$work/$kind.txt"
done
rps() { awk '/Requests\/sec/{print $2}' "$work/$1.txt"; }
p50() { awk '$1=="50%"{print $2}' "$work/$1.txt"; }
p99() { awk '$1=="99%"{print $2}' "$work/$1.txt"; }
non2xx() { awk '/Non-2xx/{print $NF}' "$work/$1.txt"; }
echo "RESULT rows=$rows vector_rps=$(rps vector) vector_p50=$(p50 vector) vector_p99=$(p99 vector) vector_non2xx=$(non2xx vector) text_rps=$(rps text) text_p50=$(p50 text) text_p99=$(p99 text) text_non2xx=$(non2xx text)"
