//! `steamrf eval rfmem --data DIR`: RF-Mem on PersonaBench with the official
//! code's protocol (../shared/data/README.md): the first 3 users of each of
//! the 2 communities at noise 0.0; one memory item per conversation entry per
//! contact, per user–AI session and per purchase session, as compact JSON
//! without `segment_id` and `session` (Python's formatting, byte for byte);
//! questions of type Subjective are not scored; Recall and NDCG at K are the
//! best over every combination of the ground truth's answer parts, computed
//! at the number of items retrieved.
//!
//! Familiarity only, recollection only and RF-Mem run through
//! [`steamrf_operators::rfmem::retrieve`] with the official parameters
//! (λ = 30, θ_high = 0.5, θ_low = 0.2, B = 4, F = 1, depth 10, mean-form
//! entropy, no top-up), sweeping α (and τ for RF-Mem); and RF-Mem with
//! steamrf's defaults (top-up of short answers) for comparison.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Instant;

use steamrf_kernels::Corpus;
use steamrf_kernels::cpu::CpuKernel;
use steamrf_operators::rfmem::{self, Mode, RfMemParams, VectorStore};

use super::plot;
use super::pyjson::{self, Json};
use crate::config::EmbedConfig;
use crate::error::{Error, Result};

/// Options of `steamrf eval rfmem`.
#[derive(Debug, Clone)]
pub struct RfMemEval {
    /// PersonaBench's `eval_data_v1` directory (or a parent holding it).
    pub data: PathBuf,
    /// The embedder (all-MiniLM-L6-v2 by default).
    pub embed: EmbedConfig,
    /// Where the markdown table goes.
    pub out: PathBuf,
    /// Noise level of the private data.
    pub noise: String,
}

struct Question {
    user: usize,
    category: String,
    /// Answer part → acceptable segment ids.
    truth: Vec<Vec<String>>,
    text: String,
}

struct User {
    segments: Vec<String>,
    store: VectorStore,
}

fn io(path: &Path) -> impl FnOnce(std::io::Error) -> Error + '_ {
    move |source| Error::Io {
        context: format!("reading {}", path.display()),
        source,
    }
}

fn load(path: &Path) -> Result<Json> {
    let text = std::fs::read_to_string(path).map_err(io(path))?;
    pyjson::parse(&text).map_err(|e| Error::Config {
        problems: vec![format!("{}: {e}", path.display())],
    })
}

fn bad(what: &str) -> Error {
    Error::Config {
        problems: vec![format!("PersonaBench data: {what}")],
    }
}

/// The official corpus of one user: (segment id, text) in the official order.
fn corpus(conv: &Json, user_ai: &Json, purchases: &Json) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let mut push = |entry: &Json| {
        if let Some(id) = entry.get("segment_id").and_then(Json::as_str) {
            out.push((
                id.to_owned(),
                entry.without(&["segment_id", "session"]).dumps(),
            ));
        }
    };
    for contact in conv.items() {
        for entry in contact.get("Conversations").map_or(&[][..], Json::items) {
            push(entry);
        }
    }
    for entry in user_ai.items().iter().chain(purchases.items()) {
        push(entry);
    }
    out
}

/// Recall and NDCG of `retrieved` against the best combination of `truth`
/// (one acceptable id per answer part), at k = `retrieved.len()`.
fn score(retrieved: &[&str], truth: &[Vec<String>]) -> (f64, f64) {
    let mut best = (0.0f64, 0.0f64);
    let k = retrieved.len();
    let mut idx = vec![0usize; truth.len()];
    if truth.iter().any(Vec::is_empty) {
        return best;
    }
    loop {
        let combo: std::collections::BTreeSet<&str> =
            idx.iter().zip(truth).map(|(&i, t)| t[i].as_str()).collect();
        let hit = retrieved.iter().filter(|r| combo.contains(*r)).count();
        let recall = if combo.is_empty() {
            0.0
        } else {
            hit as f64 / combo.len() as f64
        };
        let dcg: f64 = retrieved
            .iter()
            .enumerate()
            .filter(|(_, r)| combo.contains(*r))
            .map(|(i, _)| 1.0 / ((i + 2) as f64).log2())
            .sum();
        let idcg: f64 = (0..combo.len().min(k))
            .map(|i| 1.0 / ((i + 2) as f64).log2())
            .sum();
        let ndcg = if idcg > 0.0 { dcg / idcg } else { 0.0 };
        best = (best.0.max(recall), best.1.max(ndcg));
        // Next combination (odometer).
        let mut j = 0;
        loop {
            if j == idx.len() {
                return best;
            }
            idx[j] += 1;
            if idx[j] < truth[j].len() {
                break;
            }
            idx[j] = 0;
            j += 1;
        }
    }
}

