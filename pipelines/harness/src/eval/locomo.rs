//! `steamrf eval locomo --data DIR`: conversation retrieval on LoCoMo
//! through the served path, with the protocol of the data's README
//! (../shared/data/locomo/README.md; issue 45).
//!
//! - **Ingest as a deployment does.** One conversation is one user; each
//!   turn is a `dialogue_turn` event (event id `<user>:<dia_id>`, a session
//!   id per session, the session's time plus the turn's index in seconds,
//!   text `"<speaker>: <text>"` and `" [shares a photo of <caption>]"` when
//!   there is one), produced to Kafka and consumed by the pipeline
//!   ([`pipeline::run`], the defaults), which writes LanceDB.
//! - **Ask as an agent does.** The service ([`serve::run`], the defaults)
//!   answers every question over HTTP (`POST /v1/retrieve`, text query, no
//!   options).
//! - **Score the turns handed over**, in order, cut at B = 5, 10, 30 turns:
//!   a session item counts the turns of its text (its provenance's source
//!   events); a dialogue row one turn; a memory or a click one slot that
//!   holds no turn. Recall@B is the share of the question's evidence turns
//!   within the first B, averaged over questions (categories 1–4; 5 has no
//!   evidence), with 95% bootstrap intervals over questions.
//! - **Baseline in the same run**: BM25 (k1 1.2, b 0.75, lower-cased
//!   alphanumeric terms, per conversation) over 3-turn windows (a turn and
//!   the two before it in its session), the windows' turns taken in rank
//!   order, each once.

use std::collections::{BTreeMap, HashSet};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use rdkafka::ClientConfig;
use rdkafka::producer::{BaseProducer, BaseRecord, Producer};
use serde_json::{Value, json};
use steamrf_operators::lexical::{Bm25Index, Bm25Params};
use steamrf_pipelines::config::Config;
use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::pipeline::{self, RunOptions};
use steamrf_pipelines::serve;

use super::bootstrap_ci;

/// Options of `steamrf eval locomo`.
#[derive(Debug, Clone)]
pub struct LocomoEval {
    /// The directory holding `locomo-<split>.json`, or the file.
    pub data: PathBuf,
    /// The split's name in the RESULT line (`dev`).
    pub split: String,
    /// The configuration everything runs with (the defaults unless given);
    /// the topic, the group and the tables are this run's own.
    pub config: Config,
    /// More `[serve.units]` (or `rfmem.`-prefixed `[serve.rfmem]`) settings
    /// to serve the same tables with (`"mix=0.5,lexical_weight=0.3"`,
    /// `"rfmem.mode=familiarity"`), one row each after the
    /// configuration's: the development sweep. The RESULT line is the
    /// configuration's.
    pub sweep: Vec<String>,
}

/// The budgets recall is read at.
const BUDGETS: [usize; 3] = [5, 10, 30];

struct Turn {
    dia: String,
    session: usize,
    ts_ms: i64,
    text: String,
}

struct Conversation {
    user: String,
    turns: Vec<Turn>,
}

struct Question {
    conv: usize,
    text: String,
    evidence: Vec<String>,
    category: i64,
}

fn bad(what: impl std::fmt::Display) -> Error {
    Error::Config {
        problems: vec![format!("LoCoMo data: {what}")],
    }
}

fn internal(e: impl std::fmt::Display) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

/// `"1:56 pm on 8 May, 2023"` → milliseconds since the epoch (UTC).
fn session_ms(s: &str) -> Option<i64> {
    let (time, date) = s.split_once(" on ")?;
    let (hm, ampm) = time.trim().split_once(' ')?;
    let (h, m) = hm.split_once(':')?;
    let (mut h, m): (u32, u32) = (h.parse().ok()?, m.parse().ok()?);
    match ampm.to_ascii_lowercase().as_str() {
        "am" if h == 12 => h = 0,
        "am" => {}
        "pm" if h < 12 => h += 12,
        "pm" => {}
        _ => return None,
    }
    let mut parts = date.split([' ', ',']).filter(|p| !p.is_empty());
    let day: u32 = parts.next()?.parse().ok()?;
    let name = parts.next()?.to_ascii_lowercase();
    let month = chrono::Month::try_from(
        [
            "january",
            "february",
            "march",
            "april",
            "may",
            "june",
            "july",
            "august",
            "september",
            "october",
            "november",
            "december",
        ]
        .iter()
        .position(|x| x.starts_with(&name))? as u8
            + 1,
    )
    .ok()?;
    let year: i32 = parts.next()?.parse().ok()?;
    let d = chrono::NaiveDate::from_ymd_opt(year, month.number_from_month(), day)?;
    Some(d.and_hms_opt(h, m, 0)?.and_utc().timestamp_millis())
}

