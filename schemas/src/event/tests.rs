use super::*;

fn ok(json: &str) -> Event<'_> {
    decode(json.as_bytes()).unwrap_or_else(|e| panic!("{json} should decode: {e}"))
}

#[track_caller]
fn err(json: &str, kind: DecodeErrorKind, field: &str) -> DecodeError {
    let e = decode(json.as_bytes()).expect_err(json);
    assert_eq!((e.kind, e.field.as_str()), (kind, field), "{json}: {e}");
    e
}

const CLICK: &str = r#"{"type":"click","schema_version":1,"event_id":"e1","timestamp":1700000000000,"user_id":"u1","item_id":"i1"}"#;

#[test]
fn decodes_every_type() {
    match ok(CLICK) {
        Event::Interaction(i) => {
            assert_eq!(i.kind, InteractionKind::Click);
            assert_eq!(
                (&*i.event_id, &*i.user_id, i.item_id.as_deref()),
                ("e1", "u1", Some("i1"))
            );
            assert_eq!(i.timestamp_ms, 1_700_000_000_000);
            assert!(
                matches!(i.event_id, Cow::Borrowed(_)),
                "unescaped strings borrow"
            );
        }
        other => panic!("{other:?}"),
    }
    match ok(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":"2026-11-30T12:00:00+01:00","user_id":"u","item_id":"i","quantity":2,"price":3.5,"currency":"USD"}"#,
    ) {
        Event::Interaction(i) => {
            assert_eq!(i.kind, InteractionKind::Purchase);
            assert_eq!(
                (i.quantity, i.price, i.currency.as_deref()),
                (Some(2), Some(3.5), Some("USD"))
            );
            assert_eq!(i.timestamp_ms, 1_796_036_400_000);
        }
        other => panic!("{other:?}"),
    }
    match ok(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
    ) {
        Event::Interaction(i) => assert_eq!(i.quantity, Some(1), "quantity defaults to 1"),
        other => panic!("{other:?}"),
    }
    match ok(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"assistant","text":"Try \"Blue Train\"."}"#,
    ) {
        Event::Interaction(i) => {
            assert_eq!(i.role, Some(Role::Assistant));
            assert_eq!(i.text.as_deref(), Some("Try \"Blue Train\"."));
        }
        other => panic!("{other:?}"),
    }
    match ok(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"T","categories":["A","B"],"description":"d","attributes":{"year":1959,"tags":["x"]}}"#,
    ) {
        Event::Item(i) => {
            assert_eq!(i.categories, vec!["A", "B"]);
            assert_eq!(
                i.attributes.as_deref(),
                Some(r#"{"year":1959,"tags":["x"]}"#)
            );
        }
        other => panic!("{other:?}"),
    }
    match ok(
        r#"{"type":"profile","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","attributes":{"age":30}}"#,
    ) {
        Event::Profile(p) => assert_eq!(p.attributes.as_deref(), Some(r#"{"age":30}"#)),
        other => panic!("{other:?}"),
    }
}

#[test]
fn unknown_fields_are_ignored() {
    ok(
        r#"{"type":"click","schema_version":1,"event_id":"e1","timestamp":1,"user_id":"u1","item_id":"i1","page":"home","x":{"y":[1,2]}}"#,
    );
}

#[test]
fn invalid_json_and_non_objects() {
    err("{not json", DecodeErrorKind::InvalidJson, "");
    err("", DecodeErrorKind::InvalidJson, "");
    err("[1,2]", DecodeErrorKind::InvalidJson, "");
    err("\"click\"", DecodeErrorKind::InvalidJson, "");
    err(
        &format!("{CLICK} trailing"),
        DecodeErrorKind::InvalidJson,
        "",
    );
    let mut bad_utf8 = br#"{"type":"click","schema_version":1,"event_id":""#.to_vec();
    bad_utf8.extend([0xff, 0xfe]);
    bad_utf8.extend(br#"","timestamp":1,"user_id":"u","item_id":"i"}"#);
    let e = decode(&bad_utf8).unwrap_err();
    assert_eq!(e.kind, DecodeErrorKind::InvalidJson, "{e}");
    assert!(e.reason.contains("invalid UTF-8 at byte 47"), "{e}");
}

#[test]
fn wrong_types_name_the_field() {
    let e = err(
        r#"{"type":"click","schema_version":1,"event_id":5,"timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "event_id",
    );
    assert!(e.reason.contains("invalid type"), "{e}");
    err(
        r#"{"type":"click","schema_version":"1","event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "schema_version",
    );
    err(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"t","categories":["a",3]}"#,
        DecodeErrorKind::InvalidField,
        "categories[1]",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":true,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","event_id":"f","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "event_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":1e400}"#,
        DecodeErrorKind::InvalidJson,
        "",
    );
}

#[test]
fn missing_fields() {
    err(
        r#"{"schema_version":1,"event_id":"e","timestamp":1}"#,
        DecodeErrorKind::MissingField,
        "type",
    );
    err(
        r#"{"type":"click","event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "schema_version",
    );
    err(
        r#"{"type":"click","schema_version":1,"timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "event_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "user_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":null,"item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "user_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u"}"#,
        DecodeErrorKind::MissingField,
        "item_id",
    );
    err(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u"}"#,
        DecodeErrorKind::MissingField,
        "item_id",
    );
    err(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","role":"user","text":"t"}"#,
        DecodeErrorKind::MissingField,
        "session_id",
    );
    err(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","text":"t"}"#,
        DecodeErrorKind::MissingField,
        "role",
    );
    err(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"user"}"#,
        DecodeErrorKind::MissingField,
        "text",
    );
    err(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"title":"t"}"#,
        DecodeErrorKind::MissingField,
        "item_id",
    );
    err(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i"}"#,
        DecodeErrorKind::MissingField,
        "title",
    );
    err(
        r#"{"type":"profile","schema_version":1,"event_id":"e","timestamp":1}"#,
        DecodeErrorKind::MissingField,
        "user_id",
    );
}

