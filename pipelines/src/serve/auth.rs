//! Bearer tokens scoped to tenants.
//!
//! The tokens file has one token per line: `<token> <tenant>[,<tenant>...]`,
//! `*` for every tenant, `#` starting a comment. Tokens are compared in
//! constant time. With no file configured every request is allowed (local use).
//! The service reads the file, and re-reads it on change, through
//! `serve::TokensFile`.

use std::collections::BTreeSet;

use crate::error::{Error, Result};

/// What a token may read.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    /// Every tenant.
    All,
    /// These tenants.
    Tenants(BTreeSet<String>),
}

impl Scope {
    /// Whether `tenant` may be read.
    pub fn allows(&self, tenant: &str) -> bool {
        match self {
            Self::All => true,
            Self::Tenants(t) => t.contains(tenant),
        }
    }
}

/// The configured tokens.
#[derive(Clone)]
pub struct Auth {
    tokens: Option<Vec<(Vec<u8>, Scope)>>,
}

impl std::fmt::Debug for Auth {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Auth")
            .field("tokens", &self.tokens.as_ref().map(Vec::len))
            .finish()
    }
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denied {
    /// No or an unknown token (401).
    Unauthenticated,
}

fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

impl Auth {
    /// No authentication.
    pub fn open() -> Self {
        Self { tokens: None }
    }

    /// Whether tokens are required.
    pub fn enabled(&self) -> bool {
        self.tokens.is_some()
    }

    /// How many tokens there are.
    pub fn len(&self) -> usize {
        self.tokens.as_ref().map_or(0, Vec::len)
    }

    /// Whether there are none (no file, or a file without tokens).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Parses a tokens file's text.
    ///
    /// # Errors
    /// [`Error::Config`] naming each bad line (never echoing the token).
    pub fn parse(text: &str) -> Result<Self> {
        let mut tokens = Vec::new();
        let mut problems = Vec::new();
        for (i, line) in text.lines().enumerate() {
            let line = line.split('#').next().unwrap_or("").trim();
            if line.is_empty() {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(token), Some(tenants), None) = (parts.next(), parts.next(), parts.next())
            else {
                problems.push(format!(
                    "serve.tokens_file line {}: expected \"<token> <tenant>[,<tenant>...]\"",
                    i + 1
                ));
                continue;
            };
            if token.len() < 16 {
                problems.push(format!(
                    "serve.tokens_file line {}: tokens must be at least 16 characters",
                    i + 1
                ));
                continue;
            }
            let scope = if tenants == "*" {
                Scope::All
            } else {
                Scope::Tenants(
                    tenants
                        .split(',')
                        .filter(|t| !t.is_empty())
                        .map(str::to_owned)
                        .collect(),
                )
            };
            tokens.push((token.as_bytes().to_vec(), scope));
        }
        if !problems.is_empty() {
            return Err(Error::Config { problems });
        }
        Ok(Self {
            tokens: Some(tokens),
        })
    }

    /// [`Self::parse`], refusing a file without a single token: an emptied
    /// or truncated file (a Secret being rewritten, a bad deploy) would
    /// otherwise lock every client out. To turn authentication off, leave
    /// `serve.tokens_file` empty.
    ///
    /// # Errors
    /// As [`Self::parse`], and [`Error::Config`] for a file of no tokens.
    pub fn parse_in_force(text: &str) -> Result<Self> {
        let auth = Self::parse(text)?;
        if auth.is_empty() {
            return Err(Error::Config {
                problems: vec![
                    "serve.tokens_file holds no tokens (empty or truncated?); to turn \
                     authentication off, leave serve.tokens_file empty"
                        .into(),
                ],
            });
        }
        Ok(auth)
    }

    /// The scope of the `Authorization` header's bearer token. The scheme
    /// is matched without regard to case (RFC 7235 § 2.1).
    ///
    /// # Errors
    /// [`Denied::Unauthenticated`] for a missing, malformed or unknown token.
    pub fn scope(&self, authorization: Option<&str>) -> Result<Scope, Denied> {
        let Some(tokens) = &self.tokens else {
            return Ok(Scope::All);
        };
        let presented = authorization
            .map(str::trim_start)
            .and_then(|h| h.split_once(' '))
            .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
            .map(|(_, t)| t.trim())
            .ok_or(Denied::Unauthenticated)?;
        let mut found = None;
        // Every token is compared, so timing does not tell which matched.
        for (t, scope) in tokens {
            if ct_eq(t, presented.as_bytes()) {
                found = Some(scope.clone());
            }
        }
        found.ok_or(Denied::Unauthenticated)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_are_scoped_to_tenants() {
        let a = Auth::parse(
            "# ops\nacme-token-0123456789 acme\nall-token-0123456789 *  # admin\nboth-token-0123456789 acme,globex\n",
        )
        .unwrap();
        let s = a.scope(Some("Bearer acme-token-0123456789")).unwrap();
        assert!(s.allows("acme") && !s.allows("globex"));
        assert!(
            a.scope(Some("Bearer all-token-0123456789"))
                .unwrap()
                .allows("x")
        );
        let both = a.scope(Some("Bearer both-token-0123456789")).unwrap();
        assert!(both.allows("globex") && both.allows("acme") && !both.allows("default"));
        assert_eq!(a.scope(None), Err(Denied::Unauthenticated));
        assert_eq!(a.scope(Some("Bearer nope")), Err(Denied::Unauthenticated));
        assert_eq!(
            a.scope(Some("Basic acme-token-0123456789")),
            Err(Denied::Unauthenticated)
        );
        assert_eq!(Auth::open().scope(None), Ok(Scope::All));
        // RFC 7235: the scheme is case-insensitive.
        for h in [
            "bearer acme-token-0123456789",
            "BEARER acme-token-0123456789",
            "Bearer   acme-token-0123456789 ",
        ] {
            assert!(a.scope(Some(h)).unwrap().allows("acme"), "{h}");
        }
        assert_eq!(
            a.scope(Some("Bearer")),
            Err(Denied::Unauthenticated),
            "no token"
        );
        assert_eq!(
            a.scope(Some("Bearer ")),
            Err(Denied::Unauthenticated),
            "an empty token"
        );
    }

    #[test]
    fn a_file_without_tokens_is_refused() {
        for text in ["", "\n", "# all comments\n# nothing else\n"] {
            assert!(Auth::parse(text).unwrap().is_empty());
            let e = Auth::parse_in_force(text).unwrap_err().to_string();
            assert!(e.contains("holds no tokens"), "{text:?}: {e}");
        }
        assert_eq!(
            Auth::parse_in_force("acme-token-0123456789 acme\n")
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn bad_lines_are_reported_without_the_token() {
        let e = Auth::parse("short acme\nlonely-token-0123456789\n")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1") && e.contains("line 2"), "{e}");
        assert!(!e.contains("lonely"), "{e}");
    }
}
