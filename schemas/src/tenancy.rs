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

/// The shard (0..`shards`) that owns `tenant`'s communities: the partition
/// of the internal changes topic its memory changes are published to, and so
/// the community writer that keeps its links, communities and prototypes.
/// FNV-1a (64-bit) of the tenant's UTF-8 bytes, modulo `shards`: stable
/// across processes, versions and platforms, because every ingest instance
/// and every writer must compute the same owner. `shards` of 0 counts as 1.
pub fn shard_of(tenant: &str, shards: u32) -> u32 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tenant.as_bytes() {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h % u64::from(shards.max(1))) as u32
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

    #[test]
    fn shards_are_stable_and_spread() {
        // Published FNV-1a 64 values: a change here moves tenants between
        // writers of running deployments.
        assert_eq!(
            shard_of("", 1 << 31),
            (0xcbf2_9ce4_8422_2325u64 % (1 << 31)) as u32
        );
        assert_eq!(
            shard_of("a", 1 << 31),
            (0xaf63_dc4c_8601_ec8cu64 % (1 << 31)) as u32
        );
        assert_eq!(shard_of("acme", 0), 0);
        assert_eq!(shard_of("acme", 1), 0);
        let mut counts = [0u32; 4];
        for t in 0..4000 {
            counts[shard_of(&format!("tenant{t}"), 4) as usize] += 1;
        }
        assert!(
            counts.iter().all(|&c| (800..1200).contains(&c)),
            "{counts:?}"
        );
    }
}
