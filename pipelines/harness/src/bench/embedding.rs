//! `steamrf bench embed`: sentences/s of the in-process embedder beside
//! sentence-transformers on the same texts and model, in the same run; and
//! the timed embedder run that `bench ingest`'s turn rates reuse.

use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Instant;

use steamrf_pipelines::config::{Config, EmbedConfig, EmbedEngine, EmbedPrecision};
use steamrf_pipelines::embed;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::sql;

use super::produce::{bench_is_turn, bench_turn_text};
use super::texts::bench_texts;

/// The in-process embedder timed on `texts`.
pub(super) struct Timed {
    /// The best of the runs, seconds.
    pub(super) secs: f64,
    /// The vectors of the last run, row-major.
    pub(super) vectors: Vec<f32>,
    /// Tokens embedded in one run.
    pub(super) tokens: u64,
    /// The embedder's vector length.
    pub(super) dim: usize,
    /// The number format it ran at (`f32`, `int16`, `int8`).
    pub(super) precision: &'static str,
}

/// Loads the local engine of `cfg`, warms it up, then embeds `texts` `runs`
/// times: calls of `chunk` texts, all submitted at once (each call is cut
/// into forward passes that the workers take in turn).
pub(super) async fn time_embedder(
    cfg: &EmbedConfig,
    texts: &[String],
    chunk: usize,
    runs: usize,
) -> Result<Timed> {
    let mut cfg = cfg.clone();
    cfg.engine = EmbedEngine::Local;
    let embedder = embed::embedder(&cfg)?.ok_or_else(|| Error::Internal {
        message: "no embedder".into(),
    })?;
    let err = |e: steamrf_operators::embed::EmbedError| Error::Internal {
        message: e.to_string(),
    };
    // Warm-up (first-touch of the weights, thread start).
    embedder
        .embed(texts.iter().take(64).cloned().collect())
        .await
        .map_err(err)?;
    let mut timed = Timed {
        secs: f64::INFINITY,
        vectors: Vec::new(),
        tokens: 0,
        dim: embedder.dim(),
        precision: embedder.precision(),
    };
    for _ in 0..runs.max(1) {
        let t = Instant::now();
        let calls = texts
            .chunks(chunk.max(1))
            .map(|c| embedder.embed(c.to_vec()));
        let results = futures::future::join_all(calls).await;
        timed.secs = timed.secs.min(t.elapsed().as_secs_f64());
        timed.vectors.clear();
        timed.tokens = 0;
        for r in results {
            let r = r.map_err(err)?;
            timed.tokens += r.tokens;
            timed.vectors.extend(r.vectors);
        }
    }
    Ok(timed)
}

/// The in-process embeddings of every non-empty line of `path`, `dim`
/// values each, in file order (`bench communities --texts`).
///
/// # Errors
/// The file unreadable or empty, or the model failing to load.
pub async fn embed_file(cfg: &EmbedConfig, path: &std::path::Path) -> Result<Vec<f32>> {
    let texts: Vec<String> = std::fs::read_to_string(path)
        .map_err(|source| Error::Io {
            context: format!("reading {}", path.display()),
            source,
        })?
        .lines()
        .filter(|l| !l.trim().is_empty())
        .map(str::to_owned)
        .collect();
    if texts.is_empty() {
        return Err(Error::Internal {
            message: format!("{} has no text", path.display()),
        });
    }
    Ok(time_embedder(cfg, &texts, 256, 1).await?.vectors)
}

/// Options of `steamrf bench embed`.
#[derive(Debug, Clone)]
pub struct EmbedBench {
    /// Texts to embed (generated unless `corpus` is given).
    pub texts: usize,
    /// One text per line, instead of the generated corpus.
    pub corpus: Option<PathBuf>,
    /// The embedding configuration (model directory, batch size, workers).
    pub config: EmbedConfig,
    /// Texts per embed call (the pipeline's micro-batch of dialogue turns).
    pub chunk: usize,
    /// Skip the sentence-transformers reference.
    pub no_reference: bool,
}

