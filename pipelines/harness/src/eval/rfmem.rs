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
use steamrf_operators::embed::SparseVec;
use steamrf_operators::rfmem::{self, Mode, RfMemParams, VectorStore};
use steamrf_pipelines::config::EmbedConfig;
use steamrf_pipelines::error::{Error, Result};

use super::passages;
use super::plot;
use super::pyjson::{self, Json};

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
    /// How sessions are cut into windows.
    pub window: steamrf_operators::passage::WindowParams,
    /// The noise level the hybrid parameters are chosen on.
    pub tune_noise: String,
    /// The service's configuration: its evidence units (`[serve.units]`,
    /// `[serve.rfmem]`, `max_turns`) are scored as they are, unfitted.
    pub serve: steamrf_pipelines::config::ServeConfig,
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

/// One noise level's corpus and questions.
struct Data {
    /// Every memory item's official text, users one after another.
    texts: Vec<String>,
    /// Each user's range of `texts`.
    spans: Vec<std::ops::Range<usize>>,
    questions: Vec<Question>,
    user_segments: Vec<Vec<String>>,
    user_units: Vec<Vec<passages::Unit>>,
}

/// Loads the official protocol's users and questions at `noise`.
fn load_data(root: &Path, noise: &str) -> Result<Data> {
    let mut texts: Vec<String> = Vec::new();
    let mut spans = Vec::new();
    let mut questions = Vec::new();
    let mut user_segments = Vec::new();
    let mut user_units = Vec::new();
    for community in 0..2 {
        let dir = root.join(format!("community_{community}"));
        let info = load(&dir.join("eval_info/eval_info_all.json"))?;
        let gt = load(&dir.join(format!("eval_info/qa_gt_context_all_noise_{noise}.json")))?;
        let private = dir.join(format!("private_data/noise_{noise}"));
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
            if !(conv.contains_key(name)
                || user_ai.contains_key(name)
                || purchases.contains_key(name))
            {
                return Err(bad(&format!(
                    "{name} (community {community}) has no private data in {}",
                    private.display()
                )));
            }
            let empty = Json::Arr(Vec::new());
            let (c, a, p) = (
                conv.get(name).unwrap_or(&empty),
                user_ai.get(name).unwrap_or(&empty),
                purchases.get(name).unwrap_or(&empty),
            );
            let items = corpus(c, a, p);
            user_units.push(passages::units(c, a, p));
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
    if questions.is_empty() {
        return Err(bad(&format!(
            "no scored questions under {} at noise {}",
            root.display(),
            noise
        )));
    }
    Ok(Data {
        texts,
        spans,
        questions,
        user_segments,
        user_units,
    })
}

/// Runs the evaluation.
///
/// # Errors
/// Missing or malformed data, or embedding failures.
pub async fn rfmem(e: RfMemEval) -> Result<Vec<String>> {
    let started = Instant::now();
    std::fs::create_dir_all(&e.out).map_err(|source| Error::Io {
        context: format!("creating {}", e.out.display()),
        source,
    })?;
    let root = ["eval_data_v1/synthetic_data", "synthetic_data", ""]
        .iter()
        .map(|s| e.data.join(s))
        .find(|p| p.join("community_0").is_dir())
        .ok_or_else(|| bad(&format!("no community_0 under {}", e.data.display())))?;
    let Data {
        texts,
        spans,
        questions,
        user_segments,
        user_units,
    } = load_data(&root, &e.noise)?;
    let mut out = vec![format!(
        "eval rfmem: PersonaBench noise {}, {} users, {} memory items, {} scored questions",
        e.noise,
        user_segments.len(),
        texts.len(),
        questions.len()
    )];
    let embedder = steamrf_pipelines::embed::embedder(&e.embed)?.ok_or_else(|| Error::Config {
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
    let item_vectors: Vec<Vec<f32>> = spans
        .iter()
        .map(|s| docs.vectors[s.start * dim..s.end * dim].to_vec())
        .collect();
    let sparse = steamrf_pipelines::embed::sparse_encoder(&e.embed)?;
    let hybrid_users = passages::build(
        &embedder,
        sparse.as_deref(),
        user_segments.clone(),
        &user_units,
        &item_vectors,
        &e.window,
        &mut out,
    )
    .await?;
    // The tuning split: the same protocol at another noise level.
    let tuning = if e.tune_noise == e.noise {
        None
    } else {
        let d = load_data(&root, &e.tune_noise)?;
        let docs = emb(d.texts).await?;
        let qv = emb(d.questions.iter().map(|q| q.text.clone()).collect()).await?;
        let item_vectors: Vec<Vec<f32>> = d
            .spans
            .iter()
            .map(|s| docs.vectors[s.start * dim..s.end * dim].to_vec())
            .collect();
        out.push(format!(
            "  tuning split: noise {}, {} memory items, {} questions",
            e.tune_noise,
            docs.vectors.len() / dim,
            d.questions.len()
        ));
        let users = passages::build(
            &embedder,
            sparse.as_deref(),
            d.user_segments,
            &d.user_units,
            &item_vectors,
            &e.window,
            &mut out,
        )
        .await?;
        Some((users, d.questions, qv.vectors))
    };
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
        &e.out
            .join(format!("rfmem-personabench-noise{}-alpha.png", e.noise)),
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
    let test = Split {
        users: &hybrid_users,
        questions: &questions,
        vectors: &qv.vectors,
    };
    let tune = tuning.as_ref().map_or(
        Split {
            users: &hybrid_users,
            questions: &questions,
            vectors: &qv.vectors,
        },
        |(users, questions, vectors)| Split {
            users,
            questions,
            vectors,
        },
    );
    let hybrid = hybrid_section(&test, &tune, dim, &mut table)?;
    let units = units_section(
        &e.serve,
        sparse.as_deref(),
        &test,
        &tune,
        dim,
        &hybrid,
        &mut table,
    )?;
    let file = super::write_table(
        &e.out,
        &format!("rfmem-personabench-noise{}.md", e.noise),
        &table,
    )?;
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
        "RESULT noise={} recall5={:.4} recall10={:.4} ndcg10={:.4} tuned_on=noise{} familiarity_recall10={f10:.4} official_rfmem_recall5={:.4} official_rfmem_recall10={:.4} recall10_ci95_low={:.4} recall10_ci95_high={:.4} delta10={:.4} delta10_ci95_low={:.4} delta10_ci95_high={:.4} units_recall5={:.4} units_recall10={:.4} units_recall10_ci95_low={:.4} units_recall10_ci95_high={:.4} units_delta10_vs_rows={:.4} units_delta10_ci95_low={:.4} units_delta10_ci95_high={:.4} units_turns_per_answer={:.1} units_tune_recall10={:.4}",
        e.noise,
        hybrid.r5,
        hybrid.r10.0,
        hybrid.n10,
        e.tune_noise,
        headline.0,
        headline.1,
        hybrid.r10.1,
        hybrid.r10.2,
        hybrid.delta.0,
        hybrid.delta.1,
        hybrid.delta.2,
        units.r5,
        units.r10.0,
        units.r10.1,
        units.r10.2,
        units.delta.0,
        units.delta.1,
        units.delta.2,
        units.turns,
        units.tune_r10,
    ));
    Ok(out)
}

/// The served answer's headline on the test split.
struct Served {
    r5: f64,
    r10: (f64, f64, f64),
    /// Recall@10 minus the row path's declared configuration, paired.
    delta: (f64, f64, f64),
    /// Turns handed over per K = 10 answer.
    turns: f64,
    tune_r10: f64,
}

/// Scores what `steamrf serve` answers from these sessions with its
/// configuration as it is (`[serve.units]`, fitted on LoCoMo's development
/// half, not here): windows ranked as evidence units, an answer scored by
/// the items its units come from. Appends its table to `table`.
fn units_section(
    serve: &steamrf_pipelines::config::ServeConfig,
    sparse: Option<&steamrf_operators::embed::Splade>,
    test: &Split<'_>,
    tune: &Split<'_>,
    dim: usize,
    rows: &Hybrid,
    table: &mut String,
) -> Result<Served> {
    let served = passages::Served {
        units: &serve.units,
        rf: &serve.rfmem,
        max_turns: serve.max_turns,
    };
    let encode = |split: &Split<'_>| -> Result<Vec<Option<SparseVec>>> {
        let Some(enc) = sparse else {
            return Ok(vec![None; split.questions.len()]);
        };
        let texts: Vec<&str> = split.questions.iter().map(|q| q.text.as_str()).collect();
        let v =
            tokio::task::block_in_place(|| enc.encode(&texts)).map_err(|e| Error::Internal {
                message: format!("sparse-encoding the questions: {e}"),
            })?;
        Ok(v.into_iter().map(Some).collect())
    };
    let (test_sparse, tune_sparse) = (encode(test)?, encode(tune)?);
    let on_test = passages::run_units(test.users, &test.qs(dim), &test_sparse, &served, score)?;
    let on_tune = passages::run_units(tune.users, &tune.qs(dim), &tune_sparse, &served, score)?;
    let out = Served {
        r5: avg(&on_test.scores.r5),
        r10: super::bootstrap_ci(&on_test.scores.r10, 17),
        delta: paired_ci(&on_test.scores.r10, &rows.per_question),
        turns: avg(&on_test.turns),
        tune_r10: avg(&on_tune.scores.r10),
    };
    let recollected = |r: &passages::ServedRun| r.scores.recollected.iter().filter(|x| **x).count();
    // The two knobs that trade LoCoMo's evidence turns against sessions
    // covered, the cap on units per session and the soft penalty for each
    // unit a session already gave: a sweep on both splits.
    let mut sweep = String::from(
        "\n| `[serve.units]` | tuning R@10 | test R@10 | test turns per answer |\n| --- | ---: | ---: | ---: |\n",
    );
    let variants = [0usize, 1, 2, 3]
        .map(|per_row| (per_row, 0.0f32))
        .into_iter()
        .chain([0.025f32, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0].map(|penalty| (0, penalty)));
    for (per_row, repeat_penalty) in variants {
        let units = steamrf_operators::passage::UnitParams {
            per_row,
            repeat_penalty,
            ..serve.units
        };
        let configured = units == serve.units;
        // The configured values' runs are the ones above.
        let other;
        let (t, v) = if configured {
            (&on_test, &on_tune)
        } else {
            let at = passages::Served {
                units: &units,
                ..served
            };
            other = (
                passages::run_units(test.users, &test.qs(dim), &test_sparse, &at, score)?,
                passages::run_units(tune.users, &tune.qs(dim), &tune_sparse, &at, score)?,
            );
            (&other.0, &other.1)
        };
        sweep.push_str(&format!(
            "| per_row {per_row}, repeat_penalty {repeat_penalty}{} | {:.4} | {:.4} | {:.1} |\n",
            if configured { " (configured)" } else { "" },
            avg(&v.scores.r10),
            avg(&t.scores.r10),
            avg(&t.turns),
        ));
    }
    table.push_str(&format!(
        "\nThe served answer: for sessions with windows `steamrf serve` ranks the windows themselves as evidence units (`[serve.units]`: mix {:.2}, lexical {:.2}, sparse {:.2}{}; `[serve.rfmem]` {:?}; at most {} turns), so this is what an agent asking `/v1/retrieve` for K units gets. Scored by the items its units come from, in the order they first appear; nothing here is fitted on PersonaBench (the weights come from LoCoMo's development half).\n\n| split | Recall@5 | Recall@10 | NDCG@10 | R@10 95% CI | Δ R@10 vs the row path above (95% CI) | turns per answer | recollected |\n| --- | ---: | ---: | ---: | --- | --- | ---: | ---: |\n| test | {:.4} | **{:.4}** | {:.4} | {:.4} – {:.4} | {:+.4} ({:+.4} – {:+.4}) | {:.1} | {} of {} |\n| tuning | {:.4} | {:.4} | {:.4} | | | {:.1} | {} of {} |\n",
        serve.units.mix,
        serve.units.lexical_weight,
        serve.units.sparse_weight,
        if sparse.is_some() { "" } else { ", no sparse encoder configured" },
        serve.rfmem.mode,
        serve.max_turns,
        out.r5,
        out.r10.0,
        avg(&on_test.scores.n10),
        out.r10.1,
        out.r10.2,
        out.delta.0,
        out.delta.1,
        out.delta.2,
        out.turns,
        recollected(&on_test),
        on_test.scores.r10.len(),
        avg(&on_tune.scores.r5),
        out.tune_r10,
        avg(&on_tune.scores.n10),
        avg(&on_tune.turns),
        recollected(&on_tune),
        on_tune.scores.r10.len(),
    ));
    table.push_str(&sweep);
    Ok(out)
}

