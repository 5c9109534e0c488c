//! `steamrf eval rfmem`'s second part: hybrid RF-Mem over passages
//! ([`steamrf_operators::passage`]) on the same PersonaBench protocol.
//!
//! Each memory item is a session of turns (a conversation with a contact, a
//! user–AI session, a purchase session). As `steamrf serve` does for a
//! dialogue session: the turns are embedded one by one and the row's vector
//! is their normalised mean (ablations: the mean of its windows' vectors,
//! the session embedded whole with its header, and the official whole-item
//! vector, the last two cut at the model's limit); the windows of consecutive turns get a header
//! ("Conversation with Samuel Mills on 2024-10-14") and one vector each; BM25
//! indexes the session's text.
//!
//! **Tuning, declared:** the noise-0.3 split (`--tune-noise`): its memory
//! corpus has 43% more items (other distractors), its questions are the
//! same. Every configuration is run on both; the one with the best Recall@10
//! on the tuning split is the result on the test split, and the whole sweep
//! is printed beside it.

use std::collections::BTreeMap;
use std::time::Instant;

use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_operators::embed::{SparseVec, Splade, normalize};
use steamrf_operators::lexical::{Bm25Index, Bm25Params, SparseIndex};
use steamrf_operators::passage::{
    self, HybridParams, PassageIndex, UnitBudget, UnitParams, Units, WindowParams, header, render,
    windows,
};
use steamrf_operators::rfmem::{Mode, Path, RfMemParams, VectorStore};
use steamrf_pipelines::error::{Error, Result};

use super::pyjson::Json;

/// One memory item as a session: its header and its turns as text.
#[derive(Debug, Clone, PartialEq)]
pub(super) struct Unit {
    pub header: String,
    pub turns: Vec<String>,
}

/// `"2024/Oct/14/09:14 AM"` → `"2024-10-14"` (the string itself when it
/// is not in that form).
fn date(time: &str) -> String {
    let parts: Vec<&str> = time.split('/').collect();
    const MONTHS: [&str; 12] = [
        "Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec",
    ];
    match parts.as_slice() {
        [y, m, d, ..] => match MONTHS.iter().position(|x| x == m) {
            Some(i) => format!("{y}-{:02}-{:0>2}", i + 1, d),
            None => time.to_owned(),
        },
        _ => time.to_owned(),
    }
}

fn text(j: Option<&Json>) -> String {
    match j {
        Some(Json::Str(s)) => s.clone(),
        Some(Json::Arr(a)) => a
            .iter()
            .map(|x| text(Some(x)))
            .collect::<Vec<_>>()
            .join(", "),
        Some(other) => other.dumps(),
        None => String::new(),
    }
}

/// The sessions of one user, in the official corpus order
/// ([`super::rfmem`]'s `corpus`): entries without a segment id are skipped
/// there and here.
pub(super) fn units(conv: &Json, user_ai: &Json, purchases: &Json) -> Vec<Unit> {
    let mut out = Vec::new();
    let dialogue = |turns: &[Json]| -> Vec<String> {
        turns
            .iter()
            .map(|t| format!("{}: {}", text(t.get("role")), text(t.get("content"))))
            .collect()
    };
    for contact in conv.items() {
        let who = text(contact.get("Target_name"));
        for e in contact.get("Conversations").map_or(&[][..], Json::items) {
            if e.get("segment_id").is_none() {
                continue;
            }
            out.push(Unit {
                header: header("Conversation", &who, &date(&text(e.get("time")))),
                turns: dialogue(e.get("conversation").map_or(&[][..], Json::items)),
            });
        }
    }
    for e in user_ai.items() {
        if e.get("segment_id").is_none() {
            continue;
        }
        out.push(Unit {
            header: header(
                "Conversation",
                "the AI assistant",
                &date(&text(e.get("time"))),
            ),
            turns: dialogue(e.get("user_ai_interaction").map_or(&[][..], Json::items)),
        });
    }
    for e in purchases.items() {
        if e.get("segment_id").is_none() {
            continue;
        }
        out.push(Unit {
            header: header("Purchases", "", &date(&text(e.get("time")))),
            turns: e
                .get("purchase_history")
                .map_or(&[][..], Json::items)
                .iter()
                .map(|p| {
                    format!(
                        "bought {} ({}; {}): {}",
                        text(p.get("title")),
                        text(p.get("brand")),
                        text(p.get("categories")),
                        text(p.get("description"))
                    )
                })
                .collect(),
        });
    }
    out
}