#[test]
fn invalid_values() {
    err(
        r#"{"type":"like","schema_version":1,"event_id":"e","timestamp":1}"#,
        DecodeErrorKind::UnknownType,
        "type",
    );
    err(
        r#"{"type":"click","schema_version":2,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::UnsupportedVersion,
        "schema_version",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "event_id",
    );
    let long = "x".repeat(MAX_ID_BYTES + 1);
    err(
        &format!(
            r#"{{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"{long}","item_id":"i"}}"#
        ),
        DecodeErrorKind::InvalidField,
        "user_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e\n","timestamp":1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "event_id",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":-1,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":99999999999999999,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":18446744073709551615,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1.5,"user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":"yesterday","user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":"2300-01-01T00:00:00Z","user_id":"u","item_id":"i"}"#,
        DecodeErrorKind::InvalidField,
        "timestamp",
    );
    err(
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":1e39}"#,
        DecodeErrorKind::InvalidField,
        "rating",
    );
    err(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","quantity":0}"#,
        DecodeErrorKind::InvalidField,
        "quantity",
    );
    err(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","price":-1}"#,
        DecodeErrorKind::InvalidField,
        "price",
    );
    err(
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","currency":"euro"}"#,
        DecodeErrorKind::InvalidField,
        "currency",
    );
    err(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"bot","text":"t"}"#,
        DecodeErrorKind::InvalidField,
        "role",
    );
    err(
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"user","text":"  "}"#,
        DecodeErrorKind::InvalidField,
        "text",
    );
    err(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"t","categories":["a",""]}"#,
        DecodeErrorKind::InvalidField,
        "categories[1]",
    );
    err(
        r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"t","attributes":[1]}"#,
        DecodeErrorKind::InvalidField,
        "attributes",
    );
    err(
        r#"{"type":"profile","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","attributes":"old"}"#,
        DecodeErrorKind::InvalidField,
        "attributes",
    );
}

