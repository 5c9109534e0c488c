//! Event types, decoding and Arrow schemas for steamrf.
//!
//! Producers send JSON events (see `docs/events.md`). [`decode`] turns one
//! Kafka payload into an [`Event`] or a [`DecodeError`] that names the field
//! and the reason; it never panics. [`tables`] holds the Arrow schemas of the
//! LanceDB tables and of every event type, and [`TableBuilders`] appends
//! decoded events into Arrow `RecordBatch`es for those tables. [`api`] parses
//! the retrieval service's request bodies the same way.

#![deny(missing_docs)]

pub mod api;
mod error;
mod event;
pub mod memory;
pub mod tables;
pub mod tenancy;

pub use error::{DecodeError, DecodeErrorKind};
#[doc(hidden)]
pub use event::decode_slow;
pub use event::{
    Event, EventType, ForgetEvent, Interaction, InteractionKind, ItemEvent, MAX_ID_BYTES,
    MAX_TIMESTAMP_MS, MIN_TIMESTAMP_MS, ProfileEvent, Role, SCHEMA_VERSION, decode,
};
pub use tables::{Provenance, TableBatches, TableBuilders, TableName};
