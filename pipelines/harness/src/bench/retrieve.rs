//! `steamrf bench retrieve`: RF-Mem latency for one user with N memories,
//! per path and per store, excluding the query embedding.
//!
//! Memories are clustered synthetic unit vectors (see `Synth`). Half the
//! queries are near a memory (familiar), half are random directions
//! (unfamiliar), so the adaptive gate takes both paths. Stores measured in
//! the same run:
//! - `exact`: the flat f32 scan the service uses below `serve.ivf_min_rows`
//!   (one thread per request, as served);
//! - `int8`: the same scan scored in int8 with exact f32 rescoring, what the
//!   service uses from 8,192 rows on a CPU with AVX-512 VNNI
//!   (`serve.cpu_precision = "auto"`; its recall@k against exact is printed);
//! - `ivf`: the in-memory IVF the service uses above it (its recall@k
//!   against exact is printed);
//! - `lancedb`: the same vectors in a LanceDB table, top-k through its
//!   vector search (an IVF_PQ index above `--lancedb-index-rows`), the
//!   familiarity path only: recollection issues dozens of searches per
//!   query and is served from memory.
//!
//! The RESULT line reports, on the store the service would choose for N,
//! the familiarity path as `p50_ms`/`p99_ms`, the recollection path, and
//! RF-Mem end to end (its mix of both).

use std::sync::Arc;
use std::time::Instant;

use arrow_array::RecordBatch;
use arrow_array::builder::{FixedSizeListBuilder, Float32Builder, StringBuilder};
use arrow_schema::{DataType, Field, Schema};
use futures::TryStreamExt;
use lancedb::query::{ExecutableQuery, QueryBase};
use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::IvfParams;
use steamrf_operators::rfmem::{self, Mode, RfMemParams, VectorStore};
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::serve::cache::vector_store;

use super::{Synth, internal, percentile, rss_bytes};

/// Options of `steamrf bench retrieve`.
#[derive(Debug, Clone)]
pub struct RetrieveBench {
    /// Memories of the one user.
    pub memories: usize,
    /// Queries per measurement.
    pub queries: usize,
    /// Topics the memories are drawn around (0: memories / 100, at least 10).
    pub topics: usize,
    /// IVF lists scanned per query.
    pub probes: usize,
    /// The service's switch to IVF (serve.ivf_min_rows).
    pub ivf_min_rows: usize,
    /// Also measure LanceDB's vector search.
    pub lancedb: bool,
    /// Build an IVF_PQ index in LanceDB from this many rows.
    pub lancedb_index_rows: usize,
    /// Passage windows per row in the hybrid measurement.
    pub windows_per_row: usize,
}

struct Stats {
    p50: f64,
    p99: f64,
    mean_rounds: f64,
    recollected: usize,
    n: usize,
}

fn measure(store: &VectorStore, queries: &[Vec<f32>], p: &RfMemParams) -> Result<Stats> {
    // Warm-up: the first queries fault pages in.
    for q in queries.iter().take(5) {
        rfmem::retrieve(store, q, p).map_err(internal)?;
    }
    let mut ms = Vec::with_capacity(queries.len());
    let mut rounds = 0u64;
    let mut recollected = 0;
    for q in queries {
        let t = Instant::now();
        let a = rfmem::retrieve(store, q, p).map_err(internal)?;
        ms.push(t.elapsed().as_secs_f64() * 1e3);
        if a.path == rfmem::Path::Recollection {
            recollected += 1;
            rounds += u64::from(a.rounds);
        }
    }
    ms.sort_by(f64::total_cmp);
    Ok(Stats {
        p50: percentile(&ms, 0.5),
        p99: percentile(&ms, 0.99),
        mean_rounds: rounds as f64 / recollected.max(1) as f64,
        recollected,
        n: queries.len(),
    })
}

