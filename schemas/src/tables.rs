//! Arrow schemas of the LanceDB tables and of each event type, and builders
//! that append decoded events into `RecordBatch`es for those tables.
//!
//! Tables (all written idempotently, see `ARCHITECTURE.md`):
//! - `interactions`: clicks, purchases and dialogue turns, keyed by
//!   `(user_id, event_id)` (an `event_id` is unique per user), without vectors (most rows have none, and a vector column costs a click
//!   row 1,536 bytes in memory and every idempotent merge a join over it);
//! - `turn_vectors`: each embedded dialogue turn's vector, keyed by
//!   `(user_id, event_id)`;
//! - `items`: the catalog, keyed by `item_id` (latest event time wins);
//! - `profiles`: user attributes, keyed by `user_id` (latest event time wins);
//! - `passages`: one embedded window of turns per dialogue turn, keyed as
//!   the turn.
//!
//! Every row carries its provenance: the Kafka partition and offset it came
//! from and when steamrf ingested it.

use std::sync::{Arc, LazyLock};

use arrow_array::builder::{
    ArrayBuilder, Float32Builder, Float64Builder, Int32Builder, Int64Builder, ListBuilder,
    PrimitiveBuilder, StringBuilder, TimestampMillisecondBuilder,
};
use arrow_array::types::ArrowPrimitiveType;
use arrow_array::{
    Array, ArrayRef, FixedSizeListArray, Float32Array, PrimitiveArray, RecordBatch, new_null_array,
};
use arrow_buffer::NullBuffer;
use arrow_schema::{ArrowError, DataType, Field, Schema, SchemaRef, TimeUnit};

use crate::event::{Event, EventType, Interaction, ItemEvent, ProfileEvent};

/// The LanceDB tables the ingest pipeline writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TableName {
    /// Clicks, purchases, dialogue turns (no vectors).
    Interactions,
    /// The vector of each embedded dialogue turn, by its `event_id`.
    TurnVectors,
    /// The item catalog.
    Items,
    /// User profiles.
    Profiles,
    /// Passages: each dialogue turn with the turns before it in its session,
    /// embedded as one window (docs/retrieval.md).
    Passages,
}

impl TableName {
    /// All tables, in a fixed order.
    pub const ALL: [Self; 5] = [
        Self::Interactions,
        Self::TurnVectors,
        Self::Items,
        Self::Profiles,
        Self::Passages,
    ];

    /// The table's name in LanceDB (and the `table` metric label).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Interactions => "interactions",
            Self::TurnVectors => "turn_vectors",
            Self::Items => "items",
            Self::Profiles => "profiles",
            Self::Passages => "passages",
        }
    }

    /// Whether the key is unique per user rather than table-wide: the
    /// per-user tables store one row per `(user_id, event_id)`, so one
    /// tenant's or user's `event_id` can neither hide nor stand in for
    /// another's (docs/security.md). Items and profiles keep one key.
    pub fn keyed_per_user(self) -> bool {
        matches!(
            self,
            Self::Interactions | Self::TurnVectors | Self::Passages
        )
    }

    /// The columns a stored row is identified by: the key, with `user_id`
    /// where [`Self::keyed_per_user`].
    pub fn key_columns(self) -> &'static [&'static str] {
        if self.keyed_per_user() {
            &["event_id", "user_id"]
        } else {
            match self {
                Self::Items => &["item_id"],
                _ => &["user_id"],
            }
        }
    }

    /// The column writes are idempotent on (with `user_id` where
    /// [`Self::keyed_per_user`]).
    pub fn key(self) -> &'static str {
        match self {
            Self::Interactions | Self::TurnVectors => "event_id",
            Self::Items => "item_id",
            Self::Profiles => "user_id",
            Self::Passages => "event_id",
        }
    }

    /// The table's Arrow schema.
    pub fn schema(self) -> SchemaRef {
        match self {
            Self::Interactions => INTERACTIONS.clone(),
            Self::TurnVectors => TURN_VECTORS.clone(),
            Self::Items => ITEMS.clone(),
            Self::Profiles => PROFILES.clone(),
            Self::Passages => PASSAGES.clone(),
        }
    }
}

fn ts() -> DataType {
    DataType::Timestamp(TimeUnit::Millisecond, Some("UTC".into()))
}

fn provenance_fields() -> [Field; 3] {
    [
        Field::new("source_partition", DataType::Int32, false),
        Field::new("source_offset", DataType::Int64, false),
        Field::new("ingested_at", ts(), false),
    ]
}

fn utf8(name: &str, nullable: bool) -> Field {
    Field::new(name, DataType::Utf8, nullable)
}

