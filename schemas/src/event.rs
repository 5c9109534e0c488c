//! The JSON events producers send, and their decoder.
//!
//! Decoding is two-step: the payload is parsed into a flat, borrowed
//! [`Raw`] record (unknown fields are ignored, see `docs/events.md`), then
//! [`Raw::validate`] checks the rules of the event's type and yields a typed
//! [`Event`]. Strings borrow from the payload whenever they carry no escapes.
//! The parse is `fast::parse` for the flat objects nearly every event is,
//! and serde for anything it declines; both yield the same record.

use std::borrow::Cow;
use std::fmt;

use serde::Deserialize;
use serde::de::{self, Deserializer, Visitor};
use serde_json::value::RawValue;

use crate::error::{DecodeError, DecodeErrorKind};

/// The event schema version this build reads and writes.
pub const SCHEMA_VERSION: u16 = 1;
/// The longest accepted id (`event_id`, `user_id`, `item_id`, `session_id`), in bytes.
pub const MAX_ID_BYTES: usize = 256;
/// The earliest accepted timestamp: 1970-01-01T00:00:00Z.
pub const MIN_TIMESTAMP_MS: i64 = 0;
/// The first rejected timestamp: 2200-01-01T00:00:00Z.
pub const MAX_TIMESTAMP_MS: i64 = 7_258_118_400_000;

/// The `type` of an event.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum EventType {
    /// A user clicked (viewed, rated) an item.
    Click,
    /// A user bought an item.
    Purchase,
    /// One turn of a dialogue between a user and an assistant.
    DialogueTurn,
    /// A catalog upsert.
    Item,
    /// A user's static attributes.
    Profile,
    /// A request to delete everything stored about a user.
    Forget,
}

impl EventType {
    /// Every event type.
    pub const ALL: [Self; 6] = [
        Self::Click,
        Self::Purchase,
        Self::DialogueTurn,
        Self::Item,
        Self::Profile,
        Self::Forget,
    ];

    /// The wire name, as in the `type` field.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Click => "click",
            Self::Purchase => "purchase",
            Self::DialogueTurn => "dialogue_turn",
            Self::Item => "item",
            Self::Profile => "profile",
            Self::Forget => "forget",
        }
    }

    fn parse(s: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|t| t.as_str() == s)
    }
}

/// The kind of an [`Interaction`]: the three event types stored in `interactions`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum InteractionKind {
    /// `click`
    Click,
    /// `purchase`
    Purchase,
    /// `dialogue_turn`
    DialogueTurn,
}

impl InteractionKind {
    /// The wire name, stored in the `kind` column.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Click => "click",
            Self::Purchase => "purchase",
            Self::DialogueTurn => "dialogue_turn",
        }
    }
}

/// Who spoke a dialogue turn.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// The user.
    User,
    /// The assistant (the agent).
    Assistant,
    /// A system message.
    System,
}

impl Role {
    /// The wire name.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::User => "user",
            Self::Assistant => "assistant",
            Self::System => "system",
        }
    }
}

/// A click, purchase or dialogue turn: one row of the `interactions` table.
#[derive(Debug, Clone, PartialEq)]
pub struct Interaction<'a> {
    /// Which of the three.
    pub kind: InteractionKind,
    /// Producer-assigned unique id; writes are idempotent on it.
    pub event_id: Cow<'a, str>,
    /// Event time, milliseconds since the Unix epoch (UTC).
    pub timestamp_ms: i64,
    /// The user.
    pub user_id: Cow<'a, str>,
    /// The item (required for clicks and purchases, optional for dialogue turns).
    pub item_id: Option<Cow<'a, str>>,
    /// The session (required for dialogue turns).
    pub session_id: Option<Cow<'a, str>>,
    /// Explicit feedback on a click, if any.
    pub rating: Option<f32>,
    /// Units bought (purchases; defaults to 1).
    pub quantity: Option<i32>,
    /// Unit price (purchases).
    pub price: Option<f64>,
    /// ISO 4217 currency code of `price`.
    pub currency: Option<Cow<'a, str>>,
    /// Speaker (dialogue turns).
    pub role: Option<Role>,
    /// What was said (dialogue turns).
    pub text: Option<Cow<'a, str>>,
}