/// A question as the hybrid evaluation needs it.
pub(super) struct Q<'a> {
    pub user: usize,
    pub text: &'a str,
    pub vector: &'a [f32],
    pub truth: &'a [Vec<String>],
}

/// One user's two indexes (row vector: mean of turns, or the whole item).
pub(super) struct HybridUser {
    pub segments: Vec<String>,
    pub by_turns: PassageIndex,
    pub by_item: PassageIndex,
    pub by_windows: PassageIndex,
    pub by_head: PassageIndex,
    /// Whole items only, no windows, no lexical side: plain top-k.
    pub plain: PassageIndex,
    /// What `steamrf serve` answers from a corpus of sessions: the turn-mean
    /// rows, their windows as evidence units (each with its turns, BM25
    /// over its own text and, with a sparse encoder, its turns' SPLADE
    /// vectors max-pooled), ranked by [`passage::retrieve_units_until`].
    pub by_units: PassageIndex,
}

fn store(rows: Vec<f32>, dim: usize) -> Result<VectorStore> {
    Ok(VectorStore::flat(
        Corpus::from_vec(rows, dim).map_err(|e| Error::Internal {
            message: e.to_string(),
        })?,
        CpuKernel {
            threads: 1,
            ..CpuKernel::default()
        },
    ))
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

/// Embeds turns and windows and builds every user's indexes. `items[u]`
/// are user `u`'s sessions, `item_vectors[u]` their official whole-item
/// vectors (row-major).
pub(super) async fn build(
    embedder: &std::sync::Arc<dyn steamrf_operators::embed::Embedder>,
    sparse: Option<&Splade>,
    segments: Vec<Vec<String>>,
    items: &[Vec<Unit>],
    item_vectors: &[Vec<f32>],
    w: &WindowParams,
    out: &mut Vec<String>,
) -> Result<Vec<HybridUser>> {
    let started = Instant::now();
    let mut turn_texts = Vec::new();
    let mut window_texts = Vec::new();
    let mut lexical_docs: Vec<Vec<String>> = Vec::new();
    let mut head_texts = Vec::new();
    for user in items {
        let mut docs = Vec::new();
        for unit in user {
            head_texts.push(render(&unit.header, &unit.turns));
            turn_texts.extend(unit.turns.iter().cloned());
            for r in windows(unit.turns.len(), w) {
                window_texts.push(render(&unit.header, &unit.turns[r]));
            }
            docs.push(render(&unit.header, &unit.turns));
        }
        lexical_docs.push(docs);
    }
    let (n_turns, n_windows) = (turn_texts.len(), window_texts.len());
    let emb = |texts: Vec<String>| async move {
        embedder.embed(texts).await.map_err(|e| Error::Embed {
            retryable: false,
            source: Box::new(e),
        })
    };
    // Each turn's learned sparse vector, as the pipeline stores it.
    let turn_sparse: Vec<SparseVec> = match sparse {
        Some(enc) => {
            let refs: Vec<&str> = turn_texts.iter().map(String::as_str).collect();
            tokio::task::block_in_place(|| enc.encode(&refs)).map_err(internal)?
        }
        None => vec![SparseVec::default(); turn_texts.len()],
    };
    let tv = emb(turn_texts).await?;
    let wv = emb(window_texts).await?;
    let hv = emb(head_texts).await?;
    out.push(format!(
        "  passages: {n_turns} turns and {n_windows} windows of up to {} turns (one ending at each turn) embedded in {:.1} s ({} windows cut to the model's limit)",
        w.turns,
        started.elapsed().as_secs_f64(),
        wv.truncated
    ));
    let dim = tv.dim.max(wv.dim);
    let (mut t_at, mut w_at, mut h_at) = (0usize, 0usize, 0usize);
    let mut users = Vec::new();
    for ((user, segs), (docs, item_vecs)) in items
        .iter()
        .zip(segments)
        .zip(lexical_docs.into_iter().zip(item_vectors))
    {
        let mut rows = Vec::with_capacity(user.len() * dim);
        let mut window_means = Vec::with_capacity(user.len() * dim);
        let heads = hv.vectors[h_at * dim..(h_at + user.len()) * dim].to_vec();
        h_at += user.len();
        let mut wins = Vec::new();
        let mut owner = Vec::new();
        // Per window, as the service's cache builds its units: its turns,
        // its turns' text for BM25, its turns' sparse vectors max-pooled.
        let mut spans = Vec::new();
        let mut unit_texts = Vec::new();
        let mut unit_sparse = Vec::new();
        for (i, unit) in user.iter().enumerate() {
            let ranges = windows(unit.turns.len(), w);
            for r in &ranges {
                spans.push((r.start as u32, r.end as u32));
                unit_texts.push(unit.turns[r.clone()].join("\n"));
                unit_sparse.push(SparseVec::max_of(
                    &turn_sparse[t_at + r.start..t_at + r.end],
                ));
            }
            let mut v = vec![0.0f32; dim];
            for t in 0..unit.turns.len() {
                let x = &tv.vectors[(t_at + t) * dim..(t_at + t + 1) * dim];
                v.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            }
            if unit.turns.is_empty() {
                v.copy_from_slice(&item_vecs[i * dim..(i + 1) * dim]);
            }
            normalize(&mut v);
            rows.extend(v);
            t_at += unit.turns.len();
            let n = ranges.len();
            let mut m = vec![0.0f32; dim];
            for x in wv.vectors[w_at * dim..(w_at + n) * dim].chunks_exact(dim) {
                m.iter_mut().zip(x).for_each(|(a, b)| *a += b);
            }
            wins.extend_from_slice(&wv.vectors[w_at * dim..(w_at + n) * dim]);
            owner.extend(std::iter::repeat_n(i as u32, n));
            if n == 0 {
                // As the service does: a row without windows is its own one.
                let item = &item_vecs[i * dim..(i + 1) * dim];
                m.copy_from_slice(item);
                wins.extend_from_slice(item);
                owner.push(i as u32);
                // One unit of the whole row, as the service makes it.
                spans.push((0, 0));
                unit_texts.push(String::new());
                unit_sparse.push(SparseVec::default());
            }
            normalize(&mut m);
            window_means.extend(m);
            w_at += n;
        }
        // The same windows and lexical index under each choice of row vector.
        let with_rows = |rows: Vec<f32>| -> Result<PassageIndex> {
            PassageIndex::new(
                store(rows, dim)?,
                store(wins.clone(), dim)?,
                owner.clone(),
                Some(Bm25Index::new(&docs, Bm25Params::default())),
            )
            .map_err(internal)
        };
        let mut units = Units::new(
            spans,
            Some(Bm25Index::new(&unit_texts, Bm25Params::default())),
        );
        if unit_sparse.iter().any(|v| !v.is_empty()) {
            units = units.with_sparse(SparseIndex::new(&unit_sparse));
        }
        let by_units = PassageIndex::new(
            store(rows.clone(), dim)?,
            store(wins.clone(), dim)?,
            owner.clone(),
            None,
        )
        .and_then(|ix| ix.with_units(units))
        .map_err(internal)?;
        let by_turns = with_rows(rows)?;
        let by_item = with_rows(item_vecs.clone())?;
        let by_windows = with_rows(window_means)?;
        let by_head = with_rows(heads)?;
        let plain = PassageIndex::new(
            store(item_vecs.clone(), dim)?,
            store(Vec::new(), dim)?,
            Vec::new(),
            None,
        )
        .map_err(internal)?;
        users.push(HybridUser {
            segments: segs,
            by_turns,
            by_item,
            by_windows,
            by_head,
            plain,
            by_units,
        });
    }
    Ok(users)
}

/// One configuration of the sweep.
#[derive(Debug, Clone, Copy)]
pub(super) struct Config {
    pub row_vector: RowVector,
    pub rf: RfMemParams,
    pub hybrid: HybridParams,
}

/// Which vector stands for the whole row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RowVector {
    /// The normalised mean of its turns (what `steamrf serve` has).
    Turns,
    /// The official whole-item vector (cut at 256 tokens).
    Item,
    /// The normalised mean of its windows' vectors.
    Windows,
    /// The session rendered with its header, embedded whole (cut at the
    /// model's limit: in practice its first turns).
    Head,
    /// The whole-item vector and nothing else (the top-k baseline).
    Plain,
}

