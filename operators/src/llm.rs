//! Memory and prototype content from an OpenAI-compatible chat endpoint
//! (`POST /v1/chat/completions`: vLLM, llama.cpp's server, OpenAI...).
//!
//! The deterministic summariser ([`crate::steam::memory::summarise`]) is the
//! default; this client is used when an endpoint is configured. Prompts are
//! templates in the repository (`prompts/memory.txt`, `prompts/prototype.txt`)
//! with `{facets}`, `{recent}` and `{previous}` placeholders.
//!
//! - A cap on calls in flight: callers wait for a slot (back-pressure on the
//!   stage that asks).
//! - A token budget: once the prompt and completion tokens reported by the
//!   endpoint reach it, [`ChatClient::complete`] answers
//!   [`LlmError::BudgetExhausted`] and the caller falls back to the
//!   deterministic summary (counted).
//! - Timeouts, 429 and 5xx are retried with exponential backoff and jitter;
//!   other answers fail at once with the server's reason.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use serde::Deserialize;

/// The memory prompt shipped with steamrf.
pub const MEMORY_PROMPT: &str = include_str!("../../prompts/memory.txt");
/// The prototype prompt shipped with steamrf.
pub const PROTOTYPE_PROMPT: &str = include_str!("../../prompts/prototype.txt");

/// Endpoint settings.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatOptions {
    /// Base URL (`http://vllm:8000`) or the full `…/v1/chat/completions` URL.
    pub url: String,
    /// The `model` field.
    pub model: String,
    /// Sent as `Authorization: Bearer …` when set.
    pub api_key: Option<String>,
    /// Per-request timeout.
    pub timeout: Duration,
    /// Attempts per request, the first included.
    pub max_attempts: u32,
    /// First backoff; doubles per attempt, with jitter.
    pub initial_backoff: Duration,
    /// Calls in flight at once.
    pub max_in_flight: usize,
    /// `max_tokens` per completion.
    pub max_completion_tokens: u32,
    /// Total tokens (prompt + completion) this client may spend; 0: no limit.
    pub token_budget: u64,
    /// Sampling temperature (the STEAM paper uses 0.2).
    pub temperature: f32,
}

impl Default for ChatOptions {
    fn default() -> Self {
        Self {
            url: "http://127.0.0.1:8000".into(),
            model: "default".into(),
            api_key: None,
            timeout: Duration::from_secs(60),
            max_attempts: 4,
            initial_backoff: Duration::from_millis(500),
            max_in_flight: 4,
            max_completion_tokens: 96,
            token_budget: 0,
            temperature: 0.2,
        }
    }
}

/// Why a completion failed.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The token budget is spent; use the deterministic summary.
    #[error("the LLM token budget of {0} tokens is spent")]
    BudgetExhausted(u64),
    /// The answer is no summary (the caller checked it, e.g. with [`echoes`]).
    #[error("unusable completion: {0}")]
    Unusable(String),
    /// The endpoint failed after retries, or answered something unusable.
    #[error("chat endpoint {url}: {reason}")]
    Remote {
        /// The endpoint.
        url: String,
        /// What went wrong.
        reason: String,
        /// Whether a later call may succeed.
        retryable: bool,
    },
}

/// Counters the pipeline exports.
#[derive(Debug, Default)]
pub struct ChatStats {
    /// Completed calls.
    pub calls: AtomicU64,
    /// Prompt tokens reported by the endpoint.
    pub prompt_tokens: AtomicU64,
    /// Completion tokens reported by the endpoint.
    pub completion_tokens: AtomicU64,
    /// Retried requests.
    pub retries: AtomicU64,
    /// Calls that failed for good.
    pub failures: AtomicU64,
}

/// The chat client.
#[derive(Debug)]
pub struct ChatClient {
    client: reqwest::Client,
    endpoint: String,
    opts: ChatOptions,
    permits: tokio::sync::Semaphore,
    stats: ChatStats,
}