/// A catalog upsert: one row of the `items` table (latest event time wins).
#[derive(Debug, Clone, PartialEq)]
pub struct ItemEvent<'a> {
    /// Producer-assigned unique id.
    pub event_id: Cow<'a, str>,
    /// Event time, ms since the epoch.
    pub timestamp_ms: i64,
    /// The item.
    pub item_id: Cow<'a, str>,
    /// Display title.
    pub title: Cow<'a, str>,
    /// Categories or genres, most general first.
    pub categories: Vec<Cow<'a, str>>,
    /// Free-text description.
    pub description: Option<Cow<'a, str>>,
    /// Any other attributes, as the JSON object text the producer sent.
    pub attributes: Option<Cow<'a, str>>,
}

/// A user's static attributes: one row of the `profiles` table (latest wins).
#[derive(Debug, Clone, PartialEq)]
pub struct ProfileEvent<'a> {
    /// Producer-assigned unique id.
    pub event_id: Cow<'a, str>,
    /// Event time, ms since the epoch.
    pub timestamp_ms: i64,
    /// The user.
    pub user_id: Cow<'a, str>,
    /// The attributes, as the JSON object text the producer sent.
    pub attributes: Option<Cow<'a, str>>,
}

/// A right-to-be-forgotten request: delete the user's interactions, profile,
/// memories and links (events of the user after it in the partition are
/// stored again).
#[derive(Debug, Clone, PartialEq)]
pub struct ForgetEvent<'a> {
    /// Producer-assigned unique id (echoed in the receipt).
    pub event_id: Cow<'a, str>,
    /// Event time, ms since the epoch.
    pub timestamp_ms: i64,
    /// The user to forget.
    pub user_id: Cow<'a, str>,
}

/// A decoded event.
#[derive(Debug, Clone, PartialEq)]
pub enum Event<'a> {
    /// `click`, `purchase` or `dialogue_turn`.
    Interaction(Interaction<'a>),
    /// `item`.
    Item(ItemEvent<'a>),
    /// `profile`.
    Profile(ProfileEvent<'a>),
    /// `forget`: not a row; the pipeline runs it between batches.
    Forget(ForgetEvent<'a>),
}

impl Event<'_> {
    /// The event's `event_id`.
    pub fn event_id(&self) -> &str {
        match self {
            Self::Interaction(e) => &e.event_id,
            Self::Item(e) => &e.event_id,
            Self::Profile(e) => &e.event_id,
            Self::Forget(e) => &e.event_id,
        }
    }

    /// The event's `timestamp`, ms since the epoch.
    pub fn timestamp_ms(&self) -> i64 {
        match self {
            Self::Interaction(e) => e.timestamp_ms,
            Self::Item(e) => e.timestamp_ms,
            Self::Profile(e) => e.timestamp_ms,
            Self::Forget(e) => e.timestamp_ms,
        }
    }

    /// Refuses an event stamped more than `max_skew_ms` after `now_ms`
    /// (the reader's clock): a clock gone wrong, or one pushing stream time
    /// ahead on purpose, which would age every honest event out of the
    /// sink's fast path. The decoder itself knows no clock.
    ///
    /// # Errors
    /// An `invalid_field` error on `timestamp`.
    pub fn check_not_ahead(&self, now_ms: i64, max_skew_ms: i64) -> Result<(), DecodeError> {
        let ts = self.timestamp_ms();
        if ts > now_ms.saturating_add(max_skew_ms) {
            return Err(DecodeError::invalid(
                "timestamp",
                format!(
                    "{ts} is {} s ahead of this reader's clock ({now_ms}); at most kafka.max_future_skew ({} s) is accepted",
                    (ts - now_ms) / 1000,
                    max_skew_ms / 1000
                ),
            ));
        }
        Ok(())
    }
}

/// Decodes one payload. Never panics; every error names the field and the reason.
///
/// # Errors
/// A [`DecodeError`] for invalid JSON, a missing or invalid field, an unknown
/// `type`, or an unsupported `schema_version`. (Size is checked by the caller,
/// which knows the configured limit.)
pub fn decode(payload: &[u8]) -> Result<Event<'_>, DecodeError> {
    decode_with(payload, fast::parse)
}

/// [`decode`] without its fast path: every payload through serde. The
/// fuzz target checks that both give the same result.
#[doc(hidden)]
pub fn decode_slow(payload: &[u8]) -> Result<Event<'_>, DecodeError> {
    decode_with(payload, |_| None)
}

