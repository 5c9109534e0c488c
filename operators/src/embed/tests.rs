use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use serde::Deserialize;

use super::*;

/// The real all-MiniLM-L6-v2, fetched by `scripts/tools.sh`.
fn model_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("STEAMRF_MODEL_DIR") {
        return PathBuf::from(dir);
    }
    let dir = PathBuf::from(manifest_dir()).join("../.tools/models/all-MiniLM-L6-v2");
    assert!(
        dir.join("model.safetensors").exists(),
        "the MiniLM model is missing at {}: run scripts/tools.sh (or set STEAMRF_MODEL_DIR)",
        dir.display()
    );
    dir
}

fn model() -> MiniLm {
    MiniLm::load(&model_dir(), MiniLmOptions::default()).unwrap()
}

fn f32_opts() -> MiniLmOptions {
    MiniLmOptions {
        precision: Precision::F32,
        ..MiniLmOptions::default()
    }
}

#[derive(Deserialize)]
struct Reference {
    sentences: Vec<String>,
    token_ids: Vec<Vec<u32>>,
    vectors: Vec<Vec<f32>>,
}

fn reference() -> Reference {
    serde_json::from_str(include_str!("testdata/minilm-reference.json")).unwrap()
}

fn check_parity(got: &[f32], want: &[f32], what: &str) {
    let max_abs = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    let cos: f32 = got.iter().zip(want).map(|(a, b)| a * b).sum();
    assert!(max_abs <= 1e-5, "{what}: max abs difference {max_abs}");
    assert!(cos >= 0.9999, "{what}: cosine {cos}");
}

#[test]
fn tokenizer_matches_sentence_transformers_including_truncation_at_256() {
    let m = model();
    let r = reference();
    for (s, want) in r.sentences.iter().zip(&r.token_ids) {
        assert_eq!(&m.token_ids(s).unwrap(), want, "{s}");
    }
    // The long sentence is 287 tokens before truncation.
    assert!(r.token_ids.iter().any(|t| t.len() == 256));
}

