//! Every metric the pipeline exports, in one place (names, help, labels).
//!
//! Naming follows the Prometheus guide: `steamrf_<subsystem>_<noun>_<unit>`,
//! counters end in `_total`, base units (seconds, bytes). Labels come from
//! closed sets only: configured topic names, table names, and the enums'
//! `as_str` values. Never user, event or memory ids; never partitions.

use prometheus::{
    Encoder, Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge,
    IntGaugeVec, Opts, Registry, TextEncoder, exponential_buckets,
};
use steamrf_operators::batch::FlushReason;
use steamrf_schemas::{DecodeErrorKind, TableName};

use crate::error::ErrorKind;

/// The dead-letter kind of a row whose text the embedding endpoint refused.
pub const EMBEDDING_REJECTED: &str = "embedding_rejected";

/// The pipeline's metrics, registered in their own registry.
#[derive(Clone, Debug)]
pub struct Metrics {
    registry: Registry,
    /// Records polled from Kafka, by topic.
    pub records_received: IntCounterVec,
    /// Payload bytes polled from Kafka, by topic.
    pub bytes_received: IntCounterVec,
    /// Consumer lag from librdkafka statistics, summed over this member's partitions, by topic.
    pub consumer_lag: IntGaugeVec,
    /// Partitions currently assigned to this member.
    pub assigned_partitions: IntGauge,
    /// Group rebalances seen, by kind (assign, revoke, error).
    pub rebalances: IntCounterVec,
    /// Records sent to the dead-letter topic, by reason.
    pub dead_lettered: IntCounterVec,
    /// Micro-batches cut, by reason.
    pub batches: IntCounterVec,
    /// Records per micro-batch.
    pub batch_records: Histogram,
    /// Payload bytes per micro-batch.
    pub batch_bytes: Histogram,
    /// From a batch's first record being polled to its offsets being committed.
    pub batch_latency: Histogram,
    /// From each record's Kafka timestamp to its batch's offsets being
    /// committed (its rows durable): the end-to-end latency.
    pub end_to_end: Histogram,
    /// Batches waiting between the consumer and the writer.
    pub queue_depth: IntGauge,
    /// Seconds the source spent blocked on a full queue (backpressure from the sink).
    pub backpressure: prometheus::Counter,
    /// Rows written (inserted or updated), by table.
    pub rows_written: IntCounterVec,
    /// Rows skipped as already present (replays), by table.
    pub rows_deduplicated: IntCounterVec,
    /// Duration of one table write, by table.
    pub write_duration: HistogramVec,
    /// Records (valid and dead-lettered) whose offsets were committed.
    pub records_committed: IntCounter,
    /// `forget` events carried out.
    pub forgets: IntCounter,
    /// Offset commits, by result (ok, error).
    pub commits: IntCounterVec,
    /// Errors, by component and error type.
    pub errors: IntCounterVec,
    /// Table compactions run, by table.
    pub optimizations: IntCounterVec,
    /// Insert-if-absent writes, by table and path: `fresh` (committed
    /// without looking the keys up) or `exact` (looked up).
    pub fresh_writes: IntCounterVec,
    /// Batches whose only doubt was a few keys the filter of forgotten
    /// keys may hold, looked up key by key, by table.
    pub suspect_lookups: IntCounterVec,
    /// Latest LanceDB version written, by table.
    pub table_version: IntGaugeVec,
    /// Texts embedded, by kind (dialogue_turn, item).
    pub embed_texts: IntCounterVec,
    /// Rows not embedded because the stored row is the same or newer, by kind.
    pub embed_skipped: IntCounterVec,
    /// Tokens fed to the embedding model.
    pub embed_tokens: IntCounter,
    /// Texts cut to the model's maximum length.
    pub embed_truncated: IntCounter,
    /// Remote embedding requests retried.
    pub embed_retries: IntCounter,
    /// Embedding calls that failed for good (the batch is not committed).
    pub embed_failures: IntCounter,
    /// Texts the endpoint refused (400, 413, 422), dead-lettered, by kind.
    pub embed_rejected: IntCounterVec,
    /// Duration of one embedding call (one micro-batch of one kind).
    pub embed_duration: Histogram,
    /// Memory evolution steps, by kind (formed, consolidated).
    pub steam_memories: IntCounterVec,
    /// Interactions not observed (item unknown or without embedding).
    pub steam_skipped: IntCounter,
    /// Cross-user links written.
    pub steam_links: IntCounter,
    /// Community merges.
    pub steam_merges: IntCounter,
    /// Community splits.
    pub steam_splits: IntCounter,
    /// Communities (singletons included).
    pub steam_communities: IntGauge,
    /// Published prototypes.
    pub steam_prototypes: IntGauge,
    /// Duration of the STEAM stage for one micro-batch.
    pub steam_duration: Histogram,
    /// LLM summaries, by result (ok, fallback to the deterministic summary).
    pub llm_calls: IntCounterVec,
    /// LLM tokens spent, by kind (prompt, completion).
    pub llm_tokens: IntCounterVec,
    /// One LLM summary, retries included (ok or fallback).
    pub llm_duration: Histogram,
    /// 1 for the similarity kernel backend in use (cpu, cuda).
    pub kernel_backend: IntGaugeVec,
    /// 1 for the number format the embedder runs at (f32, int8, remote).
    pub embed_precision: IntGaugeVec,
    /// Duration of one relation-extraction kernel call (batch cosine + top-k).
    pub kernel_duration: Histogram,
    /// Members of the largest community.
    pub steam_community_size_max: IntGauge,
    /// Rows into and out of each operator, by operator and direction.
    pub operator_rows: IntCounterVec,
    /// Duration of each operator per micro-batch, by operator.
    pub operator_duration: HistogramVec,
}

