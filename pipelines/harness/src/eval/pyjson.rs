//! An order-preserving JSON reader and a writer that reproduces Python's
//! `json.dumps(value, separators=(',', ':'))` (keys in file order, non-ASCII
//! escaped as `\uXXXX`), so evaluation corpora are byte-identical to the
//! ones the papers' official code builds. `serde_json` sorts keys unless a
//! crate-wide feature is switched on, which would change every dependent.

/// A JSON value with object keys in document order. Numbers keep their text.
#[derive(Debug, Clone, PartialEq)]
pub enum Json {
    /// `null`
    Null,
    /// `true` / `false`
    Bool(bool),
    /// A number, as written.
    Num(String),
    /// A string.
    Str(String),
    /// An array.
    Arr(Vec<Json>),
    /// An object, keys in document order.
    Obj(Vec<(String, Json)>),
}

impl Json {
    /// The value under `key` of an object.
    pub fn get(&self, key: &str) -> Option<&Json> {
        match self {
            Self::Obj(kv) => kv.iter().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }

    /// The elements of an array (empty for anything else).
    pub fn items(&self) -> &[Json] {
        match self {
            Self::Arr(a) => a,
            _ => &[],
        }
    }

    /// The string, if this is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Self::Str(s) => Some(s),
            _ => None,
        }
    }

    /// This value with every object key in `drop` removed, recursively.
    pub fn without(&self, drop: &[&str]) -> Json {
        match self {
            Self::Arr(a) => Self::Arr(a.iter().map(|v| v.without(drop)).collect()),
            Self::Obj(kv) => Self::Obj(
                kv.iter()
                    .filter(|(k, _)| !drop.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.without(drop)))
                    .collect(),
            ),
            other => other.clone(),
        }
    }

    /// Python's `json.dumps(self, separators=(',', ':'))`.
    pub fn dumps(&self) -> String {
        let mut out = String::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut String) {
        match self {
            Self::Null => out.push_str("null"),
            Self::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Self::Num(n) => out.push_str(n),
            Self::Str(s) => write_str(s, out),
            Self::Arr(a) => {
                out.push('[');
                for (i, v) in a.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    v.write(out);
                }
                out.push(']');
            }
            Self::Obj(kv) => {
                out.push('{');
                for (i, (k, v)) in kv.iter().enumerate() {
                    if i > 0 {
                        out.push(',');
                    }
                    write_str(k, out);
                    out.push(':');
                    v.write(out);
                }
                out.push('}');
            }
        }
    }
}