fn load(path: &Path) -> Result<(Vec<Conversation>, Vec<Question>)> {
    let file = if path.is_dir() {
        std::fs::read_dir(path)
            .map_err(|source| Error::Io {
                context: format!("reading {}", path.display()),
                source,
            })?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|e| e == "json"))
            .ok_or_else(|| bad(format!("no .json file in {}", path.display())))?
    } else {
        path.to_owned()
    };
    let text = std::fs::read_to_string(&file).map_err(|source| Error::Io {
        context: format!("reading {}", file.display()),
        source,
    })?;
    let all: Vec<Value> = serde_json::from_str(&text).map_err(bad)?;
    let (mut convs, mut questions) = (Vec::new(), Vec::new());
    for (ci, c) in all.iter().enumerate() {
        let id = c["sample_id"]
            .as_str()
            .ok_or_else(|| bad("a conversation without sample_id"))?;
        let conv = &c["conversation"];
        let mut turns = Vec::new();
        for n in 1.. {
            let Some(session) = conv.get(format!("session_{n}")) else {
                break;
            };
            let when = conv[format!("session_{n}_date_time")]
                .as_str()
                .and_then(session_ms)
                .ok_or_else(|| bad(format!("{id}: session_{n} has no readable date")))?;
            for (i, t) in session.as_array().into_iter().flatten().enumerate() {
                let (Some(speaker), Some(dia), Some(said)) = (
                    t["speaker"].as_str(),
                    t["dia_id"].as_str(),
                    t["text"].as_str(),
                ) else {
                    return Err(bad(format!("{id}: a turn of session_{n} is incomplete")));
                };
                let mut text = format!("{speaker}: {said}");
                if let Some(c) = t["blip_caption"].as_str() {
                    text.push_str(&format!(" [shares a photo of {c}]"));
                }
                turns.push(Turn {
                    dia: dia.to_owned(),
                    session: n,
                    ts_ms: when + i as i64 * 1000,
                    text,
                });
            }
        }
        for q in c["qa"].as_array().into_iter().flatten() {
            let category = q["category"].as_i64().unwrap_or(0);
            let evidence: Vec<String> = q["evidence"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|e| e.as_str().map(str::to_owned))
                .collect();
            if !(1..=4).contains(&category) || evidence.is_empty() {
                continue;
            }
            questions.push(Question {
                conv: ci,
                text: q["question"].as_str().unwrap_or_default().to_owned(),
                evidence,
                category,
            });
        }
        convs.push(Conversation {
            user: format!("locomo-{id}"),
            turns,
        });
    }
    Ok((convs, questions))
}

fn event(c: &Conversation, t: &Turn) -> (String, String) {
    let e = json!({
        "type": "dialogue_turn",
        "schema_version": 1,
        "event_id": format!("{}:{}", c.user, t.dia),
        "timestamp": t.ts_ms,
        "user_id": c.user,
        "session_id": format!("{}:session_{}", c.user, t.session),
        "role": "user",
        "text": t.text,
    });
    (c.user.clone(), e.to_string())
}