/// Per-question results of one configuration.
#[derive(Debug, Clone, Default)]
pub(super) struct PerQuestion {
    pub r5: Vec<f64>,
    pub r10: Vec<f64>,
    pub n10: Vec<f64>,
    pub recollected: Vec<bool>,
    /// The probe's mean window cosine (K = 10 run).
    pub probe_mean: Vec<f32>,
}

/// The official metric: (recall, NDCG) of retrieved ids against the truth.
pub(super) type Metric = fn(&[&str], &[Vec<String>]) -> (f64, f64);

/// Runs `c` at K = 5 and K = 10 over every question.
pub(super) fn run(
    users: &[HybridUser],
    qs: &[Q<'_>],
    c: &Config,
    score: Metric,
) -> Result<PerQuestion> {
    let mut out = PerQuestion::default();
    for q in qs {
        let u = &users[q.user];
        let ix = match c.row_vector {
            RowVector::Turns => &u.by_turns,
            RowVector::Item => &u.by_item,
            RowVector::Windows => &u.by_windows,
            RowVector::Head => &u.by_head,
            RowVector::Plain => &u.plain,
        };
        for k in [5, 10] {
            let a = passage::retrieve_until(
                ix,
                q.vector,
                Some(q.text),
                &RfMemParams { k, ..c.rf },
                &c.hybrid,
                &|| false,
            )
            .map_err(internal)?;
            let ids: Vec<&str> = a
                .hits
                .iter()
                .map(|h| u.segments[h.row as usize].as_str())
                .collect();
            let (r, n) = score(&ids, q.truth);
            if k == 5 {
                out.r5.push(r);
            } else {
                out.r10.push(r);
                out.n10.push(n);
                out.recollected.push(a.path == Path::Recollection);
                out.probe_mean.push(a.probe.mean);
            }
        }
    }
    Ok(out)
}

/// What the service's defaults answer (`[serve.units]`, `[serve.rfmem]`,
/// `serve.max_turns`), per question.
pub(super) struct Served<'a> {
    pub units: &'a UnitParams,
    pub rf: &'a RfMemParams,
    pub max_turns: usize,
}

