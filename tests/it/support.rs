//! Helpers shared by the end-to-end tests.

use std::collections::BTreeMap;
use std::io::Write;
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rdkafka::ClientConfig;
use rdkafka::consumer::{BaseConsumer, Consumer};
use rdkafka::message::{Headers, Message};
use rdkafka::{Offset, TopicPartitionList};

pub fn repo_root() -> PathBuf {
    Path::new(&manifest_dir()).parent().unwrap().to_path_buf()
}

/// The broker under test; fails loudly when none is listening.
/// The real all-MiniLM-L6-v2, fetched by scripts/tools.sh.
pub fn model_dir() -> PathBuf {
    std::env::var_os("STEAMRF_MODEL_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| repo_root().join(".tools/models/all-MiniLM-L6-v2"))
}

/// SPLADE-tiny, fetched by scripts/tools.sh.
pub fn sparse_model_dir() -> PathBuf {
    repo_root().join(".tools/models/splade-tiny")
}

pub fn brokers() -> String {
    let b = std::env::var("STEAMRF_TEST_BROKERS").unwrap_or_else(|_| "127.0.0.1:9092".into());
    let first = b.split(',').next().unwrap().to_owned();
    if TcpStream::connect_timeout(&first.parse().unwrap(), Duration::from_secs(2)).is_err() {
        panic!(
            "no Kafka broker at {first}: start one with scripts/broker.sh start (scripts/test.sh does)"
        );
    }
    b
}

pub fn unique(prefix: &str) -> String {
    let n: u64 = rand::rng().random();
    format!("{prefix}-{}-{:08x}", std::process::id(), n as u32)
}

/// The `steamrf` binary built next to this test binary.
pub fn steamrf_bin() -> PathBuf {
    if let Some(p) = std::env::var_os("STEAMRF_BIN") {
        return p.into();
    }
    let exe = std::env::current_exe().unwrap();
    let p = exe.parent().unwrap().parent().unwrap().join("steamrf");
    assert!(
        p.exists(),
        "{} missing: build the workspace first (cargo build --workspace)",
        p.display()
    );
    p
}

/// `$STEAMRF_TOOLS` (default `<repo>/.tools`): what scripts/tools.sh installed.
pub fn tools_dir() -> PathBuf {
    std::env::var_os("STEAMRF_TOOLS").map_or_else(|| repo_root().join(".tools"), PathBuf::from)
}

pub fn python() -> PathBuf {
    let p = tools_dir().join("venv/bin/python");
    assert!(p.exists(), "{} missing: run scripts/tools.sh", p.display());
    p
}

/// Produces each line of `file` with confluent-kafka (creating the topic).
pub fn produce(topic: &str, partitions: u32, file: &Path, rate: Option<u32>) -> Child {
    produce_to(&brokers(), topic, partitions, file, rate)
}

/// As [`produce`], to the broker at `brokers`.
pub fn produce_to(
    brokers: &str,
    topic: &str,
    partitions: u32,
    file: &Path,
    rate: Option<u32>,
) -> Child {
    let mut cmd = Command::new(python());
    cmd.arg(repo_root().join("scripts/produce.py")).args([
        "--brokers",
        brokers,
        "--topic",
        topic,
        "--partitions",
        &partitions.to_string(),
    ]);
    if let Some(r) = rate {
        cmd.args(["--rate", &r.to_string()]);
    }
    cmd.arg(file).stdout(Stdio::null()).spawn().unwrap()
}

/// Writes `lines` to `dir`/events.jsonl and produces them all to `topic`.
pub fn produce_lines(dir: &Path, topic: &str, partitions: u32, lines: &[String]) {
    let file = dir.join("events.jsonl");
    std::fs::write(&file, lines.join("\n") + "\n").unwrap();
    produce_all(topic, partitions, &file);
}

pub fn produce_all(topic: &str, partitions: u32, file: &Path) {
    let status = produce(topic, partitions, file, None).wait().unwrap();
    assert!(status.success(), "produce.py failed");
}

/// What a generated event file should turn into.
#[derive(Debug, Default)]
pub struct Expected {
    /// Distinct event ids of valid clicks, purchases and dialogue turns.
    pub interactions: usize,
    /// Distinct event ids of valid dialogue turns (each embedded once).
    pub dialogue: usize,
    pub items: usize,
    pub profiles: usize,
    /// Malformed payloads and the error kind each must be dead-lettered with.
    pub malformed: BTreeMap<Vec<u8>, &'static str>,
    pub lines: usize,
}

/// Writes `n` events, every `malformed_every`-th one malformed (cycling
/// through every kind of bad input), with a few exact duplicates (a producer
/// retry) that must not add rows. `id_prefix` keeps event ids unique across files.
pub fn generate(
    path: &Path,
    n: usize,
    malformed_every: usize,
    seed: u64,
    id_prefix: &str,
) -> Expected {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut f = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut exp = Expected::default();
    let mut valid: Vec<Vec<u8>> = Vec::new();
    let mut m = 0usize;
    for i in 0..n {
        let ts = 1_764_000_000_000i64 + i as i64 * 1000;
        let user = format!("u{}", rng.random_range(0..200));
        let id = format!("{id_prefix}-{i}");
        let line: Vec<u8> = if malformed_every > 0 && i % malformed_every == malformed_every - 1 {
            m += 1;
            let (payload, kind): (Vec<u8>, &'static str) = match m % 9 {
                0 => (format!(r#"{{"type":"click","event_id":"{id}","#).into_bytes(), "invalid_json"),
                1 => (format!(r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":{ts},"item_id":"i1"}}"#).into_bytes(), "missing_field"),
                2 => (format!(r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"{user}","session_id":"s","role":"robot","text":"hi"}}"#).into_bytes(), "invalid_field"),
                3 => (format!(r#"{{"type":"wishlist","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"{user}"}}"#).into_bytes(), "unknown_type"),
                4 => (format!(r#"{{"type":"item","schema_version":1,"event_id":"{id}","timestamp":{ts},"item_id":"big","title":"{}"}}"#, "x".repeat(70 * 1024)).into_bytes(), "oversize"),
                5 => {
                    let mut v = format!(r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":""#).into_bytes();
                    v.extend([0xC3, 0x28, 0xFF]);
                    v.extend(br#"","item_id":"i"}"#);
                    (v, "invalid_json")
                }
                6 => (format!(r#"{{"type":"click","schema_version":7,"event_id":"{id}","timestamp":{ts},"user_id":"{user}","item_id":"i"}}"#).into_bytes(), "unsupported_version"),
                7 => (format!(r#"{{"type":"purchase","schema_version":1,"event_id":"{id}","timestamp":99999999999999,"user_id":"{user}","item_id":"i"}}"#).into_bytes(), "invalid_field"),
                // Decodable (before 2200), but stamped past kafka.max_future_skew.
                _ => (format!(r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":7000000000000,"user_id":"{user}","item_id":"i"}}"#).into_bytes(), "invalid_field"),
            };
            exp.malformed.insert(payload.clone(), kind);
            payload
        } else {
            let r: u32 = rng.random_range(0..100);
            let line = if r < 68 {
                exp.interactions += 1;
                format!(
                    r#"{{"type":"click","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"{user}","item_id":"i{}"}}"#,
                    rng.random_range(0..500)
                )
            } else if r < 78 {
                exp.interactions += 1;
                format!(
                    r#"{{"type":"purchase","schema_version":1,"event_id":"{id}","timestamp":"2026-11-2{}T10:00:00Z","user_id":"{user}","item_id":"i{}","quantity":2,"price":12.5,"currency":"EUR"}}"#,
                    i % 10,
                    rng.random_range(0..500)
                )
            } else if r < 93 {
                exp.interactions += 1;
                exp.dialogue += 1;
                format!(
                    r#"{{"type":"dialogue_turn","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"{user}","session_id":"s{}","role":"user","text":"I want something like \"Blue Train\" — ünïcode ok"}}"#,
                    i / 7
                )
            } else if r < 97 {
                exp.items += 1;
                format!(
                    r#"{{"type":"item","schema_version":1,"event_id":"{id}","timestamp":{ts},"item_id":"{id}-item","title":"Album {i}","categories":["Jazz","Hard bop"],"attributes":{{"year":1957}}}}"#
                )
            } else {
                exp.profiles += 1;
                format!(
                    r#"{{"type":"profile","schema_version":1,"event_id":"{id}","timestamp":{ts},"user_id":"{id}-user","attributes":{{"age":30,"country":"DE"}}}}"#
                )
            };
            line.into_bytes()
        };
        f.write_all(&line).unwrap();
        f.write_all(b"\n").unwrap();
        exp.lines += 1;
        if !exp.malformed.contains_key(&line) {
            valid.push(line);
        }
        // About 0.5% exact re-sends of an earlier valid event.
        if rng.random_range(0..200) == 0 && !valid.is_empty() {
            let dup = valid[rng.random_range(0..valid.len())].clone();
            f.write_all(&dup).unwrap();
            f.write_all(b"\n").unwrap();
            exp.lines += 1;
        }
    }
    exp
}

/// A `steamrf run` child process with its own config and metrics port.
pub struct Pipeline {
    pub child: Child,
    pub metrics_port: u16,
    pub log: PathBuf,
}

pub struct PipelineConfig<'a> {
    pub dir: &'a Path,
    pub topic: &'a str,
    pub group: &'a str,
    pub dlq: &'a str,
    pub max_rows: usize,
    pub linger_ms: u64,
}

impl PipelineConfig<'_> {
    pub fn lancedb_uri(&self) -> String {
        self.dir.join("lancedb").to_string_lossy().into_owned()
    }

    /// As [`PipelineConfig::write`], with `extra` TOML appended (more sections).
    pub fn write_with(&self, extra: &str) -> PathBuf {
        let path = self.write();
        let mut text = std::fs::read_to_string(&path).unwrap();
        text.push_str(extra);
        std::fs::write(&path, text).unwrap();
        path
    }

    /// Runs `steamrf run` on this configuration (plus `extra`) until the
    /// topic has been idle for 3 s, and checks it exits 0.
    pub fn run_to_idle(&self, extra: &str) {
        Pipeline::run_to_idle(&self.write_with(extra));
    }

    pub fn write(&self) -> PathBuf {
        let path = self.dir.join(format!("{}.toml", self.group));
        let text = format!(
            "[kafka]\nbrokers = \"{}\"\ngroup_id = \"{}\"\ntopics = [\"{}\"]\ndead_letter_topic = \"{}\"\nmax_event_bytes = \"64KiB\"\nstatistics_interval = \"1s\"\n\
             [batch]\nmax_rows = {}\nlinger = \"{}ms\"\n[lancedb]\nuri = \"{}\"\n[embed]\nmodel_dir = \"{}\"\nsparse_model_dir = \"{}\"\n",
            brokers(),
            self.group,
            self.topic,
            self.dlq,
            self.max_rows,
            self.linger_ms,
            self.lancedb_uri(),
            model_dir().display(),
            sparse_model_dir().display()
        );
        std::fs::write(&path, text).unwrap();
        path
    }
}

/// Creates `topic` with `partitions` partitions by producing one item event
/// to it (the file goes in `dir`).
pub fn seed_topic(dir: &Path, topic: &str, partitions: u32) {
    let seed = dir.join("seed.jsonl");
    std::fs::write(
        &seed,
        format!(
            r#"{{"schema_version":1,"event_id":"{topic}-seed","timestamp":1764000000000,"type":"item","item_id":"i","title":"t"}}"#
        ) + "\n",
    )
    .unwrap();
    produce_all(topic, partitions, &seed);
}

pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

impl Pipeline {
    pub fn start(config: &Path, exit_when_idle: Option<&str>) -> Self {
        Self::start_command("run", config, exit_when_idle)
    }

    /// Runs `steamrf run` on `config` until the topic has been idle for 3 s,
    /// checks it exits 0, and returns it (for its log).
    pub fn run_to_idle(config: &Path) -> Self {
        let mut p = Self::start(config, Some("3s"));
        assert!(
            p.wait(Duration::from_secs(120)).success(),
            "{}",
            p.log_text()
        );
        p
    }

    /// `steamrf <command> --config … --metrics-addr …` (`run` or `communities`).
    pub fn start_command(command: &str, config: &Path, exit_when_idle: Option<&str>) -> Self {
        let metrics_port = free_port();
        let log = config.with_extension(format!("{metrics_port}.log"));
        let mut cmd = Command::new(steamrf_bin());
        cmd.args([command, "--config"])
            .arg(config)
            .args(["--metrics-addr", &format!("127.0.0.1:{metrics_port}")]);
        if let Some(idle) = exit_when_idle {
            cmd.args(["--exit-when-idle", idle]);
        }
        let child = cmd
            .env("STEAMRF_LOG", "warn,steamrf_pipelines=info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        Self {
            child,
            metrics_port,
            log,
        }
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits for exit within `timeout`; panics (with the log) otherwise.
    pub fn wait(&mut self, timeout: Duration) -> ExitStatus {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s;
            }
            if Instant::now() > deadline {
                self.child.kill().ok();
                panic!(
                    "steamrf did not exit within {timeout:?}; log:\n{}",
                    self.log_text()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    pub fn kill9(&mut self) {
        self.child.kill().unwrap(); // SIGKILL
        self.child.wait().unwrap();
    }

    pub fn sigterm(&mut self) -> ExitStatus {
        // std only sends SIGKILL; kill(1) sends SIGTERM without unsafe code.
        let ok = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .unwrap();
        assert!(ok.success());
        self.wait(Duration::from_secs(60))
    }

    /// One metric's value from /metrics (summing its series), or None while unreachable.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let body = http_get(self.metrics_port, "/metrics")?;
        let mut sum = None;
        for line in body.lines() {
            let Some(rest) = line.strip_prefix(name) else {
                continue;
            };
            if !(rest.starts_with(' ') || rest.starts_with('{')) {
                continue;
            }
            let v: f64 = rest.rsplit(' ').next()?.parse().ok()?;
            *sum.get_or_insert(0.0) += v;
        }
        sum
    }

    pub fn wait_metric(&self, name: &str, pred: impl Fn(f64) -> bool, timeout: Duration) -> f64 {
        let deadline = Instant::now() + timeout;
        loop {
            if let Some(v) = self.metric(name)
                && pred(v)
            {
                return v;
            }
            assert!(
                Instant::now() < deadline,
                "{name} did not reach the expected value; log:\n{}",
                self.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Pipeline {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

pub fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::Read;
    let mut s = TcpStream::connect(("127.0.0.1", port)).ok()?;
    s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
    )
    .ok()?;
    let mut out = String::new();
    s.read_to_string(&mut out).ok()?;
    out.split_once("\r\n\r\n").map(|(_, b)| b.to_owned())
}

/// Runs SQL over the pipeline's tables and returns the first column of the
/// first row; `None` if the query fails (tables not created yet).
/// The local S3 store of scripts/s3.sh.
pub const S3_ENDPOINT: &str = "http://127.0.0.1:8333";

/// LanceDB's storage options for the local S3 store, as `[lancedb.storage_options]` keys.
pub const S3_OPTIONS: [(&str, &str); 5] = [
    ("aws_endpoint", S3_ENDPOINT),
    ("aws_access_key_id", "steamrf"),
    ("aws_secret_access_key", "steamrf-secret"),
    ("aws_region", "us-east-1"),
    ("allow_http", "true"),
];

/// `steamrf sql` over the tables at `uri` (a directory or s3://).
fn sql_command(uri: &str, sql: &str) -> Command {
    let mut c = Command::new(steamrf_bin());
    c.args(["sql", sql]).env("STEAMRF__LANCEDB__URI", uri);
    if uri.starts_with("s3://") {
        for (k, v) in S3_OPTIONS {
            c.env(
                format!("STEAMRF__LANCEDB__STORAGE_OPTIONS__{}", k.to_uppercase()),
                v,
            );
        }
    }
    c
}

pub fn try_sql_count(uri: &str, sql: &str) -> Option<i64> {
    let out = sql_command(uri, sql).output().unwrap();
    if !out.status.success() {
        return None;
    }
    let text = String::from_utf8(out.stdout).unwrap();
    // A pretty table: the 4th line holds the first value.
    let row = text.lines().nth(3)?;
    row.trim_matches(|c| c == '|' || c == ' ')
        .split('|')
        .next()?
        .trim()
        .parse()
        .ok()
}

/// The pretty-printed result of `sql` (for comparing whole tables).
pub fn sql_text(uri: &str, sql: &str) -> String {
    let out = sql_command(uri, sql).output().unwrap();
    assert!(
        out.status.success(),
        "{sql}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

/// The query's pretty-printed result; `None` if it fails (tables not created yet).
pub fn try_sql_text(uri: &str, sql: &str) -> Option<String> {
    let out = sql_command(uri, sql).output().unwrap();
    out.status
        .success()
        .then(|| String::from_utf8(out.stdout).unwrap())
}

/// As [`try_sql_count`], failing the test if the query fails.
pub fn sql_count(uri: &str, sql: &str) -> i64 {
    try_sql_count(uri, sql).unwrap_or_else(|| panic!("steamrf sql {sql:?} failed on {uri}"))
}

/// Waits until `sql` over the tables returns `want` (a failing query or a
/// NULL, as before the tables exist, is waited out too).
pub fn wait_count(uri: &str, sql: &str, want: i64, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        let got = try_sql_count(uri, sql);
        if got == Some(want) {
            return;
        }
        assert!(Instant::now() < deadline, "{sql}: {got:?}, want {want}");
        std::thread::sleep(Duration::from_millis(500));
    }
}

/// A dead letter as read back from Kafka.
#[derive(Debug)]
pub struct DeadLetter {
    pub payload: Vec<u8>,
    pub headers: BTreeMap<String, String>,
}

/// Reads every record of the (single-partition) dead-letter topic until
/// `want` have arrived or `timeout` passes.
pub fn read_dead_letters(topic: &str, want: usize, timeout: Duration) -> Vec<DeadLetter> {
    read_dead_letters_from(&brokers(), topic, want, timeout)
}

/// As [`read_dead_letters`], from the broker at `brokers`.
pub fn read_dead_letters_from(
    brokers: &str,
    topic: &str,
    want: usize,
    timeout: Duration,
) -> Vec<DeadLetter> {
    let consumer: BaseConsumer = ClientConfig::new()
        .set("bootstrap.servers", brokers)
        .set("group.id", unique("dlq-reader"))
        .set("enable.auto.commit", "false")
        .create()
        .unwrap();
    let mut tpl = TopicPartitionList::new();
    tpl.add_partition_offset(topic, 0, Offset::Beginning)
        .unwrap();
    consumer.assign(&tpl).unwrap();
    let mut out = Vec::new();
    let deadline = Instant::now() + timeout;
    while out.len() < want && Instant::now() < deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            let mut headers = BTreeMap::new();
            if let Some(h) = m.headers() {
                for hd in h.iter() {
                    headers.insert(
                        hd.key.to_owned(),
                        String::from_utf8_lossy(hd.value.unwrap_or_default()).into_owned(),
                    );
                }
            }
            out.push(DeadLetter {
                payload: m.payload().unwrap_or_default().to_vec(),
                headers,
            });
        }
    }
    // Anything beyond `want` would be a duplicate or a stray: look briefly.
    let extra_deadline = Instant::now() + Duration::from_secs(2);
    while Instant::now() < extra_deadline {
        if let Some(Ok(m)) = consumer.poll(Duration::from_millis(200)) {
            out.push(DeadLetter {
                payload: m.payload().unwrap_or_default().to_vec(),
                headers: BTreeMap::new(),
            });
        }
    }
    out
}

/// A minimal OpenAI-compatible chat endpoint on 127.0.0.1 (no LLM can be
/// reached from here): every completion is `reply`; prompts are recorded.
/// The body of one HTTP/1.1 request (by its Content-Length); `None` if the
/// client hung up first.
fn read_body(stream: &TcpStream) -> Option<Vec<u8>> {
    use std::io::{BufRead, BufReader, Read};
    let mut reader = BufReader::new(stream.try_clone().ok()?);
    let mut len = 0usize;
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return None;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            len = v.trim().parse().unwrap_or(0);
        }
        if line == "\r\n" {
            break;
        }
    }
    let mut body = vec![0u8; len];
    reader.read_exact(&mut body).ok()?;
    Some(body)
}

pub struct FakeChat {
    pub url: String,
    pub prompts: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl FakeChat {
    pub fn start(reply: &'static str) -> Self {
        use std::io::Write;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let prompts = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let seen = prompts.clone();
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let seen = seen.clone();
                std::thread::spawn(move || {
                    let Some(body) = read_body(&stream) else {
                        return;
                    };
                    let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    seen.lock().unwrap().push(
                        req["messages"][0]["content"]
                            .as_str()
                            .unwrap_or("")
                            .to_owned(),
                    );
                    let out = serde_json::json!({
                        "choices": [{"message": {"role": "assistant", "content": reply}}],
                        "usage": {"prompt_tokens": 50, "completion_tokens": 5}
                    })
                    .to_string();
                    // The client may have given up; nothing to do then.
                    write!(
                        stream,
                        "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{out}",
                        out.len()
                    )
                    .ok();
                });
            }
        });
        Self { url, prompts }
    }
}

/// llama.cpp's OpenAI-compatible server (PyPI llama-cpp-python[server],
/// built by scripts/tools.sh) serving SmolLM2-135M-Instruct, killed on drop.
pub struct LlamaServer {
    child: Child,
    pub url: String,
    pub log: PathBuf,
}

impl LlamaServer {
    /// Starts it on a free port (its log in `dir`) and waits until it
    /// answers `/v1/models`.
    pub fn start(dir: &Path) -> Self {
        let python = tools_dir().join("llm-venv/bin/python");
        let model = tools_dir().join("models/SmolLM2-135M-Instruct.Q4_1.gguf");
        for p in [&python, &model] {
            assert!(p.exists(), "{} missing: run scripts/tools.sh", p.display());
        }
        let port = free_port();
        let log = dir.join(format!("llama-{port}.log"));
        let child = Command::new(python)
            .args(["-m", "llama_cpp.server", "--model"])
            .arg(model)
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            .args(["--n_ctx", "2048", "--n_threads", "2", "--verbose", "false"])
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let s = Self {
            child,
            url: format!("http://127.0.0.1:{port}"),
            log,
        };
        let deadline = Instant::now() + Duration::from_secs(120);
        while http_get(port, "/v1/models").is_none() {
            assert!(
                Instant::now() < deadline,
                "the llama.cpp server did not start:\n{}",
                std::fs::read_to_string(&s.log).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
        s
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// A `steamrf serve` child process, killed on drop.
pub struct Service {
    child: Child,
    pub port: u16,
    pub log: PathBuf,
}

impl Service {
    /// Starts the service on a free port and waits for `/readyz`.
    pub fn start(config: &Path) -> Self {
        Self::start_until(config, "/readyz", "ready\n")
    }

    /// Starts the service and waits until `GET path` answers `body` (only
    /// `/healthz` for a service that cannot read its tables).
    pub fn start_until(config: &Path, path: &str, body: &str) -> Self {
        let port = free_port();
        let log = config.with_extension(format!("serve-{port}.log"));
        let child = Command::new(steamrf_bin())
            .args(["serve", "--config"])
            .arg(config)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .env("STEAMRF_LOG", "warn,steamrf_pipelines=debug")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap();
        let s = Self { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(60);
        while http_get(port, path).as_deref() != Some(body) {
            assert!(
                Instant::now() < deadline,
                "serve never answered {path}:\n{}",
                s.log_text()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
        s
    }

    pub fn log_text(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// POSTs JSON; returns the status and the body.
    pub fn post(&self, path: &str, token: Option<&str>, body: &str) -> (u16, String) {
        let auth = token.map_or(String::new(), |t| format!("Authorization: Bearer {t}\r\n"));
        self.post_with_headers(path, &auth, body)
    }

    /// POSTs JSON with `headers` (each line ending in CRLF).
    pub fn post_with_headers(&self, path: &str, auth: &str, body: &str) -> (u16, String) {
        use std::io::Read;
        let mut s = TcpStream::connect(("127.0.0.1", self.port)).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        write!(
            s,
            "POST {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\nContent-Type: application/json\r\n{auth}Content-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .unwrap();
        let mut out = String::new();
        s.read_to_string(&mut out).unwrap();
        let (head, body) = out.split_once("\r\n\r\n").unwrap();
        let status = head.split_whitespace().nth(1).unwrap().parse().unwrap();
        // Bodies are small: axum sends them with Content-Length, not chunked.
        (status, body.to_owned())
    }
}

impl Drop for Service {
    fn drop(&mut self) {
        self.child.kill().ok();
        self.child.wait().ok();
    }
}

/// The package directory at run time. `cargo test` sets it for the test
/// process; the compile-time `env!` would name wherever the binary was built,
/// which with a target directory shared between clones may no longer exist.
fn manifest_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned())
}

/// A local OpenAI-compatible `/v1/embeddings` server (no embedding service
/// is reachable from here) that can be made to fail: the first `fail`
/// requests get 503 or 429 alternately (`usize::MAX`: every request).
/// Vectors are deterministic per text.
/// Texts holding this are refused by [`FlakyEmbeddings`] with a 400.
pub const REFUSED_MARKER: &str = "REFUSE-ME";

pub struct FlakyEmbeddings {
    pub url: String,
    pub fail: std::sync::Arc<std::sync::atomic::AtomicUsize>,
    pub requests: std::sync::Arc<std::sync::atomic::AtomicUsize>,
}

impl FlakyEmbeddings {
    /// `config` (a pipeline's TOML) with the remote embedding engine
    /// pointed at this server (two attempts, 2 s timeout).
    pub fn configure(&self, config: &str) -> String {
        config.replace("[embed]\n", "[embed]\nengine = \"remote\"\n")
            + &format!(
                "[embed.remote]\nurl = \"{}\"\nmax_attempts = 2\ntimeout = \"2s\"\n",
                self.url
            )
    }

    pub fn start(fail: usize) -> Self {
        use std::io::Write;
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let fail = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(fail));
        let requests = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (f, r) = (fail.clone(), requests.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { continue };
                let (fail, requests) = (f.clone(), r.clone());
                std::thread::spawn(move || {
                    let Some(body) = read_body(&stream) else {
                        return;
                    };
                    let n = requests.fetch_add(1, Ordering::SeqCst);
                    let failing = fail
                        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |f| match f {
                            0 => None,
                            usize::MAX => Some(usize::MAX),
                            f => Some(f - 1),
                        })
                        .is_ok();
                    let req: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
                    // Like an endpoint refusing a text over its context length.
                    let refused = req["input"].as_array().is_some_and(|inputs| {
                        inputs
                            .iter()
                            .any(|t| t.as_str().unwrap_or("").contains(REFUSED_MARKER))
                    });
                    let (status, out) = if refused {
                        (
                            "400 Bad Request",
                            r#"{"error":{"message":"input is too long for this model"}}"#
                                .to_owned(),
                        )
                    } else if failing {
                        let s = if n % 2 == 0 {
                            "503 Service Unavailable"
                        } else {
                            "429 Too Many Requests"
                        };
                        (s, r#"{"error":{"message":"try again"}}"#.to_owned())
                    } else {
                        let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
                        let inputs = req["input"].as_array().cloned().unwrap_or_default();
                        let data: Vec<serde_json::Value> = inputs
                            .iter()
                            .enumerate()
                            .map(|(i, t)| {
                                let h = t.as_str().unwrap_or("").bytes().fold(7u64, |h, b| {
                                    h.wrapping_mul(31).wrapping_add(u64::from(b))
                                });
                                let v: Vec<f32> = (0..384)
                                    .map(|d| {
                                        ((h.wrapping_add(d * 7919) % 1000) as f32) / 1000.0 - 0.5
                                    })
                                    .collect();
                                let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
                                let v: Vec<f32> = v.iter().map(|x| x / norm).collect();
                                serde_json::json!({"index": i, "embedding": v})
                            })
                            .collect();
                        let out = serde_json::json!({"data": data, "usage": {"prompt_tokens": inputs.len() * 8}});
                        ("200 OK", out.to_string())
                    };
                    write!(
                        stream,
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{out}",
                        out.len()
                    )
                    .ok();
                });
            }
        });
        Self {
            url,
            fail,
            requests,
        }
    }
}

/// A topic's config value, as the broker describes it.
pub fn topic_config(topic: &str, key: &str) -> Option<String> {
    use rdkafka::admin::{AdminClient, AdminOptions, ResourceSpecifier};
    let admin: AdminClient<_> = ClientConfig::new()
        .set("bootstrap.servers", brokers())
        .create()
        .unwrap();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let described = rt
        .block_on(admin.describe_configs(&[ResourceSpecifier::Topic(topic)], &AdminOptions::new()))
        .unwrap();
    described
        .into_iter()
        .flatten()
        .find_map(|r| r.get(key).and_then(|e| e.value.clone()))
}

/// Runs `steamrf ARGS` from the repository root, which must succeed; its
/// output and the fields of its last line, `RESULT key=value …` (every
/// `bench` and `eval` ends with one).
pub fn steamrf_result<S: AsRef<std::ffi::OsStr>>(
    args: impl IntoIterator<Item = S>,
) -> (String, std::collections::HashMap<String, f64>) {
    let out = Command::new(steamrf_bin())
        .current_dir(repo_root())
        .args(args)
        .env("STEAMRF_LOG", "warn")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{text}");
    let r = steamrf_harness::bench::result_fields(&text)
        .unwrap_or_else(|| panic!("no RESULT line last: {text}"));
    (text, r)
}
