//! Memory ids: 128 bits of a keyed BLAKE3 hash of the owner and the
//! forming event, so no client can steer one onto another user's memory.
//!
//! A memory's id is `BLAKE3-keyed(key, tag ‖ len(user) ‖ user ‖ event)`
//! truncated to 128 bits, where `tag` tells an event's memory from a
//! user's profile memory (an event whose id is `"profile"` gets an id of
//! its own) and the length prefix keeps `("u1e", "1")` and `("u1", "e1")`
//! apart. BLAKE3 is collision resistant with or without the key: two
//! different (user, event) pairs that map to one id are not known and
//! would take about 2^64 work to find. The key adds unpredictability: with
//! a deployment secret (`steam.id_key`), knowing a user id and an event id
//! does not tell anyone the memory's id. Without one, a public key fixed in
//! this file is used and `steamrf validate` says so.
//!
//! The key is fixed for the life of a store: the ids of memories formed
//! later, and every user's profile memory, follow it. `steamrf migrate
//! --id-key-from` rewrites the ids under a new key (docs/security.md).
//!
//! Ids are written as 32 lowercase hex digits: in the tables (`Utf8`
//! columns, so SQL and Arrow consumers read them directly), on the changes
//! topic and in the API.

use std::fmt;
use std::str::FromStr;

/// A memory's global id (also a community's and a prototype's id: a
/// member's). Ordered by value; written as 32 lowercase hex digits.
///
/// Aligned to 8 bytes, not `u128`'s 16 (`packed(8)`), so the structs and
/// map entries that hold one are not padded to 16: a
/// `HashMap<MemoryId, Vec<_>>` slot is 40 bytes instead of 48, an
/// `Option<MemoryId>` 24 instead of 32. The field is read by value (a
/// reference to it is refused by the compiler).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[repr(C, packed(8))]
pub struct MemoryId(pub u128);

impl fmt::Display for MemoryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let v = self.0;
        write!(f, "{v:032x}")
    }
}

impl fmt::Debug for MemoryId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

/// A string that is not 32 hex digits.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("a memory id is 32 hex digits, not {0:?}")]
pub struct BadMemoryId(pub String);

impl FromStr for MemoryId {
    type Err = BadMemoryId;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
            return Err(BadMemoryId(s.chars().take(40).collect()));
        }
        u128::from_str_radix(s, 16)
            .map(Self)
            .map_err(|_| BadMemoryId(s.to_owned()))
    }
}

impl serde::Serialize for MemoryId {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> serde::Deserialize<'de> for MemoryId {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = <std::borrow::Cow<'de, str>>::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

/// The key memory ids are hashed under. `Debug` never shows it.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct IdKey([u8; 32]);

impl fmt::Debug for IdKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_public() {
            "IdKey(public)"
        } else {
            "IdKey(<secret>)"
        })
    }
}

/// Context string of the key derivation (BLAKE3's `derive_key` mode).
const CONTEXT: &str = "steamrf 2026-12 memory ids v1";

impl Default for IdKey {
    /// The public key: ids are collision resistant but predictable.
    fn default() -> Self {
        Self::from_secret("")
    }
}

impl IdKey {
    /// The key derived from a deployment secret (any string; `""` is the
    /// public key).
    pub fn from_secret(secret: &str) -> Self {
        Self(blake3::derive_key(CONTEXT, secret.as_bytes()))
    }

    /// Whether this is the public key (no secret configured).
    pub fn is_public(&self) -> bool {
        self.0 == blake3::derive_key(CONTEXT, b"")
    }

    /// The id of the memory `user_id` forms from event `event_id`.
    pub fn memory(&self, user_id: &str, event_id: &str) -> MemoryId {
        self.hash(Tag::Event, user_id, event_id.as_bytes())
    }

    /// The id of `user_id`'s profile memory.
    pub fn profile(&self, user_id: &str) -> MemoryId {
        self.hash(Tag::Profile, user_id, b"")
    }

    /// Whether this key gives `id` to a memory of `user_id` whose first
    /// interaction is `first_event` (the event that formed it; a profile
    /// memory's id depends on the user alone). False for a memory written
    /// under another key: the stage refuses a store whose memories no id
    /// of which this key explains.
    pub fn explains(&self, id: MemoryId, user_id: &str, first_event: Option<&str>) -> bool {
        id == self.profile(user_id) || first_event.is_some_and(|e| id == self.memory(user_id, e))
    }

    /// The id a memory written under an earlier steamrf (a 63-bit id that
    /// could not be traced back to its forming event) gets under this key.
    pub fn legacy(&self, user_id: &str, old: i64) -> MemoryId {
        self.hash(Tag::Legacy, user_id, &old.to_le_bytes())
    }

    fn hash(&self, tag: Tag, user_id: &str, rest: &[u8]) -> MemoryId {
        let mut h = blake3::Hasher::new_keyed(&self.0);
        h.update(&[tag as u8]);
        h.update(&(user_id.len() as u64).to_le_bytes());
        h.update(user_id.as_bytes());
        h.update(rest);
        let out = h.finalize();
        let mut first = [0u8; 16];
        first.copy_from_slice(&out.as_bytes()[..16]);
        MemoryId(u128::from_le_bytes(first))
    }
}

