//! The decoder's fast path: a scanner for the flat JSON object nearly every
//! event is, yielding the same [`Raw`] record serde would.
//!
//! It accepts only what it can read exactly as serde_json does: an object
//! whose keys and string values carry no escapes or control characters,
//! whose numbers are plain (no exponent, at most 15 digits), and whose
//! values are strings, numbers, `true`, `false` or `null`. Anything else
//! (an escape, a nested value, a duplicate key, a value of the wrong type,
//! invalid JSON) makes it answer `None`, and the payload takes the serde
//! path, which also writes every error message. So it changes no result,
//! only the cost of the usual one: the fuzz target `decode_event` checks
//! that [`super::decode`] and [`super::decode_slow`] agree on every input.
//!
//! Bench clicks (~200 bytes) decode in ~0.6× the time serde takes
//! (`steamrf bench decode`, validation included); decoding through serde was
//! a fifth of ingest's CPU.

use std::borrow::Cow;

use super::{Raw, Str, Timestamp, rfc3339_ms};

/// Reads `text` as a flat event object, or `None` to leave it to serde.
pub(super) fn parse(text: &str) -> Option<Raw<'_>> {
    let b = text.as_bytes();
    let mut i = skip_ws(b, 0);
    if b.get(i) != Some(&b'{') {
        return None;
    }
    i = skip_ws(b, i + 1);
    let mut raw = Raw::default();
    let mut seen = 0u32;
    if b.get(i) == Some(&b'}') {
        i += 1;
    } else {
        loop {
            let (key, after) = string(text, i)?;
            i = skip_ws(b, after);
            if b.get(i) != Some(&b':') {
                return None;
            }
            i = skip_ws(b, i + 1);
            let field = Field::of(key);
            if let Some(f) = field {
                // serde rejects a repeated field, even one that was `null`.
                let bit = 1u32 << (f as u32);
                if seen & bit != 0 {
                    return None;
                }
                seen |= bit;
            }
            i = value(text, i, field, &mut raw)?;
            i = skip_ws(b, i);
            match b.get(i) {
                Some(b',') => i = skip_ws(b, i + 1),
                Some(b'}') => {
                    i += 1;
                    break;
                }
                _ => return None,
            }
        }
    }
    (skip_ws(b, i) == b.len()).then_some(raw)
}

/// The fields of [`Raw`] the fast path fills.
#[derive(Clone, Copy)]
enum Field {
    Type,
    SchemaVersion,
    EventId,
    Timestamp,
    UserId,
    ItemId,
    SessionId,
    Rating,
    Quantity,
    Price,
    Currency,
    Role,
    Text,
    Title,
    Description,
    /// `categories` and `attributes`: nested values, left to serde.
    Nested,
}

impl Field {
    fn of(key: &str) -> Option<Self> {
        Some(match key {
            "type" => Self::Type,
            "schema_version" => Self::SchemaVersion,
            "event_id" => Self::EventId,
            "timestamp" => Self::Timestamp,
            "user_id" => Self::UserId,
            "item_id" => Self::ItemId,
            "session_id" => Self::SessionId,
            "rating" => Self::Rating,
            "quantity" => Self::Quantity,
            "price" => Self::Price,
            "currency" => Self::Currency,
            "role" => Self::Role,
            "text" => Self::Text,
            "title" => Self::Title,
            "description" => Self::Description,
            "categories" | "attributes" => Self::Nested,
            _ => return None,
        })
    }
}