#[test]
fn error_display_names_field_and_reason() {
    let e = decode(
        br#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i"}"#,
    )
    .unwrap_err();
    assert_eq!(
        e.to_string(),
        "missing_field: field `user_id`: required field is missing"
    );
    assert_eq!(
        DecodeError::oversize(10, 5).to_string(),
        "oversize: payload is 10 bytes, more than max_event_bytes = 5"
    );
}

#[test]
fn never_panics_on_arbitrary_bytes() {
    // A cheap deterministic fuzz: every prefix and single-byte corruption of a valid event.
    let base = br#"{"type":"item","schema_version":1,"event_id":"e","timestamp":"2026-01-01T00:00:00Z","item_id":"i","title":"t","categories":["a"],"attributes":{"k":[1,{"z":null}]}}"#;
    for n in 0..=base.len() {
        assert!(decode(&base[..n]).is_ok() || n < base.len());
    }
    for i in 0..base.len() {
        for b in [0u8, b'"', b'{', b'}', b'\\', 0xff, b'9', b','] {
            let mut v = base.to_vec();
            v[i] = b;
            std::hint::black_box(decode(&v).is_ok());
        }
    }
}

#[test]
fn forget_names_the_user_and_nothing_else_is_required() {
    match ok(
        r#"{"type":"forget","schema_version":1,"event_id":"f1","timestamp":1700000000000,"user_id":"alice"}"#,
    ) {
        Event::Forget(f) => {
            assert_eq!((&*f.event_id, &*f.user_id), ("f1", "alice"));
        }
        other => panic!("{other:?}"),
    }
    err(
        r#"{"type":"forget","schema_version":1,"event_id":"f1","timestamp":1700000000000}"#,
        DecodeErrorKind::MissingField,
        "user_id",
    );
    err(
        r#"{"type":"forget","schema_version":1,"event_id":"f1","timestamp":1700000000000,"user_id":""}"#,
        DecodeErrorKind::InvalidField,
        "user_id",
    );
}

#[test]
fn the_byte_scan_for_control_characters_agrees_with_char_is_control_for_every_char() {
    for c in (0..=0x10_ffff).filter_map(char::from_u32) {
        let s = format!("a{c}é{c}");
        assert_eq!(has_control(&s), c.is_control(), "U+{:04X}", c as u32);
    }
    assert!(!has_control("user-42 ¢ ÂÂ"));
}

/// Payloads at the edges of the fast path: each must decode exactly as
/// serde alone decodes it.
const EDGES: &[&str] = &[
    CLICK,
    r#"{}"#,
    r#" { } "#,
    r#"{"type":"click"}"#,
    r#"{"type":null,"schema_version":1}"#,
    r#"{"type":"click","type":"click"}"#,
    r#"{"type":"click","type":null}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e\"1","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e\u0041","timestamp":1,"user_id":"u","item_id":"i"}"#,
    "{\"type\":\"click\",\"schema_version\":1,\"event_id\":\"e\x01\",\"timestamp\":1,\"user_id\":\"u\",\"item_id\":\"i\"}",
    r#"{"type":"click","schema_version":1.0,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":-1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":01,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":18446744073709551616,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":-0,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1.0,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1e3,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":"2026-11-30T12:00:00Z","user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":"yesterday","user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":999999999999999999,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":-0}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":0.1}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":123456789.012345}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":1234567890.0123456}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":1.}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","rating":"4"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","extra":{"a":1}}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","extra":[true,false,null]}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","extra":true,"more":nul}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","x":-12.5,"y":"\n"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i",}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"} x"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i"}{}"#,
    "{\"type\":\"click\",\t\"schema_version\" :\r\n1 ,\"event_id\":\"é\",\"timestamp\":1,\"user_id\":\"u\",\"item_id\":\"i\"}",
    r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","quantity":3,"price":19.99,"currency":"EUR"}"#,
    r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","quantity":3.0}"#,
    r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","quantity":-3}"#,
    r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","price":-1.5}"#,
    r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"user","text":"hi there"}"#,
    r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"robot","text":"  "}"#,
    r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"T","categories":["a","b"],"attributes":{"k":1}}"#,
    r#"{"type":"item","schema_version":1,"event_id":"e","timestamp":1,"item_id":"i","title":"T","description":"d","categories":null}"#,
    r#"{"type":"profile","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","attributes":null}"#,
    r#"{"type":"forget","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"","timestamp":1,"user_id":"u","item_id":"i"}"#,
    r#"{"type":"click" "schema_version":1}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":5,"item_id":"i"}"#,
    r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i""#,
    r#"{"type""#,
    r#"{"#,
];

