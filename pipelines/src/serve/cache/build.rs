//! A user's corpus built from their rows: turns joined with their vectors,
//! sessions with their passage windows, items with the catalogue, a BM25
//! index over the texts, and an IVF store for a large user.

use std::collections::{BTreeMap, HashMap};

use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type, TimestampMillisecondType};
use arrow_array::{Array, RecordBatch};
use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::IvfParams;
use steamrf_kernels::quant::{INT8_MIN_ROWS, QuantKernel};
use steamrf_operators::embed::SparseVec;
use steamrf_operators::lexical::{Bm25Index, Bm25Params, SparseIndex};
use steamrf_operators::passage::{PassageIndex, Units};
use steamrf_operators::rfmem::VectorStore;
use steamrf_operators::steam::memory::{Memory, UserMemories};
use steamrf_schemas::tables::EMBEDDING_DIM;

use super::corpus::opt_str;
use super::corpus::{Entry, EntryKind, ItemInfo, UserCorpus, UserData, Window, memory_bytes};
use crate::config::{CorpusKind, ServeConfig};
use crate::error::{Error, Result};
use crate::steam::vector;

pub(super) struct Row {
    pub(super) entry: Entry,
    pub(super) vector: Vec<f32>,
    pub(super) ts: i64,
    pub(super) windows: Vec<Vec<f32>>,
    /// Each window's sparse vector (the term-wise max of its turns').
    pub(super) window_sparse: Vec<SparseVec>,
}

pub(super) struct Turn {
    pub(super) ts: i64,
    pub(super) event_id: String,
    pub(super) content: String,
    pub(super) vector: Vec<f32>,
    pub(super) source: Option<(i32, i64)>,
    pub(super) sparse: Option<SparseVec>,
}

/// A store over `flat` as the service searches it: exact below `min_rows`
/// vectors, an IVF (`serve.ivf_probes` probed) from there on.
///
/// # Errors
/// Vectors of the wrong length.
pub fn vector_store(cfg: &ServeConfig, flat: Vec<f32>, min_rows: usize) -> Result<VectorStore> {
    let n = flat.len() / EMBEDDING_DIM;
    let corpus = Corpus::from_vec(flat, EMBEDDING_DIM).map_err(internal)?;
    Ok(if n >= min_rows {
        VectorStore::ivf(
            corpus,
            &IvfParams {
                probes: cfg.ivf_probes,
                ..IvfParams::default()
            },
            CpuKernel::default(),
        )
        .map_err(internal)?
    } else {
        // int8 from the size where it pays; the kernel is refused on a CPU
        // without VNNI, where "auto" means f32 and "int8" was refused at
        // startup (validation).
        let int8 = cfg.cpu_precision.int8() && n >= INT8_MIN_ROWS;
        match int8.then(|| QuantKernel::new(cfg.rescore)) {
            Some(Ok(mut kernel)) => {
                kernel.threads = cfg.search_threads;
                VectorStore::flat_int8(corpus, kernel)
            }
            _ => VectorStore::flat(
                corpus,
                CpuKernel {
                    threads: cfg.search_threads,
                    ..CpuKernel::default()
                },
            ),
        }
    })
}

/// One user's stored rows, as [`build_user`] reads them.
#[derive(Debug, Clone, Copy, Default)]
pub struct UserRows<'a> {
    /// `interactions` rows (columns [`INTERACTION_COLUMNS`]).
    pub interactions: &'a [RecordBatch],
    /// `turn_vectors` rows (columns [`TURN_VECTOR_COLUMNS`]).
    pub turn_vectors: &'a [RecordBatch],
    /// `passages` rows (columns [`PASSAGE_COLUMNS`]).
    pub passages: &'a [RecordBatch],
}