#[derive(Default, Clone, Copy)]
struct Acc {
    recall: f64,
    ndcg: f64,
    n: usize,
}

type Scores = BTreeMap<String, Acc>;

fn run(
    users: &[User],
    questions: &[Question],
    vectors: &[f32],
    p: &RfMemParams,
) -> Result<(Scores, usize)> {
    let dim = users.first().map_or(384, |u| u.store.dim());
    let mut scores: Scores = BTreeMap::new();
    let mut recollected = 0;
    for (qi, q) in questions.iter().enumerate() {
        let u = &users[q.user];
        let a = rfmem::retrieve(&u.store, &vectors[qi * dim..(qi + 1) * dim], p).map_err(|e| {
            Error::Internal {
                message: e.to_string(),
            }
        })?;
        recollected += usize::from(a.path == rfmem::Path::Recollection);
        let ids: Vec<&str> = a
            .hits
            .iter()
            .map(|h| u.segments[h.index as usize].as_str())
            .collect();
        let (r, n) = score(&ids, &q.truth);
        for cat in ["Overall", q.category.as_str()] {
            let s = scores.entry(cat.to_owned()).or_default();
            s.recall += r;
            s.ndcg += n;
            s.n += 1;
        }
    }
    Ok((scores, recollected))
}

fn mean(s: &Scores, cat: &str) -> (f64, f64) {
    s.get(cat).map_or((0.0, 0.0), |a| {
        (a.recall / a.n.max(1) as f64, a.ndcg / a.n.max(1) as f64)
    })
}