/// `steamrf bench embed`: sentences/s of the in-process embedder through the
/// pipeline's async interface at the configured `embed.precision`, beside the
/// same embedder at f32 and sentence-transformers on torch (f32, and under
/// `torch.autocast(bfloat16)`) on the same texts and model directory, in the
/// same run; the lowest cosine between the configured and the f32 vectors.
///
/// # Errors
/// The model failing to load, or the reference failing to run.
pub async fn embed(b: EmbedBench) -> Result<Vec<String>> {
    let mut out = Vec::new();
    let texts = match &b.corpus {
        Some(path) => std::fs::read_to_string(path)
            .map_err(|source| Error::Io {
                context: format!("reading {}", path.display()),
                source,
            })?
            .lines()
            .take(b.texts)
            .map(str::to_owned)
            .collect(),
        None => bench_texts(b.texts, 42),
    };
    let mut cfg = b.config.clone();
    cfg.engine = EmbedEngine::Local;
    let mut f32_cfg = cfg.clone();
    f32_cfg.precision = EmbedPrecision::F32;
    // The configured precision, then f32 unless that is what ran: each the
    // best of two runs.
    let configured = time_embedder(&cfg, &texts, b.chunk, 2).await?;
    let precision = configured.precision;
    let f32_run = if precision == "f32" {
        None
    } else {
        Some(time_embedder(&f32_cfg, &texts, b.chunk, 2).await?)
    };
    let reference32 = f32_run.as_ref().unwrap_or(&configured);
    let Timed {
        secs: best,
        ref vectors,
        tokens,
        dim,
        ..
    } = configured;
    let steamrf = texts.len() as f64 / best;
    let f32_rate = texts.len() as f64 / reference32.secs;
    let cos_min = vectors
        .chunks(dim)
        .zip(reference32.vectors.chunks(dim))
        .map(|(a, b)| a.iter().zip(b).map(|(x, y)| x * y).sum::<f32>())
        .fold(1.0f32, f32::min);
    out.push(format!(
        "steamrf ({:?} forward pass, {precision}, {} worker(s), batches of {}, length-sorted): {} texts, {:.1} tokens/text, {best:.2} s, {steamrf:.1} sentences/s",
        cfg.backend,
        embed::workers(&cfg),
        cfg.batch_size,
        texts.len(),
        tokens as f64 / texts.len() as f64
    ));
    out.push(format!(
        "steamrf at f32, same texts: {:.2} s, {f32_rate:.1} sentences/s; {precision} is {:.2}x f32, lowest cosine to the f32 vectors {cos_min:.5} over {} texts",
        reference32.secs,
        steamrf / f32_rate,
        texts.len()
    ));
    // The learned sparse encoder on the same texts (what each ingested turn
    // costs on top of its dense vector), best of two.
    let sparse_rate = match embed::sparse_encoder(&cfg)? {
        Some(enc) => {
            let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
            let mut best_s = f64::INFINITY;
            let mut terms = 0usize;
            for _ in 0..2 {
                let t = Instant::now();
                let v = tokio::task::block_in_place(|| enc.encode(&refs)).map_err(|e| {
                    Error::Internal {
                        message: e.to_string(),
                    }
                })?;
                best_s = best_s.min(t.elapsed().as_secs_f64());
                terms = v.iter().map(|v| v.len()).sum();
            }
            let rate = texts.len() as f64 / best_s;
            out.push(format!(
                "SPLADE ({}, {} thread(s)): {best_s:.2} s, {rate:.1} sentences/s, {:.1} terms/text; a turn's sparse vector costs {:.2}x its {precision} dense one",
                enc.model_id(),
                embed::workers(&cfg),
                terms as f64 / texts.len() as f64,
                steamrf / rate
            ));
            rate
        }
        None => f64::NAN,
    };
    let ours = format!(
        "precision={precision} steamrf_sentences_per_s={steamrf:.1} f32_sentences_per_s={f32_rate:.1} ratio_vs_f32={:.3} cos_min={cos_min:.5} sparse_sentences_per_s={sparse_rate:.1} sparse_cost_vs_dense={:.3}",
        steamrf / f32_rate,
        steamrf / sparse_rate
    );
    if b.no_reference {
        out.push(format!(
            "RESULT {ours} reference_sentences_per_s=nan torch_bf16_sentences_per_s=nan ratio=nan ratio_vs_torch_bf16=nan"
        ));
        return Ok(out);
    }
    let file = tempfile::NamedTempFile::new().map_err(|source| Error::Io {
        context: "creating a temp file".into(),
        source,
    })?;
    std::fs::write(file.path(), texts.join("\n")).map_err(|source| Error::Io {
        context: "writing the texts".into(),
        source,
    })?;
    let output = Command::new("scripts/st-reference.sh")
        .arg("--texts")
        .arg(file.path())
        .arg("--model")
        .arg(&cfg.model_dir)
        .args(["--batch-size", &cfg.batch_size.to_string()])
        .arg("--bf16")
        .stderr(Stdio::inherit())
        .output()
        .map_err(|source| Error::Io {
            context: "running scripts/st-reference.sh".into(),
            source,
        })?;
    if !output.status.success() {
        return Err(Error::Internal {
            message: "scripts/st-reference.sh failed (see above)".into(),
        });
    }
    let report: serde_json::Value =
        serde_json::from_slice(&output.stdout).map_err(|e| Error::Internal {
            message: format!("st_bench.py output: {e}"),
        })?;
    let reference = report["sentences_per_s"].as_f64().unwrap_or(f64::NAN);
    let bf16 = report["bf16_sentences_per_s"].as_f64().unwrap_or(f64::NAN);
    let mut max_diff = 0.0f32;
    if let Some(vs) = report["vectors"].as_array() {
        for (i, v) in vs.iter().enumerate() {
            for (j, x) in v.as_array().into_iter().flatten().enumerate() {
                let x = x.as_f64().unwrap_or(f64::NAN) as f32;
                max_diff = max_diff.max((x - reference32.vectors[i * dim + j]).abs());
            }
        }
    }
    out.push(format!(
        "sentence-transformers {} (torch {}, {} threads, batch {}): f32 {reference:.1} sentences/s, bf16 autocast {bf16:.1} (lowest cosine to its f32 vectors {}); steamrf f32's max abs difference over the first 50 vectors: {max_diff:.1e}",
        "6.2.0",
        report["torch"].as_str().unwrap_or("?"),
        report["threads"],
        cfg.batch_size,
        report["bf16_cos_min"]
    ));
    out.push(format!(
        "RESULT {ours} reference_sentences_per_s={reference:.1} torch_bf16_sentences_per_s={bf16:.1} ratio={:.3} ratio_vs_torch_bf16={:.3}",
        steamrf / reference,
        steamrf / bf16
    ));
    Ok(out)
}

