//! Pipeline configuration: one TOML file, layered over built-in defaults and
//! under environment overrides, validated with every problem reported at once.
//!
//! Layers, lowest first:
//! 1. `default.toml` (compiled in);
//! 2. the pipeline file;
//! 3. environment variables `STEAMRF__SECTION__KEY=value`. Values parse as
//!    TOML scalars or arrays when they can, else as strings. Under
//!    `kafka.properties` and `lancedb.storage_options` the rest of the name is
//!    lower-cased, and for Kafka `_` becomes `.`:
//!    `STEAMRF__KAFKA__PROPERTIES__SASL_PASSWORD` sets `sasl.password`.

use std::collections::BTreeMap;
use std::fmt;
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;
use serde::de::{self, Deserializer};
use steamrf_operators::batch::BatchPolicy;
use toml::{Table, Value};

use crate::error::{Error, Result};

const DEFAULT_TOML: &str = include_str!("default.toml");
/// Prefix of environment overrides.
pub const ENV_PREFIX: &str = "STEAMRF__";

/// The whole pipeline configuration.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Config {
    /// The Kafka source and dead-letter sink.
    pub kafka: KafkaConfig,
    /// Micro-batching.
    pub batch: BatchConfig,
    /// The LanceDB sink.
    pub lancedb: LanceDbConfig,
    /// Embeddings of dialogue turns and items.
    pub embed: EmbedConfig,
    /// The STEAM write path.
    pub steam: SteamConfig,
    /// How user ids map to tenants.
    pub tenancy: TenancyConfig,
    /// The retrieval service (`steamrf serve`).
    pub serve: ServeConfig,
}

/// `[tenancy]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenancyConfig {
    /// A user's tenant is the part of its id before this (one character);
    /// empty: one tenant.
    pub separator: String,
}

impl TenancyConfig {
    /// The separator, if any.
    pub fn separator(&self) -> Option<char> {
        self.separator.chars().next()
    }
}

/// What a user's retrieval corpus holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Deserialize, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CorpusKind {
    /// Atomic memories (the `memories` table).
    Memory,
    /// Dialogue turns, or whole sessions with `group_sessions`.
    Dialogue,
    /// Dialogue sessions searched through their passage windows (the
    /// `passages` table) and their whole vector.
    Passage,
    /// Clicks and purchases, as their item's embedding.
    Interaction,
}

/// `[serve]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServeConfig {
    /// HTTP address of the API (and its /metrics).
    pub listen: String,
    /// How often the tables are checked for new versions.
    #[serde(with = "humantime_serde_compat")]
    pub refresh_interval: Duration,
    /// What a user's corpus holds.
    pub kinds: Vec<CorpusKind>,
    /// One row per dialogue session instead of per turn.
    pub group_sessions: bool,
    /// Users with at least this many rows are searched through an IVF index.
    pub ivf_min_rows: usize,
    /// Users with at least this many passage windows search them through an IVF index.
    pub ivf_min_windows: usize,
    /// IVF lists scanned per query.
    pub ivf_probes: usize,
    /// Threads per exact search.
    pub search_threads: usize,
    /// How exact scans of at least 8,192 rows score: auto (int8 where the
    /// CPU has AVX-512 VNNI), f32 or int8; int8 keeps a quarter-size copy of
    /// the rows beside them and rescores its best candidates exactly.
    #[serde(deserialize_with = "cpu_precision")]
    pub cpu_precision: steamrf_kernels::cuda::CpuPrecision,
    /// With int8 scans: candidates rescored exactly per query, × k.
    pub rescore: usize,
    /// Follow the user's memories to published prototypes.
    pub collaborative: bool,
    /// Collaborative memories considered per request.
    pub collaborative_k: usize,
    /// API tokens file (empty: no authentication).
    pub tokens_file: String,
    /// Largest request body.
    pub max_request_bytes: ByteSize,
    /// Largest `k` and `options.probe_k` a request may ask for.
    pub max_k: usize,
    /// Retrieval work per request; recollection answers what it has at expiry.
    #[serde(with = "humantime_serde_compat")]
    pub request_timeout: Duration,
    /// Requests answered at once; more are shed with 503.
    pub max_in_flight: usize,
    /// Time a client has to send its request headers.
    #[serde(with = "humantime_serde_compat")]
    pub header_timeout: Duration,
    /// Time a client has to send its request body.
    #[serde(with = "humantime_serde_compat")]
    pub body_timeout: Duration,
    /// Open connections at most; past it the service stops accepting.
    pub max_connections: usize,
    /// `/readyz` fails once no refresh has succeeded for this long.
    #[serde(with = "humantime_serde_compat")]
    pub max_staleness: Duration,
    /// glibc malloc arenas at most (0: glibc's default).
    pub malloc_arenas: usize,
    /// Bytes of users' rows and prototype members held in memory at most.
    pub cache_bytes: ByteSize,
    /// A user's most recent rows of each per-user table served at most.
    pub max_user_rows: usize,
    /// Text of one answered item at most (a session answers with its
    /// matched window).
    pub max_item_bytes: ByteSize,
    /// Turns one answer hands over at most by default (a request may ask
    /// for up to `max_k`); `k` counts evidence units.
    pub max_turns: usize,
    /// Accept `POST /v1/events` and produce them to Kafka.
    pub accept_events: bool,
    /// Where accepted events go (empty: the first of `kafka.topics`).
    pub events_topic: String,
    /// Events per `POST /v1/events` request at most.
    pub max_events: usize,
    /// `Host` headers `/mcp` answers (empty: any).
    pub mcp_allowed_hosts: Vec<String>,
    /// RF-Mem parameters (each overridable per request in `options`, up to
    /// the configured values of the cost keys).
    pub rfmem: steamrf_operators::rfmem::RfMemParams,
    /// How window, whole-row and lexical scores combine (`[serve.hybrid]`).
    pub hybrid: steamrf_operators::passage::HybridParams,
    /// The same, for windows ranked as evidence units (`[serve.units]`).
    pub units: steamrf_operators::passage::UnitParams,
    /// How `/v1/recommend` ranks (`[serve.ranker]`).
    pub ranker: RankerConfig,
}

/// `[serve.ranker]`: the recommendation ranker's weights and bounds.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RankerConfig {
    /// STEAM's `recommend` score.
    pub steam: f64,
    /// Item-item CF over the history.
    pub item_cf: f64,
    /// BM25 of the item's text against the history's texts.
    pub bm25: f64,
    /// Distinct users per item.
    pub popularity: f64,
    /// Most recent distinct history items scored against.
    pub max_history: usize,
    /// Item statistics are rebuilt at most this often.
    #[serde(with = "humantime_serde_compat")]
    pub stats_interval: Duration,
}

