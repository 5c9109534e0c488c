//! `/mcp`: the service as Model Context Protocol tools for LLM agents, over
//! the streamable HTTP transport of the official Rust SDK (`rmcp`).
//!
//! The tools are the HTTP API under other names, with the same checks:
//! `retrieve` is `/v1/retrieve` with a text query, `recommend` is
//! `/v1/recommend`, and `remember` and `forget` write an event through the
//! same decoder and producer as `POST /v1/events`, so an agent's writes take
//! the one write path (Kafka → `steamrf run`) and keep its guarantees.
//!
//! - **Auth.** The bearer token is checked on every HTTP request to `/mcp`
//!   before MCP sees it: no or an unknown token is a 401. Its scope travels
//!   in the request's extensions to the tools, which apply it as the HTTP
//!   routes do: another tenant's user is a tool error with status 403, and
//!   `forget` needs a token for every tenant (`*`).
//! - **Stateless.** No MCP session is kept (`legacy_session_mode` off, JSON
//!   answers), so any replica behind a load balancer answers any request.
//! - **Limits.** The body is read under `serve.body_timeout` and
//!   `serve.max_request_bytes` here; the tools take `serve.max_in_flight`
//!   permits and keep to `serve.request_timeout` like the routes they mirror.
//! - **Errors.** A refused call is a tool result with `isError` and the
//!   API's error object (`status`, `code`, `field`, `message`), which the
//!   model reads; a malformed call (a wrong argument type) is JSON-RPC's
//!   invalid params.

use std::sync::Arc;
use std::time::Instant;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::http::request::Parts;
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, any_service};
use rmcp::handler::server::router::tool::ToolRouter;
use rmcp::handler::server::tool::Extension;
use rmcp::handler::server::wrapper::Parameters;
use rmcp::model::{CallToolResult, Implementation, ServerCapabilities, ServerConfig};
use rmcp::transport::streamable_http_server::session::never::NeverSessionManager;
use rmcp::transport::streamable_http_server::{StreamableHttpServerConfig, StreamableHttpService};
use rmcp::{ErrorData, ServerHandler, schemars, tool, tool_handler, tool_router};
use serde::{Deserialize, Serialize};

use super::auth::Scope;
use super::events::produce_as;
use super::{
    ApiError, AppState, RecommendRequest, RetrieveRequest, authenticate, read_body, recommend_as,
    retrieve_as,
};

/// What the server tells a client about itself at initialisation.
const INSTRUCTIONS: &str = "Long-term memory of users, built from their events \
(clicks, purchases, dialogue turns) by steamrf. Call `retrieve` with a user id and a \
question before answering something that may depend on what the user said or did \
earlier; every row comes with its provenance. Call `remember` to store a new dialogue \
turn or interaction (it becomes retrievable within about a second). `recommend` ranks \
candidate item ids for a user. `forget` deletes everything stored about a user and \
needs an admin token.";

/// The `/mcp` route, mounted by [`super::router`].
pub(super) fn route(st: &Arc<AppState>) -> MethodRouter<Arc<AppState>> {
    let config = StreamableHttpServerConfig::default()
        .with_legacy_session_mode(false)
        .with_json_response(true)
        .with_sse_keep_alive(None)
        .with_allowed_hosts(st.cfg.mcp_allowed_hosts.clone())
        .with_max_request_body_bytes(st.cfg.max_request_bytes.0);
    let tools = Tools {
        st: st.clone(),
        tool_router: Tools::tool_router(),
    };
    let mcp = StreamableHttpService::new(
        move || Ok(tools.clone()),
        Arc::new(NeverSessionManager::default()),
        config,
    );
    any_service(mcp).layer(axum::middleware::from_fn_with_state(st.clone(), guard))
}