fn write_str(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 || (c as u32) > 0x7e => {
                let mut buf = [0u16; 2];
                for unit in c.encode_utf16(&mut buf) {
                    out.push_str(&format!("\\u{unit:04x}"));
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Parses one JSON document.
///
/// # Errors
/// A message with the byte offset of the first problem.
pub fn parse(text: &str) -> Result<Json, String> {
    let mut p = Parser {
        b: text.as_bytes(),
        i: 0,
    };
    let v = p.value()?;
    p.ws();
    if p.i != p.b.len() {
        return Err(format!("trailing data at byte {}", p.i));
    }
    Ok(v)
}

struct Parser<'a> {
    b: &'a [u8],
    i: usize,
}

impl Parser<'_> {
    fn ws(&mut self) {
        while self.i < self.b.len() && matches!(self.b[self.i], b' ' | b'\n' | b'\r' | b'\t') {
            self.i += 1;
        }
    }

    fn err<T>(&self, what: &str) -> Result<T, String> {
        Err(format!("{what} at byte {}", self.i))
    }

    fn eat(&mut self, lit: &str) -> bool {
        if self.b[self.i..].starts_with(lit.as_bytes()) {
            self.i += lit.len();
            true
        } else {
            false
        }
    }

    fn value(&mut self) -> Result<Json, String> {
        self.ws();
        match self.b.get(self.i) {
            None => self.err("unexpected end"),
            Some(b'{') => {
                self.i += 1;
                let mut kv = Vec::new();
                self.ws();
                if self.eat("}") {
                    return Ok(Json::Obj(kv));
                }
                loop {
                    self.ws();
                    let k = self.string()?;
                    self.ws();
                    if !self.eat(":") {
                        return self.err("expected ':'");
                    }
                    let v = self.value()?;
                    kv.push((k, v));
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("}") {
                        return Ok(Json::Obj(kv));
                    }
                    return self.err("expected ',' or '}'");
                }
            }
            Some(b'[') => {
                self.i += 1;
                let mut a = Vec::new();
                self.ws();
                if self.eat("]") {
                    return Ok(Json::Arr(a));
                }
                loop {
                    a.push(self.value()?);
                    self.ws();
                    if self.eat(",") {
                        continue;
                    }
                    if self.eat("]") {
                        return Ok(Json::Arr(a));
                    }
                    return self.err("expected ',' or ']'");
                }
            }
            Some(b'"') => Ok(Json::Str(self.string()?)),
            Some(_) if self.eat("null") => Ok(Json::Null),
            Some(_) if self.eat("true") => Ok(Json::Bool(true)),
            Some(_) if self.eat("false") => Ok(Json::Bool(false)),
            Some(_) => {
                let start = self.i;
                while self.i < self.b.len()
                    && matches!(
                        self.b[self.i],
                        b'-' | b'+' | b'.' | b'e' | b'E' | b'0'..=b'9'
                    )
                {
                    self.i += 1;
                }
                if start == self.i {
                    return self.err("unexpected character");
                }
                Ok(Json::Num(
                    String::from_utf8_lossy(&self.b[start..self.i]).into_owned(),
                ))
            }
        }
    }

    fn string(&mut self) -> Result<String, String> {
        if !self.eat("\"") {
            return self.err("expected a string");
        }
        let mut out = String::new();
        let mut units: Vec<u16> = Vec::new();
        loop {
            let Some(&c) = self.b.get(self.i) else {
                return self.err("unterminated string");
            };
            if c == b'\\' {
                let Some(&e) = self.b.get(self.i + 1) else {
                    return self.err("unterminated escape");
                };
                self.i += 2;
                if e == b'u' {
                    let hex = std::str::from_utf8(self.b.get(self.i..self.i + 4).unwrap_or(b""))
                        .ok()
                        .and_then(|h| u16::from_str_radix(h, 16).ok());
                    let Some(u) = hex else {
                        return self.err("bad \\u escape");
                    };
                    self.i += 4;
                    units.push(u);
                    continue;
                }
                flush(&mut units, &mut out);
                out.push(match e {
                    b'"' => '"',
                    b'\\' => '\\',
                    b'/' => '/',
                    b'b' => '\u{8}',
                    b'f' => '\u{c}',
                    b'n' => '\n',
                    b'r' => '\r',
                    b't' => '\t',
                    _ => return self.err("bad escape"),
                });
                continue;
            }
            flush(&mut units, &mut out);
            if c == b'"' {
                self.i += 1;
                return Ok(out);
            }
            // A run of plain bytes (valid UTF-8, as the input is a &str).
            let start = self.i;
            while self.i < self.b.len() && self.b[self.i] != b'"' && self.b[self.i] != b'\\' {
                self.i += 1;
            }
            out.push_str(&String::from_utf8_lossy(&self.b[start..self.i]));
        }
    }
}

fn flush(units: &mut Vec<u16>, out: &mut String) {
    if !units.is_empty() {
        out.push_str(&String::from_utf16_lossy(units));
        units.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dumps_like_python() {
        // json.dumps(json.loads(t), separators=(",", ":")) in Python 3. Numbers
        // keep their text (Python re-formats floats such as 1e2; PersonaBench
        // has plain decimals only).
        let t = r#"{"b": 1, "a": [true, null, 2.5, -3.25], "s": "caf\u00e9 \"q\" \\ \n\ud83d\ude00 é", "segment_id": "x", "o": {"session": 1, "k": "v"}}"#;
        let v = parse(t).unwrap();
        assert_eq!(
            v.dumps(),
            r#"{"b":1,"a":[true,null,2.5,-3.25],"s":"caf\u00e9 \"q\" \\ \n\ud83d\ude00 \u00e9","segment_id":"x","o":{"session":1,"k":"v"}}"#
        );
        assert_eq!(
            v.without(&["segment_id", "session"]).dumps(),
            r#"{"b":1,"a":[true,null,2.5,-3.25],"s":"caf\u00e9 \"q\" \\ \n\ud83d\ude00 \u00e9","o":{"k":"v"}}"#
        );
        assert_eq!(v.get("b"), Some(&Json::Num("1".into())));
        assert!(parse("{\"a\": 1,}").is_err());
        assert!(parse("[1] x").is_err());
    }
}