impl RankerConfig {
    /// The weights.
    pub fn weights(&self) -> steamrf_operators::rank::Weights {
        steamrf_operators::rank::Weights {
            steam: self.steam,
            item_cf: self.item_cf,
            bm25: self.bm25,
            popularity: self.popularity,
        }
    }

    /// The bounds.
    pub fn params(&self) -> steamrf_operators::rank::RankParams {
        steamrf_operators::rank::RankParams {
            max_history: self.max_history,
        }
    }
}

/// `[steam]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SteamConfig {
    /// Run the write path in this process.
    pub enabled: bool,
    /// τ for consolidation.
    pub tau: f32,
    /// k1: links per memory.
    pub k1: usize,
    /// τ for links.
    pub link_tau: f32,
    /// Users a community must span before its prototype is published.
    pub min_users: usize,
    /// Consolidate (false: the "w/o MC" ablation).
    pub consolidate: bool,
    /// Cap on memories per user.
    pub max_memories_per_user: usize,
    /// Memory and prototype content from an LLM (off when `url` is empty).
    pub llm: LlmConfig,
    /// Similarity kernel for relation extraction: auto (CUDA if a device
    /// works, else CPU), cuda, or cpu.
    #[serde(deserialize_with = "kernel_choice")]
    pub kernel: steamrf_kernels::cuda::Choice,
    /// Device storage precision: f32 or f16.
    #[serde(deserialize_with = "kernel_precision")]
    pub precision: steamrf_kernels::cuda::Precision,
    /// How the CPU kernel scores: auto (int8 where the CPU has AVX-512
    /// VNNI), f32 or int8.
    #[serde(deserialize_with = "cpu_precision")]
    pub cpu_precision: steamrf_kernels::cuda::CpuPrecision,
    /// With int8 scoring: candidates rescored exactly per query, × k1.
    pub rescore: usize,
    /// How relation extraction searches: auto (an IVF on the CPU, exact on
    /// CUDA), exact, or ivf.
    pub relation_index: RelationIndex,
    /// IVF lists (0: the square root of the memories at each training).
    pub ivf_lists: usize,
    /// IVF lists searched per changed memory.
    pub ivf_probes: usize,
    /// Below this many memories relation extraction is exact.
    pub ivf_min_memories: usize,
    /// Largest community a link may grow by merging (0: unbounded).
    pub max_community: usize,
    /// How the relation index keeps the memories' embeddings: f32 or bf16.
    #[serde(deserialize_with = "row_precision")]
    pub index_precision: steamrf_kernels::RowPrecision,
    /// Where links, communities and prototypes are kept.
    pub communities: CommunitiesMode,
    /// The internal topic of memory changes (`communities = "topic"`).
    pub changes_topic: String,
    /// Its partitions: one per concurrent community writer, keyed by tenant.
    pub changes_partitions: u32,
    /// Its `retention.ms` when steamrf creates it.
    #[serde(with = "humantime_serde_compat")]
    pub changes_retention: Duration,
    /// The secret memory ids are hashed under (empty: a public key).
    pub id_key: Secret,
}

/// A secret from the configuration: `Debug` never shows it.
#[derive(Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(pub String);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(redact(&self.0))
    }
}

/// Most partitions of the changes topic (community writers at once).
pub const MAX_CHANGES_PARTITIONS: u32 = 1024;

impl SteamConfig {
    /// The changes topic's configs when steamrf creates it.
    pub fn changes_topic_configs(&self) -> Vec<(&'static str, String)> {
        vec![(
            "retention.ms",
            self.changes_retention.as_millis().to_string(),
        )]
    }
}

/// How relation extraction finds a changed memory's nearest memories.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RelationIndex {
    /// [`RelationIndex::Ivf`] on the CPU kernel, [`RelationIndex::Exact`] on CUDA.
    Auto,
    /// Every memory scored (the reference).
    Exact,
    /// An inverted file kept up to date with the memories
    /// (`steamrf_kernels::ivf::IvfKernel`), exact below `ivf_min_memories`.
    Ivf,
}

/// Where community maintenance runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CommunitiesMode {
    /// In this pipeline process (run one instance).
    InProcess,
    /// In one `steamrf communities` process fed by `changes_topic`.
    Topic,
}

fn kernel_choice<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<steamrf_kernels::cuda::Choice, D::Error> {
    use steamrf_kernels::cuda::Choice;
    match String::deserialize(d)?.as_str() {
        "auto" => Ok(Choice::Auto),
        "cuda" => Ok(Choice::Cuda),
        "cpu" => Ok(Choice::Cpu),
        other => Err(de::Error::custom(format!(
            "unknown kernel {other:?} (expected auto, cuda or cpu)"
        ))),
    }
}

fn row_precision<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<steamrf_kernels::RowPrecision, D::Error> {
    String::deserialize(d)?
        .parse()
        .map_err(|e: steamrf_kernels::Error| de::Error::custom(e.to_string()))
}

fn cpu_precision<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<steamrf_kernels::cuda::CpuPrecision, D::Error> {
    use steamrf_kernels::cuda::CpuPrecision;
    match String::deserialize(d)?.as_str() {
        "auto" => Ok(CpuPrecision::Auto),
        "f32" => Ok(CpuPrecision::F32),
        "int8" => Ok(CpuPrecision::Int8),
        other => Err(de::Error::custom(format!(
            "unknown cpu_precision {other:?} (expected auto, f32 or int8)"
        ))),
    }
}

fn kernel_precision<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<steamrf_kernels::cuda::Precision, D::Error> {
    use steamrf_kernels::cuda::Precision;
    match String::deserialize(d)?.as_str() {
        "f32" => Ok(Precision::F32),
        "f16" => Ok(Precision::F16),
        other => Err(de::Error::custom(format!(
            "unknown precision {other:?} (expected f32 or f16)"
        ))),
    }
}

/// `[steam.llm]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LlmConfig {
    /// OpenAI-compatible base URL; empty: the deterministic summariser.
    pub url: String,
    /// The `model` field.
    pub model: String,
    /// Bearer token (empty: none).
    pub api_key: String,
    /// Per-request timeout.
    #[serde(with = "humantime_serde_compat")]
    pub timeout: Duration,
    /// Calls in flight.
    pub max_in_flight: usize,
    /// `max_tokens` per completion.
    pub max_completion_tokens: u32,
    /// Total tokens this process may spend (0: no limit).
    pub token_budget: u64,
    /// Sampling temperature.
    pub temperature: f32,
}

impl fmt::Debug for LlmConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LlmConfig")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &redact(&self.api_key))
            .field("max_in_flight", &self.max_in_flight)
            .field("token_budget", &self.token_budget)
            .finish_non_exhaustive()
    }
}