/// An id column of `interactions`, compressed with LZ4 instead of FSST
/// (`lance-encoding:compression = lz4`). LanceDB picks FSST for strings by
/// default; on the click stream that was half of LanceDB's encoding CPU,
/// ~0.25 µs per event. LZ4 takes about a tenth of that, and 1M bench clicks
/// take 61 MB of data files instead of 52 MB (98 MB uncompressed). Only new
/// tables take the hint (Lance keeps the schema a table was created with);
/// `text` keeps FSST.
fn lz4_utf8(name: &str, nullable: bool) -> Field {
    utf8(name, nullable)
        .with_metadata([("lance-encoding:compression".to_owned(), "lz4".to_owned())].into())
}

/// Length of every embedding column (all-MiniLM-L6-v2's hidden size).
pub const EMBEDDING_DIM: usize = 384;

/// The embedding column: `FixedSizeList<Float32, 384>`, null where nothing is
/// embedded (an item while embedding is switched off).
pub fn embedding_field() -> Field {
    Field::new(
        "embedding",
        DataType::FixedSizeList(
            Arc::new(Field::new("item", DataType::Float32, true)),
            EMBEDDING_DIM as i32,
        ),
        true,
    )
}

fn categories_type() -> DataType {
    DataType::List(Arc::new(Field::new("item", DataType::Utf8, true)))
}

static INTERACTIONS: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        lz4_utf8("event_id", false),
        utf8("kind", false),
        lz4_utf8("user_id", false),
        Field::new("timestamp", ts(), false),
        lz4_utf8("item_id", true),
        lz4_utf8("session_id", true),
        Field::new("rating", DataType::Float32, true),
        Field::new("quantity", DataType::Int32, true),
        Field::new("price", DataType::Float64, true),
        utf8("currency", true),
        utf8("role", true),
        utf8("text", true),
    ];
    fields.extend(provenance_fields());
    Arc::new(Schema::new(fields))
});

static TURN_VECTORS: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        // The turn's `interactions` row.
        utf8("event_id", false),
        utf8("user_id", false),
        Field::new("timestamp", ts(), false),
        embedding_field(),
    ];
    // The turn's own provenance.
    fields.extend(provenance_fields());
    // Its learned sparse vector (SPLADE): term ids ascending and their
    // weights; null where no sparse encoder ran. Last, so that a table
    // written before they existed gains them as all-null columns on open.
    fields.extend(sparse_fields());
    Arc::new(Schema::new(fields))
});

/// The sparse-vector columns of `turn_vectors`: `terms` (ascending term
/// ids) and `weights`, both nullable lists.
pub fn sparse_fields() -> [Field; 2] {
    [
        Field::new(
            "terms",
            DataType::List(Arc::new(Field::new("item", DataType::UInt32, false))),
            true,
        ),
        Field::new(
            "weights",
            DataType::List(Arc::new(Field::new("item", DataType::Float32, false))),
            true,
        ),
    ]
}

/// `batch` (a `turn_vectors` batch) with its `terms` and `weights` columns
/// set from `sparse`, one entry per row (`None`: null, no vector).
///
/// # Errors
/// If `sparse` has another length than the batch, an entry's terms and
/// weights differ in length, or the batch lacks the columns.
pub fn with_sparse_terms(
    batch: &RecordBatch,
    sparse: &[Option<(&[u32], &[f32])>],
) -> Result<RecordBatch, ArrowError> {
    use arrow_array::builder::UInt32Builder;
    if sparse.len() != batch.num_rows() {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{} sparse vectors for {} rows",
            sparse.len(),
            batch.num_rows()
        )));
    }
    let [terms_field, weights_field] = sparse_fields();
    let item = |f: &Field| match f.data_type() {
        DataType::List(item) => item.clone(),
        _ => unreachable!("the sparse fields are lists"),
    };
    let mut terms = ListBuilder::new(UInt32Builder::new()).with_field(item(&terms_field));
    let mut weights = ListBuilder::new(Float32Builder::new()).with_field(item(&weights_field));
    for s in sparse {
        match s {
            Some((t, w)) if t.len() == w.len() => {
                terms.values().append_slice(t);
                terms.append(true);
                weights.values().append_slice(w);
                weights.append(true);
            }
            Some((t, w)) => {
                return Err(ArrowError::InvalidArgumentError(format!(
                    "a sparse vector with {} terms and {} weights",
                    t.len(),
                    w.len()
                )));
            }
            None => {
                terms.append(false);
                weights.append(false);
            }
        }
    }
    let schema = batch.schema();
    let mut cols = batch.columns().to_vec();
    for (name, array) in [
        ("terms", Arc::new(terms.finish()) as ArrayRef),
        ("weights", Arc::new(weights.finish()) as ArrayRef),
    ] {
        let (i, _) = schema.column_with_name(name).ok_or_else(|| {
            ArrowError::InvalidArgumentError(format!("the batch lacks the {name} column"))
        })?;
        cols[i] = array;
    }
    RecordBatch::try_new(schema, cols)
}