/// Reads the value at `i` into `field` of `raw` (an unknown field's value is
/// skipped); returns the index after it.
fn value<'a>(text: &'a str, i: usize, field: Option<Field>, raw: &mut Raw<'a>) -> Option<usize> {
    let b = text.as_bytes();
    if b[i..].starts_with(b"null") {
        // `null` is an absent optional field; every Raw field is optional.
        return match field {
            Some(Field::Nested) => None,
            _ => Some(i + 4),
        };
    }
    let Some(field) = field else {
        // An unknown field: skipped when it is a scalar.
        return match b.get(i)? {
            b'"' => string(text, i).map(|(_, end)| end),
            b't' if b[i..].starts_with(b"true") => Some(i + 4),
            b'f' if b[i..].starts_with(b"false") => Some(i + 5),
            _ => number(b, i).map(|n| n.end),
        };
    };
    let slot = match field {
        Field::Type => &mut raw.kind,
        Field::EventId => &mut raw.event_id,
        Field::UserId => &mut raw.user_id,
        Field::ItemId => &mut raw.item_id,
        Field::SessionId => &mut raw.session_id,
        Field::Currency => &mut raw.currency,
        Field::Role => &mut raw.role,
        Field::Text => &mut raw.text,
        Field::Title => &mut raw.title,
        Field::Description => &mut raw.description,
        Field::SchemaVersion => {
            let n = number(b, i)?;
            raw.schema_version = Some(n.unsigned()?);
            return Some(n.end);
        }
        Field::Quantity => {
            let n = number(b, i)?;
            raw.quantity = Some(i64::try_from(n.unsigned()?).ok()?);
            return Some(n.end);
        }
        Field::Timestamp => {
            if b.get(i) == Some(&b'"') {
                let (s, end) = string(text, i)?;
                raw.timestamp = Some(Timestamp(rfc3339_ms(s)));
                return Some(end);
            }
            let n = number(b, i)?;
            raw.timestamp = Some(Timestamp(Ok(i64::try_from(n.unsigned()?).ok()?)));
            return Some(n.end);
        }
        Field::Rating | Field::Price => {
            let n = number(b, i)?;
            let v = n.float()?;
            if matches!(field, Field::Rating) {
                raw.rating = Some(v);
            } else {
                raw.price = Some(v);
            }
            return Some(n.end);
        }
        Field::Nested => return None,
    };
    let (s, end) = string(text, i)?;
    *slot = Some(Str(Cow::Borrowed(s)));
    Some(end)
}

/// The string starting with the quote at `i`, when it has no escapes and
/// no control characters, and the index after its closing quote.
fn string(text: &str, i: usize) -> Option<(&str, usize)> {
    let b = text.as_bytes();
    if b.get(i) != Some(&b'"') {
        return None;
    }
    let end = stop(b, i + 1)?;
    // Escapes and control characters are serde's to handle (or reject).
    (b[end] == b'"').then(|| (&text[i + 1..end], end + 1))
}

/// The index of the first `"`, `\\` or control character at or after
/// `from`, eight bytes at a time: in each word, the lowest byte the bit
/// tricks flag is the first match (a false flag only ever sits above a
/// true one, where a borrow carried).
fn stop(b: &[u8], from: usize) -> Option<usize> {
    const ONES: u64 = 0x0101_0101_0101_0101;
    const HIGH: u64 = 0x8080_8080_8080_8080;
    let zero_byte = |v: u64| v.wrapping_sub(ONES) & !v;
    let mut i = from;
    while let Some(word) = b.get(i..i + 8) {
        let x = u64::from_le_bytes(word.try_into().expect("eight bytes"));
        let hits = (zero_byte(x ^ (ONES * u64::from(b'"')))
            | zero_byte(x ^ (ONES * u64::from(b'\\')))
            | (x.wrapping_sub(ONES * 0x20) & !x))
            & HIGH;
        if hits != 0 {
            return Some(i + (hits.trailing_zeros() / 8) as usize);
        }
        i += 8;
    }
    b[i..]
        .iter()
        .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
        .map(|p| i + p)
}

/// A JSON number token: `-? (0 | [1-9][0-9]*) (. [0-9]+)?`, without an
/// exponent (that is serde's to read).
struct Number {
    negative: bool,
    /// Its digits as one integer, the `.` ignored (meaningful up to 19
    /// digits; both readers below take fewer).
    significand: u64,
    /// Digits in the token.
    digits: usize,
    /// Digits after the `.`.
    fraction: usize,
    end: usize,
}

impl Number {
    /// Its value, when it is a non-negative integer of at most 18 digits:
    /// what serde reads as a `u64` and what fits an `i64` too.
    fn unsigned(&self) -> Option<u64> {
        (!self.negative && self.fraction == 0 && self.digits <= 18).then_some(self.significand)
    }