fn line(out: &mut Vec<String>, store: &str, path: &str, s: &Stats) {
    eprintln!("  {store} {path}: p50 {:.3} ms", s.p50);
    out.push(format!(
        "  {store:<8} {path:<13} p50 {:>8.3} ms  p99 {:>8.3} ms  p99/p50 {:>5.2}  ({} of {} recollected, {:.1} rounds)",
        s.p50,
        s.p99,
        s.p99 / s.p50.max(1e-9),
        s.recollected,
        s.n,
        s.mean_rounds
    ));
}

/// Runs the benchmark.
///
/// # Errors
/// Kernel or LanceDB failures.
pub async fn retrieve(b: RetrieveBench) -> Result<Vec<String>> {
    let dim = steamrf_schemas::tables::EMBEDDING_DIM;
    let n = b.memories.max(1);
    let topics = if b.topics == 0 {
        (n / 100).max(10)
    } else {
        b.topics
    };
    let mut out = vec![format!(
        "bench retrieve: one user, {n} memories ({topics} topics), {dim}-d, {} queries per path",
        b.queries
    )];
    let started = Instant::now();
    let (rows, queries) = tokio::task::spawn_blocking(move || {
        let mut synth = Synth::new(topics, dim);
        let mut rows = Vec::with_capacity(n * dim);
        for i in 0..n {
            rows.extend(synth.memory(i % topics));
        }
        let mut queries = Vec::with_capacity(b.queries);
        for i in 0..b.queries {
            let t = (i * 7919) % topics;
            if i % 2 == 0 {
                queries.push(synth.memory(t));
            } else {
                // A direction no topic is near: an unfamiliar query (the
                // probe's mean falls below θ_low and the gate recollects).
                let mut q: Vec<f32> = (0..dim).map(|_| synth.gauss()).collect();
                steamrf_operators::embed::normalize(&mut q);
                queries.push(q);
            }
        }
        (rows, queries)
    })
    .await
    .map_err(internal)?;
    out.push(format!(
        "  generated in {:.1} s",
        started.elapsed().as_secs_f64()
    ));
    let served_kernel = CpuKernel {
        threads: 1,
        ..CpuKernel::default()
    };
    let exact = VectorStore::flat(
        Corpus::from_vec(rows.clone(), dim).map_err(internal)?,
        served_kernel,
    );
    // The int8 scan the service uses from 8,192 rows on a CPU with VNNI
    // (`serve.cpu_precision = "auto"`), rescoring `4 · k` candidates exactly.
    let int8 = match steamrf_kernels::quant::QuantKernel::new(4) {
        Ok(mut kernel) => {
            kernel.threads = 1;
            kernel.f32_below = 0;
            Some(VectorStore::flat_int8(
                Corpus::from_vec(rows.clone(), dim).map_err(internal)?,
                kernel,
            ))
        }
        Err(_) => None,
    };
    let t = Instant::now();
    let ivf = VectorStore::ivf(
        Corpus::from_vec(rows.clone(), dim).map_err(internal)?,
        &IvfParams {
            probes: b.probes,
            ..IvfParams::default()
        },
        CpuKernel::default(),
    )
    .map_err(internal)?;
    out.push(format!(
        "  IVF built in {:.1} s ({} probes)",
        t.elapsed().as_secs_f64(),
        b.probes
    ));
    let base = RfMemParams::default();
    let modes = [
        ("familiarity", Mode::Familiarity),
        ("recollection", Mode::Recollection),
        ("rf-mem", Mode::Adaptive),
    ];
    let mut stats = Vec::new();
    let stores = [
        ("exact", Some(&exact)),
        ("int8", int8.as_ref()),
        ("ivf", Some(&ivf)),
    ];
    for (name, store) in stores.iter().filter_map(|(n, s)| s.map(|s| (*n, s))) {
        for (path, mode) in modes {
            let p = RfMemParams { mode, ..base };
            let s = measure(store, &queries, &p)?;
            line(&mut out, name, path, &s);
            stats.push((name, path, s));
        }
    }
    // Recall@k of the IVF against the exact scan, apart for familiar
    // queries (real neighbours) and unfamiliar ones (near-ties of noise).
    let k = base.k;
    let mut hit = [0usize; 2];
    for (i, q) in queries.iter().enumerate() {
        hit[i % 2] += shared_top_k(&exact, &ivf, q, k)?;
    }
    let per_kind = (queries.len() / 2).max(1) * k;
    // The int8 scan against the exact one: rows in both top-k, all queries.
    let mut int8_recall = f64::NAN;
    if let Some(store) = &int8 {
        let mut same = 0usize;
        for q in &queries {
            same += shared_top_k(&exact, store, q, k)?;
        }
        int8_recall = same as f64 / (queries.len() * k).max(1) as f64;
        out.push(format!(
            "  int8 recall@{k} vs exact: {int8_recall:.4}; its int8 copy {:.1} MiB beside {:.1} MiB of f32 rows",
            store.extra_bytes() as f64 / (1u64 << 20) as f64,
            (rows.len() * 4) as f64 / (1u64 << 20) as f64
        ));
    }
    let recall = hit[0] as f64 / per_kind as f64;
    let recall_unfamiliar = hit[1] as f64 / per_kind as f64;
    out.push(format!(
        "  ivf recall@{k} vs exact: {recall:.3} on familiar queries, {recall_unfamiliar:.3} on unfamiliar ones"
    ));
    let h = hybrid(&rows, dim, topics, &queries, b.windows_per_row)?;
    out.push(format!(
        "  passages hybrid rf-mem p50 {:>8.3} ms  p99 {:>8.3} ms  on {} windows ({})",
        h.p50, h.p99, h.store, h.note
    ));
    out.push(format!(
        "  passages hybrid exact  p50 {:>8.3} ms  p99 {:>8.3} ms  (served rows in the exact answer: {:.3} on familiar queries, {:.3} on unfamiliar ones)",
        h.exact_p50, h.exact_p99, h.recall, h.recall_unfamiliar
    ));
    let mut lance_p50 = f64::NAN;
    if b.lancedb {
        let (p50, p99, note) = lancedb_topk(&rows, dim, &queries, k, b.lancedb_index_rows).await?;
        out.push(format!(
            "  lancedb  familiarity   p50 {p50:>8.3} ms  p99 {p99:>8.3} ms  ({note})"
        ));
        lance_p50 = p50;
    }
    out.push(format!(
        "  peak RSS {:.2} GiB",
        rss_bytes("VmHWM:") as f64 / (1u64 << 30) as f64
    ));
    let served = if n >= b.ivf_min_rows {
        "ivf"
    } else if int8.is_some() && n >= steamrf_kernels::quant::INT8_MIN_ROWS {
        "int8"
    } else {
        "exact"
    };
    let get = |path: &str| {
        stats
            .iter()
            .find(|(store, p, _)| *store == served && *p == path)
            .map(|(_, _, s)| (s.p50, s.p99))
            .unwrap_or((f64::NAN, f64::NAN))
    };
    let (f50, f99) = get("familiarity");
    let (r50, r99) = get("recollection");
    let (a50, a99) = get("rf-mem");
    let exact_p50 = stats
        .iter()
        .find(|(store, p, _)| *store == "exact" && *p == "familiarity")
        .map_or(f64::NAN, |(_, _, s)| s.p50);
    out.push(format!(
        "RESULT memories={n} store={served} p50_ms={f50:.4} p99_ms={f99:.4} recollection_p50_ms={r50:.4} recollection_p99_ms={r99:.4} rfmem_p50_ms={a50:.4} rfmem_p99_ms={a99:.4} hybrid_p50_ms={:.4} hybrid_p99_ms={:.4} hybrid_store={} hybrid_recall_vs_exact={:.3} ivf_recall_at_{k}={recall:.3} exact_f32_p50_ms={exact_p50:.4} int8_recall_vs_exact={int8_recall:.4} lancedb_topk_p50_ms={lance_p50:.4}",
        h.p50, h.p99, h.store, h.recall
    ));
    Ok(out)
}