static ITEMS: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        utf8("item_id", false),
        utf8("event_id", false),
        Field::new("timestamp", ts(), false),
        utf8("title", false),
        Field::new("categories", categories_type(), false),
        utf8("description", true),
        utf8("attributes", true),
        embedding_field(),
    ];
    fields.extend(provenance_fields());
    Arc::new(Schema::new(fields))
});

static PROFILES: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        utf8("user_id", false),
        utf8("event_id", false),
        Field::new("timestamp", ts(), false),
        utf8("attributes", true),
    ];
    fields.extend(provenance_fields());
    Arc::new(Schema::new(fields))
});

static PASSAGES: LazyLock<SchemaRef> = LazyLock::new(|| {
    let mut fields = vec![
        // The turn the window ends at (one window per turn).
        utf8("event_id", false),
        utf8("user_id", false),
        utf8("session_id", false),
        // The ending turn's time.
        Field::new("timestamp", ts(), false),
        // The window's first turn, and how many turns it holds.
        utf8("first_event_id", false),
        Field::new("turns", DataType::Int32, false),
        // The header and the turns, as embedded.
        utf8("text", false),
        embedding_field(),
    ];
    fields.extend(provenance_fields());
    Arc::new(Schema::new(fields))
});

/// The Arrow schema of one event type as it arrives: the columns of its table
/// that the event fills (provenance columns excluded). Documented in
/// `docs/events.md` and snapshot-tested in `schemas/golden/`.
pub fn event_schema(ty: EventType) -> SchemaRef {
    let pick = |table: TableName, cols: &[&str]| {
        let schema = table.schema();
        let fields: Vec<Field> = cols
            .iter()
            .filter_map(|c| schema.field_with_name(c).ok())
            // Storage hints are the table's business, not the event's.
            .map(|f| f.clone().with_metadata(Default::default()))
            .collect();
        Arc::new(Schema::new(fields))
    };
    let common = ["event_id", "kind", "user_id", "timestamp"];
    match ty {
        EventType::Click => pick(
            TableName::Interactions,
            &[&common[..], &["item_id", "session_id", "rating"]].concat(),
        ),
        EventType::Purchase => pick(
            TableName::Interactions,
            &[
                &common[..],
                &["item_id", "session_id", "quantity", "price", "currency"],
            ]
            .concat(),
        ),
        EventType::DialogueTurn => pick(
            TableName::Interactions,
            &[&common[..], &["session_id", "role", "text", "item_id"]].concat(),
        ),
        EventType::Item => pick(
            TableName::Items,
            &[
                "item_id",
                "event_id",
                "timestamp",
                "title",
                "categories",
                "description",
                "attributes",
            ],
        ),
        EventType::Profile => pick(
            TableName::Profiles,
            &["user_id", "event_id", "timestamp", "attributes"],
        ),
        // Not stored: the fields it carries.
        EventType::Forget => pick(TableName::Profiles, &["user_id", "event_id", "timestamp"]),
    }
}

/// Where a row came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Provenance {
    /// Kafka partition.
    pub partition: i32,
    /// Kafka offset.
    pub offset: i64,
    /// Ingest wall-clock time, ms since the epoch.
    pub ingested_at_ms: i64,
}

#[derive(Debug, Default)]
struct ProvenanceBuilder {
    partition: Int32Builder,
    offset: Int64Builder,
    ingested_at: TimestampMillisecondBuilder,
}

impl ProvenanceBuilder {
    fn append(&mut self, p: Provenance) {
        self.partition.append_value(p.partition);
        self.offset.append_value(p.offset);
        self.ingested_at.append_value(p.ingested_at_ms);
    }

    fn finish(&mut self) -> [ArrayRef; 3] {
        [
            Arc::new(finish_sized(&mut self.partition)),
            Arc::new(finish_sized(&mut self.offset)),
            Arc::new(finish_sized(&mut self.ingested_at).with_timezone("UTC")),
        ]
    }
}

/// Finishes a string builder and leaves it with the capacity this batch
/// needed, so that a next batch of the same shape grows no buffer: each
/// doubling copied what the builder held and faulted in fresh pages (page
/// clearing alone was ~7% of the source thread at 100k-row batches). The
/// capacity is only reserved; pages count towards RSS once written.
fn finish_str_sized(b: &mut StringBuilder) -> ArrayRef {
    let (rows, bytes) = (b.len(), b.values_slice().len());
    let out = Arc::new(b.finish());
    *b = StringBuilder::with_capacity(rows, bytes);
    out
}