#[derive(Deserialize)]
struct Response {
    choices: Vec<Choice>,
    #[serde(default)]
    usage: Option<Usage>,
}

#[derive(Deserialize)]
struct Choice {
    message: Message,
    /// `"length"` when `max_tokens` cut the completion off.
    #[serde(default)]
    finish_reason: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    content: Option<String>,
}

#[derive(Deserialize, Default)]
struct Usage {
    #[serde(default)]
    prompt_tokens: u64,
    #[serde(default)]
    completion_tokens: u64,
}

/// Fills a prompt template.
pub fn render(
    template: &str,
    facets: &BTreeMap<String, u32>,
    recent: &[String],
    previous: &str,
) -> String {
    let facets = facets
        .iter()
        .map(|(f, n)| format!("{f} ({n})"))
        .collect::<Vec<_>>()
        .join(", ");
    template
        .replace("{facets}", if facets.is_empty() { "none" } else { &facets })
        .replace("{recent}", &recent.join("; "))
        .replace(
            "{previous}",
            if previous.is_empty() {
                "none"
            } else {
                previous
            },
        )
}

impl ChatClient {
    /// Builds the client (no request is made).
    ///
    /// # Errors
    /// If the HTTP client cannot be built.
    pub fn new(opts: ChatOptions) -> Result<Self, LlmError> {
        let endpoint = crate::http::endpoint(&opts.url, "chat/completions");
        let client = crate::http::client(opts.timeout).map_err(|reason| LlmError::Remote {
            url: endpoint.clone(),
            reason,
            retryable: false,
        })?;
        Ok(Self {
            client,
            endpoint,
            permits: tokio::sync::Semaphore::new(opts.max_in_flight.max(1)),
            opts,
            stats: ChatStats::default(),
        })
    }

    /// Counters since start.
    pub fn stats(&self) -> &ChatStats {
        &self.stats
    }

    /// Tokens spent so far (prompt + completion).
    pub fn tokens_spent(&self) -> u64 {
        self.stats.prompt_tokens.load(Ordering::Relaxed)
            + self.stats.completion_tokens.load(Ordering::Relaxed)
    }

    fn err(&self, reason: impl Into<String>, retryable: bool) -> LlmError {
        LlmError::Remote {
            url: self.endpoint.clone(),
            reason: reason.into(),
            retryable,
        }
    }

    /// One completion for `prompt` (a single user message), trimmed.
    ///
    /// # Errors
    /// [`LlmError::BudgetExhausted`] once the budget is spent; otherwise the
    /// endpoint's failure after retries.
    pub async fn complete(&self, prompt: &str) -> Result<String, LlmError> {
        let budget = self.opts.token_budget;
        let body = serde_json::to_vec(&serde_json::json!({
            "model": self.opts.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.opts.max_completion_tokens,
            "temperature": self.opts.temperature,
        }))
        .map_err(|e| self.err(format!("serialising: {e}"), false))?;
        let mut attempt = 0u32;
        loop {
            let result = {
                let _permit = self
                    .permits
                    .acquire()
                    .await
                    .map_err(|_| self.err("closed", false))?;
                if budget > 0 && self.tokens_spent() >= budget {
                    return Err(LlmError::BudgetExhausted(budget));
                }
                self.attempt(&body).await
            };
            match result {
                Ok(text) => return Ok(text),
                Err(LlmError::Remote {
                    retryable: true, ..
                }) if attempt + 1 < self.opts.max_attempts => {
                    self.stats.retries.fetch_add(1, Ordering::Relaxed);
                    let wait = crate::http::backoff(
                        self.opts.initial_backoff,
                        Duration::from_secs(30),
                        attempt,
                    );
                    tokio::time::sleep(wait).await;
                    attempt += 1;
                }
                Err(e) => {
                    self.stats.failures.fetch_add(1, Ordering::Relaxed);
                    return Err(e);
                }
            }
        }
    }