/// Rows of `b`'s top-`k` for `q` that `a`'s top-`k` has too.
fn shared_top_k(a: &VectorStore, b: &VectorStore, q: &[f32], k: usize) -> Result<usize> {
    let top = |s: &VectorStore| -> Result<Vec<u32>> {
        Ok(s.search(q, k, f32::NEG_INFINITY)
            .map_err(internal)?
            .remove(0)
            .iter()
            .map(|h| h.index)
            .collect())
    };
    let want = top(a)?;
    Ok(top(b)?.iter().filter(|i| want.contains(i)).count())
}

/// The served path over the same rows as sessions: `windows` passage
/// windows per row (near the row's vector), BM25 over a synthetic text per
/// row (60 words from a Zipf-like vocabulary of 5,000; queries of 6 words,
/// half of them from a row's text), and the service's default
/// `[serve.rfmem]`, `[serve.units]` and `serve.max_turns`, the windows
/// ranked as evidence units as the service does: (p50 ms, p99 ms, what ran).
fn hybrid(
    rows: &[f32],
    dim: usize,
    topics: usize,
    queries: &[Vec<f32>],
    windows: usize,
) -> Result<Hybrid> {
    use rand::{Rng, SeedableRng};
    use steamrf_operators::embed::SparseVec;
    use steamrf_operators::lexical::{Bm25Index, Bm25Params, SparseIndex};
    use steamrf_operators::passage::{self, PassageIndex, UnitBudget, Units};

    let n = rows.len() / dim;
    let cfg = steamrf_pipelines::config::Config::load(None)?.serve;
    let mut synth = Synth::new(topics, dim);
    let mut rng = rand::rngs::StdRng::seed_from_u64(5);
    let word = |rng: &mut rand::rngs::StdRng| {
        // Zipf-like: the rank's inverse is uniform.
        let r = (5000f64.powf(rng.random_range(0.0..1.0)) as usize).min(4999);
        format!("w{r}")
    };
    let texts: Vec<String> = (0..n)
        .map(|_| {
            (0..60)
                .map(|_| word(&mut rng))
                .collect::<Vec<_>>()
                .join(" ")
        })
        .collect();
    let mut flat = Vec::with_capacity(n * windows * dim);
    let mut owner = Vec::with_capacity(n * windows);
    for i in 0..n {
        for _ in 0..windows {
            flat.extend(synth.memory(i % topics));
            owner.push(i as u32);
        }
    }
    // As served: the windows are the evidence units, each with a third of
    // its row's words and the turns of a 3-turn window.
    let (mut spans, mut window_texts) = (Vec::new(), Vec::new());
    for t in &texts {
        let words: Vec<&str> = t.split(' ').collect();
        for j in 0..windows {
            spans.push(((j as u32).saturating_sub(2), j as u32 + 1));
            window_texts.push(
                (0..20)
                    .map(|w| words[(j * 20 + w) % words.len()])
                    .collect::<Vec<_>>()
                    .join(" "),
            );
        }
    }
    // Learned sparse vectors shaped like SPLADE-tiny's on LoCoMo turns: the
    // text's own words as terms, plus expansion terms, ~67 per window and
    // ~25 per query, over a 30,522-term vocabulary.
    let sparse_of = |text: &str, expand: usize, rng: &mut rand::rngs::StdRng| {
        let mut pairs: Vec<(u32, f32)> = text
            .split(' ')
            .map(|w| {
                let h = w.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                    (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
                });
                ((h % 30_522) as u32, rng.random_range(0.5..2.5))
            })
            .collect();
        pairs.extend((0..expand).map(|_| {
            let r = (30_522f64.powf(rng.random_range(0.0..1.0)) as u32).min(30_521);
            (r, rng.random_range(0.1..1.5))
        }));
        SparseVec::from_pairs(pairs)
    };
    let window_sparse: Vec<SparseVec> = window_texts
        .iter()
        .map(|t| sparse_of(t, 50, &mut rng))
        .collect();
    let units = || {
        Units::new(
            spans.clone(),
            Some(Bm25Index::new(&window_texts, Bm25Params::default())),
        )
        .with_sparse(SparseIndex::new(&window_sparse))
    };
    // As served: exact or IVF by `serve.ivf_min_rows` / `serve.ivf_min_windows`.
    let t = Instant::now();
    let index = PassageIndex::new(
        vector_store(&cfg, rows.to_vec(), cfg.ivf_min_rows)?,
        vector_store(&cfg, flat.clone(), cfg.ivf_min_windows)?,
        owner.clone(),
        None,
    )
    .and_then(|ix| ix.with_units(units()))
    .map_err(internal)?;
    let built = t.elapsed();
    // The exact reference: both stores scanned flat.
    let exact = PassageIndex::new(
        vector_store(&cfg, rows.to_vec(), usize::MAX)?,
        vector_store(&cfg, flat, usize::MAX)?,
        owner,
        None,
    )
    .and_then(|ix| ix.with_units(units()))
    .map_err(internal)?;
    let budget = UnitBudget {
        units: cfg.rfmem.k,
        turns: cfg.max_turns,
    };
    let qtext: Vec<String> = (0..queries.len())
        .map(|i| {
            if i % 2 == 0 {
                let words: Vec<&str> = texts[(i * 7919) % n].split(' ').collect();
                (0..6)
                    .map(|j| words[(j * 11 + i) % words.len()])
                    .collect::<Vec<_>>()
                    .join(" ")
            } else {
                (0..6).map(|_| word(&mut rng)).collect::<Vec<_>>().join(" ")
            }
        })
        .collect();
    let qsparse: Vec<SparseVec> = qtext.iter().map(|t| sparse_of(t, 20, &mut rng)).collect();
    let run = |index: &PassageIndex, i: usize| {
        passage::retrieve_units_until(
            index,
            &queries[i],
            Some(&qtext[i]),
            Some(&qsparse[i]),
            &cfg.rfmem,
            &cfg.units,
            budget,
            &|| false,
        )
        .map_err(internal)
    };
    let time = |index: &PassageIndex| -> Result<(f64, f64, usize, Vec<Vec<u32>>)> {
        for i in 0..queries.len().min(5) {
            run(index, i)?;
        }
        let mut ms = Vec::with_capacity(queries.len());
        let mut recollected = 0;
        let mut found = Vec::with_capacity(queries.len());
        for i in 0..queries.len() {
            let t = Instant::now();
            let a = run(index, i)?;
            ms.push(t.elapsed().as_secs_f64() * 1e3);
            recollected += usize::from(a.dense.path == rfmem::Path::Recollection);
            found.push(a.hits.iter().map(|h| h.row).collect());
        }
        ms.sort_by(f64::total_cmp);
        Ok((
            percentile(&ms, 0.5),
            percentile(&ms, 0.99),
            recollected,
            found,
        ))
    };
    let (p50, p99, recollected, served_rows) = time(&index)?;
    let (e50, e99, _, exact_rows) = time(&exact)?;
    // Rows the served answer shares with the exact one, on familiar (even)
    // and unfamiliar (odd) queries.
    let (mut shared, mut total) = ([0usize; 2], [0usize; 2]);
    for (i, (s, e)) in served_rows.iter().zip(&exact_rows).enumerate() {
        shared[i % 2] += s.iter().filter(|r| e.contains(r)).count();
        total[i % 2] += e.len();
    }
    let recall = |i: usize| shared[i] as f64 / total[i].max(1) as f64;
    Ok(Hybrid {
        p50,
        p99,
        exact_p50: e50,
        exact_p99: e99,
        store: if index.is_approximate() {
            "ivf"
        } else {
            "exact"
        },
        recall: recall(0),
        recall_unfamiliar: recall(1),
        note: format!(
            "{n} rows, {} windows as evidence units, BM25 over their 20-word texts and synthetic SPLADE-shaped sparse vectors (~67 terms), index built in {:.0} ms; {recollected} of {} recollected",
            index.windows(),
            built.as_secs_f64() * 1e3,
            queries.len()
        ),
    })
}