/// Authenticates every request to `/mcp`, and reads its body within the
/// service's limits, before MCP parses anything.
async fn guard(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let started = Instant::now();
    let (mut parts, body) = req.into_parts();
    let scope = match authenticate(&st, &parts.headers) {
        Ok(s) => s,
        Err(e) => {
            st.metrics.finish("mcp", started, Some(e.status));
            return unauthenticated(&e);
        }
    };
    let body = match read_body(&st, body).await {
        Ok(b) => b,
        Err(e) => {
            st.metrics.finish("mcp", started, Some(e.status));
            return e.into_response();
        }
    };
    parts.extensions.insert(scope);
    next.run(Request::from_parts(parts, Body::from(body))).await
}

/// A 401 with `WWW-Authenticate: Bearer` whose body is a JSON-RPC error, so
/// that an MCP client shows the reason rather than a bare status.
fn unauthenticated(e: &ApiError) -> Response {
    let body = serde_json::json!({
        "jsonrpc": "2.0",
        "id": null,
        "error": {
            "code": -32001,
            "message": format!("{}: {}", e.code, e.message),
            "data": { "status": e.status.as_u16(), "code": e.code },
        },
    });
    let mut r = (
        e.status,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response();
    r.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        header::HeaderValue::from_static("Bearer"),
    );
    r
}

/// The tools, one per request (the transport is stateless).
#[derive(Clone)]
struct Tools {
    st: Arc<AppState>,
    tool_router: ToolRouter<Self>,
}

/// How `retrieve` answers.
#[derive(Debug, Clone, Copy, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
enum RetrieveMode {
    /// RF-Mem decides per question: a quick similarity probe, then plain
    /// top-k when the memory is clearly familiar with the question, or
    /// iterative recollection when it is not.
    Adaptive,
    /// Plain top-k by similarity to the query: fastest.
    Familiarity,
    /// Iterative recollection: expands the query with what it finds, round
    /// by round; best for questions that combine several past events.
    Recollection,
}