/// Per-question results of the served path, and the turns each K = 10
/// answer hands over.
pub(super) struct ServedRun {
    pub scores: PerQuestion,
    pub turns: Vec<f64>,
}

/// Runs the served path at K = 5 and K = 10 over every question: `k`
/// evidence units under the turn budget, scored by the items (sessions)
/// they come from, in the order the units first name them. `sparse[i]` is
/// question `i`'s SPLADE vector (none without an encoder).
pub(super) fn run_units(
    users: &[HybridUser],
    qs: &[Q<'_>],
    sparse: &[Option<SparseVec>],
    served: &Served<'_>,
    score: Metric,
) -> Result<ServedRun> {
    let mut out = ServedRun {
        scores: PerQuestion::default(),
        turns: Vec::new(),
    };
    for (i, q) in qs.iter().enumerate() {
        let u = &users[q.user];
        for k in [5, 10] {
            let a = passage::retrieve_units_until(
                &u.by_units,
                q.vector,
                Some(q.text),
                sparse.get(i).and_then(Option::as_ref),
                &RfMemParams { k, ..*served.rf },
                served.units,
                UnitBudget {
                    units: k,
                    turns: served.max_turns,
                },
                &|| false,
            )
            .map_err(internal)?;
            let ids = sessions_of(&a.hits, &u.segments);
            let (r, n) = score(&ids, q.truth);
            if k == 5 {
                out.scores.r5.push(r);
            } else {
                out.scores.r10.push(r);
                out.scores.n10.push(n);
                out.scores
                    .recollected
                    .push(a.dense.path == Path::Recollection);
                out.turns
                    .push(a.hits.iter().map(|h| h.turns()).sum::<usize>() as f64);
            }
        }
    }
    Ok(out)
}

/// The sessions (segment ids) an answer's units come from, each once, in
/// the order the units first name them.
fn sessions_of<'a>(hits: &[passage::UnitHit], segments: &'a [String]) -> Vec<&'a str> {
    let mut ids: Vec<&str> = Vec::new();
    for h in hits {
        let id = segments[h.row as usize].as_str();
        if !ids.contains(&id) {
            ids.push(id);
        }
    }
    ids
}

/// The sweep: row vector × mix × lexical weight, familiarity; then the
/// paths (recollection, RF-Mem gates) at each familiarity setting's best.
pub(super) fn sweep() -> Vec<Config> {
    let mut out = Vec::new();
    for row_vector in [
        RowVector::Turns,
        RowVector::Windows,
        RowVector::Head,
        RowVector::Item,
    ] {
        for mix in [0.0f32, 0.25, 0.5, 0.75, 1.0] {
            for lexical_weight in [0.0f32, 0.1, 0.2, 0.3, 0.5, 0.75] {
                out.push(Config {
                    row_vector,
                    rf: RfMemParams {
                        mode: Mode::Familiarity,
                        ..RfMemParams::default()
                    },
                    hybrid: HybridParams {
                        mix,
                        lexical_weight,
                        ..HybridParams::default()
                    },
                });
            }
        }
    }
    out
}