fn decode_with<'a>(
    payload: &'a [u8],
    fast: impl FnOnce(&'a str) -> Option<Raw<'a>>,
) -> Result<Event<'a>, DecodeError> {
    // serde would also accept a JSON array as a struct; events are objects.
    if payload.iter().find(|b| !b.is_ascii_whitespace()) != Some(&b'{') {
        return Err(DecodeError::new(
            DecodeErrorKind::InvalidJson,
            "",
            "expected a JSON object",
        ));
    }
    // One UTF-8 check of the whole payload (a word-at-a-time ASCII scan for
    // the usual event) instead of one per string: `from_str` trusts it, where
    // `from_slice` would re-validate every string it reads.
    let text = std::str::from_utf8(payload).map_err(|e| {
        DecodeError::new(
            DecodeErrorKind::InvalidJson,
            "",
            format!(
                "invalid UTF-8 at byte {} (events are UTF-8 JSON)",
                e.valid_up_to()
            ),
        )
    })?;
    if let Some(raw) = fast(text) {
        return raw.validate();
    }
    match serde_json::from_str::<Raw<'_>>(text) {
        Ok(raw) => raw.validate(),
        Err(err) => Err(describe_parse_error(text, &err)),
    }
}

/// Re-parses a failed payload with path tracking, to name the field at fault.
/// Only runs on the error path, so the fast path pays nothing for it.
fn describe_parse_error(payload: &str, err: &serde_json::Error) -> DecodeError {
    use serde_json::error::Category;
    if !matches!(err.classify(), Category::Data) {
        return DecodeError::new(DecodeErrorKind::InvalidJson, "", err.to_string());
    }
    let mut de = serde_json::Deserializer::from_str(payload);
    match serde_path_to_error::deserialize::<_, Raw<'_>>(&mut de) {
        Err(e) => {
            let path = e.path().to_string();
            let message = e.inner().to_string();
            if let Some(dup) = message
                .strip_prefix("duplicate field `")
                .and_then(|r| r.split('`').next())
            {
                DecodeError::invalid(dup, message.clone())
            } else if path == "." {
                DecodeError::new(
                    DecodeErrorKind::InvalidJson,
                    "",
                    format!("expected a JSON object: {}", e.inner()),
                )
            } else {
                DecodeError::invalid(&path, e.inner().to_string())
            }
        }
        // Cannot happen (the same input failed above); report the first error.
        Ok(_) => DecodeError::new(DecodeErrorKind::InvalidField, "", err.to_string()),
    }
}

/// A string that borrows from the payload when it has no escapes.
#[derive(Debug)]
struct Str<'a>(Cow<'a, str>);

impl<'de: 'a, 'a> Deserialize<'de> for Str<'a> {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Str<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a string")
            }
            fn visit_borrowed_str<E: de::Error>(self, v: &'de str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Borrowed(v)))
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v.to_owned())))
            }
            fn visit_string<E: de::Error>(self, v: String) -> Result<Self::Value, E> {
                Ok(Str(Cow::Owned(v)))
            }
        }
        d.deserialize_str(V)
    }
}