    /// Its value as serde reads it into an `f64`, for at most 15 digits:
    /// the significand (below 2^53, so exact as an `f64`) divided by an
    /// exact power of ten, one correctly rounded operation, which is what
    /// serde computes (with or without `float_roundtrip`) and what `str::parse`
    /// returns.
    fn float(&self) -> Option<f64> {
        const POW10: [f64; 16] = [
            1e0, 1e1, 1e2, 1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9, 1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
        ];
        if self.digits > 15 {
            return None;
        }
        #[allow(clippy::cast_precision_loss)]
        let v = self.significand as f64 / POW10[self.fraction];
        Some(if self.negative { -v } else { v })
    }
}

/// The number token at `i`, when it is one this path reads.
fn number(b: &[u8], i: usize) -> Option<Number> {
    let negative = b.get(i) == Some(&b'-');
    let mut j = i + usize::from(negative);
    let mut significand = 0u64;
    let mut digits_from = |j: &mut usize| {
        let start = *j;
        while let Some(d) = b.get(*j).filter(|d| d.is_ascii_digit()) {
            significand = significand
                .wrapping_mul(10)
                .wrapping_add(u64::from(d - b'0'));
            *j += 1;
        }
        *j - start
    };
    let int_start = j;
    let int_digits = digits_from(&mut j);
    // JSON has no leading zeros ("01") and needs a digit.
    if int_digits == 0 || (int_digits > 1 && b[int_start] == b'0') {
        return None;
    }
    let mut fraction = 0;
    if b.get(j) == Some(&b'.') {
        j += 1;
        fraction = digits_from(&mut j);
        if fraction == 0 {
            return None;
        }
    }
    if matches!(b.get(j), Some(b'e' | b'E')) {
        return None;
    }
    Some(Number {
        negative,
        significand,
        digits: int_digits + fraction,
        fraction,
        end: j,
    })
}

fn skip_ws(b: &[u8], mut i: usize) -> usize {
    while matches!(b.get(i), Some(b' ' | b'\t' | b'\n' | b'\r')) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    #[test]
    fn plain_decimals_read_as_the_standard_library_reads_them() {
        let mut state = 0x2545_F491_4F6C_DD1Du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..200_000 {
            let digits = 1 + (next() % 15) as usize;
            let int = 1 + (next() % digits as u64) as usize;
            let mut t = String::new();
            if next() % 2 == 0 {
                t.push('-');
            }
            for k in 0..digits {
                if k == int {
                    t.push('.');
                }
                // No leading zero unless the integer part is "0".
                let d = if k == 0 && int > 1 {
                    1 + next() % 9
                } else {
                    next() % 10
                };
                t.push(char::from(b'0' + d as u8));
            }
            let b = t.as_bytes();
            let n = super::number(b, 0).unwrap_or_else(|| panic!("{t}"));
            assert_eq!(n.end, b.len(), "{t}");
            let v = n.float().unwrap();
            assert_eq!(v.to_bits(), t.parse::<f64>().unwrap().to_bits(), "{t}");
        }
    }

    #[test]
    fn the_word_scan_finds_what_a_byte_scan_finds() {
        let naive = |b: &[u8], from: usize| {
            b[from..]
                .iter()
                .position(|&c| c == b'"' || c == b'\\' || c < 0x20)
                .map(|p| from + p)
        };
        // Every stop byte, and the bytes next to them, at every offset of
        // words of every length up to 24, behind each kind of neighbour.
        let bytes = [
            b'"', b'\\', 0x00, 0x1f, 0x20, 0x21, 0x5b, 0x5d, 0x7f, 0x80, 0xc3, 0xff, b'a',
        ];
        for len in 0..24 {
            for at in 0..len {
                for &c in &bytes {
                    for &fill in &[b'a', 0xff, 0x20, 0x80] {
                        let mut b = vec![fill; len];
                        b[at] = c;
                        for from in 0..=len {
                            assert_eq!(super::stop(&b, from), naive(&b, from), "{b:?} from {from}");
                        }
                    }
                }
            }
        }
    }
}