/// [`finish_str_sized`] for a primitive builder.
fn finish_sized<T: ArrowPrimitiveType>(b: &mut PrimitiveBuilder<T>) -> PrimitiveArray<T> {
    let rows = b.len();
    let out = b.finish();
    *b = PrimitiveBuilder::with_capacity(rows);
    out
}

#[derive(Debug, Default)]
struct InteractionsBuilder {
    event_id: StringBuilder,
    kind: StringBuilder,
    user_id: StringBuilder,
    timestamp: TimestampMillisecondBuilder,
    item_id: StringBuilder,
    session_id: StringBuilder,
    rating: Float32Builder,
    quantity: Int32Builder,
    price: Float64Builder,
    currency: StringBuilder,
    role: StringBuilder,
    text: StringBuilder,
    provenance: ProvenanceBuilder,
    len: usize,
}

impl InteractionsBuilder {
    fn append(&mut self, e: &Interaction<'_>, p: Provenance) {
        self.event_id.append_value(&e.event_id);
        self.kind.append_value(e.kind.as_str());
        self.user_id.append_value(&e.user_id);
        self.timestamp.append_value(e.timestamp_ms);
        self.item_id.append_option(e.item_id.as_deref());
        self.session_id.append_option(e.session_id.as_deref());
        self.rating.append_option(e.rating);
        self.quantity.append_option(e.quantity);
        self.price.append_option(e.price);
        self.currency.append_option(e.currency.as_deref());
        self.role.append_option(e.role.map(|r| r.as_str()));
        self.text.append_option(e.text.as_deref());
        self.provenance.append(p);
        self.len += 1;
    }

    fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        self.len = 0;
        let mut cols: Vec<ArrayRef> = vec![
            finish_str_sized(&mut self.event_id),
            finish_str_sized(&mut self.kind),
            finish_str_sized(&mut self.user_id),
            Arc::new(finish_sized(&mut self.timestamp).with_timezone("UTC")),
            finish_str_sized(&mut self.item_id),
            finish_str_sized(&mut self.session_id),
            Arc::new(finish_sized(&mut self.rating)),
            Arc::new(finish_sized(&mut self.quantity)),
            Arc::new(finish_sized(&mut self.price)),
            finish_str_sized(&mut self.currency),
            finish_str_sized(&mut self.role),
            finish_str_sized(&mut self.text),
        ];
        cols.extend(self.provenance.finish());
        RecordBatch::try_new(INTERACTIONS.clone(), cols)
    }
}

#[derive(Debug)]
struct ItemsBuilder {
    item_id: StringBuilder,
    event_id: StringBuilder,
    timestamp: TimestampMillisecondBuilder,
    title: StringBuilder,
    categories: ListBuilder<StringBuilder>,
    description: StringBuilder,
    attributes: StringBuilder,
    provenance: ProvenanceBuilder,
    len: usize,
}

impl Default for ItemsBuilder {
    fn default() -> Self {
        Self {
            item_id: StringBuilder::new(),
            event_id: StringBuilder::new(),
            timestamp: TimestampMillisecondBuilder::new(),
            title: StringBuilder::new(),
            categories: ListBuilder::new(StringBuilder::new()).with_field(Arc::new(Field::new(
                "item",
                DataType::Utf8,
                true,
            ))),
            description: StringBuilder::new(),
            attributes: StringBuilder::new(),
            provenance: ProvenanceBuilder::default(),
            len: 0,
        }
    }
}

impl ItemsBuilder {
    fn append(&mut self, e: &ItemEvent<'_>, p: Provenance) {
        self.item_id.append_value(&e.item_id);
        self.event_id.append_value(&e.event_id);
        self.timestamp.append_value(e.timestamp_ms);
        self.title.append_value(&e.title);
        for c in &e.categories {
            self.categories.values().append_value(c);
        }
        self.categories.append(true);
        self.description.append_option(e.description.as_deref());
        self.attributes.append_option(e.attributes.as_deref());
        self.provenance.append(p);
        self.len += 1;
    }

    fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        let rows = std::mem::take(&mut self.len);
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(self.item_id.finish()),
            Arc::new(self.event_id.finish()),
            Arc::new(self.timestamp.finish().with_timezone("UTC")),
            Arc::new(self.title.finish()),
            Arc::new(self.categories.finish()),
            Arc::new(self.description.finish()),
            Arc::new(self.attributes.finish()),
            new_null_array(embedding_field().data_type(), rows),
        ];
        cols.extend(self.provenance.finish());
        RecordBatch::try_new(ITEMS.clone(), cols)
    }
}

