//! `POST /v1/events`: events over HTTP into the pipeline's input topic, for
//! clients that do not speak Kafka (`serve.accept_events`).
//!
//! There is still one write path, Kafka → `steamrf run`, and every guarantee
//! of it holds: the events are checked by the same decoder as the Kafka
//! source (a bad one is refused here with a 400 naming its field, and nothing
//! of that request is produced), keyed as producers key them (by user, items
//! by item id) so a user's events stay in order, and produced idempotently.
//! The answer (202) comes once the broker has acknowledged every event; when
//! it has not, the client resends the same request: the pipeline stores each
//! `event_id` once.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::response::Response;
use rdkafka::producer::{FutureProducer, FutureRecord};
use serde::Serialize;
use serde_json::value::RawValue;
use steamrf_schemas::{Event, decode};

use super::auth::Scope;
use super::{ApiError, AppState, authenticate, authorize, read_body, respond_with};
use crate::config::Config;
use crate::error::Result;

/// Where accepted events go.
pub struct EventSink {
    producer: FutureProducer,
    topic: String,
    max_event_bytes: usize,
    max_future_skew_ms: i64,
    timeout: Duration,
}

impl std::fmt::Debug for EventSink {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventSink")
            .field("topic", &self.topic)
            .finish_non_exhaustive()
    }
}

impl EventSink {
    /// A producer to `serve.events_topic` (empty: the first of
    /// `kafka.topics`, the pipeline's input).
    ///
    /// # Errors
    /// librdkafka rejects the configuration.
    pub fn new(config: &Config) -> Result<Self> {
        let topic = if config.serve.events_topic.is_empty() {
            config.kafka.topics.first().cloned().unwrap_or_default()
        } else {
            config.serve.events_topic.clone()
        };
        let max_event_bytes = config.kafka.max_event_bytes.0;
        Ok(Self {
            producer: crate::source::producer(
                &config.kafka,
                "the events producer",
                Some(max_event_bytes + 4096),
            )?,
            topic,
            max_event_bytes,
            max_future_skew_ms: i64::try_from(config.kafka.max_future_skew.as_millis())
                .unwrap_or(i64::MAX),
            timeout: config.serve.request_timeout.max(Duration::from_secs(5)),
        })
    }
}

/// The answer of `POST /v1/events`.
#[derive(Debug, Serialize)]
pub struct EventsResponse {
    /// Events produced.
    pub accepted: usize,
    /// Their ids, in request order.
    pub event_ids: Vec<String>,
    /// The topic they went to.
    pub topic: String,
}

pub(super) async fn events(State(st): State<Arc<AppState>>, req: Request) -> Response {
    let started = Instant::now();
    let id = st.request_id();
    let result = events_inner(&st, req).await;
    respond_with(&st, "events", &id, started, StatusCode::ACCEPTED, result)
}

/// One event or a JSON array of them, as the raw JSON of each.
fn split(body: &[u8]) -> Result<Vec<&RawValue>, ApiError> {
    let bad = |m: String| ApiError::invalid("body", m);
    match body.iter().find(|b| !b.is_ascii_whitespace()) {
        Some(b'[') => serde_json::from_slice::<Vec<&RawValue>>(body)
            .map_err(|e| bad(format!("not a JSON array of events: {e}"))),
        Some(b'{') => serde_json::from_slice::<&RawValue>(body)
            .map(|v| vec![v])
            .map_err(|e| bad(format!("not a JSON event: {e}"))),
        _ => Err(bad(
            "expected one event (a JSON object) or an array of them".into(),
        )),
    }
}

/// The record key and, for events of a user, the user.
fn key_of<'e>(e: &'e Event<'_>) -> (&'e str, Option<&'e str>) {
    match e {
        Event::Interaction(i) => (&i.user_id, Some(&i.user_id)),
        Event::Profile(p) => (&p.user_id, Some(&p.user_id)),
        Event::Forget(f) => (&f.user_id, None),
        Event::Item(i) => (&i.item_id, None),
    }
}