    async fn attempt(&self, body: &[u8]) -> Result<String, LlmError> {
        let bytes = crate::http::post_json(
            &self.client,
            &self.endpoint,
            self.opts.api_key.as_deref(),
            body,
        )
        .await
        .map_err(|f| self.err(f.reason, f.retryable))?;
        let parsed: Response = serde_json::from_slice(&bytes)
            .map_err(|e| self.err(format!("unreadable response: {e}"), false))?;
        let usage = parsed.usage.unwrap_or_default();
        self.stats.calls.fetch_add(1, Ordering::Relaxed);
        self.stats
            .prompt_tokens
            .fetch_add(usage.prompt_tokens, Ordering::Relaxed);
        self.stats
            .completion_tokens
            .fetch_add(usage.completion_tokens, Ordering::Relaxed);
        let Some(choice) = parsed.choices.into_iter().next() else {
            return Err(self.err("no completion", false));
        };
        let cut = choice.finish_reason.as_deref() == Some("length");
        usable(choice.message.content.as_deref().unwrap_or(""), cut)
            .map_err(|reason| self.err(reason, false))
    }
}

/// Whether `text` echoes `template`'s labels (the words before a
/// `{placeholder}`, such as "Categories seen (with counts):"): a small model
/// that repeats its prompt wrote no summary.
pub fn echoes(template: &str, text: &str) -> bool {
    template.lines().any(|line| {
        line.find('{').is_some_and(|at| {
            let label = line[..at].trim();
            label.len() >= 8 && text.contains(label)
        })
    })
}