/// Runs the evaluation.
///
/// # Errors
/// Missing or malformed data, or embedding failures.
pub async fn rfmem(e: RfMemEval) -> Result<Vec<String>> {
    let started = Instant::now();
    let root = ["eval_data_v1/synthetic_data", "synthetic_data", ""]
        .iter()
        .map(|s| e.data.join(s))
        .find(|p| p.join("community_0").is_dir())
        .ok_or_else(|| bad(&format!("no community_0 under {}", e.data.display())))?;
    let mut texts: Vec<String> = Vec::new();
    let mut spans = Vec::new();
    let mut questions = Vec::new();
    let mut user_segments = Vec::new();
    for community in 0..2 {
        let dir = root.join(format!("community_{community}"));
        let info = load(&dir.join("eval_info/eval_info_all.json"))?;
        let gt = load(&dir.join(format!(
            "eval_info/qa_gt_context_all_noise_{}.json",
            e.noise
        )))?;
        let private = dir.join(format!("private_data/noise_{}", e.noise));
        let by_name = |file: &str| -> Result<BTreeMap<String, Json>> {
            Ok(load(&private.join(file))?
                .items()
                .iter()
                .filter_map(|x| Some((x.get("Name")?.as_str()?.to_owned(), x.get("Data")?.clone())))
                .collect())
        };
        let conv = by_name("conversation_data_all.json")?;
        let user_ai = by_name("user_ai_interaction_data_all.json")?;
        let purchases = by_name("purchase_history_data_all.json")?;
        let truth: BTreeMap<&str, &Json> = gt
            .items()
            .iter()
            .filter_map(|x| Some((x.get("q_id")?.as_str()?, x.get("segment_id")?)))
            .collect();
        for person in info.items().iter().take(3) {
            let name = person
                .get("Name")
                .and_then(Json::as_str)
                .ok_or_else(|| bad("a user without Name"))?;
            let empty = Json::Arr(Vec::new());
            let items = corpus(
                conv.get(name).unwrap_or(&empty),
                user_ai.get(name).unwrap_or(&empty),
                purchases.get(name).unwrap_or(&empty),
            );
            let user = user_segments.len();
            spans.push(texts.len()..texts.len() + items.len());
            let (segs, docs): (Vec<String>, Vec<String>) = items.into_iter().unzip();
            texts.extend(docs);
            user_segments.push(segs);
            for q in person
                .get("Eval_Info")
                .and_then(|i| i.get("qa"))
                .map_or(&[][..], Json::items)
            {
                let ty = q.get("type").and_then(Json::as_str).unwrap_or("");
                if ty == "Subjective" {
                    continue;
                }
                let qid = q.get("q_id").and_then(Json::as_str).unwrap_or("");
                let Some(Json::Obj(parts)) = truth.get(qid).copied() else {
                    continue;
                };
                let difficulty = if ty == "Preference" {
                    q.get("difficulty").and_then(Json::as_str).unwrap_or("easy")
                } else {
                    "easy"
                };
                questions.push(Question {
                    user,
                    category: format!("{}_{}", ty.replace(' ', "_"), difficulty.replace(' ', "_")),
                    truth: parts
                        .iter()
                        .map(|(_, v)| {
                            v.items()
                                .iter()
                                .filter_map(|s| s.as_str().map(str::to_owned))
                                .collect()
                        })
                        .collect(),
                    text: q
                        .get("question")
                        .and_then(Json::as_str)
                        .unwrap_or("")
                        .to_owned(),
                });
            }
        }
    }
    let mut out = vec![format!(
        "eval rfmem: PersonaBench noise {}, {} users, {} memory items, {} scored questions",
        e.noise,
        user_segments.len(),
        texts.len(),
        questions.len()
    )];
    let embedder = crate::embed::embedder(&e.embed)?.ok_or_else(|| Error::Config {
        problems: vec!["embed.engine: eval rfmem needs an embedder".into()],
    })?;
    let t = Instant::now();
    let emb = |texts: Vec<String>| {
        let embedder = embedder.clone();
        async move {
            embedder.embed(texts).await.map_err(|e| Error::Embed {
                retryable: false,
                source: Box::new(e),
            })
        }
    };
    let docs = emb(texts).await?;
    let qv = emb(questions.iter().map(|q| q.text.clone()).collect()).await?;
    out.push(format!(
        "  embedded in {:.1} s ({} tokens, {} texts cut to the model's limit)",
        t.elapsed().as_secs_f64(),
        docs.tokens + qv.tokens,
        docs.truncated + qv.truncated
    ));
    let dim = docs.dim;
    let users: Vec<User> = spans
        .iter()
        .zip(user_segments)
        .map(|(span, segments)| {
            let rows = docs.vectors[span.start * dim..span.end * dim].to_vec();
            Ok(User {
                segments,
                store: VectorStore::flat(
                    Corpus::from_vec(rows, dim).map_err(|e| Error::Internal {
                        message: e.to_string(),
                    })?,
                    CpuKernel {
                        threads: 1,
                        ..CpuKernel::default()
                    },
                ),
            })
        })
        .collect::<Result<_>>()?;
    let official = RfMemParams {
        fill: false,
        ..RfMemParams::default()
    };
    let at = |k: usize, p: RfMemParams| RfMemParams {
        k,
        probe_k: 10,
        ..p
    };
    let mut table = String::from(
        "| method | α | τ | Recall@5 | Recall@10 | NDCG@10 | recollected |\n| --- | ---: | ---: | ---: | ---: | ---: | ---: |\n",
    );
    // 1 familiarity + 9 recollection + 27 RF-Mem + 1 steamrf-defaults rows.
    let bar = super::progress(38, "configurations");
    let mut row = |name: &str, p: RfMemParams| -> Result<(f64, f64, Scores)> {
        bar.inc(1);
        let (s5, _) = run(&users, &questions, &qv.vectors, &at(5, p))?;
        let (s10, rec) = run(&users, &questions, &qv.vectors, &at(10, p))?;
        let (r5, _) = mean(&s5, "Overall");
        let (r10, n10) = mean(&s10, "Overall");
        let (a, tau) = match p.mode {
            Mode::Familiarity => ("–".to_owned(), "–".to_owned()),
            Mode::Recollection => (format!("{:.1}", p.alpha), "–".to_owned()),
            Mode::Adaptive => (format!("{:.1}", p.alpha), format!("{:.2}", p.tau)),
        };
        table.push_str(&format!(
            "| {name} | {a} | {tau} | {r5:.4} | {r10:.4} | {n10:.4} | {rec} of {} |\n",
            questions.len()
        ));
        Ok((r5, r10, s10))
    };
    let (f5, f10, fam) = row(
        "Familiarity (top-k)",
        RfMemParams {
            mode: Mode::Familiarity,
            ..official
        },
    )?;
    let mut best_rec = (0.0, 0.0, 0.0);
    let alphas: Vec<f64> = (1..=9).map(|a| f64::from(a) / 10.0).collect();
    let mut sweep = vec![plot::Series {
        name: "Recollection only".into(),
        values: Vec::new(),
    }];
    for a in 1..=9 {
        let alpha = a as f32 / 10.0;
        let (r5, r10, _) = row(
            "Recollection only",
            RfMemParams {
                mode: Mode::Recollection,
                alpha,
                ..official
            },
        )?;
        sweep[0].values.push(r10);
        if r10 > best_rec.1 {
            best_rec = (r5, r10, f64::from(alpha));
        }
    }
    let mut headline = (0.0, 0.0);
    let mut by_type = BTreeMap::new();
    for tau in [0.2f32, 0.25, 0.3] {
        sweep.push(plot::Series {
            name: format!("RF-Mem, τ = {tau:.2}"),
            values: Vec::new(),
        });
        for a in 1..=9 {
            let alpha = a as f32 / 10.0;
            let (r5, r10, s) = row(
                "RF-Mem (official)",
                RfMemParams {
                    alpha,
                    tau,
                    ..official
                },
            )?;
            if let Some(s) = sweep.last_mut() {
                s.values.push(r10);
            }
            if a == 5 && (tau - 0.25).abs() < 1e-6 {
                headline = (r5, r10);
                by_type = s;
            }
        }
    }
    let (d5, d10, _) = row("RF-Mem (steamrf defaults: top-up)", RfMemParams::default())?;
    bar.finish_and_clear();
    sweep.push(plot::Series {
        name: "Familiarity (top-k)".into(),
        values: vec![f10],
    });
    let png = plot::lines(
        &e.out.join("rfmem-personabench-alpha.png"),
        "PersonaBench Recall@10 against α (all-MiniLM-L6-v2)",
        ("α", "Recall@10"),
        &alphas,
        &sweep,
    )?;
    table.push_str("\nBy question type, Recall@10 (RF-Mem α = 0.5, τ = 0.25 vs Familiarity):\n\n| type | n | Familiarity | RF-Mem |\n| --- | ---: | ---: | ---: |\n");
    for (cat, acc) in &by_type {
        table.push_str(&format!(
            "| {cat} | {} | {:.4} | {:.4} |\n",
            acc.n,
            mean(&fam, cat).0,
            mean(&by_type, cat).0
        ));
    }
    let file = super::write_table(&e.out, "rfmem-personabench.md", &table)?;
    out.extend(table.lines().map(|l| format!("  {l}")));
    out.push(format!(
        "  familiarity R@5/R@10 {f5:.4}/{f10:.4}; best recollection {:.4}/{:.4} (α {:.1}); steamrf defaults {d5:.4}/{d10:.4}; table in {}; {}; took {:.0} s",
        best_rec.0,
        best_rec.1,
        best_rec.2,
        file.display(),
        plot::said(&png),
        started.elapsed().as_secs_f64()
    ));
    out.push(format!(
        "RESULT recall5={:.4} recall10={:.4} alpha=0.5 tau=0.25 familiarity_recall10={f10:.4} steamrf_defaults_recall10={d10:.4}",
        headline.0, headline.1
    ));
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_official_metric_takes_the_best_combination() {
        let truth = vec![vec!["a".to_owned(), "b".to_owned()], vec!["c".to_owned()]];
        // b and c retrieved: the combination (b, c) is fully recalled.
        let (r, n) = score(&["x", "b", "c"], &truth);
        assert!((r - 1.0).abs() < 1e-12);
        let dcg = 1.0 / 3f64.log2() + 1.0 / 4f64.log2();
        let idcg = 1.0 + 1.0 / 3f64.log2();
        assert!((n - dcg / idcg).abs() < 1e-12);
        assert_eq!(score(&["x"], &truth), (0.0, 0.0));
        assert_eq!(score(&["a"], &truth).0, 0.5);
    }

    #[test]
    fn corpus_items_follow_the_official_order_and_format() {
        let conv = pyjson::parse(
            r#"[{"Target_name": "Sam", "Conversations": [{"session": "s1", "time": "t", "conversation": [{"role": "Jen", "content": "caf\u00e9"}], "segment_id": "001"}]}]"#,
        )
        .unwrap();
        let ai =
            pyjson::parse(r#"[{"session": "s2", "user_ai_interaction": [], "segment_id": "002"}]"#)
                .unwrap();
        let buy = pyjson::parse(r#"[{"session": "s3", "purchase_history": [{"title": "T", "price": 9.5}], "segment_id": "003"}]"#).unwrap();
        let c = corpus(&conv, &ai, &buy);
        assert_eq!(
            c,
            vec![
                (
                    "001".to_owned(),
                    r#"{"time":"t","conversation":[{"role":"Jen","content":"caf\u00e9"}]}"#
                        .to_owned()
                ),
                ("002".to_owned(), r#"{"user_ai_interaction":[]}"#.to_owned()),
                (
                    "003".to_owned(),
                    r#"{"purchase_history":[{"title":"T","price":9.5}]}"#.to_owned()
                ),
            ]
        );
    }
}
