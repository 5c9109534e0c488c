//! The retrieval service's metrics (its own registry; docs/metrics.md).

use std::time::Instant;

use axum::http::StatusCode;
use prometheus::{
    Histogram, HistogramOpts, HistogramVec, IntCounter, IntCounterVec, IntGauge, IntGaugeVec,
    Registry, exponential_buckets,
};
use steamrf_operators::rfmem::{Path, Rule};

use super::cache::{CacheStats, Snapshot, TABLES};
use crate::metrics::{counter, gauge_vec, histogram};

/// Routes, as label values.
pub(super) const ROUTES: [&str; 8] = [
    "retrieve",
    "recommend",
    "events",
    "mcp",
    "mcp_retrieve",
    "mcp_recommend",
    "mcp_remember",
    "mcp_forget",
];

/// Every metric of `steamrf serve`.
#[derive(Clone, Debug)]
pub struct ServeMetrics {
    registry: Registry,
    /// API requests, by route and status code.
    pub requests: IntCounterVec,
    /// API request duration, by route.
    pub request_duration: HistogramVec,
    /// Gate decisions, by path and rule.
    pub gate: IntCounterVec,
    /// Time in the chosen path, by path.
    pub path_duration: HistogramVec,
    /// Time in the probe and gate.
    pub probe_duration: Histogram,
    /// Recollection rounds per recollection.
    pub rounds: Histogram,
    /// Query embedding time.
    pub query_embed: Histogram,
    /// Refreshes after a table changed, by result.
    pub refreshes: IntCounterVec,
    /// Refresh time.
    pub refresh_duration: Histogram,
    /// Table versions of the served snapshot.
    pub table_version: IntGaugeVec,
    /// Estimated bytes in the cache.
    pub cache_bytes: IntGauge,
    /// Cache entries, by kind (user, prototype).
    pub cache_entries: IntGaugeVec,
    /// Cache look-ups, by kind and result (hit, miss, joined).
    pub cache_lookups: IntCounterVec,
    /// Events produced through `POST /v1/events`.
    pub events: IntCounter,
    /// Cache entries dropped, by reason (capacity, changed).
    pub cache_evictions: IntCounterVec,
    /// Time reading a missed entry from the tables, by kind.
    pub cache_fill_duration: HistogramVec,
    /// Requests refused because `max_in_flight` were being answered.
    pub shed: IntCounter,
    /// Retrievals cut short, by reason (deadline, client_gone).
    pub cut: IntCounterVec,
    /// Tokens file reloads, by result (ok, error).
    pub token_reloads: IntCounterVec,
    /// 1 for the number format the query embedder runs at.
    pub embed_precision: IntGaugeVec,
}

fn latency_buckets() -> Vec<f64> {
    exponential_buckets(0.0001, 2.0, 18).expect("valid buckets")
}

impl Default for ServeMetrics {
    fn default() -> Self {
        Self::new()
    }
}