/// A timestamp: integer milliseconds since the epoch, or an RFC 3339 string.
#[derive(Debug, Clone, Copy)]
struct Timestamp(Result<i64, &'static str>);

impl<'de> Deserialize<'de> for Timestamp {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl Visitor<'_> for V {
            type Value = Timestamp;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("integer milliseconds since the Unix epoch or an RFC 3339 string")
            }
            fn visit_i64<E: de::Error>(self, v: i64) -> Result<Self::Value, E> {
                Ok(Timestamp(Ok(v)))
            }
            fn visit_u64<E: de::Error>(self, v: u64) -> Result<Self::Value, E> {
                Ok(Timestamp(i64::try_from(v).map_err(|_| "out of range")))
            }
            fn visit_f64<E: de::Error>(self, v: f64) -> Result<Self::Value, E> {
                if v.fract() == 0.0 && v.abs() < 9.0e15 {
                    #[allow(clippy::cast_possible_truncation)]
                    Ok(Timestamp(Ok(v as i64)))
                } else {
                    Ok(Timestamp(Err("must be an integer number of milliseconds")))
                }
            }
            fn visit_str<E: de::Error>(self, v: &str) -> Result<Self::Value, E> {
                Ok(Timestamp(rfc3339_ms(v)))
            }
        }
        d.deserialize_any(V)
    }
}

/// An RFC 3339 timestamp string in ms since the epoch.
fn rfc3339_ms(v: &str) -> Result<i64, &'static str> {
    chrono::DateTime::parse_from_rfc3339(v)
        .map(|t| t.timestamp_millis())
        .map_err(|_| "not an RFC 3339 date-time (e.g. 2026-11-30T12:00:00Z)")
}

/// Every field any event type may carry; validated per type afterwards.
#[derive(Debug, Default, Deserialize)]
struct Raw<'a> {
    #[serde(rename = "type", borrow, default)]
    kind: Option<Str<'a>>,
    #[serde(default)]
    schema_version: Option<u64>,
    #[serde(borrow, default)]
    event_id: Option<Str<'a>>,
    #[serde(default)]
    timestamp: Option<Timestamp>,
    #[serde(borrow, default)]
    user_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    item_id: Option<Str<'a>>,
    #[serde(borrow, default)]
    session_id: Option<Str<'a>>,
    #[serde(default)]
    rating: Option<f64>,
    #[serde(default)]
    quantity: Option<i64>,
    #[serde(default)]
    price: Option<f64>,
    #[serde(borrow, default)]
    currency: Option<Str<'a>>,
    #[serde(borrow, default)]
    role: Option<Str<'a>>,
    #[serde(borrow, default)]
    text: Option<Str<'a>>,
    #[serde(borrow, default)]
    title: Option<Str<'a>>,
    #[serde(borrow, default)]
    description: Option<Str<'a>>,
    #[serde(borrow, default)]
    categories: Option<Vec<Str<'a>>>,
    #[serde(borrow, default)]
    attributes: Option<&'a RawValue>,
}

fn id<'a>(field: &str, v: Option<Str<'a>>) -> Result<Cow<'a, str>, DecodeError> {
    let v = v.ok_or_else(|| DecodeError::missing(field))?.0;
    check_id(field, v)
}

fn opt_id<'a>(field: &str, v: Option<Str<'a>>) -> Result<Option<Cow<'a, str>>, DecodeError> {
    v.map(|s| check_id(field, s.0)).transpose()
}

fn check_id<'a>(field: &str, v: Cow<'a, str>) -> Result<Cow<'a, str>, DecodeError> {
    if v.is_empty() {
        return Err(DecodeError::invalid(field, "must not be empty"));
    }
    if v.len() > MAX_ID_BYTES {
        return Err(DecodeError::invalid(
            field,
            format!("is {} bytes, longer than {MAX_ID_BYTES}", v.len()),
        ));
    }
    if has_control(&v) {
        return Err(DecodeError::invalid(
            field,
            "must not contain control characters",
        ));
    }
    Ok(v)
}