#[derive(Debug, Default)]
struct ProfilesBuilder {
    user_id: StringBuilder,
    event_id: StringBuilder,
    timestamp: TimestampMillisecondBuilder,
    attributes: StringBuilder,
    provenance: ProvenanceBuilder,
    len: usize,
}

impl ProfilesBuilder {
    fn append(&mut self, e: &ProfileEvent<'_>, p: Provenance) {
        self.user_id.append_value(&e.user_id);
        self.event_id.append_value(&e.event_id);
        self.timestamp.append_value(e.timestamp_ms);
        self.attributes.append_option(e.attributes.as_deref());
        self.provenance.append(p);
        self.len += 1;
    }

    fn finish(&mut self) -> Result<RecordBatch, ArrowError> {
        self.len = 0;
        let mut cols: Vec<ArrayRef> = vec![
            Arc::new(self.user_id.finish()),
            Arc::new(self.event_id.finish()),
            Arc::new(self.timestamp.finish().with_timezone("UTC")),
            Arc::new(self.attributes.finish()),
        ];
        cols.extend(self.provenance.finish());
        RecordBatch::try_new(PROFILES.clone(), cols)
    }
}

/// Appends decoded events into one in-progress batch per table.
#[derive(Debug, Default)]
pub struct TableBuilders {
    interactions: InteractionsBuilder,
    items: ItemsBuilder,
    profiles: ProfilesBuilder,
}

/// One micro-batch: at most one `RecordBatch` per table (absent when empty).
#[derive(Debug, Default, Clone)]
pub struct TableBatches {
    /// Rows for `interactions`.
    pub interactions: Option<RecordBatch>,
    /// Rows for `items`.
    pub items: Option<RecordBatch>,
    /// Rows for `profiles`.
    pub profiles: Option<RecordBatch>,
    /// Rows for `turn_vectors` (made by the embed stage, never by the
    /// builders): the vectors of the batch's dialogue turns, also those a
    /// replay finds stored, so the STEAM stage sees every turn's vector.
    pub turn_vectors: Option<RecordBatch>,
    /// Rows for `passages` (made by the embed stage, never by the builders).
    pub passages: Option<RecordBatch>,
}

impl TableBatches {
    /// The batches with their table names.
    pub fn iter(&self) -> impl Iterator<Item = (TableName, &RecordBatch)> {
        [
            (TableName::Interactions, self.interactions.as_ref()),
            (TableName::TurnVectors, self.turn_vectors.as_ref()),
            (TableName::Items, self.items.as_ref()),
            (TableName::Profiles, self.profiles.as_ref()),
            (TableName::Passages, self.passages.as_ref()),
        ]
        .into_iter()
        .filter_map(|(t, b)| b.map(|b| (t, b)))
    }

    /// Total rows over all tables.
    pub fn num_rows(&self) -> usize {
        self.iter().map(|(_, b)| b.num_rows()).sum()
    }
}

impl TableBuilders {
    /// Appends one event to its table's batch.
    pub fn append(&mut self, event: &Event<'_>, provenance: Provenance) {
        match event {
            Event::Interaction(e) => self.interactions.append(e, provenance),
            Event::Item(e) => self.items.append(e, provenance),
            Event::Profile(e) => self.profiles.append(e, provenance),
            // Run between batches by the pipeline, never stored.
            Event::Forget(_) => {}
        }
    }

    /// Rows appended since the last [`Self::finish`].
    pub fn len(&self) -> usize {
        self.interactions.len + self.items.len + self.profiles.len
    }

    /// Whether nothing was appended since the last [`Self::finish`].
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Finishes the in-progress batches and starts new ones.
    ///
    /// # Errors
    /// Only if the builders and schemas disagree, which is a bug.
    pub fn finish(&mut self) -> Result<TableBatches, ArrowError> {
        let interactions = (self.interactions.len > 0)
            .then(|| self.interactions.finish())
            .transpose()?;
        let items = (self.items.len > 0)
            .then(|| self.items.finish())
            .transpose()?;
        let profiles = (self.profiles.len > 0)
            .then(|| self.profiles.finish())
            .transpose()?;
        Ok(TableBatches {
            interactions,
            items,
            profiles,
            turn_vectors: None,
            passages: None,
        })
    }
}