/// What [`hybrid`] measured.
struct Hybrid {
    /// On the stores the service would choose.
    p50: f64,
    p99: f64,
    /// On exact (flat) stores.
    exact_p50: f64,
    exact_p99: f64,
    /// `ivf` when either store is approximate.
    store: &'static str,
    /// Served rows that are in the exact answer, on familiar queries.
    recall: f64,
    /// The same on unfamiliar ones (random directions: near-ties of noise).
    recall_unfamiliar: f64,
    note: String,
}

/// LanceDB's vector search over the same rows: (p50 ms, p99 ms, what ran).
async fn lancedb_topk(
    rows: &[f32],
    dim: usize,
    queries: &[Vec<f32>],
    k: usize,
    index_rows: usize,
) -> Result<(f64, f64, String)> {
    let dir = super::temp_dir()?;
    let db = lancedb::connect(dir.path().to_str().unwrap_or("."))
        .execute()
        .await
        .map_err(Error::lance("connecting"))?;
    let schema = Arc::new(Schema::new(vec![
        Field::new("user_id", DataType::Utf8, false),
        super::vector_field(dim),
    ]));
    let n = rows.len() / dim;
    let mut batches = Vec::new();
    for start in (0..n).step_by(100_000) {
        let end = (start + 100_000).min(n);
        let mut users = StringBuilder::new();
        let mut vecs = FixedSizeListBuilder::new(Float32Builder::new(), dim as i32)
            .with_field(Arc::new(Field::new("item", DataType::Float32, true)));
        for i in start..end {
            users.append_value("u1");
            vecs.values().append_slice(&rows[i * dim..(i + 1) * dim]);
            vecs.append(true);
        }
        batches.push(
            RecordBatch::try_new(
                schema.clone(),
                vec![Arc::new(users.finish()), Arc::new(vecs.finish())],
            )
            .map_err(Error::Arrow)?,
        );
    }
    let t = Instant::now();
    let table = db
        .create_empty_table("memories", schema.clone())
        .execute()
        .await
        .map_err(Error::lance("creating the bench table"))?;
    for batch in batches {
        super::add(&table, batch)
            .await
            .map_err(Error::lance("writing the bench table"))?;
    }
    let mut note = format!("written in {:.1} s", t.elapsed().as_secs_f64());
    if n >= index_rows {
        let t = Instant::now();
        table
            .create_index(
                &["vector"],
                lancedb::index::Index::IvfPq(
                    lancedb::index::vector::IvfPqIndexBuilder::default()
                        .distance_type(lancedb::DistanceType::Cosine),
                ),
            )
            .execute()
            .await
            .map_err(Error::lance("building the vector index"))?;
        note.push_str(&format!(
            ", IVF_PQ index built in {:.1} s",
            t.elapsed().as_secs_f64()
        ));
    } else {
        note.push_str(", no index: flat scan");
    }
    let mut ms = Vec::with_capacity(queries.len());
    for (i, q) in queries.iter().enumerate() {
        let t = Instant::now();
        let hits: Vec<RecordBatch> = table
            .query()
            .nearest_to(q.as_slice())
            .map_err(Error::lance("query"))?
            .distance_type(lancedb::DistanceType::Cosine)
            .only_if("user_id = 'u1'")
            .limit(k)
            .execute()
            .await
            .map_err(Error::lance("query"))?
            .try_collect()
            .await
            .map_err(Error::lance("query"))?;
        if i >= 5 {
            ms.push(t.elapsed().as_secs_f64() * 1e3);
        }
        drop(hits);
    }
    ms.sort_by(f64::total_cmp);
    Ok((percentile(&ms, 0.5), percentile(&ms, 0.99), note))
}