async fn events_inner(st: &Arc<AppState>, req: Request) -> Result<EventsResponse, ApiError> {
    if st.events.is_none() {
        return Err(off("POST /v1/events"));
    }
    let (parts, body) = req.into_parts();
    let scope = authenticate(st, &parts.headers)?;
    let body = read_body(st, body).await?;
    let raws = split(&body)?;
    let raws: Vec<&[u8]> = raws.iter().map(|r| r.get().as_bytes()).collect();
    produce_as(st, &scope, &raws).await
}

/// The 404 of a write when `serve.accept_events` is off.
pub(super) fn off(what: &str) -> ApiError {
    ApiError {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        field: None,
        message: format!("{what} is off on this server (serve.accept_events)"),
        request_id: None,
    }
}

/// Checks every one of `raws` (the JSON of an event each) with the Kafka
/// source's decoder and `scope`, then produces them all; nothing is produced
/// when one is refused. `POST /v1/events` and MCP's `remember` and `forget`.
pub(super) async fn produce_as(
    st: &AppState,
    scope: &Scope,
    raws: &[&[u8]],
) -> Result<EventsResponse, ApiError> {
    let Some(sink) = &st.events else {
        return Err(off("writing events"));
    };
    if raws.is_empty() {
        return Err(ApiError::invalid("body", "no events"));
    }
    if raws.len() > st.cfg.max_events {
        return Err(ApiError::invalid(
            "body",
            format!(
                "{} events; at most {} per request (serve.max_events)",
                raws.len(),
                st.cfg.max_events
            ),
        ));
    }
    // Every event is checked before any is produced.
    let mut records = Vec::with_capacity(raws.len());
    for (i, &bytes) in raws.iter().enumerate() {
        if bytes.len() > sink.max_event_bytes {
            return Err(ApiError::invalid(
                format!("events[{i}]"),
                format!(
                    "{} bytes, over kafka.max_event_bytes ({})",
                    bytes.len(),
                    sink.max_event_bytes
                ),
            ));
        }
        let now_ms = chrono::Utc::now().timestamp_millis();
        let event = decode(bytes)
            .and_then(|e| {
                e.check_not_ahead(now_ms, sink.max_future_skew_ms)?;
                Ok(e)
            })
            .map_err(|e| {
                let field = if e.field.is_empty() {
                    format!("events[{i}]")
                } else {
                    format!("events[{i}].{}", e.field)
                };
                ApiError::invalid(field, e.reason)
            })?;
        let (key, user) = key_of(&event);
        match user {
            Some(u) => authorize(st, scope, u, &format!("events[{i}].user_id"))?,
            None if *scope != Scope::All => {
                return Err(ApiError {
                    status: StatusCode::FORBIDDEN,
                    code: "forbidden",
                    field: Some(format!("events[{i}].type")),
                    message: "item and forget events need a token for every tenant (\"*\")".into(),
                    request_id: None,
                });
            }
            None => {}
        }
        records.push((key.to_owned(), event.event_id().to_owned(), bytes));
    }
    let _permit = st.admit()?;
    let deliveries = records.iter().map(|(key, _, payload)| {
        sink.producer.send(
            FutureRecord::to(&sink.topic).key(key).payload(*payload),
            sink.timeout,
        )
    });
    let failed: Vec<String> = futures::future::join_all(deliveries)
        .await
        .into_iter()
        .filter_map(|r| r.err().map(|(e, _)| e.to_string()))
        .collect();
    if let Some(first) = failed.first() {
        tracing::warn!(failed = failed.len(), error = %first, "Producing events failed.");
        return Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            code: "unavailable",
            field: None,
            message: format!(
                "the broker did not acknowledge {} of {} events; resend the request (each event_id is stored once)",
                failed.len(),
                records.len()
            ),
            request_id: None,
        });
    }
    st.metrics.events.inc_by(records.len() as u64);
    Ok(EventsResponse {
        accepted: records.len(),
        event_ids: records.into_iter().map(|(_, id, _)| id).collect(),
        topic: sink.topic.clone(),
    })
}