/// Returns `batch` with its `embedding` column set: row `rows[i]` gets
/// `vectors[i * EMBEDDING_DIM..][..EMBEDDING_DIM]`; other rows keep their value
/// (null unless set before).
///
/// # Errors
/// If the batch has no embedding column, a row is out of range, or
/// `vectors` is not `rows.len() × EMBEDDING_DIM` long.
pub fn with_embeddings(
    batch: &RecordBatch,
    rows: &[usize],
    vectors: &[f32],
) -> Result<RecordBatch, ArrowError> {
    let dim = EMBEDDING_DIM;
    if vectors.len() != rows.len() * dim {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{} vectors of {dim} values expected, got {} values",
            rows.len(),
            vectors.len()
        )));
    }
    let schema = batch.schema();
    let (idx, field) = schema.column_with_name("embedding").ok_or_else(|| {
        ArrowError::InvalidArgumentError("the batch has no embedding column".into())
    })?;
    let n = batch.num_rows();
    let old = batch
        .column(idx)
        .as_any()
        .downcast_ref::<FixedSizeListArray>()
        .ok_or_else(|| {
            ArrowError::InvalidArgumentError("embedding is not a FixedSizeList".into())
        })?;
    let mut values = vec![0.0f32; n * dim];
    let mut valid = vec![false; n];
    for r in 0..n {
        if old.is_valid(r) {
            let row = old.value(r);
            if let Some(v) = row.as_any().downcast_ref::<Float32Array>() {
                values[r * dim..(r + 1) * dim].copy_from_slice(v.values());
                valid[r] = true;
            }
        }
    }
    for (i, &r) in rows.iter().enumerate() {
        if r >= n {
            return Err(ArrowError::InvalidArgumentError(format!(
                "row {r} out of range (batch of {n})"
            )));
        }
        values[r * dim..(r + 1) * dim].copy_from_slice(&vectors[i * dim..(i + 1) * dim]);
        valid[r] = true;
    }
    let DataType::FixedSizeList(item, _) = field.data_type() else {
        unreachable!("checked by the downcast above")
    };
    let array = FixedSizeListArray::try_new(
        item.clone(),
        dim as i32,
        Arc::new(Float32Array::from(values)),
        Some(NullBuffer::from(valid)),
    )?;
    let mut cols = batch.columns().to_vec();
    cols[idx] = Arc::new(array);
    RecordBatch::try_new(schema, cols)
}

/// `turn_vectors` rows for rows `rows` of an `interactions` batch: their
/// event id, user, time and provenance, and `vectors[i * EMBEDDING_DIM..]`
/// for `rows[i]`.
///
/// # Errors
/// If `interactions` lacks a column, a row is out of range, or `vectors` is
/// not `rows.len() × EMBEDDING_DIM` long.
pub fn turn_vectors(
    interactions: &RecordBatch,
    rows: &[usize],
    vectors: &[f32],
) -> Result<RecordBatch, ArrowError> {
    let n = interactions.num_rows();
    if let Some(&r) = rows.iter().find(|&&r| r >= n) {
        return Err(ArrowError::InvalidArgumentError(format!(
            "row {r} out of range (batch of {n})"
        )));
    }
    let embedding = embedding_array(vectors, rows.len())?;
    let idx = arrow_array::UInt32Array::from_iter_values(rows.iter().map(|&r| r as u32));
    let schema = TURN_VECTORS.clone();
    let cols = schema
        .fields()
        .iter()
        .map(|f| {
            if f.name() == "embedding" {
                return Ok(embedding.clone());
            }
            if f.name() == "terms" || f.name() == "weights" {
                return Ok(new_null_array(f.data_type(), rows.len()));
            }
            let c = interactions.column_by_name(f.name()).ok_or_else(|| {
                ArrowError::InvalidArgumentError(format!("interactions batch lacks {}", f.name()))
            })?;
            arrow_select::take::take(c, &idx, None)
        })
        .collect::<Result<Vec<_>, _>>()?;
    RecordBatch::try_new(schema, cols)
}

/// An embedding column of `n` rows, all valid, from `vectors` (row-major,
/// [`EMBEDDING_DIM`] each).
///
/// # Errors
/// When `vectors` does not hold `n` rows.
pub fn embedding_array(vectors: &[f32], n: usize) -> Result<ArrayRef, ArrowError> {
    if vectors.len() != n * EMBEDDING_DIM {
        return Err(ArrowError::InvalidArgumentError(format!(
            "{n} vectors of {EMBEDDING_DIM} values expected, got {} values",
            vectors.len()
        )));
    }
    let DataType::FixedSizeList(item, _) = embedding_field().data_type().clone() else {
        unreachable!("the embedding field is a FixedSizeList")
    };
    Ok(Arc::new(FixedSizeListArray::try_new(
        item,
        EMBEDDING_DIM as i32,
        Arc::new(Float32Array::from(vectors.to_vec())),
        None,
    )?))
}