impl RetrieveMode {
    fn as_str(self) -> &'static str {
        match self {
            Self::Adaptive => "adaptive",
            Self::Familiarity => "familiarity",
            Self::Recollection => "recollection",
        }
    }
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RetrieveArgs {
    /// The user whose memory to search, exactly as the application names
    /// them (with a tenant prefix where the deployment uses one, e.g.
    /// "acme:alice").
    user_id: String,
    /// What to look for, in natural language: a question or a topic, e.g.
    /// "which jazz albums did she like?".
    query: String,
    /// How many results to return at most: rows (default: the server's,
    /// usually 10), or with dialogue sessions evidence units of a few turns
    /// each (default: as many as `max_turns` holds).
    #[serde(default)]
    k: Option<usize>,
    /// Dialogue turns to hand back at most, over all results (default: the
    /// server's, usually 30).
    #[serde(default)]
    max_turns: Option<usize>,
    /// At most this many results from one conversation (default: the
    /// server's, usually no limit). 1 spreads the answer over as many
    /// conversations as it can, e.g. for "in which conversations did she
    /// mention X?".
    #[serde(default)]
    per_session: Option<usize>,
    /// How to search; leave it out to let the server decide ("adaptive").
    #[serde(default)]
    mode: Option<RetrieveMode>,
    /// Also return what similar users of the same community remember
    /// (shared prototypes; never other users' raw rows). Default: the
    /// server's setting.
    #[serde(default)]
    collaborative: Option<bool>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RecommendArgs {
    /// The user to rank for.
    user_id: String,
    /// Item ids to rank (1 to 1000), as the catalogue names them.
    candidates: Vec<String>,
    /// Return only the best k (default: all of them).
    #[serde(default)]
    k: Option<usize>,
}

/// Who said a remembered turn.
#[derive(Debug, Clone, Copy, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
enum Role {
    /// The user said it.
    #[default]
    User,
    /// The assistant said it.
    Assistant,
    /// A system message.
    System,
}

/// What a user did with an item.
#[derive(Debug, Clone, Copy, Default, Deserialize, schemars::JsonSchema)]
#[serde(rename_all = "snake_case")]
enum Action {
    /// Viewed or clicked it.
    #[default]
    Click,
    /// Bought it.
    Purchase,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct RememberArgs {
    /// The user the memory belongs to.
    user_id: String,
    /// A dialogue turn to remember, verbatim: what was said. Give `text`,
    /// or `item_id` alone for an interaction with an item.
    #[serde(default)]
    text: Option<String>,
    /// Who said `text` (default "user").
    #[serde(default)]
    role: Option<Role>,
    /// The conversation `text` belongs to (default "mcp"); turns of one
    /// conversation are grouped when retrieved.
    #[serde(default)]
    session_id: Option<String>,
    /// An item of the catalogue: the item the turn is about, or, without
    /// `text`, the item the user interacted with.
    #[serde(default)]
    item_id: Option<String>,
    /// Without `text`: what the user did with `item_id` (default "click").
    #[serde(default)]
    action: Option<Action>,
    /// Without `text`: explicit feedback on `item_id`, e.g. 1 to 5 stars.
    #[serde(default)]
    rating: Option<f64>,
}

#[derive(Debug, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields)]
struct ForgetArgs {
    /// The user whose data is deleted, entirely and irreversibly.
    user_id: String,
}

/// The refusal a model reads: the API's error object and its status.
#[derive(Serialize)]
struct Refusal<'e> {
    status: u16,
    #[serde(flatten)]
    error: &'e ApiError,
}

impl Tools {
    /// The scope [`guard`] put on the request.
    fn scope(parts: &Parts) -> Result<Scope, ApiError> {
        parts.extensions.get::<Scope>().cloned().ok_or_else(|| {
            ApiError::internal("an MCP request reached a tool without passing the token check")
        })
    }

    /// Counts the call and turns its result into the tool's.
    fn reply<T: Serialize>(
        &self,
        tool: &str,
        started: Instant,
        result: Result<T, ApiError>,
    ) -> Result<CallToolResult, ErrorData> {
        let route = format!("mcp_{tool}");
        self.st
            .metrics
            .finish(&route, started, result.as_ref().err().map(|e| e.status));
        match result {
            Ok(v) => serde_json::to_value(v)
                .map(CallToolResult::structured)
                .map_err(|e| ErrorData::internal_error(e.to_string(), None)),
            Err(e) => {
                let id = self.st.request_id();
                let e = e.for_request(&route, &id);
                let body = serde_json::json!({ "error": Refusal { status: e.status.as_u16(), error: &e } });
                Ok(CallToolResult::structured_error(body))
            }
        }
    }

    /// `remember`'s event, as the JSON a producer would send.
    fn event(args: &RememberArgs) -> Result<serde_json::Value, ApiError> {
        let mut e = serde_json::json!({
            "schema_version": steamrf_schemas::SCHEMA_VERSION,
            "event_id": format!("mcp-{:032x}", rand::random::<u128>()),
            "timestamp": chrono::Utc::now().timestamp_millis(),
            "user_id": args.user_id,
        });
        let m = e.as_object_mut().expect("an object");
        match (&args.text, &args.item_id) {
            (Some(text), item) => {
                if args.action.is_some() || args.rating.is_some() {
                    return Err(ApiError::invalid(
                        if args.action.is_some() {
                            "action"
                        } else {
                            "rating"
                        },
                        "only for an interaction without text",
                    ));
                }
                m.insert("type".into(), "dialogue_turn".into());
                m.insert("text".into(), text.as_str().into());
                let role = match args.role.unwrap_or_default() {
                    Role::User => "user",
                    Role::Assistant => "assistant",
                    Role::System => "system",
                };
                m.insert("role".into(), role.into());
                m.insert(
                    "session_id".into(),
                    args.session_id.as_deref().unwrap_or("mcp").into(),
                );
                if let Some(item) = item {
                    m.insert("item_id".into(), item.as_str().into());
                }
            }
            (None, Some(item)) => {
                if args.role.is_some() {
                    return Err(ApiError::invalid("role", "only for a dialogue turn (text)"));
                }
                let kind = match args.action.unwrap_or_default() {
                    Action::Click => "click",
                    Action::Purchase => "purchase",
                };
                m.insert("type".into(), kind.into());
                m.insert("item_id".into(), item.as_str().into());
                if let Some(s) = &args.session_id {
                    m.insert("session_id".into(), s.as_str().into());
                }
                if let Some(r) = args.rating {
                    if kind != "click" {
                        return Err(ApiError::invalid("rating", "only for a click"));
                    }
                    m.insert("rating".into(), r.into());
                }
            }
            (None, None) => {
                return Err(ApiError::invalid(
                    "text",
                    "give text (a dialogue turn) or item_id (an interaction)",
                ));
            }
        }
        Ok(e)
    }

    /// Produces one event through `POST /v1/events`' checks, naming its
    /// fields as the tool's arguments (`text`, not `events[0].text`).
    async fn write(&self, parts: &Parts, event: &serde_json::Value) -> Result<Written, ApiError> {
        let scope = Self::scope(parts)?;
        let bytes = serde_json::to_vec(event).map_err(|e| ApiError::internal(e.to_string()))?;
        let r = produce_as(&self.st, &scope, &[&bytes])
            .await
            .map_err(|mut e| {
                if let Some(f) = &e.field {
                    let f = f.strip_prefix("events[0]").unwrap_or(f);
                    e.field = Some(f.strip_prefix('.').unwrap_or(f).to_owned());
                    if e.field.as_deref() == Some("") {
                        e.field = None;
                    }
                }
                e
            })?;
        Ok(Written {
            event_id: r.event_ids.into_iter().next().unwrap_or_default(),
            topic: r.topic,
            note: "accepted by Kafka; the pipeline stores it asynchronously, \
                   usually within a second",
        })
    }
}

/// What `remember` and `forget` answer.
#[derive(Debug, Serialize)]
struct Written {
    /// The event's id (the row's key once stored).
    event_id: String,
    /// The topic it went to.
    topic: String,
    /// When it takes effect.
    note: &'static str,
}

#[tool_router]
impl Tools {
    #[tool(
        description = "Search a user's long-term memory: their past dialogue turns, \
        interactions and the memories steamrf consolidated from them. Returns the best \
        results, each with its content, score and provenance (table, ids, source event ids, \
        Kafka partition and offset), plus an explanation of how the search ran; dialogue comes \
        back as the few turns that matched (at most max_turns in all, 30 by default), not whole \
        conversations. Use it before answering anything that may depend on what the user said \
        or did earlier.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn retrieve(
        &self,
        Parameters(args): Parameters<RetrieveArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let started = Instant::now();
        let result = async {
            let scope = Self::scope(&parts)?;
            let options = args.mode.map(|m| {
                let mut o = serde_json::Map::new();
                o.insert("mode".into(), m.as_str().into());
                o
            });
            let req = RetrieveRequest {
                user_id: args.user_id,
                query: Some(args.query),
                query_vector: None,
                k: args.k,
                max_turns: args.max_turns,
                per_session: args.per_session,
                options,
                collaborative: args.collaborative,
            };
            retrieve_as(&self.st, &scope, req, started).await
        }
        .await;
        self.reply("retrieve", started, result)
    }

    #[tool(
        description = "Rank candidate items (ids from the catalogue) for a user, best first, \
        by how well each matches the user's memories and what similar users chose. Each \
        ranked item says why. Unknown item ids come last.",
        annotations(read_only_hint = true, open_world_hint = false)
    )]
    async fn recommend(
        &self,
        Parameters(args): Parameters<RecommendArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let started = Instant::now();
        let result = async {
            let scope = Self::scope(&parts)?;
            let req = RecommendRequest {
                user_id: args.user_id,
                candidates: args.candidates,
                k: args.k,
            };
            recommend_as(&self.st, &scope, req).await
        }
        .await;
        self.reply("recommend", started, result)
    }

    #[tool(
        description = "Store something about a user in their long-term memory: a dialogue \
        turn (`text`, with `role` and `session_id`) or an interaction with a catalogue item \
        (`item_id` with `action` click or purchase, optionally a `rating`). It goes through \
        the same event pipeline as the application's own events and becomes retrievable \
        within about a second. Returns the event id.",
        annotations(
            read_only_hint = false,
            destructive_hint = false,
            open_world_hint = false
        )
    )]
    async fn remember(
        &self,
        Parameters(args): Parameters<RememberArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let started = Instant::now();
        let result = async {
            let event = Self::event(&args)?;
            self.write(&parts, &event).await
        }
        .await;
        self.reply("remember", started, result)
    }

    #[tool(
        description = "Delete everything stored about a user: their events, memories and \
        links, and their share of community prototypes. Irreversible. Only an admin token \
        (one for every tenant) may call it; use it when the user asks to be forgotten.",
        annotations(
            read_only_hint = false,
            destructive_hint = true,
            idempotent_hint = true,
            open_world_hint = false
        )
    )]
    async fn forget(
        &self,
        Parameters(args): Parameters<ForgetArgs>,
        Extension(parts): Extension<Parts>,
    ) -> Result<CallToolResult, ErrorData> {
        let started = Instant::now();
        let result = async {
            if Self::scope(&parts)? != Scope::All {
                return Err(ApiError {
                    status: StatusCode::FORBIDDEN,
                    code: "forbidden",
                    field: None,
                    message: "forget needs an admin token (one for every tenant, \"*\")".into(),
                    request_id: None,
                });
            }
            steamrf_schemas::api::check_user(&args.user_id)?;
            let event = serde_json::json!({
                "type": "forget",
                "schema_version": steamrf_schemas::SCHEMA_VERSION,
                "event_id": format!("mcp-forget-{:032x}", rand::random::<u128>()),
                "timestamp": chrono::Utc::now().timestamp_millis(),
                "user_id": args.user_id,
            });
            self.write(&parts, &event).await
        }
        .await;
        self.reply("forget", started, result)
    }
}