/// The hybrid passages' headline (test means, with 95% CIs).
struct Hybrid {
    r5: f64,
    /// Mean and CI.
    r10: (f64, f64, f64),
    n10: f64,
    /// Recall@10 minus top-k over whole items, paired over questions.
    delta: (f64, f64, f64),
    /// Recall@10 of each test question.
    per_question: Vec<f64>,
}

/// One noise level's indexes and questions.
struct Split<'a> {
    users: &'a [passages::HybridUser],
    questions: &'a [Question],
    vectors: &'a [f32],
}

impl Split<'_> {
    fn qs(&self, dim: usize) -> Vec<passages::Q<'_>> {
        self.questions
            .iter()
            .enumerate()
            .map(|(i, q)| passages::Q {
                user: q.user,
                text: &q.text,
                vector: &self.vectors[i * dim..(i + 1) * dim],
                truth: &q.truth,
            })
            .collect()
    }
}

/// `a − b`, question by question, with its 95% bootstrap interval.
fn paired_ci(a: &[f64], b: &[f64]) -> (f64, f64, f64) {
    let diff: Vec<f64> = a.iter().zip(b).map(|(x, y)| x - y).collect();
    super::bootstrap_ci(&diff, 17)
}

fn avg(xs: &[f64]) -> f64 {
    xs.iter().sum::<f64>() / xs.len().max(1) as f64
}