impl LlmConfig {
    /// The client's options, or `None` when no endpoint is configured.
    pub fn options(&self) -> Option<steamrf_operators::llm::ChatOptions> {
        if self.url.trim().is_empty() {
            return None;
        }
        Some(steamrf_operators::llm::ChatOptions {
            url: self.url.clone(),
            model: self.model.clone(),
            api_key: (!self.api_key.is_empty()).then(|| self.api_key.clone()),
            timeout: self.timeout,
            max_in_flight: self.max_in_flight.max(1),
            max_completion_tokens: self.max_completion_tokens,
            token_budget: self.token_budget,
            temperature: self.temperature,
            ..steamrf_operators::llm::ChatOptions::default()
        })
    }
}

impl SteamConfig {
    /// The operators' parameters.
    pub fn params(&self) -> steamrf_operators::steam::SteamParams {
        use steamrf_operators::steam::{SteamParams, memory::EvolveParams};
        SteamParams {
            evolve: EvolveParams {
                tau: self.tau,
                consolidate: self.consolidate,
                max_memories_per_user: self.max_memories_per_user,
                id_key: steamrf_operators::steam::IdKey::from_secret(&self.id_key.0),
            },
            k1: self.k1,
            link_tau: self.link_tau,
            min_users: self.min_users,
            tenant_separator: None,
            max_community: self.max_community,
            index_precision: self.index_precision,
        }
    }
}

/// Which embedding engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedEngine {
    /// all-MiniLM-L6-v2 in process.
    Local,
    /// An OpenAI-compatible `/v1/embeddings` endpoint.
    Remote,
    /// Nothing is embedded; embedding columns stay null.
    Off,
}

/// Which forward pass the local engine runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedBackend {
    /// steamrf's own, on the kernels crate.
    Native,
    /// candle-transformers' BertModel.
    Candle,
}

/// The number format of the native forward pass (`embed.precision`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EmbedPrecision {
    /// bf16 where the CPU has AMX, else int16 where it has AVX-512 VNNI, else f32.
    Auto,
    /// f32: the reference.
    F32,
    /// int16 Linear layers on AVX-512 VNNI (an error on a CPU without it).
    Int16,
    /// int8 Linear layers on AVX-512 VNNI: faster, coarser (an error on a CPU without it).
    Int8,
    /// bf16 Linear layers on AMX tiles (an error on a CPU without AMX).
    Bf16,
}

/// `[embed]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct EmbedConfig {
    /// Engine.
    pub engine: EmbedEngine,
    /// Model directory for the local engine.
    pub model_dir: String,
    /// Longest input in tokens (longer texts are cut and counted).
    pub max_tokens: usize,
    /// Texts per forward pass (local engine).
    pub batch_size: usize,
    /// Worker threads running the local model (0: one per core).
    pub workers: usize,
    /// The local forward pass.
    pub backend: EmbedBackend,
    /// The native forward pass's number format.
    pub precision: EmbedPrecision,
    /// Embedding jobs queued for the workers.
    pub queue: usize,
    /// How an item becomes text.
    pub item_template: String,
    /// Turns per passage window (0: no passages).
    pub passage_turns: usize,
    /// The SPLADE model directory ("": no sparse vectors).
    pub sparse_model_dir: String,
    /// The remote engine.
    pub remote: RemoteEmbedConfig,
}

/// `[embed.remote]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoteEmbedConfig {
    /// Base URL or full `/v1/embeddings` URL.
    pub url: String,
    /// The `model` field of each request.
    pub model: String,
    /// Bearer token (empty: none).
    pub api_key: String,
    /// Per-request timeout.
    #[serde(with = "humantime_serde_compat")]
    pub timeout: Duration,
    /// Attempts per request.
    pub max_attempts: u32,
    /// Requests in flight.
    pub max_in_flight: usize,
    /// Inputs per request.
    pub max_batch: usize,
}

impl fmt::Debug for RemoteEmbedConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RemoteEmbedConfig")
            .field("url", &self.url)
            .field("model", &self.model)
            .field("api_key", &redact(&self.api_key))
            .field("timeout", &self.timeout)
            .field("max_attempts", &self.max_attempts)
            .field("max_in_flight", &self.max_in_flight)
            .field("max_batch", &self.max_batch)
            .finish()
    }
}

/// `[kafka]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct KafkaConfig {
    /// Bootstrap servers.
    pub brokers: String,
    /// At start-up, a broker must answer within this long.
    #[serde(with = "humantime_serde_compat")]
    pub connect_timeout: Duration,
    /// Consumer group id.
    pub group_id: String,
    /// Topics to consume.
    #[serde(deserialize_with = "string_list")]
    pub topics: Vec<String>,
    /// Dead-letter topic.
    pub dead_letter_topic: String,
    /// Create the dead-letter topic if missing.
    pub create_dead_letter_topic: bool,
    /// Payload size limit.
    pub max_event_bytes: ByteSize,
    /// How far ahead of the reader's clock an event may be stamped.
    #[serde(with = "humantime_serde_compat")]
    pub max_future_skew: Duration,
    /// librdkafka statistics interval (drives the lag gauge).
    #[serde(with = "humantime_serde_compat")]
    pub statistics_interval: Duration,
    /// Pass-through librdkafka properties.
    #[serde(deserialize_with = "string_map")]
    pub properties: BTreeMap<String, String>,
}

/// `[batch]`
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchConfig {
    /// Flush at this many records.
    pub max_rows: usize,
    /// Flush at this many bytes (payloads plus each row's embedding column).
    pub max_bytes: ByteSize,
    /// Flush when the oldest record has waited this long.
    #[serde(with = "humantime_serde_compat")]
    pub linger: Duration,
    /// Flush at this many records with text to embed (0: no limit).
    pub max_texts: usize,
    /// Batches queued between consumer and writer.
    pub queue_batches: usize,
    /// Return freed heap pages to the OS after each written batch.
    pub release_memory: bool,
}

impl BatchConfig {
    /// The micro-batching policy.
    pub fn policy(&self) -> BatchPolicy {
        BatchPolicy {
            max_rows: self.max_rows,
            max_bytes: self.max_bytes.0,
            linger: self.linger,
            max_texts: self.max_texts,
        }
    }
}

/// `[lancedb]`
#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LanceDbConfig {
    /// Directory or object-store URI.
    pub uri: String,
    /// Compaction and version pruning interval (0 disables).
    #[serde(with = "humantime_serde_compat")]
    pub optimize_interval: Duration,
    /// Bring the key index up to date after this many new rows (0: no index).
    pub reindex_rows: u64,
    /// Keys per insert-if-absent table remembered by the fresh-key ledger
    /// (`sink::fresh`); 0 looks every batch's keys up.
    pub fresh_keys: usize,
    /// Bytes per insert-if-absent table of the Bloom filter of the keys the
    /// fresh-key ledger forgot (`sink::fresh`).
    pub fresh_filter_bytes: ByteSize,
    /// LanceDB's index cache, per process (its own default is 6 GiB).
    pub index_cache_size: ByteSize,
    /// LanceDB's metadata cache (manifests, fragment and file metadata), per
    /// process (its own default is 1 GiB).
    pub metadata_cache_size: ByteSize,
    /// Object-store options.
    #[serde(deserialize_with = "string_map")]
    pub storage_options: BTreeMap<String, String>,
}