#[tool_handler(router = self.tool_router)]
impl ServerHandler for Tools {
    fn get_info(&self) -> ServerConfig {
        ServerConfig::new(ServerCapabilities::builder().enable_tools().build())
            .with_server_info(Implementation::new("steamrf", env!("CARGO_PKG_VERSION")))
            .with_instructions(INSTRUCTIONS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(json: serde_json::Value) -> RememberArgs {
        serde_json::from_value(json).unwrap()
    }

    /// `remember` builds events the Kafka source's decoder accepts, and
    /// names the argument at fault otherwise.
    #[test]
    fn remember_builds_events_the_decoder_accepts() {
        let field = |j| Tools::event(&args(j)).unwrap_err().field.unwrap();
        for (j, kind) in [
            (
                serde_json::json!({"user_id": "u", "text": "hi"}),
                "dialogue_turn",
            ),
            (
                serde_json::json!({"user_id": "u", "text": "hi", "role": "assistant", "item_id": "i"}),
                "dialogue_turn",
            ),
            (
                serde_json::json!({"user_id": "u", "item_id": "i", "rating": 4.5}),
                "click",
            ),
            (
                serde_json::json!({"user_id": "u", "item_id": "i", "action": "purchase"}),
                "purchase",
            ),
        ] {
            let e = Tools::event(&args(j)).unwrap();
            assert_eq!(e["type"], kind);
            let bytes = serde_json::to_vec(&e).unwrap();
            let decoded = steamrf_schemas::decode(&bytes).unwrap();
            assert!(decoded.event_id().starts_with("mcp-"));
        }
        assert_eq!(field(serde_json::json!({"user_id": "u"})), "text");
        assert_eq!(
            field(serde_json::json!({"user_id": "u", "text": "x", "rating": 1})),
            "rating"
        );
        assert_eq!(
            field(serde_json::json!({"user_id": "u", "item_id": "i", "role": "user"})),
            "role"
        );
        assert_eq!(
            field(
                serde_json::json!({"user_id": "u", "item_id": "i", "action": "purchase", "rating": 2})
            ),
            "rating"
        );
        // Unknown arguments are refused, not ignored.
        assert!(
            serde_json::from_value::<RememberArgs>(serde_json::json!({"user_id": "u", "txt": "x"}))
                .is_err()
        );
    }
}