/// A stable one-line-per-field rendering of a schema, for golden snapshots.
pub fn describe_schema(schema: &Schema) -> String {
    schema
        .fields()
        .iter()
        .map(|f| {
            let mut meta: Vec<_> = f.metadata().iter().collect();
            meta.sort();
            format!(
                "{}: {}{}{}\n",
                f.name(),
                f.data_type(),
                if f.is_nullable() { "" } else { " not null" },
                meta.iter()
                    .map(|(k, v)| format!(" [{k}={v}]"))
                    .collect::<String>()
            )
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::decode;

    /// The package directory at run time. `cargo test` sets it for the test
    /// process; the compile-time `env!` would name wherever the binary was built,
    /// which with a target directory shared between clones may no longer exist.
    fn manifest_dir() -> String {
        std::env::var("CARGO_MANIFEST_DIR")
            .unwrap_or_else(|_| env!("CARGO_MANIFEST_DIR").to_owned())
    }

    fn golden(name: &str, actual: &str) {
        let path = format!("{}/golden/{name}.txt", manifest_dir());
        if std::env::var_os("STEAMRF_BLESS").is_some() {
            std::fs::write(&path, actual).unwrap();
        }
        let expected = std::fs::read_to_string(&path)
            .unwrap_or_else(|_| panic!("missing {path}; run with STEAMRF_BLESS=1 to create it"));
        assert_eq!(
            expected, actual,
            "schema {name} changed; if intended, re-run with STEAMRF_BLESS=1 and bump SCHEMA_VERSION if producers are affected"
        );
    }

    #[test]
    fn table_schemas_match_golden() {
        for t in TableName::ALL {
            golden(
                &format!("table_{}", t.as_str()),
                &describe_schema(&t.schema()),
            );
        }
    }

    #[test]
    fn memory_table_schemas_match_golden() {
        for t in crate::memory::MemoryTable::ALL {
            golden(
                &format!("table_{}", t.as_str()),
                &describe_schema(&t.schema()),
            );
        }
    }

    #[test]
    fn event_schemas_match_golden() {
        for ty in EventType::ALL {
            golden(
                &format!("event_{}", ty.as_str()),
                &describe_schema(&event_schema(ty)),
            );
        }
    }

    #[test]
    fn builders_produce_batches_of_the_table_schemas() {
        let payloads = [
            r#"{"type":"click","schema_version":1,"event_id":"e1","timestamp":1000,"user_id":"u1","item_id":"i1","rating":4.5}"#,
            r#"{"type":"purchase","schema_version":1,"event_id":"e2","timestamp":"2026-01-01T00:00:00Z","user_id":"u1","item_id":"i2","price":9.99,"currency":"EUR"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e3","timestamp":3000,"user_id":"u1","session_id":"s1","role":"user","text":"I like jazz"}"#,
            r#"{"type":"item","schema_version":1,"event_id":"e4","timestamp":4000,"item_id":"i1","title":"Kind of Blue","categories":["Jazz","Modal"],"attributes":{"year":1959}}"#,
            r#"{"type":"profile","schema_version":1,"event_id":"e5","timestamp":5000,"user_id":"u1","attributes":{"age":31}}"#,
        ];
        let mut b = TableBuilders::default();
        for (i, p) in payloads.iter().enumerate() {
            let e = decode(p.as_bytes()).unwrap();
            b.append(
                &e,
                Provenance {
                    partition: 0,
                    offset: i as i64,
                    ingested_at_ms: 9,
                },
            );
        }
        assert_eq!(b.len(), 5);
        let out = b.finish().unwrap();
        assert!(b.is_empty());
        assert_eq!(out.interactions.as_ref().unwrap().num_rows(), 3);
        assert_eq!(out.items.as_ref().unwrap().num_rows(), 1);
        assert_eq!(out.profiles.as_ref().unwrap().num_rows(), 1);
        assert_eq!(out.num_rows(), 5);
        for (t, batch) in out.iter() {
            assert_eq!(batch.schema(), t.schema());
        }
        // A second finish with nothing appended yields nothing.
        assert_eq!(b.finish().unwrap().num_rows(), 0);
    }

    #[test]
    fn embeddings_are_set_on_the_chosen_rows_and_null_elsewhere() {
        let payloads = [
            r#"{"type":"item","schema_version":1,"event_id":"e1","timestamp":1000,"item_id":"i1","title":"a"}"#,
            r#"{"type":"item","schema_version":1,"event_id":"e2","timestamp":2000,"item_id":"i2","title":"b"}"#,
            r#"{"type":"item","schema_version":1,"event_id":"e3","timestamp":3000,"item_id":"i3","title":"c"}"#,
        ];
        let mut b = TableBuilders::default();
        for (i, p) in payloads.iter().enumerate() {
            let p0 = Provenance {
                partition: 0,
                offset: i as i64,
                ingested_at_ms: 0,
            };
            b.append(&decode(p.as_bytes()).unwrap(), p0);
        }
        let batch = b.finish().unwrap().items.unwrap();
        let col = |batch: &RecordBatch| {
            batch
                .column_by_name("embedding")
                .unwrap()
                .as_any()
                .downcast_ref::<FixedSizeListArray>()
                .unwrap()
                .clone()
        };
        assert_eq!(col(&batch).null_count(), 3);
        let mut v = vec![0.5f32; EMBEDDING_DIM];
        v.extend(vec![-1.0f32; EMBEDDING_DIM]);
        let out = with_embeddings(&batch, &[2, 1], &v).unwrap();
        let e = col(&out);
        assert!(e.is_null(0));
        let row = |r: usize| {
            e.value(r)
                .as_any()
                .downcast_ref::<Float32Array>()
                .unwrap()
                .values()
                .to_vec()
        };
        assert_eq!(row(2), vec![0.5; EMBEDDING_DIM]);
        assert_eq!(row(1), vec![-1.0; EMBEDDING_DIM]);
        // Setting another row keeps the ones already set.
        let again = with_embeddings(&out, &[0], &vec![2.0; EMBEDDING_DIM]).unwrap();
        assert_eq!(col(&again).null_count(), 0);
        assert!(with_embeddings(&batch, &[3], &vec![0.0; EMBEDDING_DIM]).is_err());
        assert!(with_embeddings(&batch, &[0], &[0.0; 3]).is_err());
    }

    #[test]
    fn turn_vectors_carry_the_chosen_turns_with_their_provenance() {
        use arrow_array::cast::AsArray;
        let payloads = [
            r#"{"type":"click","schema_version":1,"event_id":"e1","timestamp":1000,"user_id":"u1","item_id":"i1"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e2","timestamp":2000,"user_id":"u1","session_id":"s","role":"user","text":"hi"}"#,
            r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e3","timestamp":3000,"user_id":"u2","session_id":"s","role":"user","text":"jazz"}"#,
        ];
        let mut b = TableBuilders::default();
        for (i, p) in payloads.iter().enumerate() {
            let p0 = Provenance {
                partition: 1,
                offset: 10 + i as i64,
                ingested_at_ms: 0,
            };
            b.append(&decode(p.as_bytes()).unwrap(), p0);
        }
        let batch = b.finish().unwrap().interactions.unwrap();
        assert!(batch.column_by_name("embedding").is_none());
        let mut v = vec![0.5f32; EMBEDDING_DIM];
        v.extend(vec![-1.0f32; EMBEDDING_DIM]);
        let tv = turn_vectors(&batch, &[2, 1], &v).unwrap();
        assert_eq!(tv.schema(), TableName::TurnVectors.schema());
        let ids: Vec<&str> = tv.column(0).as_string::<i32>().iter().flatten().collect();
        assert_eq!(ids, ["e3", "e2"]);
        let users: Vec<&str> = tv.column(1).as_string::<i32>().iter().flatten().collect();
        assert_eq!(users, ["u2", "u1"]);
        let offsets = tv
            .column_by_name("source_offset")
            .unwrap()
            .as_primitive::<arrow_array::types::Int64Type>();
        assert_eq!(offsets.values().to_vec(), [12, 11]);
        let e = tv.column_by_name("embedding").unwrap().as_fixed_size_list();
        assert_eq!(e.null_count(), 0);
        assert_eq!(
            e.value(0)
                .as_primitive::<arrow_array::types::Float32Type>()
                .values()
                .to_vec(),
            vec![0.5; EMBEDDING_DIM]
        );
        assert!(turn_vectors(&batch, &[3], &vec![0.0; EMBEDDING_DIM]).is_err());
        assert!(turn_vectors(&batch, &[0], &[0.0; 3]).is_err());
        assert_eq!(turn_vectors(&batch, &[], &[]).unwrap().num_rows(), 0);
        // No sparse vectors until they are set; then one row's, one null.
        assert_eq!(tv.column_by_name("terms").unwrap().null_count(), 2);
        let sv = with_sparse_terms(&tv, &[Some((&[3, 9], &[0.5, 2.0])), None]).unwrap();
        assert_eq!(sv.schema(), TableName::TurnVectors.schema());
        let terms = sv.column_by_name("terms").unwrap().as_list::<i32>();
        assert!(terms.is_null(1));
        assert_eq!(
            terms
                .value(0)
                .as_primitive::<arrow_array::types::UInt32Type>()
                .values()
                .to_vec(),
            [3, 9]
        );
        assert!(with_sparse_terms(&tv, &[None]).is_err());
        assert!(with_sparse_terms(&tv, &[Some((&[1], &[])), None]).is_err());
    }
}
