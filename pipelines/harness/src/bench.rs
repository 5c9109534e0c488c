//! `steamrf bench …`: each benchmark measures steamrf beside a reference
//! measured in the same run (kcat's consume rate, numpy's matmul,
//! sentence-transformers, exact search) and ends with one `RESULT key=value
//! …` line. One module per benchmark; this one holds what they share
//! (resident memory, percentiles, synthetic vectors, temp dirs).

use steamrf_pipelines::error::{Error, Result};

mod communities;
mod decode;
mod embedding;
mod hammer;
mod index;
mod ingest;
mod latency;
mod produce;
mod retrieve;
mod serve;
mod similarity;
mod soak;
mod texts;

pub use communities::{CommunitiesBench, communities, int8_scoring};
pub use decode::{DecodeBench, decode_bench};
pub use embedding::{EmbedBench, embed, embed_file};
pub use hammer::{HammerBench, hammer};
pub use index::{IndexBench, index};
pub use ingest::IngestBench;
pub use produce::{
    PROFILE, bench_event, bench_event_mixed, bench_is_turn, bench_turn_text, produce_events,
    result_fields,
};
pub use retrieve::{RetrieveBench, retrieve};
pub use serve::{ServeBench, serve};
pub use similarity::{SimilarityBench, similarity};
pub use soak::{SoakBench, soak};
pub use texts::bench_texts;

/// `steamrf bench ingest`: runs the benchmark and returns the output lines,
/// the last one being the `RESULT` line: the throughput against kcat, or,
/// with `rate`, the end-to-end latency at that rate.
///
/// # Errors
/// Invalid options, broker, kcat or pipeline failures.
pub async fn ingest(b: IngestBench) -> Result<Vec<String>> {
    let (topic, distinct) = ingest::prepare(&b).await?;
    if b.rate > 0 {
        latency::ingest_latency(b, topic, distinct).await
    } else {
        ingest::throughput(b, topic, distinct).await
    }
}

/// Restarts the kernel's peak-RSS mark (`VmHWM`) at the current RSS
/// (Linux: `echo 5 > /proc/self/clear_refs`); without it `VmHWM` keeps the
/// process's peak since start.
fn reset_peak_rss() {
    if let Err(e) = std::fs::write("/proc/self/clear_refs", "5") {
        tracing::warn!(error = %e, "Cannot reset the peak RSS; the reported peak includes start-up.");
    }
}

/// A memory line of /proc/self/status (`VmRSS:`, `VmHWM:`), in bytes.
fn rss_bytes(field: &str) -> u64 {
    proc_status_bytes("self", field)
}

/// A memory line of `/proc/<pid>/status` (`pid` may be `self`), in bytes.
fn proc_status_bytes(pid: &str, field: &str) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with(field))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

/// The `vector` column of the benches' LanceDB tables: `dim` f32 values.
fn vector_field(dim: usize) -> arrow_schema::Field {
    use arrow_schema::{DataType, Field};
    Field::new(
        "vector",
        DataType::FixedSizeList(
            std::sync::Arc::new(Field::new("item", DataType::Float32, true)),
            dim as i32,
        ),
        false,
    )
}

/// A temporary directory for a benchmark's tables, removed on drop.
fn temp_dir() -> Result<tempfile::TempDir> {
    tempfile::tempdir().map_err(|source| Error::Io {
        context: "creating a temp dir".into(),
        source,
    })
}

/// The `p` quantile of sorted `sorted` (nearest rank); NaN when empty.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() as f64 - 1.0) * p).round() as usize]
}

/// Appends `batch` to `table` as it is (a bench's rows are new: no
/// idempotency check), in one commit.
async fn add(table: &lancedb::Table, batch: arrow_array::RecordBatch) -> lancedb::Result<()> {
    let schema = batch.schema();
    table
        .add(
            Box::new(arrow_array::RecordBatchIterator::new([Ok(batch)], schema))
                as Box<dyn arrow_array::RecordBatchReader + Send>,
        )
        .execute()
        .await
        .map(drop)
}

/// A benchmark's own failure, as an internal error.
fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

/// Clustered synthetic memories: `topics` unit centres; each memory is its
/// topic's centre plus Gaussian noise of norm ~0.7, so members of a topic
/// have cosine ~0.67 with each other (links above τ = 0.5) and ~0 across topics.
struct Synth {
    rng: rand::rngs::StdRng,
    centres: Vec<f32>,
    dim: usize,
    /// Embedded real texts (`--texts`): memories mix them instead.
    texts: Option<Vec<f32>>,
}

/// Consecutive texts a memory of real texts mixes (a conversation's
/// neighbouring turns: one topic of one dialogue).
const TEXT_WINDOW: usize = 16;

impl Synth {
    fn new(topics: usize, dim: usize) -> Self {
        use rand::SeedableRng;
        let mut s = Self {
            rng: rand::rngs::StdRng::seed_from_u64(11),
            centres: Vec::with_capacity(topics * dim),
            dim,
            texts: None,
        };
        for _ in 0..topics {
            let mut c: Vec<f32> = (0..dim).map(|_| s.gauss()).collect();
            steamrf_operators::embed::normalize(&mut c);
            s.centres.extend(c);
        }
        s
    }

    fn gauss(&mut self) -> f32 {
        use rand::Rng;
        // Box-Muller.
        let u1: f32 = self.rng.random_range(f32::EPSILON..1.0);
        let u2: f32 = self.rng.random_range(0.0..1.0);
        (-2.0 * u1.ln()).sqrt() * (std::f32::consts::TAU * u2).cos()
    }

    /// Memories from embedded real texts (one per `dim` values, in their
    /// file order): see [`Synth::text_memory`].
    fn from_texts(vectors: Vec<f32>, dim: usize) -> Self {
        let mut s = Self::new(0, dim);
        s.texts = Some(vectors);
        s
    }

    /// Texts, or 0 for topic centres.
    fn text_count(&self) -> usize {
        self.texts.as_ref().map_or(0, |t| t.len() / self.dim)
    }

    /// A memory of real texts: the normalised mean of 1–3 texts from one
    /// window of [`TEXT_WINDOW`] consecutive texts, with a little noise
    /// (cosine ~0.96 to the mean) so that no two memories are equal. Returns
    /// it with its window (the memory's "topic").
    fn text_memory(&mut self) -> (Vec<f32>, usize) {
        use rand::Rng;
        let n = self.text_count();
        let start = self
            .rng
            .random_range(0..n.saturating_sub(TEXT_WINDOW).max(1));
        let parts = self.rng.random_range(1..=3);
        let mut v = vec![0.0f32; self.dim];
        for _ in 0..parts {
            let t = (start + self.rng.random_range(0..TEXT_WINDOW)).min(n - 1);
            let Some(texts) = &self.texts else { break };
            for (x, y) in v.iter_mut().zip(&texts[t * self.dim..(t + 1) * self.dim]) {
                *x += y;
            }
        }
        steamrf_operators::embed::normalize(&mut v);
        let scale = 0.3 / (self.dim as f32).sqrt();
        for x in &mut v {
            *x += self.gauss() * scale;
        }
        steamrf_operators::embed::normalize(&mut v);
        (v, start / TEXT_WINDOW)
    }

    fn memory(&mut self, topic: usize) -> Vec<f32> {
        let scale = (0.5f32 / self.dim as f32).sqrt();
        let mut v: Vec<f32> = self.centres[topic * self.dim..(topic + 1) * self.dim].to_vec();
        for x in &mut v {
            *x += self.gauss() * scale;
        }
        steamrf_operators::embed::normalize(&mut v);
        v
    }
}
