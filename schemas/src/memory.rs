//! Arrow schemas of the STEAM write path's tables (see docs/steam.md):
//!
//! - `memories`: atomic memory units m = {c, e, I, L}, keyed by `memory_id`;
//! - `memory_links`: each memory's links to other users' memories;
//! - `prototypes`: one row per published community prototype.
//!
//! Ids are the operators' 128-bit keyed memory ids (docs/security.md),
//! stored as `Utf8` of 32 lowercase hex digits so SQL and Arrow consumers
//! read, filter and join them directly. A community's and a prototype's id
//! is one of its members' ids.

use std::sync::{Arc, LazyLock};

use arrow_schema::{DataType, Field, Schema, SchemaRef, TimeUnit};

use crate::tables::embedding_field;

/// The write path's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum MemoryTable {
    /// Atomic memories.
    Memories,
    /// Links between memories of different users.
    MemoryLinks,
    /// Community prototypes.
    Prototypes,
}

impl MemoryTable {
    /// All of them.
    pub const ALL: [Self; 3] = [Self::Memories, Self::MemoryLinks, Self::Prototypes];

    /// The table's name in LanceDB.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Memories => "memories",
            Self::MemoryLinks => "memory_links",
            Self::Prototypes => "prototypes",
        }
    }

    /// The table's Arrow schema.
    pub fn schema(self) -> SchemaRef {
        match self {
            Self::Memories => MEMORIES.clone(),
            Self::MemoryLinks => LINKS.clone(),
            Self::Prototypes => PROTOTYPES.clone(),
        }
    }
}

fn ts() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
}

fn list_of(item: DataType) -> DataType {
    DataType::List(Arc::new(Field::new("item", item, true)))
}

static MEMORIES: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("memory_id", DataType::Utf8, false),
        Field::new("user_id", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
        embedding_field(),
        Field::new("interaction_ids", list_of(DataType::Utf8), false),
        Field::new("item_ids", list_of(DataType::Utf8), false),
        Field::new("community_id", DataType::Utf8, true),
        Field::new("created_at", ts(), false),
        Field::new("updated_at", ts(), false),
        Field::new("version", DataType::Int64, false),
        Field::new("support", DataType::Int64, false),
        // The deterministic summariser's state, so a restart resumes it:
        // facet counts as a JSON object, and the latest titles or snippets.
        Field::new("facets", DataType::Utf8, false),
        Field::new("recent", list_of(DataType::Utf8), false),
    ]))
});

static LINKS: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("from_id", DataType::Utf8, false),
        Field::new("to_id", DataType::Utf8, false),
        Field::new("from_user", DataType::Utf8, false),
        Field::new("to_user", DataType::Utf8, false),
        Field::new("score", DataType::Float32, false),
    ]))
});

static PROTOTYPES: LazyLock<SchemaRef> = LazyLock::new(|| {
    Arc::new(Schema::new(vec![
        Field::new("prototype_id", DataType::Utf8, false),
        Field::new("content", DataType::Utf8, false),
        embedding_field(),
        Field::new("member_ids", list_of(DataType::Utf8), false),
        Field::new("users", DataType::Int32, false),
    ]))
});