/// Checks each librdkafka property on its own, so every bad one is reported.
pub fn check_properties(props: &BTreeMap<String, String>) -> Vec<String> {
    props
        .iter()
        .filter_map(|(k, v)| {
            let mut c = rdkafka::ClientConfig::new();
            c.set(k, v);
            match c.create::<rdkafka::consumer::BaseConsumer>() {
                Ok(_) => None,
                Err(rdkafka::error::KafkaError::ClientConfig(_, desc, _, _)) => {
                    Some(format!("kafka.properties.{k}: {desc}"))
                }
                // Properties that only make sense with others (SASL without a
                // mechanism...) are left to the real client at start-up.
                Err(_) => None,
            }
        })
        .collect()
}

/// Whether a key names a secret, whose value is never printed (a path to
/// one, `….location` or `…_file`, is printed).
fn is_secret(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    ["password", "secret", "token", "key"]
        .iter()
        .any(|s| k.contains(s))
        && !k.ends_with(".location")
        && !k.ends_with("_file")
}

/// An empty secret shows as empty; any other as `<redacted>`.
fn redact(secret: &str) -> &'static str {
    if secret.is_empty() { "" } else { "<redacted>" }
}

fn redacted(map: &BTreeMap<String, String>) -> BTreeMap<&str, &str> {
    map.iter()
        .map(|(k, v)| {
            (
                k.as_str(),
                if is_secret(k) {
                    "<redacted>"
                } else {
                    v.as_str()
                },
            )
        })
        .collect()
}

impl fmt::Debug for KafkaConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("KafkaConfig")
            .field("brokers", &self.brokers)
            .field("connect_timeout", &self.connect_timeout)
            .field("group_id", &self.group_id)
            .field("topics", &self.topics)
            .field("dead_letter_topic", &self.dead_letter_topic)
            .field("create_dead_letter_topic", &self.create_dead_letter_topic)
            .field("max_event_bytes", &self.max_event_bytes)
            .field("max_future_skew", &self.max_future_skew)
            .field("statistics_interval", &self.statistics_interval)
            .field("properties", &redacted(&self.properties))
            .finish()
    }
}

impl fmt::Debug for LanceDbConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("LanceDbConfig")
            .field("uri", &self.uri)
            .field("optimize_interval", &self.optimize_interval)
            .field("reindex_rows", &self.reindex_rows)
            .field("fresh_keys", &self.fresh_keys)
            .field("fresh_filter_bytes", &self.fresh_filter_bytes)
            .field("index_cache_size", &self.index_cache_size)
            .field("metadata_cache_size", &self.metadata_cache_size)
            .field("storage_options", &redacted(&self.storage_options))
            .finish()
    }
}

/// A size in bytes, written as an integer or as "16MiB", "512KiB", "1GB"...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub usize);

impl ByteSize {
    /// Parses "16MiB", "1GiB", "512KiB" or a plain number of bytes.
    ///
    /// # Errors
    /// Anything else, described.
    pub fn parse(s: &str) -> std::result::Result<Self, String> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (num, unit) = s.split_at(split);
        let n: usize = num
            .parse()
            .map_err(|_| format!("{s:?} is not a byte size such as \"16MiB\""))?;
        let mult: usize = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "kb" => 1_000,
            "kib" => 1 << 10,
            "mb" => 1_000_000,
            "mib" => 1 << 20,
            "gb" => 1_000_000_000,
            "gib" => 1 << 30,
            other => {
                return Err(format!(
                    "unknown byte unit {other:?} (use B, KiB, MiB, GiB, KB, MB, GB)"
                ));
            }
        };
        n.checked_mul(mult)
            .map(Self)
            .ok_or_else(|| format!("{s:?} is too large"))
    }
}

impl<'de> Deserialize<'de> for ByteSize {
    fn deserialize<D: Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        match Value::deserialize(d)? {
            Value::Integer(i) => usize::try_from(i)
                .map(Self)
                .map_err(|_| de::Error::custom("must not be negative")),
            Value::String(s) => Self::parse(&s).map_err(de::Error::custom),
            other => Err(de::Error::custom(format!(
                "expected a byte size, found {}",
                other.type_str()
            ))),
        }
    }
}

mod humantime_serde_compat {
    use super::*;
    pub(super) fn deserialize<'de, D: Deserializer<'de>>(
        d: D,
    ) -> std::result::Result<Duration, D::Error> {
        let s = String::deserialize(d)?;
        humantime::parse_duration(&s)
            .map_err(|e| de::Error::custom(format!("{s:?}: {e} (e.g. \"200ms\", \"5s\")")))
    }
}

fn scalar_to_string(v: Value) -> std::result::Result<String, String> {
    match v {
        Value::String(s) => Ok(s),
        Value::Integer(i) => Ok(i.to_string()),
        Value::Float(f) => Ok(f.to_string()),
        Value::Boolean(b) => Ok(b.to_string()),
        other => Err(format!(
            "expected a string, number or boolean, found {}",
            other.type_str()
        )),
    }
}

fn string_map<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<BTreeMap<String, String>, D::Error> {
    let t = Table::deserialize(d)?;
    t.into_iter()
        .map(|(k, v)| {
            scalar_to_string(v)
                .map(|v| (k.clone(), v))
                .map_err(|e| de::Error::custom(format!("{k}: {e}")))
        })
        .collect()
}

fn string_list<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Vec<String>, D::Error> {
    match Value::deserialize(d)? {
        Value::String(s) => Ok(s
            .split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect()),
        Value::Array(a) => a
            .into_iter()
            .map(|v| match v {
                Value::String(s) => Ok(s),
                other => Err(de::Error::custom(format!(
                    "expected strings, found {}",
                    other.type_str()
                ))),
            })
            .collect(),
        other => Err(de::Error::custom(format!(
            "expected a list of strings, found {}",
            other.type_str()
        ))),
    }
}

/// Recursively merges `over` into `base`: tables merge, everything else
/// replaces. A whole float over an integer default is that integer: Helm's
/// `toToml` writes every YAML number as a float (`changes_partitions = 8.0`).
fn merge(base: &mut Table, over: Table) {
    for (k, v) in over {
        match (base.get_mut(&k), v) {
            (Some(Value::Table(b)), Value::Table(o)) => merge(b, o),
            (Some(Value::Integer(_)), Value::Float(f))
                if f.fract() == 0.0 && f.abs() < 9_007_199_254_740_992.0 =>
            {
                base.insert(k, Value::Integer(f as i64));
            }
            (_, v) => {
                base.insert(k, v);
            }
        }
    }
}