fn produce(brokers: &str, topic: &str, convs: &[Conversation]) -> Result<usize> {
    let producer: BaseProducer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("linger.ms", "20")
        .create()
        .map_err(Error::kafka("creating the eval's producer"))?;
    let mut n = 0;
    for c in convs {
        for t in &c.turns {
            let (key, payload) = event(c, t);
            let mut record = BaseRecord::to(topic).key(&key).payload(&payload);
            loop {
                match producer.send(record) {
                    Ok(()) => break,
                    Err((_, r)) => {
                        record = r;
                        producer.poll(Duration::from_millis(10));
                    }
                }
            }
            n += 1;
        }
    }
    producer
        .flush(Duration::from_secs(60))
        .map_err(Error::kafka("flushing the eval's events"))?;
    Ok(n)
}

/// The turns (dia ids) an answer hands over, in order; `None` for a slot
/// that holds no turn (a memory, a click).
fn handed(answer: &Value, user: &str) -> (Vec<Option<String>>, usize) {
    let prefix = format!("{user}:");
    let mut out = Vec::new();
    let mut bytes = 0;
    for item in answer["items"].as_array().into_iter().flatten() {
        bytes += item["content"].as_str().map_or(0, str::len);
        let kind = item["kind"].as_str().unwrap_or_default();
        let ids = item["provenance"]["source_event_ids"].as_array();
        match (kind, ids) {
            ("session" | "dialogue", Some(ids)) => out.extend(ids.iter().map(|i| {
                i.as_str()
                    .and_then(|s| s.strip_prefix(&prefix))
                    .map(str::to_owned)
            })),
            _ => out.push(None),
        }
    }
    (out, bytes)
}

fn recall_at(turns: &[Option<String>], evidence: &[String], b: usize) -> f64 {
    let first: HashSet<&str> = turns.iter().take(b).flatten().map(String::as_str).collect();
    let hit = evidence
        .iter()
        .filter(|e| first.contains(e.as_str()))
        .count();
    hit as f64 / evidence.len() as f64
}

/// BM25 over 3-turn windows of one conversation: the turns of the windows
/// in rank order, each once, up to the largest budget.
struct Bm25Windows {
    index: Bm25Index,
    /// Window → its turns (indices into the conversation's turns).
    spans: Vec<std::ops::Range<usize>>,
}

