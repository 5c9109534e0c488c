//! Support for steamrf's end-to-end tests: a real Kafka-protocol broker
//! (started by `scripts/broker.sh`), the real `steamrf` binary, real LanceDB
//! tables in temp dirs, and an independent Kafka client (confluent-kafka,
//! through `scripts/produce.py`) to produce events.
#![allow(missing_docs, unreachable_pub, clippy::unwrap_used)]