fn parse_env_value(raw: &str) -> Value {
    toml::from_str::<Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| Value::String(raw.to_owned()))
}

/// Sets `path` in `table`, creating tables on the way; a non-table in the way
/// is replaced (the typed pass then reports the mismatch).
fn set_path(table: &mut Table, path: &[String], value: Value) {
    let Some((first, rest)) = path.split_first() else {
        return;
    };
    if rest.is_empty() {
        table.insert(first.clone(), value);
        return;
    }
    let entry = table
        .entry(first.clone())
        .or_insert_with(|| Value::Table(Table::new()));
    if !entry.is_table() {
        *entry = Value::Table(Table::new());
    }
    if let Value::Table(t) = entry {
        set_path(t, rest, value);
    }
}

/// Applies `STEAMRF__...` variables to `table`.
fn apply_env(table: &mut Table, vars: impl IntoIterator<Item = (String, String)>) {
    for (name, raw) in vars {
        let Some(rest) = name.strip_prefix(ENV_PREFIX) else {
            continue;
        };
        let parts: Vec<String> = rest.split("__").map(str::to_ascii_lowercase).collect();
        let path: Vec<String> = match parts.as_slice() {
            [section, map, key @ ..]
                if !key.is_empty()
                    && matches!(
                        (section.as_str(), map.as_str()),
                        ("kafka", "properties") | ("lancedb", "storage_options")
                    ) =>
            {
                let key = key.join("_");
                let key = if section == "kafka" {
                    key.replace('_', ".")
                } else {
                    key
                };
                vec![section.clone(), map.clone(), key]
            }
            _ => parts,
        };
        set_path(table, &path, parse_env_value(&raw));
    }
}

/// Replaces the non-empty string values of secret keys, at any depth.
fn redact_table(table: &mut Table) {
    for (k, v) in table.iter_mut() {
        match v {
            Value::Table(t) => redact_table(t),
            Value::String(s) if is_secret(k) && !s.is_empty() => *s = "<redacted>".to_owned(),
            _ => {}
        }
    }
}

/// The merged configuration tree, before typing.
fn layered(
    file: Option<&Path>,
    env: impl IntoIterator<Item = (String, String)>,
) -> Result<Table, Vec<String>> {
    let mut table: Table = toml::from_str(DEFAULT_TOML).expect("built-in default.toml parses");
    if let Some(path) = file {
        let text =
            std::fs::read_to_string(path).map_err(|e| vec![format!("{}: {e}", path.display())])?;
        let over: Table =
            toml::from_str(&text).map_err(|e| vec![format!("{}: {e}", path.display())])?;
        merge(&mut table, over);
    }
    apply_env(&mut table, env);
    Ok(table)
}

/// Checks the typed tree section by section, so one bad section does not hide
/// problems in another.
fn typed(table: &Table) -> Result<Config, Vec<String>> {
    let mut problems = Vec::new();
    for k in table.keys() {
        if ![
            "kafka", "batch", "lancedb", "embed", "steam", "tenancy", "serve",
        ]
        .contains(&k.as_str())
        {
            problems.push(format!(
                "unknown section `{k}` (expected kafka, batch, lancedb, embed, steam, tenancy, serve)"
            ));
        }
    }
    fn section<T: for<'de> Deserialize<'de>>(
        table: &Table,
        name: &str,
        problems: &mut Vec<String>,
    ) -> Option<T> {
        let v = table
            .get(name)
            .cloned()
            .unwrap_or(Value::Table(Table::new()));
        match v.try_into::<T>() {
            Ok(t) => Some(t),
            Err(e) => {
                problems.push(format!("[{name}] {}", e.to_string().trim()));
                None
            }
        }
    }
    let kafka = section::<KafkaConfig>(table, "kafka", &mut problems);
    let batch = section::<BatchConfig>(table, "batch", &mut problems);
    let lancedb = section::<LanceDbConfig>(table, "lancedb", &mut problems);
    let embed = section::<EmbedConfig>(table, "embed", &mut problems);
    let steam = section::<SteamConfig>(table, "steam", &mut problems);
    let tenancy = section::<TenancyConfig>(table, "tenancy", &mut problems);
    let serve = section::<ServeConfig>(table, "serve", &mut problems);
    match (kafka, batch, lancedb, embed, steam, tenancy, serve) {
        (
            Some(kafka),
            Some(batch),
            Some(lancedb),
            Some(embed),
            Some(steam),
            Some(tenancy),
            Some(serve),
        ) if problems.is_empty() => Ok(Config {
            kafka,
            batch,
            lancedb,
            embed,
            steam,
            tenancy,
            serve,
        }),
        _ => Err(problems),
    }
}

impl Config {
    /// Loads defaults, the file (if any) and the process environment, and
    /// validates the result.
    ///
    /// # Errors
    /// [`Error::Config`] listing every problem found.
    pub fn load(file: Option<&Path>) -> Result<Self> {
        Self::load_with_env(file, std::env::vars())
    }

    /// As [`Config::load`], with an explicit environment (for tests).
    ///
    /// # Errors
    /// [`Error::Config`] listing every problem found.
    pub fn load_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Self> {
        Self::load_layered(file, env).map(|(config, _)| config)
    }

