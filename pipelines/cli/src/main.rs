//! The `steamrf` binary: a thin CLI over `steamrf_pipelines` (production) and
//! `steamrf_harness` (`eval …`, `bench …`).

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use clap::{Parser, Subcommand};
use steamrf_harness::bench;
use steamrf_pipelines::pipeline::{self, RunOptions};
use steamrf_pipelines::{Config, Error, Metrics, sql};

/// Printed by `--help`; docs/config.md says the same.
const EXIT_CODES: &str = "Exit codes: 0 success; 1 an error (`error:` then one `caused by:` line per cause); 2 an invalid configuration (every problem listed; `validate` on an invalid file too).";

#[derive(Parser)]
#[command(
    name = "steamrf",
    version,
    about = "Turns Kafka user events into agent memory tables in LanceDB.",
    after_help = EXIT_CODES
)]
struct Cli {
    /// Log filter (tracing EnvFilter syntax), e.g. "info" or "steamrf_pipelines=debug".
    #[arg(
        long,
        env = "STEAMRF_LOG",
        default_value = "warn,steamrf=info,steamrf_pipelines=info",
        global = true
    )]
    log: String,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the ingest pipeline until SIGTERM (drains, writes, commits, exits 0).
    Run {
        /// Pipeline configuration (TOML). Defaults apply without one.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
        /// Serve /metrics, /healthz and /readyz here.
        #[arg(long, env = "STEAMRF_METRICS_ADDR", default_value = "127.0.0.1:9464")]
        metrics_addr: SocketAddr,
        /// Stop after this long without records (once partitions are assigned).
        #[arg(long, value_parser = humantime::parse_duration)]
        exit_when_idle: Option<Duration>,
    },
    /// Serve the retrieval API (RF-Mem + STEAM's local-to-global step) over the tables until SIGTERM.
    Serve {
        /// Configuration (TOML): lancedb, embed, tenancy and serve sections.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
        /// Listen here instead of serve.listen.
        #[arg(long)]
        listen: Option<SocketAddr>,
    },
    /// Run a community writer of the scaled-out write path (steam.communities = "topic") until SIGTERM: writers are one consumer group, each keeping the tenants of its changes-topic partitions.
    Communities {
        /// Pipeline configuration (TOML), the same file the ingest instances use.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
        /// Serve /metrics, /healthz and /readyz here.
        #[arg(long, env = "STEAMRF_METRICS_ADDR", default_value = "127.0.0.1:9465")]
        metrics_addr: SocketAddr,
        /// Stop after this long without changes (once partitions are assigned).
        #[arg(long, value_parser = humantime::parse_duration)]
        exit_when_idle: Option<Duration>,
    },
    /// Delete everything stored about a user (interactions, turn vectors, passages, profile, memories, links), rebuild the affected communities and prototypes, remove the bytes from disk, and print a receipt. Run it with the steamrf processes stopped; while they run, send a `forget` event instead.
    Forget {
        /// The user id.
        user_id: String,
        /// Configuration file (TOML); STEAMRF__SECTION__KEY variables override it.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Upgrade tables written by an earlier steamrf to the schema this build writes (today: turn vectors move from interactions.embedding to turn_vectors), and print what it did as JSON. Idempotent. Run it with the ingest instances stopped.
    Migrate {
        /// Configuration file (TOML); STEAMRF__SECTION__KEY variables override it.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
    /// Check a configuration file (with defaults and environment applied) and report every problem.
    Validate {
        /// The file to check.
        config: PathBuf,
        /// Also print the effective configuration (defaults, the file, then the environment) as TOML, secrets redacted.
        #[arg(long)]
        print: bool,
    },
    /// Run SQL (DataFusion) over the LanceDB tables the pipeline wrote.
    Sql {
        /// The query, e.g. "SELECT kind, count(*) FROM interactions GROUP BY kind".
        query: String,
        /// Pipeline configuration, for lancedb.uri.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
    /// The papers' evaluation protocols on their data (results: docs/results.md).
    Eval {
        #[command(subcommand)]
        which: EvalCmd,
    },
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        which: BenchCmd,
    },
}

#[derive(Subcommand)]
enum EvalCmd {
    /// The STEAM paper's protocols on the AgentCF Amazon CDs samples or MovieLens-100K: ranking (NDCG@1/5/10), user simulation (AFL: precision and F1 at 1:1, 1:3, 1:9) or diversity (ILD, entropy, DS), for steamrf, its ablations and baselines.
    Steam {
        /// ranking, simulation (MovieLens only) or diversity.
        #[arg(long, default_value = "ranking", value_parser = ["ranking", "simulation", "diversity"])]
        task: String,
        /// The amazon_cds_agentcf directory (cds-*) or the ml-100k one (ml100k-*).
        #[arg(long)]
        data: PathBuf,
        /// cds-dense, cds-sparse, ml100k-catalogue (negatives from the whole catalogue), ml100k-users (from the sampled users' items), ml100k-paper (the STEAM paper's sample: 5 history ratings and the target per user, learned from alone).
        #[arg(long, default_value = "cds-dense", value_parser = ["cds-dense", "cds-sparse", "cds-dense-valid", "cds-sparse-valid", "dense", "sparse", "ml100k-catalogue", "ml100k-users", "ml100k-paper"])]
        subset: String,
        /// Candidate shuffle seeds (comma-separated).
        #[arg(long, default_value = "1,2,3", value_delimiter = ',')]
        seeds: Vec<u64>,
        /// Where the markdown table goes.
        #[arg(long, default_value = "results")]
        out: PathBuf,
        /// Write the fused ranker's weights, fitted on the validation split, to this config file (`[serve.ranker]`, for `steamrf serve -c`).
        #[arg(long)]
        fit_out: Option<PathBuf>,
        /// Geometry ablation: item text "{title}. {category}" instead of the data set's sentence template.
        #[arg(long)]
        plain_item_text: bool,
        /// Geometry ablation: mean-centre the item vectors over the embedded items.
        #[arg(long)]
        centre: bool,
        /// Geometry ablation: one τ (formation, links, recommendation) = this quantile of the item-item cosines, instead of the paper's 0.5.
        #[arg(long, value_parser = quantile)]
        tau_quantile: Option<f32>,
        /// Ablation: δ, the weight of recommend's neighbours(c) term (0: the paper's score; default 10).
        #[arg(long)]
        neighbour_weight: Option<f32>,
        /// Ablation: k_n, the neighbour memories that vote in neighbours(c) (default 20).
        #[arg(long)]
        k_neighbours: Option<usize>,
        /// Stop after the fused ranker's fit on the validation split (ranking): print each signal's and the fits' validation NDCG@10 and a RESULT with split=valid; no test user is scored.
        #[arg(long)]
        fit_only: bool,
        /// Configuration, for [embed].
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
    /// LoCoMo through the served path (Kafka, `run`, `serve`, HTTP): recall of the evidence turns within 5/10/30 turns handed to the agent, per category, beside BM25 over 3-turn windows.
    Locomo {
        /// The directory holding locomo-<split>.json (or the file).
        #[arg(long)]
        data: PathBuf,
        /// The split's name in the RESULT line.
        #[arg(long, default_value = "dev")]
        split: String,
        /// Also serve the same tables with these [serve.units] settings, or [serve.rfmem] ones as rfmem.KEY ("mix=0.5,lexical_weight=0.3", "rfmem.mode=familiarity"; repeatable): the development sweep, one row each.
        #[arg(long = "units")]
        sweep: Vec<String>,
        /// Configuration (the defaults unless given); the topic, group and tables are the run's own.
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
    /// RF-Mem on PersonaBench with the official protocol: Recall@5/10 and NDCG for familiarity, recollection and RF-Mem, by question type, with α and τ swept.
    Rfmem {
        /// PersonaBench data (the directory holding eval_data_v1, or it).
        #[arg(long)]
        data: PathBuf,
        /// Where the markdown table goes.
        #[arg(long, default_value = "results")]
        out: PathBuf,
        /// Noise level of the private data.
        #[arg(long, default_value = "0.0")]
        noise: String,
        /// Turns per passage window (the default of embed.passage_turns).
        #[arg(long, default_value_t = 3)]
        window_turns: usize,
        /// The noise level the hybrid parameters are chosen on (the same as
        /// --noise: chosen on the test questions, flagged as such).
        #[arg(long, default_value = "0.3")]
        tune_noise: String,
        /// Configuration, for [embed] (defaults: all-MiniLM-L6-v2 in process).
        #[arg(short, long, env = "STEAMRF_CONFIG")]
        config: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// RF-Mem retrieval latency (p50/p99 per path) for one user with N memories, exact vs IVF vs LanceDB.
    Retrieve {
        /// Memories of the user.
        #[arg(long, default_value_t = 10_000)]
        memories: usize,
        /// Queries per path and store.
        #[arg(long, default_value_t = 400)]
        queries: usize,
        /// Topics the memories cluster around (0: memories / 100).
        #[arg(long, default_value_t = 0)]
        topics: usize,
        /// IVF lists scanned per query.
        #[arg(long, default_value_t = 24)]
        probes: usize,
        /// The service's switch to IVF (serve.ivf_min_rows).
        #[arg(long, default_value_t = 100_000)]
        ivf_min_rows: usize,
        /// Skip LanceDB's vector search.
        #[arg(long)]
        no_lancedb: bool,
        /// Build LanceDB's IVF_PQ index from this many rows.
        #[arg(long, default_value_t = 100_000)]
        lancedb_index_rows: usize,
        /// Passage windows per row in the hybrid (served) measurement.
        #[arg(long, default_value_t = 4)]
        windows_per_row: usize,
    },
    /// A real `steamrf serve` at a fixed request rate for a long time, the tables changing underneath: errors, latency per window, RSS growth.
    Soak {
        /// How long the load runs (humantime: "10m").
        #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// Requests per second (open loop).
        #[arg(long, default_value_t = 200)]
        rate: u32,
        /// Users in the tables.
        #[arg(long, default_value_t = 1000)]
        users: usize,
        /// Dialogue turns per user.
        #[arg(long, default_value_t = 100)]
        rows_per_user: usize,
        /// New turns written per second during the run (snapshot swaps).
        #[arg(long, default_value_t = 20)]
        writes_per_s: usize,
        /// Reporting interval.
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        sample: Duration,
    },
    /// A real `steamrf serve` over many users: hot- and cold-user latency, commit-to-answerable freshness, and RSS beside `serve.cache_bytes`.
    Serve {
        /// Users in the tables.
        #[arg(long, default_value_t = 100_000)]
        users: usize,
        /// Dialogue turns per user.
        #[arg(long, default_value_t = 100)]
        rows_per_user: usize,
        /// `serve.cache_bytes` (e.g. "512MiB").
        #[arg(long, default_value = "512MiB", value_parser = bytes)]
        cache_bytes: usize,
        /// Users asked for once each, never before (cold).
        #[arg(long, default_value_t = 5000)]
        cold_users: usize,
        /// Users in the hot set.
        #[arg(long, default_value_t = 1000)]
        hot_users: usize,
        /// Requests over the hot set.
        #[arg(long, default_value_t = 5000)]
        requests: usize,
        /// Freshness probes (a new turn, then ask until it is answered).
        #[arg(long, default_value_t = 20)]
        fresh: usize,
        /// Where the tables go (default: a temp directory), e.g. s3://bucket/prefix.
        #[arg(long)]
        uri: Option<String>,
        /// A LanceDB storage option for --uri, KEY=VALUE (repeatable).
        #[arg(long = "storage-option", value_parser = key_value)]
        storage_options: Vec<(String, String)>,
    },
    /// One user with a huge history asked for by many clients at once: the other users' latency, /healthz and RSS beside `serve.cache_bytes`.
    Hammer {
        /// Turns of the hammered user.
        #[arg(long, default_value_t = 150_000)]
        big_rows: usize,
        /// Bytes of each of its turns' text, about.
        #[arg(long, default_value_t = 1000)]
        turn_bytes: usize,
        /// Turns per session of the hammered user.
        #[arg(long, default_value_t = 1000)]
        session_turns: usize,
        /// Other users.
        #[arg(long, default_value_t = 200)]
        users: usize,
        /// Turns per other user.
        #[arg(long, default_value_t = 50)]
        rows_per_user: usize,
        /// Concurrent clients asking for the hammered user.
        #[arg(long, default_value_t = 16)]
        clients: usize,
        /// How long the hammer runs (humantime: "30s").
        #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
        duration: Duration,
        /// A new turn of the hammered user this often ("0s": none), so each refresh evicts it.
        #[arg(long, default_value = "500ms", value_parser = humantime::parse_duration)]
        write_every: Duration,
        /// Baseline requests over the other users, nobody hammering.
        #[arg(long, default_value_t = 500)]
        requests: usize,
        /// `serve.cache_bytes` (e.g. "256MiB").
        #[arg(long, default_value = "256MiB", value_parser = bytes)]
        cache_bytes: usize,
        /// Threads that spin in the benchmark's process during the hammer (CPU load on the replica's machine).
        #[arg(long, default_value_t = 0)]
        busy_threads: usize,
    },
    /// GFLOP/s of the CPU similarity kernel (top-k included) beside numpy's matmul (OpenBLAS).
    Similarity {
        /// Queries per call.
        #[arg(long, default_value_t = 1000)]
        queries: usize,
        /// Corpus rows.
        #[arg(long, default_value_t = 1_000_000)]
        corpus: usize,
        /// Dimension.
        #[arg(long, default_value_t = 384)]
        dim: usize,
        /// Hits per query.
        #[arg(long, default_value_t = 10)]
        k: usize,
        /// Python with numpy and threadpoolctl.
        #[arg(long, default_value = ".tools/venv/bin/python")]
        python: PathBuf,
        /// `cpu` (beside numpy/OpenBLAS) or `cuda` (beside cuBLAS GEMM only).
        #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
        backend: String,
        /// `f32`; `f16` (CUDA only); `int8` (CPU: int8 scoring on AVX-512 VNNI
        /// with exact f32 rescoring, timed beside the f32 kernel in the same run).
        #[arg(long, default_value = "f32", value_parser = ["f32", "f16", "int8"])]
        precision: String,
        /// With `--precision int8`: candidates rescored exactly per query, × k.
        #[arg(long, default_value_t = 4)]
        rescore: usize,
    },
    /// The event decoder's fast path beside serde alone, on the ingest bench's events.
    Decode {
        /// Events per round and path.
        #[arg(long, default_value_t = 200_000)]
        events: u64,
        /// Share of dialogue turns (0 – 1); the rest are clicks.
        #[arg(long, default_value_t = 0.0)]
        turns_share: f64,
        /// Rounds (the paths alternate; medians are reported).
        #[arg(long, default_value_t = 7)]
        rounds: usize,
    },
    /// One key-index update of interactions as the table grows: the writer's tiered update beside LanceDB's default one.
    Index {
        /// Rows before the first measured update.
        #[arg(long, default_value_t = 4_000_000)]
        rows: u64,
        /// Rows appended before each update (lancedb.reindex_rows).
        #[arg(long, default_value_t = 500_000)]
        update_rows: u64,
        /// Updates measured.
        #[arg(long, default_value_t = 8)]
        updates: usize,
        /// Stored clicks replayed (looked up) after each update, spread over the table.
        #[arg(long, default_value_t = 20_000)]
        replay_rows: u64,
    },
    /// Per-batch relation extraction + community maintenance beside a full recomputation.
    Communities {
        /// Memories in the corpus.
        #[arg(long, default_value_t = 1_000_000)]
        memories: usize,
        /// New memories per batch.
        #[arg(long, default_value_t = 1000)]
        batch: usize,
        /// Incremental batches measured (median reported).
        #[arg(long, default_value_t = 5)]
        batches: usize,
        /// Measure the full recomputation's extraction entirely (default: 3 query blocks, scaled).
        #[arg(long)]
        full_recompute: bool,
        /// Embedding dimension.
        #[arg(long, default_value_t = 384)]
        dim: usize,
        /// The CPU kernel's scoring (`steam.cpu_precision`), exhaustive or
        /// over the IVF's lists; `auto` (the default's): int8 where the CPU
        /// has AVX-512 VNNI. `int8` also runs the exact f32 writer on the
        /// same batches.
        #[arg(long, default_value = "auto", value_parser = ["auto", "f32", "int8"])]
        precision: String,
        /// Relation extraction (`steam.relation_index`): `ivf` also runs the
        /// exact f32 writer on the same batches (link recall, community agreement).
        #[arg(long, default_value = "ivf", value_parser = ["exact", "ivf"])]
        index: String,
        /// IVF lists probed per changed memory (`steam.ivf_probes`).
        #[arg(long, default_value_t = 16)]
        probes: usize,
        /// `steam.max_community` (0: unbounded).
        #[arg(long, default_value_t = 1000)]
        max_community: usize,
        /// Writers, as `steamrf communities` processes sharing the changes
        /// topic's partitions: the memories' users spread over `--tenants`
        /// tenants, each tenant kept by the writer `shard_of` names, the
        /// writers run each batch at once (on their own threads, the cores
        /// split between them).
        #[arg(long, default_value_t = 1)]
        writers: usize,
        /// Tenants the users spread over (0: one tenant, no separator).
        #[arg(long, default_value_t = 0)]
        tenants: usize,
        /// One real text per line (e.g. dialogue turns), embedded with the
        /// configured model: memories mix 1-3 neighbouring texts instead of
        /// synthetic topics.
        #[arg(long)]
        texts: Option<PathBuf>,
        /// Configuration file (the embedder, for --texts).
        #[arg(long)]
        config: Option<PathBuf>,
        /// Also extract the last batch's links with LanceDB's IVF_PQ and
        /// IVF_HNSW_SQ indexes on the same memories (one writer; with the
        /// IVF or int8, which run the exact writer for recall).
        #[arg(long)]
        lancedb: bool,
        /// Do not keep the exact writer's copy of the state (which measures
        /// community agreement and the exact batch time, and doubles the
        /// memory): link recall and the exact extraction time come from
        /// the exact kernel run on the writer's own state before each
        /// batch is linked. For corpora whose state fits only once.
        #[arg(long)]
        no_exact_writer: bool,
        /// How the writers' relation index keeps the embeddings
        /// (`steam.index_precision`). With `bf16`, the exact writer keeps
        /// f32 rows, so link recall and community agreement measure the
        /// rounding too.
        #[arg(long, default_value = "bf16", value_parser = ["f32", "bf16"])]
        index_precision: String,
    },
    /// Sentences/s of the in-process MiniLM embedder beside sentence-transformers on torch.
    Embed {
        /// Texts to embed.
        #[arg(long, default_value_t = 2000)]
        texts: usize,
        /// One text per line (default: a generated corpus of 4-48 word texts).
        #[arg(long)]
        corpus: Option<PathBuf>,
        /// Texts per embed call (one micro-batch).
        #[arg(long, default_value_t = 256)]
        chunk: usize,
        /// Skip the sentence-transformers reference.
        #[arg(long)]
        no_reference: bool,
        /// Configuration for [embed] (model_dir, batch_size, workers).
        #[arg(short, long)]
        config: Option<PathBuf>,
    },
    /// Produces N synthetic click events (the ingest benchmark's) to a topic.
    Produce {
        /// The topic (created if missing).
        #[arg(long)]
        topic: String,
        #[command(flatten)]
        events: BenchEvents,
    },
    /// Events/s from Kafka into LanceDB, beside kcat's raw group-consume rate on the same topic.
    Ingest {
        #[command(flatten)]
        events: BenchEvents,
        /// The kcat binary (needs librdkafka >= 2.12 for Tansu; scripts/tools.sh installs a wrapper).
        #[arg(long, default_value = ".tools/bin/kcat")]
        kcat: PathBuf,
        /// Base configuration for batching (topic, group and table location are fresh).
        #[arg(short, long)]
        config: Option<PathBuf>,
        /// Make LanceDB the bottleneck (1,000-row batches, no key index), so the backlog waits in Kafka.
        #[arg(long)]
        slow_sink: bool,
    },
}

/// The synthetic click events of `bench produce` and `bench ingest`.
#[derive(clap::Args)]
struct BenchEvents {
    /// Click events.
    #[arg(long, default_value_t = 1_000_000)]
    events: u64,
    /// Partitions of the topic, if it is created.
    #[arg(long, default_value_t = 4)]
    partitions: i32,
    /// Bootstrap servers.
    #[arg(long, default_value = "127.0.0.1:9092")]
    brokers: String,
    /// Distinct events among them (the rest repeat them exactly, so a table stops growing at this many rows while the backlog grows); 0: all distinct.
    #[arg(long, default_value_t = 0)]
    distinct: u64,
    /// The share of events that are dialogue turns (4–48 words, embedded at ingest with their passage windows); the rest are clicks.
    #[arg(long, default_value_t = 0.0)]
    turns_share: f64,
    /// Produce at this many events/s (0: as fast as possible). `bench ingest` then runs the pipeline while they are produced and reports the produce → durable latency instead of kcat's rate.
    #[arg(long, default_value_t = 0)]
    rate: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_new(&cli.log).unwrap_or_else(|_| "info".into()),
        )
        .with_writer(std::io::stderr)
        // Colours only on a terminal: log files and container logs stay plain.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => {
            eprintln!("error: starting the runtime: {e}");
            return ExitCode::from(1);
        }
    };
    match runtime.block_on(real_main(cli.command)) {
        Ok(code) => code,
        Err(e) => {
            // One line per cause, each said once.
            let causes = steamrf_pipelines::error::causes(e.as_ref());
            eprintln!("error: {}", causes[0]);
            for c in &causes[1..] {
                eprintln!("  caused by: {c}");
            }
            let config_error = e
                .downcast_ref::<Error>()
                .is_some_and(|e| matches!(e, Error::Config { .. }));
            ExitCode::from(if config_error { 2 } else { 1 })
        }
    }
}

async fn real_main(cmd: Cmd) -> anyhow::Result<ExitCode> {
    match cmd {
        Cmd::Run {
            config,
            metrics_addr,
            exit_when_idle,
        } => {
            let config = Config::load(config.as_deref())?;
            let metrics = Metrics::new(&config.kafka.topics);
            let stop = Arc::new(AtomicBool::new(false));
            let signals = tokio::spawn(wait_for_signals(stop.clone()));
            let opts = RunOptions {
                metrics_addr: Some(metrics_addr),
                exit_when_idle,
            };
            let result = pipeline::run(config, opts, metrics, stop).await;
            signals.abort();
            result?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Serve { config, listen } => {
            let config = Config::load(config.as_deref())?;
            let stop = Arc::new(AtomicBool::new(false));
            let signals = tokio::spawn(wait_for_signals(stop.clone()));
            let result = steamrf_pipelines::serve::run(config, listen, stop).await;
            signals.abort();
            result?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            which:
                BenchCmd::Retrieve {
                    memories,
                    queries,
                    topics,
                    probes,
                    ivf_min_rows,
                    no_lancedb,
                    lancedb_index_rows,
                    windows_per_row,
                },
        } => {
            let lines = bench::retrieve(bench::RetrieveBench {
                memories,
                queries,
                topics,
                probes,
                ivf_min_rows,
                lancedb: !no_lancedb,
                lancedb_index_rows,
                windows_per_row,
            })
            .await
            .context("bench retrieve")?;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Serve {
                    users,
                    rows_per_user,
                    cache_bytes,
                    cold_users,
                    hot_users,
                    requests,
                    fresh,
                    uri,
                    storage_options,
                },
        } => {
            let lines = bench::serve(bench::ServeBench {
                users,
                rows_per_user,
                cache_bytes,
                cold_users,
                hot_users,
                requests,
                fresh,
                uri,
                storage_options,
            })
            .await
            .context("bench serve")?;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Hammer {
                    big_rows,
                    turn_bytes,
                    session_turns,
                    users,
                    rows_per_user,
                    clients,
                    duration,
                    write_every,
                    requests,
                    cache_bytes,
                    busy_threads,
                },
        } => {
            let lines = bench::hammer(bench::HammerBench {
                big_rows,
                turn_bytes,
                session_turns,
                users,
                rows_per_user,
                clients,
                duration,
                write_every,
                requests,
                cache_bytes,
                busy_threads,
            })
            .await
            .context("bench hammer")?;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Soak {
                    duration,
                    rate,
                    users,
                    rows_per_user,
                    writes_per_s,
                    sample,
                },
        } => {
            let lines = bench::soak(bench::SoakBench {
                duration,
                rate,
                users,
                rows_per_user,
                writes_per_s,
                sample,
            })
            .await
            .context("bench soak")?;
            Ok(print_lines(&lines))
        }
        Cmd::Communities {
            config,
            metrics_addr,
            exit_when_idle,
        } => {
            let config = Config::load(config.as_deref())?;
            let stop = Arc::new(AtomicBool::new(false));
            let signals = tokio::spawn(wait_for_signals(stop.clone()));
            let result = steamrf_pipelines::communities::run(
                config,
                Some(metrics_addr),
                exit_when_idle,
                stop,
            )
            .await;
            signals.abort();
            result?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Eval {
            which:
                EvalCmd::Steam {
                    task,
                    data,
                    subset,
                    seeds,
                    out,
                    fit_out,
                    plain_item_text,
                    centre,
                    tau_quantile,
                    neighbour_weight,
                    k_neighbours,
                    fit_only,
                    config,
                },
        } => {
            let config = Config::load(config.as_deref())?;
            let lines = steamrf_harness::eval::steam(steamrf_harness::eval::SteamEval {
                data,
                subset,
                seeds,
                embed: config.embed,
                out,
                task,
                fit_out,
                geometry: steamrf_harness::eval::Geometry {
                    plain_text: plain_item_text,
                    centre,
                    tau_quantile,
                },
                scoring: steamrf_harness::eval::Scoring {
                    neighbour_weight,
                    k_neighbours,
                },
                fit_only,
                index_precision: config.steam.index_precision,
            })
            .await
            .context("eval steam")?;
            Ok(print_lines(&lines))
        }
        Cmd::Eval {
            which:
                EvalCmd::Locomo {
                    data,
                    split,
                    sweep,
                    config,
                },
        } => {
            let config = Config::load(config.as_deref())?;
            let lines = steamrf_harness::eval::locomo(steamrf_harness::eval::LocomoEval {
                data,
                split,
                config,
                sweep,
            })
            .await
            .context("eval locomo")?;
            Ok(print_lines(&lines))
        }
        Cmd::Eval {
            which:
                EvalCmd::Rfmem {
                    data,
                    out,
                    noise,
                    window_turns,
                    tune_noise,
                    config,
                },
        } => {
            let config = Config::load(config.as_deref())?;
            let lines = steamrf_harness::eval::rfmem(steamrf_harness::eval::RfMemEval {
                data,
                embed: config.embed,
                out,
                noise,
                window: steamrf_operators::passage::WindowParams {
                    turns: window_turns,
                },
                tune_noise,
                serve: config.serve,
            })
            .await
            .context("eval rfmem")?;
            Ok(print_lines(&lines))
        }
        Cmd::Forget { user_id, config } => {
            let config = Config::load(config.as_deref())?;
            let receipt = steamrf_pipelines::forget::run(&config, &user_id)
                .await
                .context("forget")?;
            println!("{}", serde_json::to_string_pretty(&receipt)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Migrate { config } => {
            let config = Config::load(config.as_deref())?;
            let report = steamrf_pipelines::migrate::migrate(
                &config.lancedb,
                config.tenancy.separator(),
                &config.steam.params().evolve.id_key,
            )
            .await
            .context("migrate")?;
            println!("{}", serde_json::to_string_pretty(&report)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Validate { config, print } => match Config::load(Some(&config)) {
            Ok(c) => {
                println!("{}: ok", config.display());
                for w in c.warnings() {
                    println!("  warning: {w}");
                }
                if print {
                    print!("\n{}", Config::effective_toml(Some(&config))?);
                }
                Ok(ExitCode::SUCCESS)
            }
            Err(Error::Config { problems }) => {
                eprintln!("{}: {} problem(s)", config.display(), problems.len());
                for p in problems {
                    eprintln!("  - {p}");
                }
                Ok(ExitCode::from(2))
            }
            Err(e) => Err(e.into()),
        },
        Cmd::Sql { query, config } => {
            let config = Config::load(config.as_deref())?;
            let batches = sql::query(&config.lancedb, &query).await?;
            println!("{}", arrow_cast::pretty::pretty_format_batches(&batches)?);
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Bench {
            which:
                BenchCmd::Similarity {
                    queries,
                    corpus,
                    dim,
                    k,
                    python,
                    backend,
                    precision,
                    rescore,
                },
        } => {
            let b = bench::SimilarityBench {
                queries,
                corpus,
                dim,
                k,
                python,
                backend,
                precision,
                rescore,
            };
            let lines = tokio::task::spawn_blocking(move || bench::similarity(&b)).await??;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Decode {
                    events,
                    turns_share,
                    rounds,
                },
        } => {
            let b = bench::DecodeBench {
                events,
                turns_share,
                rounds,
            };
            let lines = tokio::task::spawn_blocking(move || bench::decode_bench(&b)).await??;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Index {
                    rows,
                    update_rows,
                    updates,
                    replay_rows,
                },
        } => {
            let b = bench::IndexBench {
                rows,
                update_rows,
                updates,
                replay_rows,
            };
            Ok(print_lines(&bench::index(b).await?))
        }
        Cmd::Bench {
            which:
                BenchCmd::Communities {
                    memories,
                    batch,
                    batches,
                    full_recompute,
                    dim,
                    precision,
                    index,
                    probes,
                    max_community,
                    writers,
                    tenants,
                    texts,
                    config,
                    lancedb,
                    no_exact_writer,
                    index_precision,
                },
        } => {
            let texts = match texts {
                Some(path) => {
                    let config = Config::load(config.as_deref())?;
                    Some(
                        bench::embed_file(&config.embed, &path)
                            .await
                            .context("bench communities --texts")?,
                    )
                }
                None => None,
            };
            let b = bench::CommunitiesBench {
                memories,
                batch,
                batches,
                full_recompute,
                dim,
                int8: bench::int8_scoring(&precision),
                ivf: index == "ivf",
                probes,
                max_community,
                writers,
                tenants,
                texts,
                lancedb,
                exact_writer: !no_exact_writer,
                index_precision: index_precision.parse()?,
            };
            let lines = tokio::task::spawn_blocking(move || bench::communities(&b)).await??;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Embed {
                    texts,
                    corpus,
                    chunk,
                    no_reference,
                    config,
                },
        } => {
            let config = Config::load(config.as_deref())?;
            let lines = bench::embed(bench::EmbedBench {
                texts,
                corpus,
                config: config.embed,
                chunk,
                no_reference,
            })
            .await
            .context("bench embed")?;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which:
                BenchCmd::Ingest {
                    events,
                    kcat,
                    config,
                    slow_sink,
                },
        } => {
            let config = Config::load(config.as_deref())?;
            let lines = bench::ingest(bench::IngestBench {
                brokers: events.brokers,
                events: events.events,
                partitions: events.partitions,
                kcat,
                config,
                lancedb_uri: None,
                slow_sink,
                producer: std::env::current_exe().context("locating the steamrf binary")?,
                distinct: events.distinct,
                turns_share: events.turns_share,
                rate: events.rate,
            })
            .await
            .context("bench ingest")?;
            Ok(print_lines(&lines))
        }
        Cmd::Bench {
            which: BenchCmd::Produce { topic, events: e },
        } => {
            let distinct = if e.distinct == 0 {
                e.events
            } else {
                e.distinct
            };
            let lines = bench::produce_events(
                &e.brokers,
                &topic,
                e.partitions,
                e.events,
                distinct,
                e.turns_share,
                e.rate,
            )
            .await
            .context("bench produce")?;
            Ok(print_lines(&lines))
        }
    }
}

/// Prints a benchmark's report; its last line, the `RESULT` line, gains the
/// build profile (`profile=dev|release`).
fn print_lines(lines: &[String]) -> ExitCode {
    let Some((last, rest)) = lines.split_last() else {
        return ExitCode::SUCCESS;
    };
    for l in rest {
        println!("{l}");
    }
    if last.starts_with("RESULT ") {
        println!("{last} profile={}", bench::PROFILE);
    } else {
        println!("{last}");
    }
    ExitCode::SUCCESS
}

/// SIGTERM or SIGINT: drain and stop. A second one exits at once.
async fn wait_for_signals(stop: Arc<AtomicBool>) {
    use tokio::signal::unix::{SignalKind, signal};
    let (Ok(mut term), Ok(mut int)) = (
        signal(SignalKind::terminate()),
        signal(SignalKind::interrupt()),
    ) else {
        tracing::warn!("Could not install signal handlers.");
        return;
    };
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::info!("Signal received; draining.");
    stop.store(true, Ordering::Relaxed);
    tokio::select! { _ = term.recv() => {}, _ = int.recv() => {} }
    tracing::warn!(
        "Second signal; exiting without draining (nothing uncommitted is lost: it will be replayed)."
    );
    std::process::exit(130);
}

/// `KEY=VALUE`.
/// A size in bytes as the configuration writes it ("512MiB").
fn bytes(s: &str) -> Result<usize, String> {
    steamrf_pipelines::config::ByteSize::parse(s).map(|b| b.0)
}

fn key_value(s: &str) -> Result<(String, String), String> {
    s.split_once('=')
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .ok_or_else(|| format!("{s:?} is not KEY=VALUE"))
}

/// A quantile: a number in [0, 1].
fn quantile(s: &str) -> Result<f32, String> {
    match s.parse::<f32>() {
        Ok(q) if (0.0..=1.0).contains(&q) => Ok(q),
        _ => Err(format!("{s:?} is not a quantile (a number from 0 to 1)")),
    }
}