#[derive(Clone, Copy)]
#[repr(u8)]
enum Tag {
    Event = 0,
    Profile = 1,
    Legacy = 2,
}

/// The 63-bit id an earlier steamrf gave the memory `user_id` formed from
/// `event_id` (FNV-1a, shifted right once): only for `steamrf migrate`,
/// which uses it to trace a stored id back to its forming event.
pub fn legacy_fnv(user_id: &str, event_id: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in user_id.bytes().chain([0u8]).chain(event_id.bytes()) {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 1) as i64
}

/// The legacy id of `user_id`'s profile memory.
pub fn legacy_fnv_profile(user_id: &str) -> i64 {
    legacy_fnv(user_id, "profile")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Aligned to 8: what holds an id is not padded to 16, and every bit
    /// still counts (order, equality, hashing, text).
    #[test]
    fn an_id_takes_16_bytes_at_8_byte_alignment() {
        use std::collections::HashSet;
        assert_eq!((size_of::<MemoryId>(), align_of::<MemoryId>()), (16, 8));
        assert_eq!(size_of::<Option<MemoryId>>(), 24);
        assert_eq!(size_of::<(MemoryId, Vec<u32>)>(), 40);
        assert_eq!(size_of::<(MemoryId, f32)>(), 24);
        let ids = [
            0,
            1,
            u128::from(u64::MAX),
            u128::from(u64::MAX) + 1,
            u128::MAX,
        ]
        .map(MemoryId);
        assert!(ids.windows(2).all(|w| w[0] < w[1]));
        assert_eq!(ids.iter().collect::<HashSet<_>>().len(), ids.len());
        for id in ids {
            assert_eq!(id.to_string().parse::<MemoryId>().unwrap(), id);
        }
    }

    #[test]
    fn ids_are_stable_and_keep_their_parts_apart() {
        let k = IdKey::default();
        assert_eq!(k.memory("u1", "e1"), k.memory("u1", "e1"));
        assert_ne!(k.memory("u1", "e1"), k.memory("u1e", "1"));
        assert_ne!(k.memory("u1", "\0e1"), k.memory("u1\0", "e1"));
        // An event called "profile" is not the profile memory.
        assert_ne!(k.memory("u1", "profile"), k.profile("u1"));
        assert_ne!(k.legacy("u1", 7), k.memory("u1", "7"));
    }

    #[test]
    fn the_key_changes_every_id_and_never_shows() {
        let (public, secret) = (IdKey::default(), IdKey::from_secret("s3cret"));
        assert!(public.is_public() && !secret.is_public());
        assert_ne!(public.memory("u", "e"), secret.memory("u", "e"));
        assert_ne!(public.profile("u"), secret.profile("u"));
        assert!(secret.explains(secret.memory("u", "e"), "u", Some("e")));
        assert!(secret.explains(secret.profile("u"), "u", Some("p")));
        assert!(!public.explains(secret.memory("u", "e"), "u", Some("e")));
        assert_eq!(format!("{secret:?}"), "IdKey(<secret>)");
        // Pinned: ids are stored, so the derivation must never drift.
        assert_eq!(
            public.memory("u1", "e1").to_string(),
            PINNED_U1_E1,
            "memory ids changed: stored memories would no longer match their events"
        );
    }

    const PINNED_U1_E1: &str = "3be49408efb9c454b331e5632735aa9c";

    #[test]
    fn ids_round_trip_as_32_hex_digits() {
        let id = IdKey::default().memory("u", "e");
        let s = id.to_string();
        assert_eq!(s.len(), 32);
        assert_eq!(s.parse::<MemoryId>().unwrap(), id);
        assert_eq!(serde_json::to_string(&id).unwrap(), format!("\"{s}\""));
        assert_eq!(
            serde_json::from_str::<MemoryId>(&format!("\"{s}\"")).unwrap(),
            id
        );
        for bad in [
            "",
            "12",
            "zz",
            &format!("{s}0"),
            "0x000000000000000000000000000000",
        ] {
            assert!(bad.parse::<MemoryId>().is_err(), "{bad:?} parsed");
        }
        assert!(serde_json::from_str::<MemoryId>("12").is_err());
        assert_eq!(MemoryId(1).to_string(), "00000000000000000000000000000001");
    }

    #[test]
    fn the_legacy_hash_is_the_one_earlier_releases_stored() {
        // Computed independently from the FNV-1a definition (offset basis
        // 0xcbf29ce484222325, prime 0x100000001b3), shifted right once.
        assert_eq!(legacy_fnv("u1", "e1"), 5_975_540_832_370_705_655);
        assert!(legacy_fnv("x", "y") >= 0);
        assert_eq!(legacy_fnv_profile("u1"), legacy_fnv("u1", "profile"));
    }
}