impl ServeMetrics {
    /// Registers every metric, with the closed label sets pre-created.
    pub fn new() -> Self {
        let r = Registry::new();
        let requests = counter(
            &r,
            "steamrf_serve_requests_total",
            "API requests, by route and HTTP status code.",
            &["route", "status"],
        );
        let request_duration = HistogramVec::new(
            HistogramOpts::new(
                "steamrf_serve_request_duration_seconds",
                "API request duration (query embedding included), by route.",
            )
            .buckets(latency_buckets()),
            &["route"],
        )
        .expect("valid metric");
        r.register(Box::new(request_duration.clone()))
            .expect("unique metric");
        let gate = counter(
            &r,
            "steamrf_retrieve_gate_decisions_total",
            "RF-Mem gate decisions, by path and rule.",
            &["path", "rule"],
        );
        let path_duration = HistogramVec::new(
            HistogramOpts::new(
                "steamrf_retrieve_path_duration_seconds",
                "Time in the chosen retrieval path (probe excluded), by path.",
            )
            .buckets(latency_buckets()),
            &["path"],
        )
        .expect("valid metric");
        r.register(Box::new(path_duration.clone()))
            .expect("unique metric");
        let probe_duration = histogram(
            &r,
            "steamrf_retrieve_probe_duration_seconds",
            "Time in the familiarity probe and the gate.",
            latency_buckets(),
        );
        let rounds = histogram(
            &r,
            "steamrf_retrieve_recollection_rounds",
            "Rounds run per recollection.",
            vec![1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0, 15.0, 20.0],
        );
        let query_embed = histogram(
            &r,
            "steamrf_retrieve_query_embed_duration_seconds",
            "Time embedding a text query.",
            latency_buckets(),
        );
        let refreshes = counter(
            &r,
            "steamrf_serve_snapshot_loads_total",
            "Refreshes after a table changed (the catalogue and prototypes re-read, changed users evicted), by result (ok, error).",
            &["result"],
        );
        let refresh_duration = histogram(
            &r,
            "steamrf_serve_snapshot_load_duration_seconds",
            "Time of a refresh after a table changed: reading which rows changed, and the catalogue and prototypes when they did.",
            exponential_buckets(0.001, 2.0, 18).expect("valid buckets"),
        );
        let table_version = gauge_vec(
            &r,
            "steamrf_serve_table_version",
            "LanceDB version of each table in the served snapshot.",
            &["table"],
        );
        let cache_bytes = IntGauge::new(
            "steamrf_serve_cache_bytes",
            "Estimated bytes held in the user and prototype cache (bounded by serve.cache_bytes).",
        )
        .expect("valid metric");
        r.register(Box::new(cache_bytes.clone()))
            .expect("unique metric");
        let cache_entries = gauge_vec(
            &r,
            "steamrf_serve_cache_entries",
            "Entries in the cache, by kind (user; prototype: the members of one published prototype).",
            &["kind"],
        );
        let cache_lookups = counter(
            &r,
            "steamrf_serve_cache_lookups_total",
            "Cache look-ups, by kind (user, prototype) and result (hit; miss: read from the tables; joined: waited on a read of the same user already running).",
            &["kind", "result"],
        );
        let cache_evictions = counter(
            &r,
            "steamrf_serve_cache_evictions_total",
            "Cache entries dropped, by reason (capacity: least recently used, to stay within serve.cache_bytes; changed: their rows changed).",
            &["reason"],
        );
        let events = IntCounter::new(
            "steamrf_serve_events_total",
            "Events produced to Kafka through POST /v1/events (acknowledged by the broker).",
        )
        .expect("valid metric");
        r.register(Box::new(events.clone())).expect("unique metric");
        let cache_fill_duration = HistogramVec::new(
            HistogramOpts::new(
                "steamrf_serve_cache_fill_duration_seconds",
                "Time reading a missed cache entry from the tables, by kind (user, prototype).",
            )
            .buckets(latency_buckets()),
            &["kind"],
        )
        .expect("valid metric");
        r.register(Box::new(cache_fill_duration.clone()))
            .expect("unique metric");
        for kind in ["user", "prototype"] {
            cache_entries.with_label_values(&[kind]);
            cache_fill_duration.with_label_values(&[kind]);
            for result in ["hit", "miss"] {
                cache_lookups.with_label_values(&[kind, result]);
            }
        }
        for reason in ["capacity", "changed"] {
            cache_evictions.with_label_values(&[reason]);
        }
        let shed = IntCounter::new(
            "steamrf_serve_shed_total",
            "Requests refused with 503 because serve.max_in_flight requests were being answered.",
        )
        .expect("valid metric");
        r.register(Box::new(shed.clone())).expect("unique metric");
        let cut = counter(
            &r,
            "steamrf_retrieve_cut_total",
            "Retrievals whose recollection stopped early, by reason (deadline: serve.request_timeout; client_gone: the connection closed; rank_deadline: a recommend's fusion stopped at serve.request_timeout).",
            &["reason"],
        );
        let token_reloads = counter(
            &r,
            "steamrf_serve_token_reloads_total",
            "Reloads of a changed tokens file, by result (ok; error: unreadable or unparsable, the previous tokens kept).",
            &["result"],
        );
        for reason in ["deadline", "client_gone"] {
            cut.with_label_values(&[reason]);
        }
        for result in ["ok", "error"] {
            token_reloads.with_label_values(&[result]);
        }
        let embed_precision = gauge_vec(
            &r,
            "steamrf_embed_precision_info",
            "1 for the number format the query embedder runs at (f32, int16, int8; remote: another process embeds).",
            &["precision"],
        );
        for p in ["f32", "int16", "int8", "bf16", "remote"] {
            embed_precision.with_label_values(&[p]);
        }
        for route in ROUTES {
            request_duration.with_label_values(&[route]);
            for status in ["200", "400", "401", "403", "503"] {
                requests.with_label_values(&[route, status]);
            }
        }
        for (path, rule) in [
            (Path::Familiarity, Rule::MeanHigh),
            (Path::Familiarity, Rule::LowEntropy),
            (Path::Familiarity, Rule::Forced),
            (Path::Recollection, Rule::MeanLow),
            (Path::Recollection, Rule::HighEntropy),
            (Path::Recollection, Rule::NoHits),
            (Path::Recollection, Rule::Forced),
        ] {
            gate.with_label_values(&[path.as_str(), rule.as_str()]);
            path_duration.with_label_values(&[path.as_str()]);
        }
        for result in ["ok", "error"] {
            refreshes.with_label_values(&[result]);
        }
        for t in TABLES {
            table_version.with_label_values(&[t]);
        }
        Self {
            registry: r,
            requests,
            request_duration,
            gate,
            path_duration,
            probe_duration,
            rounds,
            query_embed,
            refreshes,
            refresh_duration,
            table_version,
            cache_bytes,
            cache_entries,
            cache_lookups,
            cache_evictions,
            events,
            cache_fill_duration,
            shed,
            cut,
            token_reloads,
            embed_precision,
        }
    }