impl Bm25Windows {
    fn new(c: &Conversation) -> Self {
        let mut spans = Vec::new();
        let mut start = 0;
        for (i, t) in c.turns.iter().enumerate() {
            if i > 0 && c.turns[i - 1].session != t.session {
                start = i;
            }
            spans.push(start.max(i.saturating_sub(2))..i + 1);
        }
        let texts: Vec<String> = spans
            .iter()
            .map(|r| {
                c.turns[r.clone()]
                    .iter()
                    .map(|t| t.text.as_str())
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .collect();
        Self {
            index: Bm25Index::new(&texts, Bm25Params::default()),
            spans,
        }
    }

    fn answer(&self, c: &Conversation, q: &str) -> Vec<Option<String>> {
        let mut s = self.index.scores(q);
        s.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for (w, _) in s {
            for t in self.spans[w as usize].clone() {
                if seen.insert(t) {
                    out.push(Some(c.turns[t].dia.clone()));
                }
            }
            if out.len() >= BUDGETS[BUDGETS.len() - 1] {
                break;
            }
        }
        out
    }
}

#[derive(Default, Clone)]
struct Scores {
    recall: [Vec<f64>; 3],
}

impl Scores {
    fn add(&mut self, turns: &[Option<String>], evidence: &[String]) {
        for (i, b) in BUDGETS.iter().enumerate() {
            self.recall[i].push(recall_at(turns, evidence, *b));
        }
    }

    fn cells(&self, seed: u64) -> Vec<String> {
        self.recall
            .iter()
            .map(|xs| {
                let (m, lo, hi) = bootstrap_ci(xs, seed);
                format!("{m:.3} ({lo:.3}–{hi:.3})")
            })
            .collect()
    }

    fn mean(&self, i: usize) -> f64 {
        let xs = &self.recall[i];
        xs.iter().sum::<f64>() / xs.len().max(1) as f64
    }
}

fn percentile(sorted: &[f64], q: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    sorted[((sorted.len() - 1) as f64 * q).round() as usize]
}

/// One service's answers to every question, and the baseline's.
struct Run {
    served: Scores,
    bm25: Scores,
    by_category: BTreeMap<i64, (Scores, Scores)>,
    by_path: BTreeMap<String, Scores>,
    turns_handed: Vec<f64>,
    bytes_handed: Vec<f64>,
    /// Sorted.
    latency: Vec<f64>,
}

/// `serve` with the `key=value` pairs of `spec` (comma-separated) set: keys
/// of `[serve.units]`, or of `[serve.rfmem]` as `rfmem.<key>` (a string value
/// unquoted: `rfmem.mode=familiarity`).
fn units(serve: &mut steamrf_pipelines::config::ServeConfig, spec: &str) -> Result<()> {
    let mut u = serde_json::to_value(serve.units).map_err(internal)?;
    let mut r = serde_json::to_value(serve.rfmem).map_err(internal)?;
    for kv in spec.split(',').filter(|s| !s.trim().is_empty()) {
        let (k, val) = kv
            .split_once('=')
            .ok_or_else(|| bad(format!("--units {spec:?}: {kv:?} is not key=value")))?;
        let val: Value = serde_json::from_str(val.trim())
            .unwrap_or_else(|_| Value::String(val.trim().to_owned()));
        match k.trim().strip_prefix("rfmem.") {
            Some(k) => r[k] = val,
            None => u[k.trim()] = val,
        }
    }
    serve.units = serde_json::from_value(u).map_err(|e| bad(format!("--units {spec:?}: {e}")))?;
    serve.rfmem = serde_json::from_value(r).map_err(|e| bad(format!("--units {spec:?}: {e}")))?;
    serve
        .units
        .validate()
        .and_then(|()| serve.rfmem.validate())
        .map_err(|e| bad(format!("--units {spec:?}: {e}")))?;
    Ok(())
}

/// Serves `config`'s tables and asks every question over HTTP.
async fn ask_all(
    config: &Config,
    convs: &[Conversation],
    questions: &[Question],
    baselines: &[Bm25Windows],
) -> Result<Run> {
    // Serve, and ask every question over HTTP.
    let port = crate::free_port()?;
    let addr: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
    let stop = Arc::new(AtomicBool::new(false));
    let service = tokio::spawn(serve::run(config.clone(), Some(addr), stop.clone()));
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(60))
        .build()
        .map_err(internal)?;
    let ready_by = Instant::now() + Duration::from_secs(300);
    loop {
        let ready = client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success());
        if ready {
            break;
        }
        if service.is_finished() || Instant::now() > ready_by {
            stop.store(true, Ordering::Relaxed);
            return Err(match service.await {
                Ok(Err(e)) => e,
                _ => internal("the service did not become ready within 300 s"),
            });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut served = Scores::default();
    let mut bm25 = Scores::default();
    let mut by_category: BTreeMap<i64, (Scores, Scores)> = BTreeMap::new();
    let mut by_path: BTreeMap<String, Scores> = BTreeMap::new();
    let (mut turns_handed, mut bytes_handed, mut latency) = (Vec::new(), Vec::new(), Vec::new());
    for q in questions {
        let c = &convs[q.conv];
        let t = Instant::now();
        let resp = client
            .post(format!("{base}/v1/retrieve"))
            .header("content-type", "application/json")
            .body(json!({"user_id": c.user, "query": q.text}).to_string())
            .send()
            .await
            .map_err(internal)?;
        let status = resp.status();
        let body: Value =
            serde_json::from_slice(&resp.bytes().await.map_err(internal)?).map_err(internal)?;
        latency.push(t.elapsed().as_secs_f64() * 1e3);
        if !status.is_success() {
            stop.store(true, Ordering::Relaxed);
            return Err(internal(format!("/v1/retrieve answered {status}: {body}")));
        }
        let (turns, bytes) = handed(&body, &c.user);
        turns_handed.push(turns.len() as f64);
        bytes_handed.push(bytes as f64);
        served.add(&turns, &q.evidence);
        let base_turns = baselines[q.conv].answer(c, &q.text);
        bm25.add(&base_turns, &q.evidence);
        let cat = by_category.entry(q.category).or_default();
        cat.0.add(&turns, &q.evidence);
        cat.1.add(&base_turns, &q.evidence);
        let path = body["explanation"]["path"]
            .as_str()
            .unwrap_or("unknown")
            .to_owned();
        by_path.entry(path).or_default().add(&turns, &q.evidence);
    }
    stop.store(true, Ordering::Relaxed);
    service.await.map_err(internal)??;
    latency.sort_by(f64::total_cmp);
    Ok(Run {
        served,
        bm25,
        by_category,
        by_path,
        turns_handed,
        bytes_handed,
        latency,
    })
}

/// Runs the evaluation; returns its lines, the last one `RESULT`.
///
/// # Errors
/// Unreadable data, Kafka, LanceDB or service failures.
pub async fn locomo(e: LocomoEval) -> Result<Vec<String>> {
    let (convs, questions) = load(&e.data)?;
    let dir = tempfile::tempdir().map_err(|source| Error::Io {
        context: "creating a temporary directory".into(),
        source,
    })?;
    let run_id = format!(
        "steamrf-eval-locomo-{}-{}",
        std::process::id(),
        chrono::Utc::now().timestamp_millis()
    );
    let mut config = e.config.clone();
    config.kafka.topics = vec![run_id.clone()];
    config.kafka.group_id = format!("{run_id}-group");
    config.kafka.dead_letter_topic = format!("{run_id}-dlq");
    config.steam.changes_topic = format!("{run_id}-changes");
    config.lancedb.uri = dir.path().join("lancedb").display().to_string();

    // Ingest: produce every turn, then let the pipeline drain them.
    let started = Instant::now();
    let produced = {
        let (brokers, topic) = (&config.kafka.brokers, &run_id);
        tokio::task::block_in_place(|| produce(brokers, topic, &convs))?
    };
    let metrics = Metrics::new(&config.kafka.topics);
    let summary = pipeline::run(
        config.clone(),
        RunOptions {
            metrics_addr: None,
            exit_when_idle: Some(Duration::from_secs(10)),
        },
        metrics,
        Arc::new(AtomicBool::new(false)),
    )
    .await?;
    let ingest_s = started.elapsed().as_secs_f64();
    if summary.records < produced as u64 {
        return Err(internal(format!(
            "the pipeline committed {} of {produced} events",
            summary.records
        )));
    }

    let baselines: Vec<Bm25Windows> = convs.iter().map(Bm25Windows::new).collect();
    let first = ask_all(&config, &convs, &questions, &baselines).await?;
    let mut swept = Vec::new();
    for spec in &e.sweep {
        let mut c = config.clone();
        units(&mut c.serve, spec)?;
        let r = ask_all(&c, &convs, &questions, &baselines).await?;
        swept.push((spec.clone(), r));
    }
    let Run {
        served,
        bm25,
        by_category,
        by_path,
        turns_handed,
        bytes_handed,
        latency,
    } = &first;
    let (p50, p99) = (percentile(latency, 0.5), percentile(latency, 0.99));
    let mean = |xs: &[f64]| xs.iter().sum::<f64>() / xs.len().max(1) as f64;
    let turns_per_answer = mean(turns_handed);
    let max_turns = turns_handed.iter().copied().fold(0.0, f64::max);

    let mut lines = vec![
        format!(
            "{} conversations, {} turns produced and ingested in {ingest_s:.0} s; {} questions (categories 1–4) asked over HTTP",
            convs.len(),
            produced,
            questions.len()
        ),
        String::new(),
        "| questions | method | R@5 turns | R@10 turns | R@30 turns |".into(),
        "| --- | --- | ---: | ---: | ---: |".into(),
    ];
    let row = |who: &str, method: &str, s: &Scores| {
        let c = s.cells(45);
        format!("| {who} | {method} | {} | {} | {} |", c[0], c[1], c[2])
    };
    lines.push(row(
        &format!("all ({})", questions.len()),
        "steamrf serve (defaults)",
        served,
    ));
    lines.push(row("", "BM25 over 3-turn windows", bm25));
    for (cat, (s, b)) in by_category {
        let n = s.recall[0].len();
        lines.push(row(&format!("category {cat} ({n})"), "steamrf serve", s));
        lines.push(row("", "BM25 over 3-turn windows", b));
    }
    let diff: Vec<f64> = served.recall[1]
        .iter()
        .zip(&bm25.recall[1])
        .map(|(a, b)| a - b)
        .collect();
    let (d, dlo, dhi) = bootstrap_ci(&diff, 46);
    lines.push(String::new());
    lines.push(format!(
        "R@10 steamrf − BM25 windows: {d:+.3} (95% CI {dlo:+.3} – {dhi:+.3}, paired over questions)"
    ));
    for (path, s) in by_path {
        lines.push(format!(
            "path {path}: {} questions, R@10 {:.3}",
            s.recall[1].len(),
            s.mean(1)
        ));
    }
    if !swept.is_empty() {
        lines.push(String::new());
        lines.push(format!(
            "Sweep over the same tables ([serve.units] from {:?}; the configuration's first):",
            config.serve.units
        ));
        lines.push(
            "| [serve.units] | R@5 | R@10 | R@30 | ΔR@5 / ΔR@10 / ΔR@30 vs the configuration (95% CI, paired) | recollected | turns/answer | p50 ms |"
                .into(),
        );
        lines.push("| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: |".into());
        let mut add = |spec: &str, r: &Run| {
            let c = r.served.cells(45);
            let deltas: Vec<String> = (0..3)
                .map(|b| {
                    let diff: Vec<f64> = r.served.recall[b]
                        .iter()
                        .zip(&served.recall[b])
                        .map(|(a, b)| a - b)
                        .collect();
                    let (d, lo, hi) = bootstrap_ci(&diff, 47);
                    format!("{d:+.3} ({lo:+.3} – {hi:+.3})")
                })
                .collect();
            lines.push(format!(
                "| {spec} | {} | {} | {} | {} | {} | {:.1} | {:.1} |",
                c[0],
                c[1],
                c[2],
                deltas.join(" / "),
                r.by_path
                    .get("recollection")
                    .map_or(0, |s| s.recall[0].len()),
                mean(&r.turns_handed),
                percentile(&r.latency, 0.5)
            ));
        };
        add("(configuration)", &first);
        for (spec, r) in &swept {
            add(spec, r);
        }
    }
    lines.push(format!(
        "handed to the agent per answer: {turns_per_answer:.1} turns (at most {max_turns:.0}), {:.0} bytes; latency p50 {p50:.1} ms, p99 {p99:.1} ms (HTTP, query embedding included)",
        mean(bytes_handed)
    ));
    lines.push(format!(
        "RESULT split={} questions={} r5={:.3} r10={:.3} r30={:.3} turns_per_answer={turns_per_answer:.1} bytes_per_answer={:.0} bm25w_r5={:.3} bm25w_r10={:.3} bm25w_r30={:.3} p50_ms={p50:.1} p99_ms={p99:.1}",
        e.split,
        questions.len(),
        served.mean(0),
        served.mean(1),
        served.mean(2),
        mean(bytes_handed),
        bm25.mean(0),
        bm25.mean(1),
        bm25.mean(2),
    ));
    Ok(lines)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn session_times_are_read_as_utc() {
        // 2023-05-08 13:56 UTC.
        assert_eq!(
            session_ms("1:56 pm on 8 May, 2023"),
            Some(1_683_554_160_000)
        );
        assert_eq!(
            session_ms("12:04 am on 1 January, 2024"),
            Some(1_704_067_440_000)
        );
        assert_eq!(session_ms("noon on 1 May, 2023"), None);
    }

    #[test]
    fn recall_counts_evidence_within_the_budget_only() {
        let turns: Vec<Option<String>> = vec![Some("D1:1".into()), None, Some("D1:3".into())];
        let ev = vec!["D1:3".to_owned(), "D2:1".to_owned()];
        assert_eq!(recall_at(&turns, &ev, 2), 0.0);
        assert_eq!(recall_at(&turns, &ev, 3), 0.5);
    }
}
