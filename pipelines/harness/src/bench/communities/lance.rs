//! `steamrf bench communities --lancedb`: relation extraction by LanceDB's
//! own vector indexes (IVF_PQ, IVF_HNSW_SQ) on the same memories, beside
//! the writer's in-memory IVF, so the choice of a maintained index over the
//! hand-written one is measured (issue 47).
//!
//! The memories are written to a LanceDB table without the last measured
//! batch, the index is built, then the batch arrives as a writer would see
//! it: appended, the index updated (`optimize`, no retraining), and one
//! query per changed memory (LanceDB searches one vector per query). A
//! query asks for `k1 + OVERFETCH` rows, of which the other users' rows at
//! cosine ≥ τ are the links (LanceDB has no per-query "not this user"
//! filter short of a prefilter on every query). IVF_PQ probes the writer's
//! `--probes` lists of `sqrt(n)` and refines 4× its candidates with exact
//! distances (as the writer rescores `k1 × 4` int8 candidates); IVF_HNSW_SQ
//! runs with LanceDB's defaults. Link recall is against the exact writer's
//! links for the same batch.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Instant;

use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, StringBuilder, UInt64Builder};
use arrow_array::{Array, Float32Array, RecordBatch, StringArray, UInt64Array};
use arrow_schema::{DataType, Field, Schema};
use futures::TryStreamExt;
use lancedb::index::Index;
use lancedb::index::vector::{IvfHnswSqIndexBuilder, IvfPqIndexBuilder};
use lancedb::query::{ExecutableQuery, QueryBase};
use steamrf_operators::steam::relations::Link;
use steamrf_operators::steam::{MemoryId, SteamState};
use steamrf_pipelines::error::{Error, Result};

/// Rows asked for beyond k1, to make room for the querying user's own.
const OVERFETCH: usize = 8;

/// What one LanceDB index did with the batch.
pub(super) struct Measured {
    pub kind: &'static str,
    pub build_s: f64,
    pub update_ms: f64,
    pub query_ms: f64,
    pub recall: f64,
}

/// Runs the comparison on `state` (one writer's, `dim`-dimensional
/// memories), `batch` being the last measured batch's memories and `exact`
/// the exact writer's links for it.
pub(super) fn compare(
    state: &SteamState,
    dim: usize,
    batch: &[MemoryId],
    exact: &[Link],
    probes: usize,
) -> Result<Vec<Measured>> {
    let handle = tokio::runtime::Handle::current();
    handle.block_on(run(state, dim, batch, exact, probes))
}

/// The state's memories as table rows (id = position in `ids`).
struct Rows {
    ids: Vec<MemoryId>,
    users: Vec<String>,
    vectors: Vec<f32>,
}

fn rows(state: &SteamState, dim: usize) -> Rows {
    let mut r = Rows {
        ids: Vec::new(),
        users: Vec::new(),
        vectors: Vec::new(),
    };
    for u in state.user_ids() {
        for m in state.user(u).map(|x| x.memories.as_slice()).unwrap_or(&[]) {
            if let Some(e) = state.embedding(m.id).filter(|e| e.len() == dim) {
                r.ids.push(m.id);
                r.users.push(m.user_id.clone());
                r.vectors.extend_from_slice(&e);
            }
        }
    }
    r
}

fn schema(dim: usize) -> Arc<Schema> {
    Arc::new(Schema::new(vec![
        Field::new("id", DataType::UInt64, false),
        Field::new("user_id", DataType::Utf8, false),
        super::super::vector_field(dim),
    ]))
}

fn batch_of(r: &Rows, which: &[usize], dim: usize) -> Result<RecordBatch> {
    let mut ids = UInt64Builder::new();
    let mut users = StringBuilder::new();
    let mut vecs = FixedSizeListBuilder::new(Float32Builder::new(), dim as i32)
        .with_field(Arc::new(Field::new("item", DataType::Float32, true)));
    for &i in which {
        ids.append_value(i as u64);
        users.append_value(&r.users[i]);
        vecs.values()
            .append_slice(&r.vectors[i * dim..(i + 1) * dim]);
        vecs.append(true);
    }
    RecordBatch::try_new(
        schema(dim),
        vec![
            Arc::new(ids.finish()),
            Arc::new(users.finish()),
            Arc::new(vecs.finish()),
        ],
    )
    .map_err(Error::Arrow)
}