/// A completion as content: trimmed, and when `max_tokens` cut it off
/// (`cut`), only up to its last full sentence, so no memory ends mid-word.
///
/// # Errors
/// What is unusable: an empty completion, or a cut one without a full
/// sentence (the caller keeps the deterministic summary).
pub fn usable(text: &str, cut: bool) -> Result<String, String> {
    let text = text.trim();
    if text.is_empty() {
        return Err("empty completion".into());
    }
    if !cut {
        return Ok(text.to_owned());
    }
    let end = text
        .char_indices()
        .filter(|&(i, c)| {
            matches!(c, '.' | '!' | '?')
                && text[i + 1..].chars().next().is_none_or(char::is_whitespace)
        })
        .map(|(i, _)| i + 1)
        .next_back();
    match end {
        Some(end) => Ok(text[..end].to_owned()),
        None => Err(format!(
            "completion cut off by max_completion_tokens before a full sentence: {:?}",
            text.chars().take(80).collect::<String>()
        )),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_completion_that_repeats_the_prompt_is_recognised() {
        let text = "\"Interested in Jazz.\nCategories seen (with counts): Jazz (2)\nLatest items";
        assert!(echoes(MEMORY_PROMPT, text));
        assert!(echoes(PROTOTYPE_PROMPT, "Examples: a; b"));
        assert!(!echoes(MEMORY_PROMPT, "Enjoys bebop-era jazz standards."));
        assert!(!echoes(MEMORY_PROMPT, "Previously liked opera; now jazz."));
    }

    #[test]
    fn a_cut_completion_keeps_its_full_sentences_or_is_refused() {
        assert_eq!(usable("  Likes jazz.  ", false).unwrap(), "Likes jazz.");
        assert_eq!(usable("Likes jazz", false).unwrap(), "Likes jazz");
        assert_eq!(
            usable("Likes modal jazz. Also enjoys 3.5 hours of bebop and", true).unwrap(),
            "Likes modal jazz."
        );
        assert_eq!(usable("Really? Yes! More", true).unwrap(), "Really? Yes!");
        assert!(usable("Likes modal jazz from the 1950s and", true).is_err());
        assert!(usable("   ", false).is_err());
        assert!(usable("", true).is_err());
    }

    use std::sync::Arc;
    use std::sync::atomic::AtomicUsize;

    use super::*;

    #[derive(Default)]
    struct Fake {
        fail_first: usize,
        calls: AtomicUsize,
        in_flight: AtomicUsize,
        max_in_flight: AtomicUsize,
        last_prompt: std::sync::Mutex<String>,
    }

    async fn fake_server(fake: Arc<Fake>) -> String {
        use axum::body::Bytes;
        use axum::http::StatusCode;
        use axum::response::IntoResponse;
        let app = axum::Router::new().route(
            "/v1/chat/completions",
            axum::routing::post(move |body: Bytes| {
                let fake = fake.clone();
                async move {
                    let n = fake.calls.fetch_add(1, Ordering::SeqCst);
                    let now = fake.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
                    fake.max_in_flight.fetch_max(now, Ordering::SeqCst);
                    tokio::time::sleep(Duration::from_millis(30)).await;
                    fake.in_flight.fetch_sub(1, Ordering::SeqCst);
                    if n < fake.fail_first {
                        return (StatusCode::SERVICE_UNAVAILABLE, "busy".to_owned()).into_response();
                    }
                    let req: serde_json::Value = serde_json::from_slice(&body).unwrap();
                    *fake.last_prompt.lock().unwrap() =
                        req["messages"][0]["content"].as_str().unwrap().to_owned();
                    let out = serde_json::json!({
                        "choices": [{"message": {"role": "assistant", "content": "  Loves modal jazz.  "}}],
                        "usage": {"prompt_tokens": 40, "completion_tokens": 10}
                    });
                    (StatusCode::OK, out.to_string()).into_response()
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await });
        format!("http://{addr}")
    }

    fn rt() -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap()
    }

    fn opts(url: String) -> ChatOptions {
        ChatOptions {
            url,
            initial_backoff: Duration::from_millis(5),
            max_in_flight: 2,
            ..ChatOptions::default()
        }
    }

    #[test]
    fn completes_meters_tokens_and_caps_in_flight() {
        rt().block_on(async {
            let fake = Arc::new(Fake::default());
            let c = Arc::new(ChatClient::new(opts(fake_server(fake.clone()).await)).unwrap());
            let facets = BTreeMap::from([("Jazz".to_owned(), 3)]);
            let prompt = render(MEMORY_PROMPT, &facets, &["Kind of Blue".into()], "");
            let calls = (0..6).map(|_| {
                let c = c.clone();
                let p = prompt.clone();
                async move { c.complete(&p).await }
            });
            for r in futures::future::join_all(calls).await {
                assert_eq!(r.unwrap(), "Loves modal jazz.");
            }
            assert_eq!(c.tokens_spent(), 6 * 50);
            assert_eq!(fake.max_in_flight.load(Ordering::SeqCst), 2);
            let sent = fake.last_prompt.lock().unwrap().clone();
            assert!(
                sent.contains("Jazz (3)") && sent.contains("Kind of Blue"),
                "{sent}"
            );
        });
    }

    #[test]
    fn retries_5xx_and_stops_at_the_budget() {
        rt().block_on(async {
            let fake = Arc::new(Fake {
                fail_first: 2,
                ..Fake::default()
            });
            let url = fake_server(fake.clone()).await;
            let c = ChatClient::new(ChatOptions {
                token_budget: 100,
                ..opts(url)
            })
            .unwrap();
            assert_eq!(c.complete("hi").await.unwrap(), "Loves modal jazz.");
            assert_eq!(c.stats().retries.load(Ordering::Relaxed), 2);
            c.complete("hi").await.unwrap();
            // 100 tokens spent: the next call is refused without a request.
            let before = fake.calls.load(Ordering::SeqCst);
            assert!(matches!(
                c.complete("hi").await,
                Err(LlmError::BudgetExhausted(100))
            ));
            assert_eq!(fake.calls.load(Ordering::SeqCst), before);
        });
    }
}
