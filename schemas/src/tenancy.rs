//! Tenancy: which tenant a user id belongs to. Every rule about who may see
//! or be counted with whom (links, communities, prototypes, collaborative
//! signals, API tokens) asks this module; docs/security.md.

/// The tenant of `user_id`: the part before the first `separator`, or
/// `"default"` (no separator configured, or none in the id). Links,
/// communities and prototypes never cross tenants, and the retrieval service
/// scopes API tokens to tenants.
pub fn tenant_of(user_id: &str, separator: Option<char>) -> &str {
    separator
        .and_then(|c| user_id.split_once(c))
        .map_or("default", |(t, _)| t)
}

/// Whether `other`'s memories may inform `user`'s answers at all: another
/// user of the same tenant.
pub fn is_peer(user: &str, other: &str, separator: Option<char>) -> bool {
    user != other && tenant_of(user, separator) == tenant_of(other, separator)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tenants_and_peers() {
        assert_eq!(tenant_of("acme:alice", Some(':')), "acme");
        assert_eq!(tenant_of("alice", Some(':')), "default");
        assert_eq!(tenant_of("acme:alice", None), "default");
        assert!(is_peer("acme:ann", "acme:ben", Some(':')));
        assert!(!is_peer("acme:ann", "acme:ann", Some(':')));
        assert!(!is_peer("acme:ann", "globex:ben", Some(':')));
        assert!(!is_peer("acme:ann", "ben", Some(':')));
        assert!(is_peer("acme:ann", "globex:ben", None));
    }
}