    /// The text exposition.
    pub fn render(&self) -> String {
        crate::metrics::render(&self.registry)
    }

    /// Counts a finished request (`error`: its status, if it failed).
    pub fn finish(&self, route: &str, started: Instant, error: Option<StatusCode>) {
        let status = error.unwrap_or(StatusCode::OK);
        self.requests
            .with_label_values(&[route, status.as_str()])
            .inc();
        self.request_duration
            .with_label_values(&[route])
            .observe(started.elapsed().as_secs_f64());
    }

    /// Records what a retrieval did.
    pub fn observe_answer(
        &self,
        path: Path,
        rule: Rule,
        rounds: u32,
        probe_time: std::time::Duration,
        path_time: std::time::Duration,
    ) {
        self.gate
            .with_label_values(&[path.as_str(), rule.as_str()])
            .inc();
        self.probe_duration.observe(probe_time.as_secs_f64());
        self.path_duration
            .with_label_values(&[path.as_str()])
            .observe(path_time.as_secs_f64());
        if path == Path::Recollection {
            self.rounds.observe(f64::from(rounds));
        }
    }

    /// Records a published snapshot.
    pub fn observe_snapshot(&self, s: &Snapshot) {
        for (t, v) in &s.versions {
            self.table_version
                .with_label_values(&[t])
                .set(i64::try_from(*v).unwrap_or(i64::MAX));
        }
        self.refresh_duration.observe(s.load_time.as_secs_f64());
    }

    /// Records what the cache holds.
    pub fn observe_cache(&self, s: CacheStats) {
        self.cache_bytes
            .set(i64::try_from(s.bytes).unwrap_or(i64::MAX));
        self.cache_entries
            .with_label_values(&["user"])
            .set(s.users as i64);
        self.cache_entries
            .with_label_values(&["prototype"])
            .set(s.prototypes as i64);
    }
}