    /// The valid configuration and the tree it was typed from.
    fn load_layered(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<(Self, Table)> {
        let table = layered(file, env).map_err(|problems| Error::Config { problems })?;
        let config = typed(&table).map_err(|problems| Error::Config { problems })?;
        let problems = config.problems();
        if problems.is_empty() {
            Ok((config, table))
        } else {
            Err(Error::Config { problems })
        }
    }

    /// The effective configuration (defaults, the file, then the
    /// environment) as TOML, the format it is written in, once it is valid:
    /// every key with its value, secrets (passwords, keys, tokens) shown as
    /// `<redacted>`. Keys are sorted within each section.
    ///
    /// # Errors
    /// [`Error::Config`] listing every problem found.
    pub fn effective_toml(file: Option<&Path>) -> Result<String> {
        Self::effective_toml_with_env(file, std::env::vars())
    }

    /// As [`Config::effective_toml`], with an explicit environment.
    ///
    /// # Errors
    /// [`Error::Config`] listing every problem found.
    pub fn effective_toml_with_env(
        file: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<String> {
        let (_, mut table) = Self::load_layered(file, env)?;
        redact_table(&mut table);
        toml::to_string_pretty(&table).map_err(|e| Error::Internal {
            message: format!("printing the configuration as TOML: {e}"),
        })
    }

    /// What is valid but probably not meant. Empty when nothing stands out.
    pub fn warnings(&self) -> Vec<String> {
        let mut w = Vec::new();
        let loopback = self
            .serve
            .listen
            .parse::<std::net::SocketAddr>()
            .is_ok_and(|a| a.ip().is_loopback());
        if self.serve.tokens_file.is_empty() && !loopback {
            w.push(format!(
                "serve.tokens_file is empty: the API at {} answers anyone who can reach it (set tokens for any address but loopback)",
                self.serve.listen
            ));
        }
        if self.steam.enabled && self.steam.id_key.0.is_empty() {
            w.push(
                "steam.id_key is empty: memory ids are hashed under a public key, so anyone who knows a user id and an event id can compute the memory's id (set one secret per store, the same on every instance, before the first memory is written: STEAMRF__STEAM__ID_KEY)".to_owned(),
            );
        }
        w
    }

    /// Semantic checks that serde cannot express. Empty when valid.
    pub fn problems(&self) -> Vec<String> {
        let mut p = Vec::new();
        let k = &self.kafka;
        if k.brokers.trim().is_empty() {
            p.push("kafka.brokers: must name at least one broker".to_owned());
        }
        if k.connect_timeout.is_zero() {
            p.push("kafka.connect_timeout: must be > 0".to_owned());
        }
        if k.group_id.trim().is_empty() {
            p.push("kafka.group_id: must not be empty".to_owned());
        }
        if k.topics.is_empty() {
            p.push("kafka.topics: must name at least one topic".to_owned());
        }
        for t in &k.topics {
            if !valid_topic(t) {
                p.push(format!("kafka.topics: {t:?} is not a valid topic name ([a-zA-Z0-9._-], at most 249 chars)"));
            }
        }
        if !valid_topic(&k.dead_letter_topic) {
            p.push(format!(
                "kafka.dead_letter_topic: {:?} is not a valid topic name",
                k.dead_letter_topic
            ));
        }
        if k.topics.contains(&k.dead_letter_topic) {
            p.push("kafka.dead_letter_topic: must not be one of kafka.topics (dead letters would loop)".to_owned());
        }
        if k.max_event_bytes.0 == 0 {
            p.push("kafka.max_event_bytes: must be > 0".to_owned());
        }
        for reserved in [
            "enable.auto.commit",
            "enable.auto.offset.store",
            "group.id",
            "bootstrap.servers",
        ] {
            if k.properties.contains_key(reserved) {
                p.push(format!(
                    "kafka.properties.{reserved}: set by steamrf itself (use kafka.brokers / kafka.group_id; offsets are committed after durable writes)"
                ));
            }
        }
        p.extend(check_properties(&k.properties));
        let b = &self.batch;
        if b.max_rows == 0 {
            p.push("batch.max_rows: must be > 0".to_owned());
        }
        if b.max_bytes.0 == 0 {
            p.push("batch.max_bytes: must be > 0".to_owned());
        }
        if b.linger.is_zero() || b.linger > Duration::from_secs(3600) {
            p.push("batch.linger: must be between 1ms and 1h".to_owned());
        }
        if b.queue_batches == 0 {
            p.push("batch.queue_batches: must be > 0".to_owned());
        }
        let uri = self.lancedb.uri.trim();
        if uri.is_empty() {
            p.push("lancedb.uri: must not be empty".to_owned());
        } else if let Some((scheme, _)) = uri.split_once("://")
            && !["s3", "s3+ddb", "file", "memory"].contains(&scheme)
        {
            p.push(format!(
                "lancedb.uri: scheme {scheme}:// is not supported by this build (use a directory, file://, or s3://)"
            ));
        }
        let e = &self.embed;
        if e.max_tokens < 3 || e.max_tokens > 512 {
            p.push(
                "embed.max_tokens: must be between 3 and 512 (BERT's position table)".to_owned(),
            );
        }
        if e.passage_turns > 16 {
            p.push(format!(
                "embed.passage_turns: must be between 0 (off) and 16, got {}",
                e.passage_turns
            ));
        }
        for (name, v) in [
            ("embed.batch_size", e.batch_size),
            ("embed.queue", e.queue),
            ("embed.remote.max_in_flight", e.remote.max_in_flight),
            ("embed.remote.max_batch", e.remote.max_batch),
        ] {
            if v == 0 {
                p.push(format!("{name}: must be > 0"));
            }
        }
        if e.remote.max_attempts == 0 {
            p.push("embed.remote.max_attempts: must be > 0".to_owned());
        }
        if !e.item_template.contains("{title}") {
            p.push("embed.item_template: must contain {title}".to_owned());
        }
        let st = &self.steam;
        for (name, v) in [("steam.tau", st.tau), ("steam.link_tau", st.link_tau)] {
            if !(-1.0..=1.0).contains(&v) {
                p.push(format!("{name}: a cosine, between -1 and 1"));
            }
        }
        if !st.llm.url.is_empty()
            && !st.llm.url.starts_with("http://")
            && !st.llm.url.starts_with("https://")
        {
            p.push(format!(
                "steam.llm.url: {:?} must start with http:// or https://",
                st.llm.url
            ));
        }
        if st.llm.max_in_flight == 0 {
            p.push("steam.llm.max_in_flight: must be > 0".to_owned());
        }
        if st.max_memories_per_user == 0 {
            p.push("steam.max_memories_per_user: must be > 0".to_owned());
        }
        if st.ivf_probes == 0 {
            p.push("steam.ivf_probes: must be at least 1".to_owned());
        }
        if st.rescore == 0 || st.rescore > 1000 {
            p.push(format!(
                "steam.rescore: must be between 1 and 1000, got {}",
                st.rescore
            ));
        }
        if st.enabled && e.engine == EmbedEngine::Off {
            p.push("steam.enabled: needs embeddings (embed.engine is off)".to_owned());
        }
        match e.engine {
            // The model directory is checked when the model loads (at start-up,
            // with the same hint): validation does not touch the filesystem.
            EmbedEngine::Local => {}
            EmbedEngine::Remote => {
                if !(e.remote.url.starts_with("http://") || e.remote.url.starts_with("https://")) {
                    p.push(format!(
                        "embed.remote.url: {:?} must start with http:// or https://",
                        e.remote.url
                    ));
                }
            }
            EmbedEngine::Off => {}
        }
        if self.tenancy.separator.chars().count() > 1 {
            p.push(format!(
                "tenancy.separator: must be one character or empty, got {:?}",
                self.tenancy.separator
            ));
        }
        let v = &self.serve;
        p.extend(v.ranker.weights().problems("serve.ranker"));
        if v.ranker.max_history == 0 {
            p.push("serve.ranker.max_history: must be at least 1".to_owned());
        }
        if v.listen.parse::<std::net::SocketAddr>().is_err() {
            p.push(format!(
                "serve.listen: {:?} is not an address like 127.0.0.1:8090",
                v.listen
            ));
        }
        if v.refresh_interval.is_zero() {
            p.push("serve.refresh_interval: must be > 0".to_owned());
        }
        if v.kinds.is_empty() {
            p.push(
                "serve.kinds: must name at least one of memory, dialogue, passage, interaction"
                    .to_owned(),
            );
        }
        if v.cpu_precision == steamrf_kernels::cuda::CpuPrecision::Int8
            && !steamrf_kernels::quant::vnni_available()
        {
            p.push("serve.cpu_precision: \"int8\" needs AVX-512 VNNI, which this CPU lacks; use \"auto\" or \"f32\"".to_owned());
        }
        if v.search_threads == 0 || v.ivf_probes == 0 || v.rescore == 0 {
            p.push(
                "serve.search_threads, serve.ivf_probes and serve.rescore: must be > 0".to_owned(),
            );
        }
        if !(1..=steamrf_operators::rfmem::MAX_K).contains(&v.max_k) {
            p.push(format!(
                "serve.max_k: must be in [1, {}], got {}",
                steamrf_operators::rfmem::MAX_K,
                v.max_k
            ));
        } else if v.rfmem.k > v.max_k || v.rfmem.probe_k > v.max_k {
            p.push(format!(
                "serve.rfmem.k and serve.rfmem.probe_k: must not exceed serve.max_k ({})",
                v.max_k
            ));
        }
        if v.max_in_flight == 0 {
            p.push("serve.max_in_flight: must be > 0".to_owned());
        }
        if v.accept_events {
            if v.events_topic.is_empty() && self.kafka.topics.is_empty() {
                p.push("serve.accept_events: needs serve.events_topic or kafka.topics".to_owned());
            }
            if !v.events_topic.is_empty() && !valid_topic(&v.events_topic) {
                p.push(format!(
                    "serve.events_topic: {:?} is not a valid topic name",
                    v.events_topic
                ));
            }
        }
        if v.max_events == 0 {
            p.push("serve.max_events: must be > 0".to_owned());
        }
        if v.max_connections == 0 {
            p.push("serve.max_connections: must be > 0".to_owned());
        }
        if let Some(h) = v.mcp_allowed_hosts.iter().find(|h| h.trim().is_empty()) {
            p.push(format!(
                "serve.mcp_allowed_hosts: {h:?} is not a host (leave the list empty to allow any)"
            ));
        }
        if v.max_user_rows == 0 {
            p.push("serve.max_user_rows: must be > 0".to_owned());
        }
        if v.max_turns == 0 || v.max_turns > v.max_k {
            p.push(format!(
                "serve.max_turns: must be in [1, serve.max_k = {}], got {}",
                v.max_k, v.max_turns
            ));
        }
        if v.max_item_bytes.0 < 64 {
            p.push(format!(
                "serve.max_item_bytes: must be at least 64 bytes, got {}",
                v.max_item_bytes.0
            ));
        }
        if v.cache_bytes.0 < 1 << 20 {
            p.push(format!(
                "serve.cache_bytes: must be at least 1MiB, got {}",
                v.cache_bytes.0
            ));
        }
        for (name, d) in [
            ("request_timeout", v.request_timeout),
            ("header_timeout", v.header_timeout),
            ("body_timeout", v.body_timeout),
        ] {
            if d.is_zero() {
                p.push(format!("serve.{name}: must be > 0"));
            }
        }
        if v.max_staleness < v.refresh_interval * 2 {
            p.push(format!(
                "serve.max_staleness: must be at least two refresh intervals ({:?}), got {:?}",
                v.refresh_interval * 2,
                v.max_staleness
            ));
        }
        if self.steam.communities == CommunitiesMode::Topic {
            if self.steam.changes_retention < Duration::from_secs(60) {
                p.push(format!(
                    "steam.changes_retention: must be at least 1m, got {:?}",
                    self.steam.changes_retention
                ));
            }
            if !(1..=MAX_CHANGES_PARTITIONS).contains(&self.steam.changes_partitions) {
                p.push(format!(
                    "steam.changes_partitions: must be 1..={MAX_CHANGES_PARTITIONS}, got {}",
                    self.steam.changes_partitions
                ));
            }
            if !valid_topic(&self.steam.changes_topic) {
                p.push(format!(
                    "steam.changes_topic: {:?} is not a valid topic name",
                    self.steam.changes_topic
                ));
            }
            if self.kafka.topics.contains(&self.steam.changes_topic)
                || self.steam.changes_topic == self.kafka.dead_letter_topic
            {
                p.push(
                    "steam.changes_topic: must differ from kafka.topics and the dead-letter topic"
                        .to_owned(),
                );
            }
        }
        if let Err(e) = v.rfmem.validate() {
            p.push(format!(
                "serve.rfmem.{}",
                e.to_string().trim_start_matches("options.")
            ));
        }
        if let Err(e) = v.units.validate() {
            p.push(format!("serve.{e}"));
        }
        if let Err(e) = v.hybrid.validate() {
            p.push(format!("serve.{e}"));
        }
        p
    }

    /// The STEAM operators' parameters, tenancy included.
    pub fn steam_params(&self) -> steamrf_operators::steam::SteamParams {
        steamrf_operators::steam::SteamParams {
            tenant_separator: self.tenancy.separator(),
            ..self.steam.params()
        }
    }
}

fn valid_topic(t: &str) -> bool {
    !t.is_empty()
        && t.len() <= 249
        && t != "."
        && t != ".."
        && t.bytes()
            .all(|c| c.is_ascii_alphanumeric() || b"._-".contains(&c))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file(text: &str) -> tempfile::NamedTempFile {
        let mut f = tempfile::NamedTempFile::new().unwrap();
        f.write_all(text.as_bytes()).unwrap();
        f
    }

    fn problems(text: &str) -> Vec<String> {
        let f = file(text);
        match Config::load_with_env(Some(f.path()), []) {
            Ok(_) => Vec::new(),
            Err(Error::Config { problems }) => problems,
            Err(e) => panic!("{e}"),
        }
    }

    #[test]
    fn defaults_are_valid() {
        let c = Config::load_with_env(None, []).unwrap();
        assert_eq!(c.kafka.topics, vec!["steamrf-events"]);
        assert_eq!(c.batch.max_bytes, ByteSize(32 << 20));
        assert_eq!(
            c.batch.policy(),
            BatchPolicy::default(),
            "default.toml and BatchPolicy::default agree"
        );
        assert_eq!(c.batch.linger, Duration::from_millis(200));
        assert_eq!(c.kafka.properties["session.timeout.ms"], "6000");
    }

    #[test]
    fn file_then_env_override() {
        let f = file(
            "[kafka]\ntopics = \"a, b\"\n[batch]\nmax_rows = 10\n[kafka.properties]\n\"fetch.min.bytes\" = 1\n",
        );
        let env = [
            ("STEAMRF__BATCH__MAX_ROWS".to_owned(), "20".to_owned()),
            (
                "STEAMRF__KAFKA__PROPERTIES__SASL_PASSWORD".to_owned(),
                "hunter2".to_owned(),
            ),
            (
                "STEAMRF__LANCEDB__URI".to_owned(),
                "s3://bucket/db".to_owned(),
            ),
            ("UNRELATED".to_owned(), "x".to_owned()),
        ];
        let c = Config::load_with_env(Some(f.path()), env).unwrap();
        assert_eq!(c.kafka.topics, vec!["a", "b"]);
        assert_eq!(c.batch.max_rows, 20);
        assert_eq!(c.kafka.properties["fetch.min.bytes"], "1");
        assert_eq!(c.kafka.properties["sasl.password"], "hunter2");
        assert_eq!(c.lancedb.uri, "s3://bucket/db");
        let dbg = format!("{c:?}");
        assert!(
            !dbg.contains("hunter2") && dbg.contains("<redacted>"),
            "{dbg}"
        );
    }

    #[test]
    fn the_relation_index_keeps_bf16_rows_unless_told_otherwise() {
        let c = Config::load_with_env(None, []).unwrap();
        assert_eq!(c.steam.index_precision, steamrf_kernels::RowPrecision::Bf16);
        assert_eq!(
            c.steam.params().index_precision,
            steamrf_operators::steam::SteamParams::default().index_precision,
            "default.toml and SteamParams::default agree"
        );
        let f = file("[steam]\nindex_precision = \"f32\"\n");
        let c = Config::load_with_env(Some(f.path()), []).unwrap();
        assert_eq!(
            c.steam.params().index_precision,
            steamrf_kernels::RowPrecision::F32
        );
        let p = problems("[steam]\nindex_precision = \"f16\"\n");
        assert!(
            p.iter()
                .any(|p| p.contains("index_precision") && p.contains("\"f32\" or \"bf16\"")),
            "{p:?}"
        );
    }

    #[test]
    fn whole_floats_from_helm_are_integers() {
        // What Helm's toToml renders from `changes_partitions: 8`.
        let f = file(
            "[steam]\ncommunities = \"topic\"\nchanges_partitions = 8.0\n[batch]\nmax_rows = 500.0\n",
        );
        let c = Config::load_with_env(Some(f.path()), []).unwrap();
        assert_eq!((c.steam.changes_partitions, c.batch.max_rows), (8, 500));
        let p = problems("[steam]\ncommunities = \"topic\"\nchanges_partitions = 2.5\n");
        assert!(p.iter().any(|p| p.contains("changes_partitions")), "{p:?}");
        let p = problems("[steam]\ncommunities = \"topic\"\nchanges_partitions = 0\n");
        assert!(
            p.iter()
                .any(|p| p.contains("steam.changes_partitions: must be 1..=1024")),
            "{p:?}"
        );
    }

    #[test]
    fn reports_every_problem_at_once() {
        let p = problems(
            "[kafka]\ntopics = []\ndead_letter_topic = \"bad topic\"\nbogus = 1\n\
             [batch]\nmax_rows = 0\nlinger = \"soon\"\n\
             [lancedb]\nuri = \"gs://x\"\n[extra]\n",
        );
        let all = p.join("\n");
        assert!(all.contains("unknown section `extra`"), "{all}");
        assert!(all.contains("[kafka]") && all.contains("bogus"), "{all}");
        assert!(all.contains("[batch]") && all.contains("soon"), "{all}");
        // Semantic checks run only on a well-typed tree; the structural ones above all came together.
        assert!(p.len() >= 3, "{all}");
        let p = problems(
            "[kafka]\ntopics = []\ndead_letter_topic = \"bad topic\"\n[batch]\nmax_rows = 0\n[lancedb]\nuri = \"gs://x\"\n[kafka.properties]\n\"no.such.property\" = \"1\"\n\"enable.auto.commit\" = \"true\"\n",
        );
        let all = p.join("\n");
        for needle in [
            "kafka.topics: must name at least one topic",
            "kafka.dead_letter_topic",
            "batch.max_rows",
            "lancedb.uri: scheme gs://",
            "no.such.property",
            "enable.auto.commit",
        ] {
            assert!(all.contains(needle), "missing {needle:?} in:\n{all}");
        }
    }

    /// `steamrf validate --print`: the effective configuration in the
    /// format it is written in, pasted back as a file, loads to the same
    /// configuration; secrets are not printed.
    #[test]
    fn the_effective_configuration_prints_as_toml_that_loads_back() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("c.toml");
        std::fs::write(
            &file,
            "[kafka]\nbrokers = \"b:9092\"\n[kafka.properties]\n\"sasl.password\" = \"hunter2\"\n[serve]\ntokens_file = \"/t\"\n",
        )
        .unwrap();
        let env = [("STEAMRF__SERVE__MAX_K".to_owned(), "700".to_owned())];
        let text = Config::effective_toml_with_env(Some(&file), env.clone()).unwrap();
        assert!(!text.contains("hunter2"), "{text}");
        assert!(
            text.contains("\"sasl.password\" = \"<redacted>\""),
            "{text}"
        );
        assert!(
            text.contains("tokens_file = \"/t\""),
            "a path is no secret: {text}"
        );
        assert!(text.contains("max_k = 700"), "{text}");
        assert!(text.contains("[serve.rfmem]"), "{text}");
        let again = dir.path().join("again.toml");
        std::fs::write(&again, text.replace("<redacted>", "hunter2")).unwrap();
        let a = Config::load_with_env(Some(&file), env).unwrap();
        let b = Config::load_with_env(Some(&again), []).unwrap();
        assert_eq!(format!("{a:?}"), format!("{b:?}"));
        // Invalid: the problems, not a half-printed file.
        std::fs::write(&file, "[serve]\nmax_k = 0\n").unwrap();
        assert!(matches!(
            Config::effective_toml_with_env(Some(&file), []),
            Err(Error::Config { .. })
        ));
    }

    #[test]
    fn docs_carry_the_current_defaults() {
        let docs = include_str!("../../docs/config.md");
        assert!(
            docs.contains(DEFAULT_TOML),
            "docs/config.md is stale: paste pipelines/src/default.toml into it"
        );
    }

    #[test]
    fn byte_sizes() {
        assert_eq!(ByteSize::parse("16MiB"), Ok(ByteSize(16 << 20)));
        assert_eq!(ByteSize::parse("1 KB"), Ok(ByteSize(1000)));
        assert_eq!(ByteSize::parse("42"), Ok(ByteSize(42)));
        assert!(ByteSize::parse("12 parsecs").is_err());
        assert!(ByteSize::parse("MiB").is_err());
    }
}