/// The text exposition of `r`.
pub(crate) fn render(r: &Registry) -> String {
    let mut buf = Vec::new();
    TextEncoder::new()
        .encode(&r.gather(), &mut buf)
        .expect("text encoding cannot fail");
    String::from_utf8(buf).expect("exposition is UTF-8")
}

/// Asserts every metric family in `text` is documented in docs/metrics.md
/// and that there are at least `min` of them.
#[cfg(test)]
pub(crate) fn assert_documented(text: &str, min: usize) {
    let docs = include_str!("../../docs/metrics.md");
    let mut names = 0;
    for line in text.lines().filter(|l| l.starts_with("# TYPE ")) {
        let name = line.split_whitespace().nth(2).unwrap_or_default();
        assert!(
            docs.contains(&format!("`{name}`")),
            "{name} is missing from docs/metrics.md"
        );
        names += 1;
    }
    assert!(names >= min, "{text}");
}

pub(crate) fn int_counter(r: &Registry, name: &str, help: &str) -> IntCounter {
    let c = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

pub(crate) fn counter(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntCounterVec {
    let c = IntCounterVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(c.clone())).expect("unique metric");
    c
}

pub(crate) fn gauge_vec(r: &Registry, name: &str, help: &str, labels: &[&str]) -> IntGaugeVec {
    let g = IntGaugeVec::new(Opts::new(name, help), labels).expect("valid metric");
    r.register(Box::new(g.clone())).expect("unique metric");
    g
}

pub(crate) fn histogram(r: &Registry, name: &str, help: &str, buckets: Vec<f64>) -> Histogram {
    let h = Histogram::with_opts(HistogramOpts::new(name, help).buckets(buckets))
        .expect("valid metric");
    r.register(Box::new(h.clone())).expect("unique metric");
    h
}

impl Metrics {
    /// Registers every metric and pre-creates the label values of closed sets,
    /// so dashboards see zeros instead of absent series.
    pub fn new(topics: &[String]) -> Self {
        let r = Registry::new();
        let build = gauge_vec(
            &r,
            "steamrf_build_info",
            "Build information; always 1.",
            &["version"],
        );
        build.with_label_values(&[env!("CARGO_PKG_VERSION")]).set(1);
        let seconds = exponential_buckets(0.001, 2.0, 17).expect("valid buckets");
        let m = Self {
            records_received: counter(
                &r,
                "steamrf_source_records_received_total",
                "Records polled from Kafka.",
                &["topic"],
            ),
            bytes_received: counter(
                &r,
                "steamrf_source_bytes_received_total",
                "Payload bytes polled from Kafka.",
                &["topic"],
            ),
            consumer_lag: gauge_vec(
                &r,
                "steamrf_source_consumer_lag_records",
                "Consumer lag from librdkafka statistics, summed over this member's partitions.",
                &["topic"],
            ),
            assigned_partitions: {
                let g = IntGauge::new(
                    "steamrf_source_assigned_partitions",
                    "Partitions currently assigned to this member.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            rebalances: counter(
                &r,
                "steamrf_source_rebalances_total",
                "Consumer group rebalance callbacks.",
                &["kind"],
            ),
            dead_lettered: counter(
                &r,
                "steamrf_dead_letter_records_total",
                "Malformed records sent to the dead-letter topic.",
                &["reason"],
            ),
            batches: counter(
                &r,
                "steamrf_batches_total",
                "Micro-batches cut.",
                &["reason"],
            ),
            batch_records: histogram(
                &r,
                "steamrf_batch_records",
                "Records per micro-batch.",
                exponential_buckets(1.0, 4.0, 11).expect("valid buckets"),
            ),
            batch_bytes: histogram(
                &r,
                "steamrf_batch_size_bytes",
                "Payload bytes per micro-batch.",
                exponential_buckets(1024.0, 4.0, 10).expect("valid buckets"),
            ),
            batch_latency: histogram(
                &r,
                "steamrf_batch_latency_seconds",
                "From a batch's first record being polled to its offsets being committed.",
                seconds.clone(),
            ),
            end_to_end: histogram(
                &r,
                "steamrf_ingest_end_to_end_seconds",
                "From each record's Kafka timestamp (producer CreateTime, or LogAppendTime) to its batch's offsets being committed, its rows durable.",
                vec![
                    0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 2.0, 3.0,
                    5.0, 10.0, 30.0, 60.0, 300.0,
                ],
            ),
            queue_depth: {
                let g = IntGauge::new(
                    "steamrf_batch_queue_depth",
                    "Batches waiting between the consumer and the writer.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            backpressure: {
                let c = prometheus::Counter::new(
                    "steamrf_source_backpressure_seconds_total",
                    "Seconds the source spent blocked because the writer's queue was full.",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            rows_written: counter(
                &r,
                "steamrf_sink_rows_written_total",
                "Rows inserted or updated in LanceDB.",
                &["table"],
            ),
            rows_deduplicated: counter(
                &r,
                "steamrf_sink_rows_deduplicated_total",
                "Rows skipped because their key was already written (replays).",
                &["table"],
            ),
            write_duration: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "steamrf_sink_write_duration_seconds",
                        "Duration of one durable LanceDB table write.",
                    )
                    .buckets(seconds),
                    &["table"],
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("unique metric");
                h
            },
            records_committed: {
                let c = IntCounter::new("steamrf_source_records_committed_total", "Records (valid and dead-lettered) whose offsets were committed after a durable write.").expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            forgets: {
                let c = IntCounter::new(
                    "steamrf_forgets_total",
                    "Forget events carried out (user's rows deleted, tables compacted and pruned).",
                )
                .expect("valid metric");
                r.register(Box::new(c.clone())).expect("unique metric");
                c
            },
            commits: counter(
                &r,
                "steamrf_source_offset_commits_total",
                "Kafka offset commits after durable writes.",
                &["result"],
            ),
            errors: counter(
                &r,
                "steamrf_errors_total",
                "Errors by component and type.",
                &["component", "error_type"],
            ),
            optimizations: counter(
                &r,
                "steamrf_sink_optimizations_total",
                "Table compactions and version prunes.",
                &["table"],
            ),
            fresh_writes: counter(
                &r,
                "steamrf_sink_insert_writes_total",
                "Insert-if-absent batch writes, by path: fresh (no key lookup) or exact (keys looked up); conflicted: a fresh write another writer's commit beat, then written by the exact path (and counted there too).",
                &["table", "path"],
            ),
            suspect_lookups: counter(
                &r,
                "steamrf_sink_suspect_key_lookups_total",
                "Batches whose only doubt was keys the fresh-key ledger's filter of forgotten keys may hold, looked up key by key.",
                &["table"],
            ),
            table_version: gauge_vec(
                &r,
                "steamrf_sink_table_version",
                "Latest LanceDB table version written by this process.",
                &["table"],
            ),
            embed_texts: counter(
                &r,
                "steamrf_embed_texts_total",
                "Texts embedded.",
                &["kind"],
            ),
            embed_skipped: counter(
                &r,
                "steamrf_embed_skipped_total",
                "Rows not embedded because the stored row is the same or newer.",
                &["kind"],
            ),
            embed_tokens: int_counter(
                &r,
                "steamrf_embed_tokens_total",
                "Tokens fed to the embedding model.",
            ),
            embed_truncated: int_counter(
                &r,
                "steamrf_embed_truncated_total",
                "Texts cut to the embedding model's maximum length.",
            ),
            embed_retries: int_counter(
                &r,
                "steamrf_embed_retries_total",
                "Remote embedding requests retried (timeouts, 429, 5xx).",
            ),
            embed_failures: int_counter(
                &r,
                "steamrf_embed_failures_total",
                "Embedding calls that failed after retries; the batch is not committed.",
            ),
            embed_rejected: counter(
                &r,
                "steamrf_embed_rejected_total",
                "Texts the embedding endpoint refused (HTTP 400, 413, 422); their rows are dead-lettered.",
                &["kind"],
            ),
            embed_duration: histogram(
                &r,
                "steamrf_embed_duration_seconds",
                "Duration of one embedding call (one micro-batch of one kind).",
                exponential_buckets(0.001, 2.0, 17).expect("valid buckets"),
            ),
            steam_memories: counter(
                &r,
                "steamrf_steam_memory_steps_total",
                "Memory evolution steps.",
                &["kind"],
            ),
            steam_skipped: int_counter(
                &r,
                "steamrf_steam_skipped_interactions_total",
                "Interactions not observed: item unknown or without an embedding.",
            ),
            steam_links: int_counter(
                &r,
                "steamrf_steam_links_total",
                "Cross-user memory links written.",
            ),
            steam_merges: int_counter(
                &r,
                "steamrf_steam_community_merges_total",
                "Community merges.",
            ),
            steam_splits: int_counter(
                &r,
                "steamrf_steam_community_splits_total",
                "Community splits.",
            ),
            steam_communities: {
                let g = IntGauge::new(
                    "steamrf_steam_communities",
                    "Memory communities, singletons included.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            steam_prototypes: {
                let g = IntGauge::new("steamrf_steam_prototypes", "Published prototypes.")
                    .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            steam_duration: histogram(
                &r,
                "steamrf_steam_duration_seconds",
                "Duration of the STEAM stage (evolution, links, communities, prototypes, writes) for one micro-batch.",
                exponential_buckets(0.001, 2.0, 17).expect("valid buckets"),
            ),
            llm_calls: counter(
                &r,
                "steamrf_llm_calls_total",
                "LLM summaries of memories and prototypes, by result (ok, fallback).",
                &["result"],
            ),
            llm_tokens: counter(
                &r,
                "steamrf_llm_tokens_total",
                "LLM tokens spent, as reported by the endpoint.",
                &["kind"],
            ),
            llm_duration: histogram(
                &r,
                "steamrf_llm_call_duration_seconds",
                "One LLM summary of a memory or prototype, from asking for a slot to the answer (retries included), ok or fallback.",
                exponential_buckets(0.01, 2.0, 14).expect("valid buckets"),
            ),
            kernel_backend: gauge_vec(
                &r,
                "steamrf_kernel_backend_info",
                "1 for the similarity kernel backend relation extraction uses.",
                &["backend"],
            ),
            embed_precision: gauge_vec(
                &r,
                "steamrf_embed_precision_info",
                "1 for the number format the embedder runs at (f32, int16, int8; remote: another process embeds).",
                &["precision"],
            ),
            kernel_duration: histogram(
                &r,
                "steamrf_kernel_duration_seconds",
                "Duration of one relation-extraction kernel call (batch cosine similarity + top-k).",
                exponential_buckets(0.0001, 2.0, 20).expect("valid buckets"),
            ),
            steam_community_size_max: {
                let g = IntGauge::new(
                    "steamrf_steam_community_size_max",
                    "Memories in the largest community.",
                )
                .expect("valid metric");
                r.register(Box::new(g.clone())).expect("unique metric");
                g
            },
            operator_rows: counter(
                &r,
                "steamrf_operator_rows_total",
                "Rows into and out of each operator (embed: rows in, texts embedded out; steam: observations in, memories changed out), by operator and direction.",
                &["operator", "direction"],
            ),
            operator_duration: {
                let h = HistogramVec::new(
                    HistogramOpts::new(
                        "steamrf_operator_duration_seconds",
                        "Duration of each operator for one micro-batch, by operator (embed, steam).",
                    )
                    .buckets(exponential_buckets(0.0005, 2.0, 18).expect("valid buckets")),
                    &["operator"],
                )
                .expect("valid metric");
                r.register(Box::new(h.clone())).expect("unique metric");
                h
            },
            registry: r,
        };
        for op in ["embed", "steam"] {
            m.operator_duration.with_label_values(&[op]);
            for d in ["in", "out"] {
                m.operator_rows.with_label_values(&[op, d]);
            }
        }
        for k in ["formed", "consolidated"] {
            m.steam_memories.with_label_values(&[k]);
        }
        for k in ["ok", "fallback"] {
            m.llm_calls.with_label_values(&[k]);
        }
        for b in ["cpu", "cuda"] {
            m.kernel_backend.with_label_values(&[b]);
        }
        for p in ["f32", "int16", "int8", "bf16", "remote"] {
            m.embed_precision.with_label_values(&[p]);
        }
        for k in ["prompt", "completion"] {
            m.llm_tokens.with_label_values(&[k]);
        }
        for k in ["dialogue_turn", "item", "passage"] {
            m.embed_texts.with_label_values(&[k]);
            m.embed_rejected.with_label_values(&[k]);
            m.embed_skipped.with_label_values(&[k]);
        }
        for t in topics {
            m.records_received.with_label_values(&[t]);
            m.bytes_received.with_label_values(&[t]);
            m.consumer_lag.with_label_values(&[t]);
        }
        for k in DecodeErrorKind::ALL {
            m.dead_lettered.with_label_values(&[k.as_str()]);
        }
        m.dead_lettered.with_label_values(&[EMBEDDING_REJECTED]);
        for r in FlushReason::ALL {
            m.batches.with_label_values(&[r.as_str()]);
        }
        for t in TableName::ALL {
            m.rows_written.with_label_values(&[t.as_str()]);
            m.rows_deduplicated.with_label_values(&[t.as_str()]);
            m.write_duration.with_label_values(&[t.as_str()]);
            m.optimizations.with_label_values(&[t.as_str()]);
            m.table_version.with_label_values(&[t.as_str()]);
        }
        for t in [
            TableName::Interactions,
            TableName::TurnVectors,
            TableName::Passages,
        ] {
            for p in ["fresh", "exact"] {
                m.fresh_writes.with_label_values(&[t.as_str(), p]);
            }
            m.suspect_lookups.with_label_values(&[t.as_str()]);
        }
        for c in ["source", "sink", "embed", "steam"] {
            for k in [ErrorKind::Config, ErrorKind::External, ErrorKind::Internal] {
                m.errors.with_label_values(&[c, k.as_str()]);
            }
        }
        for k in ["assign", "revoke", "error"] {
            m.rebalances.with_label_values(&[k]);
        }
        for k in ["ok", "error"] {
            m.commits.with_label_values(&[k]);
        }
        m
    }

    /// The Prometheus text exposition of every metric.
    pub fn render(&self) -> String {
        render(&self.registry)
    }

    /// Counts one error.
    pub fn error(&self, component: &str, err: &crate::Error) {
        self.errors
            .with_label_values(&[component, err.kind().as_str()])
            .inc();
    }

    /// Texts embedded over all kinds.
    pub fn total_texts_embedded(&self) -> u64 {
        ["dialogue_turn", "item", "passage"]
            .iter()
            .map(|k| self.embed_texts.with_label_values(&[k]).get())
            .sum()
    }

    /// Total rows written over all tables (for progress reporting).
    pub fn total_rows_written(&self) -> u64 {
        TableName::ALL
            .iter()
            .map(|t| self.rows_written.with_label_values(&[t.as_str()]).get())
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_metric_is_documented_and_labels_are_closed() {
        let m = Metrics::new(&["events".to_owned()]);
        let text = m.render();
        assert_documented(&text, 20);
        for forbidden in ["user_id", "event_id", "partition=\""] {
            assert!(
                !text.contains(forbidden),
                "unbounded label {forbidden} in:\n{text}"
            );
        }
    }
}