/// One user's [`UserData`] from their stored rows and memories.
///
/// # Errors
/// Vectors of the wrong length.
pub fn build_user(
    cfg: &ServeConfig,
    catalogue: &HashMap<String, ItemInfo>,
    user_id: &str,
    stored: UserRows<'_>,
    memories: Vec<Memory>,
) -> Result<UserData> {
    let UserRows {
        interactions,
        turn_vectors,
        passages,
    } = stored;
    // Each dialogue turn's vector, by event id, and its sparse vector
    // where one was stored (and the units will score it).
    let mut turn_vector: HashMap<&str, &[f32]> = HashMap::new();
    let mut turn_sparse: HashMap<&str, SparseVec> = HashMap::new();
    // Only windows score them: without passages nothing would read them.
    let want_sparse = cfg.units.sparse_weight > 0.0 && cfg.kinds.contains(&CorpusKind::Passage);
    for b in turn_vectors {
        let ids = b.column(0).as_string::<i32>();
        let terms = b.column_by_name("terms").map(|c| c.as_list::<i32>());
        let weights = b.column_by_name("weights").map(|c| c.as_list::<i32>());
        for r in 0..b.num_rows() {
            if let Some(v) = vector(b.column(1), r) {
                turn_vector.insert(ids.value(r), v);
            }
            if want_sparse
                && let (Some(t), Some(w)) = (terms, weights)
                && t.is_valid(r)
                && w.is_valid(r)
            {
                let t = t.value(r);
                let w = w.value(r);
                let pairs = t
                    .as_primitive::<arrow_array::types::UInt32Type>()
                    .values()
                    .iter()
                    .copied()
                    .zip(
                        w.as_primitive::<arrow_array::types::Float32Type>()
                            .values()
                            .iter()
                            .copied(),
                    )
                    .collect();
                turn_sparse.insert(ids.value(r), SparseVec::from_pairs(pairs));
            }
        }
    }
    let want = |k: CorpusKind| cfg.kinds.contains(&k);
    let mut rows: Vec<Row> = Vec::new();
    let mut unresolved = false;
    let mut sessions: BTreeMap<String, Vec<Turn>> = BTreeMap::new();
    // Only a ranker that scores against the history (item-CF, BM25) needs it.
    let weights = cfg.ranker.weights();
    let keep_history = weights.needs_item_cf() || weights.needs_text();
    let mut history: Vec<(i64, &str)> = Vec::new();
    for b in interactions {
        let event = b.column(0).as_string::<i32>();
        let kind = b.column(1).as_string::<i32>();
        let ts = b.column(3).as_primitive::<TimestampMillisecondType>();
        let part = b.column(8).as_primitive::<Int32Type>();
        let offset = b.column(9).as_primitive::<Int64Type>();
        for r in 0..b.num_rows() {
            if keep_history && let Some(item) = opt_str(b.column(4), r) {
                history.push((ts.value(r), item));
            }
            let source = Some((part.value(r), offset.value(r)));
            let e = turn_vector.get(event.value(r)).copied();
            if let (Some(text), Some(e)) = (opt_str(b.column(7), r), e) {
                let (as_passage, as_turn) = (want(CorpusKind::Passage), want(CorpusKind::Dialogue));
                if !as_passage && !as_turn {
                    continue;
                }
                let role = opt_str(b.column(6), r).unwrap_or("user");
                let content = format!("{role}: {text}");
                let session = opt_str(b.column(5), r);
                if let Some(s) = session
                    && (as_passage || cfg.group_sessions)
                {
                    sessions.entry(s.to_owned()).or_default().push(Turn {
                        ts: ts.value(r),
                        event_id: event.value(r).to_owned(),
                        content: content.clone(),
                        vector: e.to_vec(),
                        source,
                        sparse: turn_sparse.remove(event.value(r)),
                    });
                }
                if !as_turn || (cfg.group_sessions && session.is_some()) {
                    continue;
                }
                rows.push(Row {
                    entry: Entry {
                        kind: EntryKind::Dialogue,
                        id: event.value(r).to_owned(),
                        content,
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                        windows: Vec::new(),
                        turn_ends: Vec::new(),
                    },
                    vector: e.to_vec(),
                    ts: ts.value(r),
                    windows: Vec::new(),
                    window_sparse: Vec::new(),
                });
            } else if let Some(item) = opt_str(b.column(4), r) {
                if !want(CorpusKind::Interaction) {
                    continue;
                }
                let Some(info) = catalogue.get(item) else {
                    unresolved = true;
                    continue;
                };
                rows.push(Row {
                    entry: Entry {
                        kind: EntryKind::Interaction,
                        id: event.value(r).to_owned(),
                        content: format!("{}: {}", kind.value(r), info.title),
                        table: "interactions",
                        source_event_ids: vec![event.value(r).to_owned()],
                        source,
                        windows: Vec::new(),
                        turn_ends: Vec::new(),
                    },
                    vector: info.embedding.clone(),
                    ts: ts.value(r),
                    windows: Vec::new(),
                    window_sparse: Vec::new(),
                });
            }
        }
    }
    // The sessions' windows: session → (last turn, first turn, vector).
    type Windows<'a> = Vec<(&'a str, &'a str, &'a [f32])>;
    let mut by_session: HashMap<&str, Windows<'_>> = HashMap::new();
    for b in passages {
        let event = b.column(0).as_string::<i32>();
        let session = b.column(1).as_string::<i32>();
        let first = b.column(2).as_string::<i32>();
        for r in 0..b.num_rows() {
            if let Some(v) = vector(b.column(3), r) {
                by_session.entry(session.value(r)).or_default().push((
                    event.value(r),
                    first.value(r),
                    v,
                ));
            }
        }
    }
    for (session, mut turns) in sessions {
        turns.sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.event_id.cmp(&b.event_id)));
        let mut v = vec![0.0f32; EMBEDDING_DIM];
        for t in &turns {
            v.iter_mut().zip(&t.vector).for_each(|(a, b)| *a += b);
        }
        let at: HashMap<&str, u32> = turns
            .iter()
            .enumerate()
            .map(|(i, t)| (t.event_id.as_str(), i as u32))
            .collect();
        let mut windows: Vec<(Window, Vec<f32>)> = by_session
            .get(session.as_str())
            .into_iter()
            .flatten()
            .filter_map(|&(last, first, v)| {
                // A window whose turns are gone (forgotten) is left out.
                let (start, end) = (*at.get(first)?, *at.get(last)? + 1);
                (start < end).then(|| {
                    (
                        Window {
                            event_id: last.to_owned(),
                            start,
                            end,
                        },
                        v.to_vec(),
                    )
                })
            })
            .collect();
        windows.sort_by_key(|w| (w.0.end, w.0.start));
        let (windows, vectors): (Vec<Window>, Vec<Vec<f32>>) = windows.into_iter().unzip();
        let window_sparse = windows
            .iter()
            .map(|w| {
                SparseVec::max_of(
                    turns[w.start as usize..w.end as usize]
                        .iter()
                        .filter_map(|t| t.sparse.as_ref()),
                )
            })
            .collect();
        let mut content = String::new();
        let mut turn_ends = Vec::with_capacity(turns.len());
        for t in &turns {
            if !turn_ends.is_empty() {
                content.push('\n');
            }
            content.push_str(&t.content);
            turn_ends.push(u32::try_from(content.len()).unwrap_or(u32::MAX));
        }
        rows.push(Row {
            entry: Entry {
                kind: EntryKind::Session,
                id: session,
                content,
                table: "interactions",
                source_event_ids: turns.iter().map(|t| t.event_id.clone()).collect(),
                source: turns.first().and_then(|t| t.source),
                windows,
                turn_ends,
            },
            vector: v,
            ts: turns.first().map_or(0, |t| t.ts),
            windows: vectors,
            window_sparse,
        });
    }
    let mut mems = UserMemories::new(user_id);
    for m in memories {
        if want(CorpusKind::Memory) {
            rows.push(Row {
                entry: Entry {
                    kind: EntryKind::Memory,
                    id: m.id.to_string(),
                    content: m.content.clone(),
                    table: "memories",
                    source_event_ids: m.interactions.clone(),
                    source: None,
                    windows: Vec::new(),
                    turn_ends: Vec::new(),
                },
                vector: m.embedding.clone(),
                ts: m.created_ms,
                windows: Vec::new(),
                window_sparse: Vec::new(),
            });
        }
        mems.memories.push(m);
    }
    // Formation order, as the write path keeps them.
    mems.memories
        .sort_by(|a, b| a.created_ms.cmp(&b.created_ms).then(a.id.cmp(&b.id)));
    // A stable row order: by time, then id.
    rows.sort_by(|a, b| a.ts.cmp(&b.ts).then_with(|| a.entry.id.cmp(&b.entry.id)));
    let mut flat = Vec::with_capacity(rows.len() * EMBEDDING_DIM);
    let mut window_flat = Vec::new();
    let mut owner = Vec::new();
    let mut sparse: Vec<SparseVec> = Vec::new();
    let mut entries = Vec::with_capacity(rows.len());
    // Dense candidates come from the window index once there is one, so a
    // row without windows (a click, a memory, a session from before passages
    // were written) is its own one window; `Entry::windows` stays empty, so
    // no passage is named for it.
    let any_windows = rows.iter().any(|r| !r.windows.is_empty());
    for (i, r) in rows.into_iter().enumerate() {
        flat.extend_from_slice(&r.vector);
        if any_windows && r.windows.is_empty() {
            window_flat.extend_from_slice(&r.vector);
            owner.push(i as u32);
            sparse.push(SparseVec::default());
        }
        for w in &r.windows {
            window_flat.extend_from_slice(w);
            owner.push(i as u32);
        }
        // In the windows' order (a row that is its own window has none).
        sparse.extend(r.window_sparse);
        entries.push(r.entry);
    }
    // Row and window vectors both stay in memory (the index's own
    // `bytes()` leaves its stores to the caller).
    let vector_bytes = (flat.len() + window_flat.len()) * 4;
    // BM25 over the rows when they are the units, else over the windows.
    let lexical = (cfg.hybrid.lexical_weight > 0.0 && !any_windows).then(|| {
        Bm25Index::new(
            entries.iter().map(|e| e.content.as_str()),
            Bm25Params::default(),
        )
    });
    let mut index = PassageIndex::new(
        vector_store(cfg, flat, cfg.ivf_min_rows)?,
        vector_store(cfg, window_flat, cfg.ivf_min_windows)?,
        owner,
        lexical,
    )
    .map_err(internal)?;
    if any_windows {
        // Each window is an evidence unit, in the window index's order: its
        // turns in its row and its text for BM25 (a row that is its own
        // window: the whole row), read from the entries, not copied.
        let units = || {
            entries.iter().flat_map(|e| {
                let own = e.windows.is_empty().then_some((0, 0, e.content.as_str()));
                own.into_iter().chain(e.windows.iter().map(|w| {
                    let text = e.turns_text(w.start as usize, w.end as usize);
                    (w.start, w.end, text)
                }))
            })
        };
        let spans = units().map(|(start, end, _)| (start, end)).collect();
        let lexical = (cfg.units.lexical_weight > 0.0)
            .then(|| Bm25Index::new(units().map(|(_, _, text)| text), Bm25Params::default()));
        let mut units = Units::new(spans, lexical);
        // Learned sparse vectors, where the windows' turns carry any.
        if sparse.iter().any(|v| !v.is_empty()) {
            units = units.with_sparse(SparseIndex::new(&sparse));
        }
        index = index.with_units(units).map_err(internal)?;
    }
    history.sort_by_key(|h| h.0);
    let history: Vec<String> = history.into_iter().map(|h| h.1.to_owned()).collect();
    let bytes = size_of::<UserData>()
        + user_id.len() * 2
        + history.iter().map(|h| h.len() + 24).sum::<usize>()
        + vector_bytes
        + index.extra_bytes()
        + index.bytes()
        + entries.iter().map(Entry::bytes).sum::<usize>()
        + mems.memories.iter().map(memory_bytes).sum::<usize>();
    Ok(UserData {
        corpus: UserCorpus { entries, index },
        memories: mems,
        unresolved,
        history,
        rows_cut: 0,
        bytes,
    })
}

pub(super) fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: format!("building a user's corpus: {e}"),
    }
}