#[test]
fn embeddings_match_the_reference_batched_and_one_at_a_time() {
    let r = reference();
    let texts: Vec<&str> = r.sentences.iter().map(String::as_str).collect();
    for backend in [Backend::Native, Backend::Candle] {
        for batch_size in [32, 3] {
            let m = MiniLm::load(
                &model_dir(),
                MiniLmOptions {
                    backend,
                    batch_size,
                    ..f32_opts()
                },
            )
            .unwrap();
            let batched = m.embed_sync(&texts).unwrap();
            assert_eq!(batched.len(), texts.len());
            assert_eq!(batched.dim, MINILM_DIM);
            assert_eq!(
                batched.truncated, 1,
                "one reference sentence exceeds 256 tokens"
            );
            for (i, want) in r.vectors.iter().enumerate() {
                let what = format!("{backend:?}, batches of {batch_size}, #{i}");
                check_parity(batched.row(i), want, &what);
                if batch_size == 32 {
                    let single = m.embed_sync(&texts[i..=i]).unwrap();
                    check_parity(single.row(0), want, &format!("{what} alone"));
                }
            }
        }
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// The reduced-precision forward passes against sentence-transformers' f32
/// vectors and steamrf's own f32 pass, batched and alone: bf16 on AMX and
/// int16 on VNNI (what `auto` picks) keep every cosine ≥ 0.999, int8 (only
/// on request) ≥ 0.99. Each path runs where the CPU has it (the log names
/// which ran); elsewhere asking for it is refused by name, and `auto` is
/// checked to pick the best the CPU has.
#[test]
fn reduced_precision_embeddings_stay_close_to_f32() {
    let r = reference();
    let texts: Vec<&str> = r.sentences.iter().map(String::as_str).collect();
    let at = |precision| MiniLmOptions {
        precision,
        ..MiniLmOptions::default()
    };
    let (vnni, amx) = (
        steamrf_kernels::quant::vnni_available(),
        steamrf_kernels::bf16::amx_available(),
    );
    let auto = match (amx, vnni) {
        (true, _) => Precision::Bf16,
        (false, true) => Precision::Int16,
        _ => Precision::F32,
    };
    assert_eq!(model().precision(), auto, "auto picks the best path here");
    let mut paths = Vec::new();
    if amx {
        paths.push((Precision::Bf16, 0.999));
    } else {
        let err = MiniLm::load(&model_dir(), at(Precision::Bf16))
            .unwrap_err()
            .to_string();
        assert!(err.contains("AMX"), "{err}");
    }
    if vnni {
        paths.extend([(Precision::Int16, 0.999), (Precision::Int8, 0.99)]);
    } else {
        for p in [Precision::Int16, Precision::Int8] {
            let err = MiniLm::load(&model_dir(), at(p)).unwrap_err().to_string();
            assert!(err.contains("AVX-512 VNNI"), "{err}");
        }
    }
    eprintln!(
        "reduced-precision embedder parity on this CPU: {:?} (auto = {auto:?})",
        paths.iter().map(|p| p.0).collect::<Vec<_>>()
    );
    let exact = MiniLm::load(&model_dir(), f32_opts()).unwrap();
    let want = exact.embed_sync(&texts).unwrap();
    for (precision, floor) in paths {
        // Every cosine first, then the check: the log shows the whole spread.
        let (mut worst_st, mut worst_f32) = (1.0f32, 1.0f32);
        for batch_size in [32, 3] {
            let m = MiniLm::load(
                &model_dir(),
                MiniLmOptions {
                    batch_size,
                    ..at(precision)
                },
            )
            .unwrap();
            assert_eq!(m.precision(), precision);
            let got = m.embed_sync(&texts).unwrap();
            for (i, st) in r.vectors.iter().enumerate() {
                worst_st = worst_st.min(cosine(got.row(i), st));
                worst_f32 = worst_f32.min(cosine(got.row(i), want.row(i)));
                if batch_size == 32 {
                    let alone = m.embed_sync(&texts[i..=i]).unwrap();
                    worst_f32 = worst_f32.min(cosine(alone.row(0), want.row(i)));
                }
            }
        }
        eprintln!(
            "{precision:?} embedder: lowest cosine {worst_st:.5} to sentence-transformers, {worst_f32:.5} to steamrf f32, over {} sentences batched and alone",
            texts.len()
        );
        assert!(
            worst_st >= floor,
            "{precision:?}: lowest cosine to sentence-transformers {worst_st}"
        );
        assert!(
            worst_f32 >= floor,
            "{precision:?}: lowest cosine to steamrf f32 {worst_f32}"
        );
    }
    let candle = MiniLm::load(
        &model_dir(),
        MiniLmOptions {
            backend: Backend::Candle,
            ..at(Precision::Int16)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(candle.contains("native backend"), "{candle}");
    let auto_candle = MiniLm::load(
        &model_dir(),
        MiniLmOptions {
            backend: Backend::Candle,
            ..MiniLmOptions::default()
        },
    )
    .unwrap();
    assert_eq!(auto_candle.precision(), Precision::F32);
}

#[test]
fn empty_and_huge_texts_are_embedded_and_truncation_is_counted() {
    let m = model();
    let huge = "lorem ipsum dolor sit amet ".repeat(50_000); // 1.35 MB
    // 10,000 words (each an [UNK]) in 50 KB: cut by the tokenizer, not by clipping.
    let emoji = "🎷 ".repeat(10_000);
    let out = m.embed_sync(&["", &huge, &emoji, "jazz"]).unwrap();
    assert_eq!(out.len(), 4);
    assert_eq!(out.truncated, 2);
    for i in 0..4 {
        let norm: f32 = out.row(i).iter().map(|x| x * x).sum::<f32>().sqrt();
        assert!((norm - 1.0).abs() < 1e-4, "row {i} norm {norm}");
        assert!(out.row(i).iter().all(|x| x.is_finite()));
    }
    // [CLS] [SEP] for the empty text, 256 for each cut one, 3 for "jazz".
    assert_eq!(out.tokens, 2 + 256 + 256 + 3);
    assert!(m.embed_sync(&[]).unwrap().is_empty());
}

#[test]
fn clip_bytes_respects_char_boundaries() {
    assert_eq!(clip_bytes("héllo", 2), "h");
    assert_eq!(clip_bytes("héllo", 3), "hé");
    assert_eq!(clip_bytes("abc", 10), "abc");
}

#[test]
fn load_errors_name_the_file() {
    let dir = tempfile_dir();
    let err = MiniLm::load(&dir, MiniLmOptions::default()).unwrap_err();
    assert!(err.to_string().contains("config.json"), "{err}");
}

fn tempfile_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("steamrf-embed-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

#[test]
fn local_embedder_runs_off_the_runtime_and_keeps_order() {
    let r = reference();
    let emb = LocalEmbedder::start(MiniLm::load(&model_dir(), f32_opts()).unwrap(), 2, 4).unwrap();
    let rt = runtime();
    let results = rt.block_on(async {
        let futs = r.sentences.iter().map(|s| emb.embed(vec![s.clone()]));
        futures::future::join_all(futs).await
    });
    for (i, res) in results.into_iter().enumerate() {
        check_parity(res.unwrap().row(0), &r.vectors[i], &format!("local #{i}"));
    }
    assert_eq!(emb.stats().texts.load(Ordering::Relaxed), 20);
    assert_eq!(emb.stats().truncated.load(Ordering::Relaxed), 1);
}

#[test]
fn one_call_is_cut_into_forward_passes_for_every_worker_and_keeps_order() {
    let r = reference();
    let m = MiniLm::load(
        &model_dir(),
        MiniLmOptions {
            batch_size: 3,
            ..f32_opts()
        },
    )
    .unwrap();
    // A queue of one job: the call's jobs wait for each other's slots.
    let emb = LocalEmbedder::start(m, 2, 1).unwrap();
    let rt = runtime();
    let out = rt.block_on(emb.embed(r.sentences.clone())).unwrap();
    assert_eq!(out.len(), r.sentences.len());
    for (i, want) in r.vectors.iter().enumerate() {
        check_parity(out.row(i), want, &format!("one call, #{i}"));
    }
    assert_eq!(out.truncated, 1);
    assert_eq!(emb.stats().texts.load(Ordering::Relaxed), 20);
    let tokens: u64 = r.token_ids.iter().map(|t| t.len() as u64).sum();
    assert_eq!(out.tokens, tokens, "every job's tokens are summed");
}

// --- The remote client against a local fake OpenAI-compatible server. ---

#[derive(Default)]
struct Fake {
    /// Answer this many requests with `fail_status` before succeeding.
    failures_left: AtomicUsize,
    fail_status: u16,
    /// Sleep this long before answering (to trigger client timeouts).
    delay_ms: u64,
    in_flight: AtomicUsize,
    max_in_flight: AtomicUsize,
    requests: AtomicUsize,
}

/// A deterministic vector per text (not normalised: the client must do it).
fn fake_vector(text: &str) -> Vec<f32> {
    let mut v = vec![0.0f32; 4];
    v[text.len() % 4] = 2.0;
    v
}

async fn fake_server(fake: Arc<Fake>) -> String {
    use axum::body::Bytes;
    use axum::http::StatusCode;
    use axum::response::IntoResponse;

    let app = axum::Router::new().route(
        "/v1/embeddings",
        axum::routing::post(move |body: Bytes| {
            let fake = fake.clone();
            async move {
                fake.requests.fetch_add(1, Ordering::SeqCst);
                let now = fake.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                fake.max_in_flight.fetch_max(now, Ordering::SeqCst);
                tokio::time::sleep(Duration::from_millis(fake.delay_ms.max(20))).await;
                fake.in_flight.fetch_sub(1, Ordering::SeqCst);
                let failing = fake
                    .failures_left
                    .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                    .is_ok();
                if failing {
                    let status = StatusCode::from_u16(fake.fail_status).unwrap();
                    return (status, "{\"error\":\"try later\"}".to_owned()).into_response();
                }
                let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
                let inputs = req["input"].as_array().unwrap();
                // Answer in reverse order with explicit indices.
                let data: Vec<_> = inputs
                    .iter()
                    .enumerate()
                    .rev()
                    .map(|(i, t)| serde_json::json!({"index": i, "embedding": fake_vector(t.as_str().unwrap())}))
                    .collect();
                let body = serde_json::json!({"data": data, "usage": {"prompt_tokens": inputs.len() * 3}});
                (StatusCode::OK, body.to_string()).into_response()
            }
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await });
    format!("http://{addr}")
}

fn remote_opts(url: String) -> RemoteOptions {
    RemoteOptions {
        url,
        model: "fake".into(),
        dim: 4,
        timeout: Duration::from_millis(500),
        max_attempts: 4,
        initial_backoff: Duration::from_millis(10),
        max_backoff: Duration::from_millis(50),
        max_in_flight: 2,
        max_batch: 3,
        api_key: Some("secret".into()),
    }
}

#[test]
fn remote_embedder_splits_orders_normalises_and_caps_in_flight() {
    let rt = runtime();
    rt.block_on(async {
        let fake = Arc::new(Fake::default());
        let url = fake_server(fake.clone()).await;
        let emb = RemoteEmbedder::new(remote_opts(url)).unwrap();
        let texts: Vec<String> = (0..10).map(|i| "x".repeat(i)).collect();
        let out = emb.embed(texts.clone()).await.unwrap();
        assert_eq!(out.len(), 10);
        for (i, t) in texts.iter().enumerate() {
            let mut want = fake_vector(t);
            normalize(&mut want);
            assert_eq!(out.row(i), want.as_slice(), "row {i}");
        }
        assert_eq!(out.tokens, 30);
        // 10 inputs in requests of 3 → 4 requests, at most 2 at once.
        assert_eq!(fake.requests.load(Ordering::SeqCst), 4);
        assert!(fake.max_in_flight.load(Ordering::SeqCst) <= 2);
        assert_eq!(fake.max_in_flight.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn remote_embedder_retries_429_and_5xx_then_succeeds() {
    let rt = runtime();
    rt.block_on(async {
        for status in [429, 503] {
            let fake = Arc::new(Fake {
                failures_left: AtomicUsize::new(2),
                fail_status: status,
                ..Fake::default()
            });
            let url = fake_server(fake.clone()).await;
            let emb = RemoteEmbedder::new(remote_opts(url)).unwrap();
            let out = emb.embed(vec!["a".into()]).await.unwrap();
            assert_eq!(out.len(), 1);
            assert_eq!(emb.stats().retries.load(Ordering::Relaxed), 2, "{status}");
        }
    });
}

#[test]
fn remote_embedder_gives_up_with_an_error_and_never_drops_a_batch() {
    let rt = runtime();
    rt.block_on(async {
        // Always 500: the error comes back after max_attempts, retryable.
        let fake = Arc::new(Fake {
            failures_left: AtomicUsize::new(usize::MAX),
            fail_status: 500,
            ..Fake::default()
        });
        let url = fake_server(fake.clone()).await;
        let emb = RemoteEmbedder::new(remote_opts(url)).unwrap();
        let err = emb.embed(vec!["a".into()]).await.unwrap_err();
        assert!(err.retryable(), "{err}");
        assert!(err.to_string().contains("500"), "{err}");
        assert_eq!(fake.requests.load(Ordering::SeqCst), 4);
        assert_eq!(emb.stats().failures.load(Ordering::Relaxed), 1);

        // 400 is the caller's fault: no retry.
        let fake = Arc::new(Fake {
            failures_left: AtomicUsize::new(usize::MAX),
            fail_status: 400,
            ..Fake::default()
        });
        let url = fake_server(fake.clone()).await;
        let emb = RemoteEmbedder::new(remote_opts(url)).unwrap();
        let err = emb.embed(vec!["a".into()]).await.unwrap_err();
        assert!(!err.retryable(), "{err}");
        assert_eq!(fake.requests.load(Ordering::SeqCst), 1);

        // A server slower than the timeout: retried, then a timeout error.
        let fake = Arc::new(Fake {
            delay_ms: 2_000,
            ..Fake::default()
        });
        let url = fake_server(fake.clone()).await;
        let emb = RemoteEmbedder::new(RemoteOptions {
            timeout: Duration::from_millis(100),
            max_attempts: 2,
            ..remote_opts(url)
        })
        .unwrap();
        let err = emb.embed(vec!["a".into()]).await.unwrap_err();
        assert!(
            err.retryable() && err.to_string().contains("timed out"),
            "{err}"
        );
        assert_eq!(fake.requests.load(Ordering::SeqCst), 2);
    });
}

#[test]
fn remote_embedder_rejects_a_wrong_dimension() {
    let rt = runtime();
    rt.block_on(async {
        let fake = Arc::new(Fake::default());
        let url = fake_server(fake).await;
        let emb = RemoteEmbedder::new(RemoteOptions {
            dim: 384,
            ..remote_opts(url)
        })
        .unwrap();
        let err = emb.embed(vec!["a".into()]).await.unwrap_err();
        assert!(err.to_string().contains("expected 384"), "{err}");
    });
}

/// The package directory at run time. `cargo test` sets it for the test
/// process; the compile-time `env!` would name wherever the binary was built,
/// which with a target directory shared between clones may no longer exist.
fn manifest_dir() -> String {
    std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned())
}

/// SPLADE-tiny, fetched by `scripts/tools.sh`.
pub(crate) fn splade_dir() -> PathBuf {
    let dir = PathBuf::from(manifest_dir()).join("../.tools/models/splade-tiny");
    assert!(
        dir.join("model.safetensors").exists(),
        "SPLADE-tiny is missing at {}: run scripts/tools.sh",
        dir.display()
    );
    dir
}

/// The reference: PyTorch's `BertForMaskedLM` on the same files,
/// `log1p(relu(logits)).max(tokens)`, the number of non-zero terms and the
/// six largest (transformers 5.24, 2026-12-06).
#[test]
fn splade_matches_the_pytorch_reference() {
    let m = Splade::load(
        &splade_dir(),
        SpladeOptions {
            top_terms: 0,
            precision: Precision::F32,
            ..SpladeOptions::default()
        },
    )
    .unwrap();
    let cases: [(&str, usize, [(u32, f32); 6]); 2] = [
        (
            "Caroline: I adopted a puppy from the shelter last week!",
            30,
            [
                (7981, 2.0334),
                (2733, 1.9436),
                (7713, 1.6867),
                (2197, 1.4924),
                (6077, 1.4011),
                (6423, 1.2963),
            ],
        ),
        (
            "When did Melanie paint a sunrise?",
            18,
            [
                (2043, 2.296),
                (6773, 2.2181),
                (13932, 2.2085),
                (2016, 1.8694),
                (2001, 1.7178),
                (14225, 1.4542),
            ],
        ),
    ];
    let texts: Vec<&str> = cases.iter().map(|c| c.0).collect();
    // Once in one pass, once each on its own: the same vectors.
    let together = m.encode(&texts).unwrap();
    for (i, (text, nnz, top)) in cases.iter().enumerate() {
        let alone = m.encode(&[text]).unwrap().remove(0);
        assert_eq!(alone.terms, together[i].terms);
        let v = &together[i];
        assert_eq!(v.len(), *nnz, "{text}");
        for (term, w) in top {
            let at = v.terms.binary_search(term).expect("a top term is present");
            assert!(
                (v.weights[at] - w).abs() < 1e-3,
                "{text}: term {term} {} vs {w}",
                v.weights[at]
            );
        }
    }
    // The reduced-precision decoders, where this CPU has them: the same
    // terms, the top weights within 0.01 (int16), 0.03 (bf16) and 0.05
    // (int8) of f32's.
    let mut paths = Vec::new();
    if steamrf_kernels::quant::vnni_available() {
        paths.extend([(Precision::Int16, 0.01f32), (Precision::Int8, 0.05)]);
    }
    if steamrf_kernels::bf16::amx_available() {
        paths.push((Precision::Bf16, 0.03));
    }
    eprintln!(
        "SPLADE decoder parity against f32 on this CPU: {:?}",
        paths.iter().map(|p| p.0).collect::<Vec<_>>()
    );
    for (precision, tol) in paths {
        let q = Splade::load(
            &splade_dir(),
            SpladeOptions {
                top_terms: 0,
                precision,
                ..SpladeOptions::default()
            },
        )
        .unwrap();
        assert_eq!(q.options().precision, precision);
        for (v, f) in q.encode(&texts).unwrap().iter().zip(&together) {
            assert!(
                v.len().abs_diff(f.len()) <= 2,
                "{precision:?}: {} vs {} terms",
                v.len(),
                f.len()
            );
            for (t, w) in f.terms.iter().zip(&f.weights).filter(|p| *p.1 > 1.0) {
                let at = v.terms.binary_search(t).expect("a strong term is kept");
                assert!(
                    (v.weights[at] - w).abs() < tol,
                    "{precision:?}: term {t} {} vs {w}",
                    v.weights[at]
                );
            }
        }
    }
    // The cap keeps the largest.
    let capped = Splade::load(
        &splade_dir(),
        SpladeOptions {
            top_terms: 3,
            precision: Precision::F32,
            ..SpladeOptions::default()
        },
    )
    .unwrap()
    .encode(&texts[..1])
    .unwrap()
    .remove(0);
    assert_eq!(capped.terms, vec![2733, 7713, 7981]);
}

#[test]
fn sparse_vectors_dot_and_max() {
    let a = SparseVec::from_pairs(vec![(5, 1.0), (1, 2.0), (9, -1.0), (5, 3.0)]);
    assert_eq!(a.terms, vec![1, 5]);
    assert_eq!(a.weights, vec![2.0, 3.0]);
    let b = SparseVec::from_pairs(vec![(5, 0.5), (7, 4.0)]);
    assert_eq!(a.dot(&b), 1.5);
    assert_eq!(b.dot(&a), 1.5);
    assert_eq!(a.dot(&SparseVec::default()), 0.0);
    let m = SparseVec::max_of([&a, &b]);
    assert_eq!(m.terms, vec![1, 5, 7]);
    assert_eq!(m.weights, vec![2.0, 3.0, 4.0]);
}