/// The dialogue-turn side of `bench ingest --turns-share`.
pub(super) struct TurnRates {
    /// Turns stored.
    pub(super) turns: u64,
    /// Turns stored per second, first record → last commit.
    pub(super) turns_per_s: f64,
    /// Texts the pipeline embedded (turns and passage windows).
    pub(super) embedded: u64,
    /// Turn texts the embedder was timed on alone.
    pub(super) sample: usize,
    /// The embedder's own rate on them, texts/s.
    pub(super) embedder_per_s: f64,
    /// Texts the pipeline embedded per second, first record → last commit.
    pub(super) texts_per_s: f64,
    /// The embedder's own rate on a sample of the texts the pipeline
    /// embedded (stored turn texts and passage windows, in the pipeline's
    /// proportion), texts/s.
    pub(super) embedder_mix_per_s: f64,
}

/// Counts the stored turns and times the embedder alone on the same turn
/// texts (up to 4,000 of them), and on a sample of every text the pipeline
/// embedded; each in one call, the embedder's best.
pub(super) async fn turn_rates(
    config: &Config,
    n: u64,
    distinct: u64,
    turns_share: f64,
    secs: f64,
    metrics: &Metrics,
) -> Result<TurnRates> {
    let rows = sql::query(
        &config.lancedb,
        "SELECT count(*) AS n FROM interactions WHERE kind = 'dialogue_turn'",
    )
    .await?;
    let turns = rows
        .first()
        .and_then(|b| {
            b.column(0)
                .as_any()
                .downcast_ref::<arrow_array::Int64Array>()
                .map(|a| a.value(0))
        })
        .unwrap_or(0) as u64;
    let texts: Vec<String> = (0..n.min(distinct.max(1)))
        .filter(|&i| bench_is_turn(i, turns_share))
        .take(4000)
        .map(bench_turn_text)
        .collect();
    // One call: the embedder's best on these texts (sorted by length into
    // forward passes, every worker busy).
    let timed = time_embedder(&config.embed, &texts, texts.len(), 1).await?;
    // The same work the pipeline did: its turn texts and its windows, as
    // stored, in the proportion it embedded them.
    use arrow_array::cast::AsArray;
    let embedded = metrics.total_texts_embedded();
    let windows = sql::query(
        &config.lancedb,
        "SELECT text FROM passages ORDER BY event_id LIMIT 4000",
    )
    .await?;
    let windows: Vec<String> = windows
        .iter()
        .flat_map(|b| {
            b.column(0)
                .as_string::<i32>()
                .iter()
                .flatten()
                .map(str::to_owned)
                .collect::<Vec<_>>()
        })
        .collect();
    let share = embedded.saturating_sub(turns) as f64 / embedded.max(1) as f64;
    let k = ((texts.len() as f64 * share).round() as usize).min(windows.len());
    let mix: Vec<String> = texts[..texts.len() - k]
        .iter()
        .chain(&windows[..k])
        .cloned()
        .collect();
    let mixed = time_embedder(&config.embed, &mix, mix.len(), 1).await?;
    Ok(TurnRates {
        turns,
        turns_per_s: turns as f64 / secs,
        embedded,
        sample: texts.len(),
        embedder_per_s: texts.len() as f64 / timed.secs,
        texts_per_s: embedded as f64 / secs,
        embedder_mix_per_s: mix.len() as f64 / mixed.secs,
    })
}
