#!/usr/bin/env python3
"""Produces one Kafka record per line of a file, with the confluent-kafka client
(an independent Kafka client: librdkafka 2.x from its wheel, not steamrf's code).

Lines are sent as raw bytes (so malformed and non-UTF-8 payloads travel
unchanged); the key is the event's user_id when the line parses as JSON.
"""
import argparse, json, sys, time
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--brokers", default="127.0.0.1:9092")
    ap.add_argument("--topic", required=True)
    ap.add_argument("--partitions", type=int, default=4, help="create the topic with this many partitions if missing")
    ap.add_argument("--rate", type=float, default=0, help="events per second (0: as fast as possible)")
    ap.add_argument("file")
    a = ap.parse_args()

    admin = AdminClient({"bootstrap.servers": a.brokers})
    if a.topic not in admin.list_topics(timeout=10).topics:
        for f in admin.create_topics([NewTopic(a.topic, num_partitions=a.partitions, replication_factor=1)]).values():
            try:
                f.result()
            except Exception as e:  # already exists (a concurrent creator) is fine
                if "already exists" not in str(e).lower() and "TOPIC_ALREADY_EXISTS" not in str(e):
                    raise
    p = Producer({"bootstrap.servers": a.brokers, "enable.idempotence": True, "linger.ms": 10,
                  "message.max.bytes": 2_000_000})
    failed = []
    def done(err, _msg):
        if err is not None:
            failed.append(err)
    n = 0
    start = time.monotonic()
    with open(a.file, "rb") as f:
        for line in f:
            line = line.rstrip(b"\n")
            if not line:
                continue
            key = None
            try:
                key = str(json.loads(line).get("user_id", "")).encode() or None
            except Exception:
                pass
            while True:
                try:
                    p.produce(a.topic, value=line, key=key, on_delivery=done)
                    break
                except BufferError:
                    p.poll(0.05)
            n += 1
            p.poll(0)
            if a.rate > 0:
                ahead = n / a.rate - (time.monotonic() - start)
                if ahead > 0:
                    time.sleep(ahead)
    p.flush(60)
    if failed:
        sys.exit(f"produce.py: {len(failed)} deliveries failed: {failed[0]}")
    print(f"produced {n} records to {a.topic}")

if __name__ == "__main__":
    main()