/// Whether `s` holds a control character (`char::is_control`: U+0000 –
/// U+001F and U+007F – U+009F), by a scan of its bytes: in UTF-8 the
/// first range is those bytes themselves and the second is 0xC2 followed
/// by 0x80 – 0x9F, and neither byte pattern occurs inside another character.
fn has_control(s: &str) -> bool {
    let b = s.as_bytes();
    // Most ids are printable ASCII (0x20 – 0x7e): one pass without an early
    // exit, which the compiler vectorises.
    if !b
        .iter()
        .fold(false, |odd, &c| odd | (c.wrapping_sub(0x20) >= 0x5f))
    {
        return false;
    }
    b.iter().enumerate().any(|(i, &c)| {
        c < 0x20
            || c == 0x7f
            || (c == 0xc2 && b.get(i + 1).is_some_and(|n| (0x80..=0x9f).contains(n)))
    })
}

fn non_empty<'a>(field: &str, v: Option<Str<'a>>) -> Result<Cow<'a, str>, DecodeError> {
    let v = v.ok_or_else(|| DecodeError::missing(field))?.0;
    if v.trim().is_empty() {
        return Err(DecodeError::invalid(field, "must not be empty"));
    }
    Ok(v)
}

fn json_object<'a>(
    field: &str,
    v: Option<&'a RawValue>,
) -> Result<Option<Cow<'a, str>>, DecodeError> {
    match v {
        None => Ok(None),
        Some(raw) if raw.get() == "null" => Ok(None),
        Some(raw) if raw.get().starts_with('{') => Ok(Some(Cow::Borrowed(raw.get()))),
        Some(_) => Err(DecodeError::invalid(field, "must be a JSON object")),
    }
}