#[test]
fn the_fast_path_decodes_as_serde_does() {
    for json in EDGES {
        assert_eq!(
            decode(json.as_bytes()),
            decode_slow(json.as_bytes()),
            "{json}"
        );
    }
    // The usual events take the fast path.
    for json in [
        CLICK,
        r#"{"type":"click","schema_version":1,"event_id":"e","timestamp":"2026-11-30T12:00:00Z","user_id":"u","item_id":"i","rating":4.5}"#,
        r#"{"type":"purchase","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","item_id":"i","quantity":3,"price":19.99,"currency":"EUR"}"#,
        r#"{"type":"dialogue_turn","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u","session_id":"s","role":"user","text":"hi there","client":"web"}"#,
        r#"{"type":"forget","schema_version":1,"event_id":"e","timestamp":1,"user_id":"u"}"#,
    ] {
        assert!(fast::parse(json).is_some(), "{json}");
        assert!(decode(json.as_bytes()).is_ok(), "{json}");
    }
}

/// Random edits of a click (bytes replaced, inserted, deleted, from a
/// fixed seed) decode through both paths alike.
#[test]
fn edited_clicks_decode_as_serde_does() {
    let base = br#"{"type":"click","schema_version":1,"event_id":"bench-000000000042","timestamp":1764000000042,"user_id":"user-000042","item_id":"item-0332598","session_id":"s-2","rating":4.0}"#;
    let alphabet = b"{}[]\":,.-+eE0123456789 \\tnrufalsx\x01\xc3\xa9";
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = |n: usize| {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        usize::try_from(state % n as u64).unwrap()
    };
    let mut fast_taken = 0;
    for _ in 0..50_000 {
        let mut p = base.to_vec();
        for _ in 0..=next(3) {
            let at = next(p.len());
            let c = alphabet[next(alphabet.len())];
            match next(3) {
                0 => p[at] = c,
                1 => p.insert(at, c),
                _ => {
                    p.remove(at);
                }
            }
        }
        assert_eq!(
            decode(&p),
            decode_slow(&p),
            "{}",
            String::from_utf8_lossy(&p)
        );
        if let Ok(text) = std::str::from_utf8(&p) {
            fast_taken += usize::from(fast::parse(text).is_some());
        }
    }
    // Most edits stay in the fast path's reach (an edit inside a string).
    assert!(fast_taken > 10_000, "{fast_taken}");
}

#[test]
fn an_event_stamped_past_the_allowed_skew_is_refused_on_timestamp() {
    let at = |ts: i64| {
        format!(
            r#"{{"type":"click","schema_version":1,"event_id":"e","timestamp":{ts},"user_id":"u","item_id":"i"}}"#
        )
    };
    let now = 1_764_000_000_000;
    let hour = 3_600_000;
    for ok in [now - 86_400_000, now, now + hour] {
        let line = at(ok);
        decode(line.as_bytes())
            .unwrap()
            .check_not_ahead(now, hour)
            .unwrap();
    }
    let line = at(now + hour + 1);
    let e = decode(line.as_bytes())
        .unwrap()
        .check_not_ahead(now, hour)
        .unwrap_err();
    assert_eq!(e.kind, DecodeErrorKind::InvalidField);
    assert_eq!(e.field, "timestamp");
    assert!(e.reason.contains("max_future_skew"), "{}", e.reason);
}