/// The path variants tried on top of a familiarity configuration: always
/// recollection (α 0.3, 0.5, 0.7), and RF-Mem's gate with θ_low = θ_high at
/// the 25th, 50th and 75th percentile of the probe's mean window cosine on
/// the tuning questions (`probe_means`): recollection below, familiarity
/// above.
pub(super) fn paths(base: &Config, probe_means: &mut [f32]) -> Vec<Config> {
    let mut out = vec![*base];
    for alpha in [0.3f32, 0.5, 0.7] {
        out.push(Config {
            rf: RfMemParams {
                mode: Mode::Recollection,
                alpha,
                ..base.rf
            },
            ..*base
        });
    }
    let q = quantiles(probe_means);
    for p in ["p25", "p50", "p75"] {
        let theta = q.get(p).copied().unwrap_or(0.0);
        out.push(Config {
            rf: RfMemParams {
                mode: Mode::Adaptive,
                theta_low: theta,
                theta_high: theta,
                alpha: 0.5,
                ..base.rf
            },
            ..*base
        });
    }
    out
}

/// A configuration's short name for tables.
pub(super) fn name(c: &Config) -> String {
    let path = match c.rf.mode {
        Mode::Familiarity => "familiarity".to_owned(),
        Mode::Recollection => format!("recollection α={:.1}", c.rf.alpha),
        Mode::Adaptive => format!(
            "RF-Mem θ_low={:.2} θ_high={:.2} τ={:.2}",
            c.rf.theta_low, c.rf.theta_high, c.rf.tau
        ),
    };
    format!(
        "{} rows, mix {:.2}, lexical {:.2}, {path}",
        match c.row_vector {
            RowVector::Turns => "turn-mean",
            RowVector::Item => "item",
            RowVector::Windows => "window-mean",
            RowVector::Head => "session-head",
            RowVector::Plain => "plain item",
        },
        c.hybrid.mix,
        c.hybrid.lexical_weight
    )
}

/// Summary statistics (quantiles) of `xs`.
pub(super) fn quantiles(xs: &mut [f32]) -> BTreeMap<&'static str, f32> {
    xs.sort_by(f32::total_cmp);
    let at = |q: f64| xs[((xs.len() - 1) as f64 * q).round() as usize];
    if xs.is_empty() {
        return BTreeMap::new();
    }
    [
        ("p10", at(0.1)),
        ("p25", at(0.25)),
        ("p50", at(0.5)),
        ("p75", at(0.75)),
        ("p90", at(0.9)),
    ]
    .into_iter()
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::pyjson;

    #[test]
    fn units_are_scored_by_their_sessions_once_each_in_order() {
        let hit = |row: u32, start: u32| passage::UnitHit {
            row,
            start,
            end: start + 3,
            window: 0,
            score: 1.0,
            dense: 1.0,
            lexical: 0.0,
            sparse: 0.0,
            round: 0,
        };
        let segments: Vec<String> = ["s0", "s1", "s2"].map(String::from).to_vec();
        let hits = [hit(2, 0), hit(0, 4), hit(2, 9), hit(1, 0), hit(0, 0)];
        assert_eq!(sessions_of(&hits, &segments), ["s2", "s0", "s1"]);
        assert!(sessions_of(&[], &segments).is_empty());
    }

    #[test]
    fn sessions_become_headed_turns_in_the_official_order() {
        let conv = pyjson::parse(
            r#"[{"Target_name": "Sam", "Conversations": [{"session": "s1", "time": "2024/Oct/14/09:14 AM", "conversation": [{"role": "Jen", "content": "hi"}, {"role": "Sam", "content": "hello"}], "segment_id": "001"}, {"time": "x", "conversation": []}]}]"#,
        )
        .unwrap();
        let ai = pyjson::parse(r#"[{"session": "s2", "time": "2024/Jan/2/10:00 PM", "user_ai_interaction": [{"role": "user", "content": "tips?"}], "segment_id": "002"}]"#).unwrap();
        let buy = pyjson::parse(r#"[{"session": "s3", "time": "t", "purchase_history": [{"title": "T", "brand": "B", "categories": ["a", "b"], "description": "D"}], "segment_id": "003"}]"#).unwrap();
        let u = units(&conv, &ai, &buy);
        assert_eq!(
            u,
            vec![
                Unit {
                    header: "Conversation with Sam on 2024-10-14".into(),
                    turns: vec!["Jen: hi".into(), "Sam: hello".into()],
                },
                Unit {
                    header: "Conversation with the AI assistant on 2024-01-02".into(),
                    turns: vec!["user: tips?".into()],
                },
                Unit {
                    header: "Purchases on t".into(),
                    turns: vec!["bought T (B; a, b): D".into()],
                },
            ]
        );
    }
}
