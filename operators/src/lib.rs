//! Streaming operators for steamrf.
//!
//! - [`embed`]: text embeddings (all-MiniLM-L6-v2 in process, or an
//!   OpenAI-compatible endpoint).
//! - [`steam`]: the STEAM write path (memory formation and consolidation,
//!   relation extraction, incremental communities, prototypes) as batch
//!   operators over in-memory state.
//! - [`rfmem`]: the RF-Mem read path (familiarity probe, gate, top-k or
//!   recollection) over one user's vectors.
//! - [`passage`]: long rows as windows of turns, and hybrid retrieval
//!   (RF-Mem over the windows, pooled to rows, fused with [`lexical`] BM25).
//! - [`fuse`]: several rankers as one weighted sum of standardised scores,
//!   the weights fitted on a validation split.
//! - [`rank`]: the recommendation ranker of `eval steam` and
//!   `/v1/recommend`: STEAM's score fused with item-CF, BM25 and popularity.
//!
//! It holds the micro-batching policy shared by every stage
//! ([`batch::BatchPolicy`], [`batch::BatchTracker`]): a batch is flushed when
//! it reaches `max_rows`, `max_bytes`, or has been open for `linger`.
//! The STEAM write-path operators (formation, consolidation, communities)
//! will live here too; per the architecture invariant this crate never depends
//! on rdkafka, lancedb or axum.

#![deny(missing_docs)]

pub mod batch;
pub mod embed;
pub mod fuse;
mod http;
pub mod lexical;
pub mod llm;
pub mod passage;
pub mod rank;
pub mod rfmem;
pub mod steam;