/// Sweeps the hybrid configurations on the tuning split, picks the best
/// Recall@10 there (familiarity first, then the paths on top of it), and
/// scores the choice on the test split; appends the tables to `table`.
fn hybrid_section(
    test: &Split<'_>,
    tune: &Split<'_>,
    dim: usize,
    table: &mut String,
) -> Result<Hybrid> {
    use passages::PerQuestion;
    let (tq, vq) = (tune.qs(dim), test.qs(dim));
    let configs = passages::sweep();
    let bar = super::progress(configs.len() * 2, "hybrid configurations");
    let mut rows: Vec<(passages::Config, PerQuestion, PerQuestion)> = Vec::new();
    for c in &configs {
        bar.inc(2);
        rows.push((
            *c,
            passages::run(tune.users, &tq, c, score)?,
            passages::run(test.users, &vq, c, score)?,
        ));
    }
    bar.finish_and_clear();
    // Only what the service can run is eligible: session vectors are the
    // mean of their turns' there (whole-item vectors are an ablation).
    let best = |rows: &[(passages::Config, PerQuestion, PerQuestion)]| {
        let mut b = (f64::NEG_INFINITY, 0);
        for (i, r) in rows.iter().enumerate() {
            if r.0.row_vector != passages::RowVector::Turns {
                continue;
            }
            let m = avg(&r.1.r10);
            if m > b.0 + 1e-12 {
                b = (m, i);
            }
        }
        b.1
    };
    let chosen = best(&rows);
    // The paths on top of the familiarity choice, chosen the same way.
    let base = rows[chosen].0;
    let mut probe: Vec<f32> = passages::run(
        tune.users,
        &tq,
        &passages::Config {
            rf: RfMemParams {
                mode: Mode::Adaptive,
                ..base.rf
            },
            ..base
        },
        score,
    )?
    .probe_mean;
    let mut paths = Vec::new();
    for c in passages::paths(&base, &mut probe) {
        paths.push((
            c,
            passages::run(tune.users, &tq, &c, score)?,
            passages::run(test.users, &vq, &c, score)?,
        ));
    }
    let chosen_path = best(&paths);
    table.push_str("\nHybrid RF-Mem over passages. Familiarity sweep (the tuning split's Recall@10 chooses among the turn-mean rows, which the service has; the ablations are window-mean rows (the mean of a session's window vectors), session-head rows (the session with its header embedded whole, cut at the model's limit) and item rows (the official whole-item vector, cut at 256 tokens); the test split's Recall@10 is shown beside it):\n\n| configuration | tuning R@10 | test R@10 |\n| --- | ---: | ---: |\n");
    for (i, (c, t, v)) in rows.iter().enumerate() {
        table.push_str(&format!(
            "| {}{} | {:.4} | {:.4} |\n",
            passages::name(c),
            if i == chosen { " **(chosen)**" } else { "" },
            avg(&t.r10),
            avg(&v.r10)
        ));
    }
    // Per path on the test split: how often the gate recollects, and the
    // recall of each path on the questions routed to it and on the others.
    let fam = &paths[0].2;
    let rec = &paths[2].2; // recollection, α = 0.5
    table.push_str("\nPaths on top of the chosen familiarity setting (θ at the 25th/50th/75th percentile of the tuning split's probe means; test split routed by each gate; R@10 of familiarity and of recollection on the questions each gate sends to recollection and to familiarity):\n\n| configuration | tuning R@10 | test R@10 | test routed to recollection | on those: familiarity / recollection | on the rest: familiarity / recollection |\n| --- | ---: | ---: | ---: | --- | --- |\n");
    for (i, (c, t, v)) in paths.iter().enumerate() {
        let split = |want: bool, r: &PerQuestion| -> f64 {
            let xs: Vec<f64> = r
                .r10
                .iter()
                .zip(&v.recollected)
                .filter(|(_, x)| **x == want)
                .map(|(r, _)| *r)
                .collect();
            avg(&xs)
        };
        let routed = v.recollected.iter().filter(|x| **x).count();
        table.push_str(&format!(
            "| {}{} | {:.4} | {:.4} | {routed} of {} | {:.4} / {:.4} | {:.4} / {:.4} |\n",
            passages::name(c),
            if i == chosen_path {
                " **(chosen)**"
            } else {
                ""
            },
            avg(&t.r10),
            avg(&v.r10),
            v.r10.len(),
            split(true, fam),
            split(true, rec),
            split(false, fam),
            split(false, rec),
        ));
    }
    let pick = &paths[chosen_path].2;
    // Top-k over whole items, no windows, no lexical side: the official
    // familiarity baseline on the same split.
    let plain = passages::run(
        test.users,
        &vq,
        &passages::Config {
            row_vector: passages::RowVector::Plain,
            rf: RfMemParams {
                mode: Mode::Familiarity,
                ..RfMemParams::default()
            },
            hybrid: steamrf_operators::passage::HybridParams {
                mix: 0.0,
                lexical_weight: 0.0,
                ..Default::default()
            },
        },
        score,
    )?;
    let out = Hybrid {
        r5: avg(&pick.r5),
        r10: super::bootstrap_ci(&pick.r10, 17),
        n10: avg(&pick.n10),
        delta: paired_ci(&pick.r10, &plain.r10),
        per_question: pick.r10.clone(),
    };
    table.push_str(&format!(
        "\nDeclared configuration (chosen on the tuning split): {}. Test: Recall@5 {:.4}, Recall@10 {:.4} [95% CI {:.4}, {:.4}], NDCG@10 {:.4}; against top-k over whole items ({:.4}): {:+.4} [{:+.4}, {:+.4}] (paired bootstrap over questions, 1,000 resamples).\n",
        passages::name(&paths[chosen_path].0),
        out.r5,
        out.r10.0,
        out.r10.1,
        out.r10.2,
        out.n10,
        avg(&plain.r10),
        out.delta.0,
        out.delta.1,
        out.delta.2,
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