impl<'a> Raw<'a> {
    fn validate(self) -> Result<Event<'a>, DecodeError> {
        let kind = self.kind.ok_or_else(|| DecodeError::missing("type"))?.0;
        let ty = EventType::parse(&kind).ok_or_else(|| {
            DecodeError::new(
                DecodeErrorKind::UnknownType,
                "type",
                format!(
                    "unknown event type {kind:?} (expected one of click, purchase, dialogue_turn, item, profile, forget)"
                ),
            )
        })?;
        match self.schema_version {
            None => return Err(DecodeError::missing("schema_version")),
            Some(v) if v == u64::from(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err(DecodeError::new(
                    DecodeErrorKind::UnsupportedVersion,
                    "schema_version",
                    format!("version {v} is not supported (this build reads {SCHEMA_VERSION})"),
                ));
            }
        }
        let event_id = id("event_id", self.event_id)?;
        let timestamp_ms = match self.timestamp {
            None => return Err(DecodeError::missing("timestamp")),
            Some(Timestamp(Err(reason))) => return Err(DecodeError::invalid("timestamp", reason)),
            Some(Timestamp(Ok(ms))) if !(MIN_TIMESTAMP_MS..MAX_TIMESTAMP_MS).contains(&ms) => {
                return Err(DecodeError::invalid(
                    "timestamp",
                    format!("{ms} ms is outside 1970-01-01 .. 2200-01-01"),
                ));
            }
            Some(Timestamp(Ok(ms))) => ms,
        };
        let interaction = |kind| -> Result<Interaction<'a>, DecodeError> {
            Ok(Interaction {
                kind,
                event_id: event_id.clone(),
                timestamp_ms,
                user_id: Cow::Borrowed(""),
                item_id: None,
                session_id: None,
                rating: None,
                quantity: None,
                price: None,
                currency: None,
                role: None,
                text: None,
            })
        };
        let event = match ty {
            EventType::Click => {
                let rating = match self.rating {
                    // serde_json never yields NaN or infinities, but a value
                    // beyond f32's range would become one.
                    Some(r) if !(r.is_finite() && r.abs() <= 1e30) => {
                        return Err(DecodeError::invalid("rating", "must be a finite number"));
                    }
                    #[allow(clippy::cast_possible_truncation)]
                    r => r.map(|r| r as f32),
                };
                Event::Interaction(Interaction {
                    user_id: id("user_id", self.user_id)?,
                    item_id: Some(id("item_id", self.item_id)?),
                    session_id: opt_id("session_id", self.session_id)?,
                    rating,
                    ..interaction(InteractionKind::Click)?
                })
            }
            EventType::Purchase => {
                let quantity = match self.quantity {
                    None => 1,
                    Some(q) if (1..=1_000_000).contains(&q) => i32::try_from(q)
                        .map_err(|_| DecodeError::invalid("quantity", "out of range"))?,
                    Some(q) => {
                        return Err(DecodeError::invalid(
                            "quantity",
                            format!("{q} is outside 1 ..= 1000000"),
                        ));
                    }
                };
                if let Some(p) = self.price
                    && !(p.is_finite() && p >= 0.0)
                {
                    return Err(DecodeError::invalid(
                        "price",
                        "must be a finite number >= 0",
                    ));
                }
                let currency = match self.currency {
                    None => None,
                    Some(Str(c)) if c.len() == 3 && c.bytes().all(|b| b.is_ascii_uppercase()) => {
                        Some(c)
                    }
                    Some(Str(c)) => {
                        return Err(DecodeError::invalid(
                            "currency",
                            format!("{c:?} is not a three-letter ISO 4217 code such as \"EUR\""),
                        ));
                    }
                };
                Event::Interaction(Interaction {
                    user_id: id("user_id", self.user_id)?,
                    item_id: Some(id("item_id", self.item_id)?),
                    session_id: opt_id("session_id", self.session_id)?,
                    quantity: Some(quantity),
                    price: self.price,
                    currency,
                    ..interaction(InteractionKind::Purchase)?
                })
            }
            EventType::DialogueTurn => {
                let role = match self.role.as_ref().map(|r| r.0.as_ref()) {
                    None => return Err(DecodeError::missing("role")),
                    Some("user") => Role::User,
                    Some("assistant") => Role::Assistant,
                    Some("system") => Role::System,
                    Some(other) => {
                        return Err(DecodeError::invalid(
                            "role",
                            format!("{other:?} is not one of user, assistant, system"),
                        ));
                    }
                };
                Event::Interaction(Interaction {
                    user_id: id("user_id", self.user_id)?,
                    session_id: Some(id("session_id", self.session_id)?),
                    item_id: opt_id("item_id", self.item_id)?,
                    role: Some(role),
                    text: Some(non_empty("text", self.text)?),
                    ..interaction(InteractionKind::DialogueTurn)?
                })
            }
            EventType::Item => {
                let categories = self
                    .categories
                    .unwrap_or_default()
                    .into_iter()
                    .enumerate()
                    .map(|(i, c)| {
                        if c.0.trim().is_empty() {
                            Err(DecodeError::invalid(
                                &format!("categories[{i}]"),
                                "must not be empty",
                            ))
                        } else {
                            Ok(c.0)
                        }
                    })
                    .collect::<Result<Vec<_>, _>>()?;
                Event::Item(ItemEvent {
                    event_id,
                    timestamp_ms,
                    item_id: id("item_id", self.item_id)?,
                    title: non_empty("title", self.title)?,
                    categories,
                    description: self.description.map(|d| d.0),
                    attributes: json_object("attributes", self.attributes)?,
                })
            }
            EventType::Profile => Event::Profile(ProfileEvent {
                event_id,
                timestamp_ms,
                user_id: id("user_id", self.user_id)?,
                attributes: json_object("attributes", self.attributes)?,
            }),
            EventType::Forget => Event::Forget(ForgetEvent {
                event_id,
                timestamp_ms,
                user_id: id("user_id", self.user_id)?,
            }),
        };
        Ok(event)
    }
}

mod fast;
#[cfg(test)]
mod tests;