async fn run(
    state: &SteamState,
    dim: usize,
    batch: &[MemoryId],
    exact: &[Link],
    probes: usize,
) -> Result<Vec<Measured>> {
    let params = *state.params();
    let r = rows(state, dim);
    let in_batch: HashSet<MemoryId> = batch.iter().copied().collect();
    let (mut before, mut arriving) = (Vec::new(), Vec::new());
    for (i, id) in r.ids.iter().enumerate() {
        if in_batch.contains(id) {
            arriving.push(i);
        } else {
            before.push(i);
        }
    }
    let want: HashSet<(MemoryId, MemoryId)> = exact
        .iter()
        .filter(|l| in_batch.contains(&l.from))
        .map(|l| (l.from, l.to))
        .collect();
    let lists = (r.ids.len() as f64).sqrt().round().max(1.0) as u32;
    let kinds: [(&'static str, Index); 2] = [
        (
            "ivf_pq",
            Index::IvfPq(
                IvfPqIndexBuilder::default()
                    .distance_type(lancedb::DistanceType::Cosine)
                    .num_partitions(lists),
            ),
        ),
        (
            "ivf_hnsw_sq",
            Index::IvfHnswSq(
                IvfHnswSqIndexBuilder::default().distance_type(lancedb::DistanceType::Cosine),
            ),
        ),
    ];
    let mut out = Vec::new();
    for (kind, index) in kinds {
        let dir = super::super::temp_dir()?;
        let db = lancedb::connect(dir.path().to_str().unwrap_or("."))
            .execute()
            .await
            .map_err(Error::lance("connecting"))?;
        let table = db
            .create_empty_table("memories", schema(dim))
            .execute()
            .await
            .map_err(Error::lance("creating the bench table"))?;
        for chunk in before.chunks(100_000) {
            super::super::add(&table, batch_of(&r, chunk, dim)?)
                .await
                .map_err(Error::lance("writing the bench table"))?;
        }
        let t = Instant::now();
        table
            .create_index(&["vector"], index)
            .execute()
            .await
            .map_err(Error::lance("building the vector index"))?;
        let build_s = t.elapsed().as_secs_f64();
        // The batch arrives: appended, then added to the index.
        let t = Instant::now();
        super::super::add(&table, batch_of(&r, &arriving, dim)?)
            .await
            .map_err(Error::lance("appending the batch"))?;
        table
            .optimize(lancedb::table::OptimizeAction::Index(Default::default()))
            .await
            .map_err(Error::lance("updating the index"))?;
        let update_ms = t.elapsed().as_secs_f64() * 1e3;
        let t = Instant::now();
        let mut found = 0usize;
        for &i in &arriving {
            let v = &r.vectors[i * dim..(i + 1) * dim];
            let mut q = table
                .query()
                .nearest_to(v)
                .map_err(Error::lance("query"))?
                .distance_type(lancedb::DistanceType::Cosine)
                .limit(params.k1 + OVERFETCH);
            if kind == "ivf_pq" {
                // The writer's probes, and PQ's candidates rescored exactly
                // (4x, as `steam.rescore`), so cosines and τ are exact.
                q = q
                    .nprobes(probes)
                    .map_err(Error::lance("query"))?
                    .refine_factor(4);
            }
            let hits: Vec<RecordBatch> = q
                .execute()
                .await
                .map_err(Error::lance("query"))?
                .try_collect()
                .await
                .map_err(Error::lance("query"))?;
            let mut links: Vec<(f32, MemoryId)> = Vec::new();
            for b in &hits {
                let col = |name: &str| b.column_by_name(name).cloned();
                let (Some(ids), Some(users), Some(dist)) =
                    (col("id"), col("user_id"), col("_distance"))
                else {
                    continue;
                };
                let ids = ids.as_any().downcast_ref::<UInt64Array>();
                let users = users.as_any().downcast_ref::<StringArray>();
                let dist = dist.as_any().downcast_ref::<Float32Array>();
                let (Some(ids), Some(users), Some(dist)) = (ids, users, dist) else {
                    continue;
                };
                for j in 0..ids.len() {
                    let cos = 1.0 - dist.value(j);
                    if users.value(j) != r.users[i] && cos >= params.link_tau {
                        links.push((cos, r.ids[ids.value(j) as usize]));
                    }
                }
            }
            links.sort_by(|a, b| b.0.total_cmp(&a.0));
            found += links
                .iter()
                .take(params.k1)
                .filter(|(_, to)| want.contains(&(r.ids[i], *to)))
                .count();
        }
        let query_ms = t.elapsed().as_secs_f64() * 1e3;
        out.push(Measured {
            kind,
            build_s,
            update_ms,
            query_ms,
            recall: found as f64 / want.len().max(1) as f64,
        });
    }
    Ok(out)
}
