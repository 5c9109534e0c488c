//! The order of this crate's modules, bottom first, and the test that holds
//! the code to it: a module names only modules of lower layers (in its
//! non-test code), so there is no cycle and each layer can be read without
//! the ones above it. ARCHITECTURE.md states the same order.

/// Layers, bottom first; each lists its top-level modules.
const LAYERS: &[(&str, &[&str])] = &[
    ("foundation", &["error", "alloc"]),
    ("settings and telemetry", &["config", "metrics"]),
    ("HTTP", &["http"]),
    ("store", &["sink"]),
    ("stages", &["source", "embed", "steam"]),
    ("forget", &["forget"]),
    ("processes", &["pipeline", "communities", "serve"]),
    ("commands", &["sql", "migrate"]),
];

/// What `lib.rs` re-exports at the crate root, and from where.
const ROOT_NAMES: &[(&str, &str)] = &[
    ("Config", "config"),
    ("Error", "error"),
    ("ErrorKind", "error"),
    ("Result", "error"),
    ("Metrics", "metrics"),
];

/// The module `crate::NAME` is in: NAME itself, or where the root
/// re-export comes from.
fn module_of(name: &str) -> &str {
    ROOT_NAMES
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(name, |(_, from)| from)
}

fn layer_of(module: &str) -> Option<usize> {
    LAYERS.iter().position(|(_, ms)| ms.contains(&module))
}

/// The order as ARCHITECTURE.md writes it: `error, alloc → config, …`.
fn order_line() -> String {
    LAYERS
        .iter()
        .map(|(_, ms)| ms.join(", "))
        .collect::<Vec<_>>()
        .join(" → ")
}

/// The part of `text` that is not the trailing `#[cfg(test)] mod tests`.
fn non_test(text: &str) -> &str {
    let mut at = 0;
    for line in text.split_inclusive('\n') {
        if line.trim() == "#[cfg(test)]"
            && text[at + line.len()..]
                .trim_start()
                .starts_with("mod tests")
        {
            return &text[..at];
        }
        at += line.len();
    }
    text
}

/// The top-level modules `code` names as `crate::NAME`, comments left out.
fn named(code: &str) -> Vec<String> {
    let mut out = Vec::new();
    for line in code.lines() {
        let line = line.split("//").next().unwrap_or_default();
        let mut rest = line;
        while let Some(i) = rest.find("crate::") {
            rest = &rest[i + "crate::".len()..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if !name.is_empty() {
                out.push(name);
            }
        }
    }
    out.sort();
    out.dedup();
    out
}

#[test]
fn no_module_names_one_above_it() {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut files = Vec::new();
    let mut dirs = vec![src.clone()];
    while let Some(d) = dirs.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                dirs.push(p);
            } else if p.extension().is_some_and(|x| x == "rs") {
                files.push(p);
            }
        }
    }
    files.sort();
    let mut problems = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(&src).unwrap().to_string_lossy().into_owned();
        // The crate root, this file and test-only modules.
        if ["lib.rs", "layers.rs"].contains(&rel.as_str()) || rel.ends_with("/tests.rs") {
            continue;
        }
        let module = rel.split(['/', '.']).next().unwrap();
        let Some(mine) = layer_of(module) else {
            problems.push(format!(
                "{rel}: module `{module}` is in no layer (src/layers.rs)"
            ));
            continue;
        };
        let text = std::fs::read_to_string(f).unwrap();
        for name in named(non_test(&text)) {
            let other = module_of(&name);
            match layer_of(other) {
                Some(l) if l < mine || other == module => {}
                Some(l) => problems.push(format!(
                    "{rel} ({}) names crate::{other} ({})",
                    LAYERS[mine].0, LAYERS[l].0
                )),
                None => problems.push(format!("{rel} names crate::{other}, which is in no layer")),
            }
        }
    }
    assert!(
        problems.is_empty(),
        "modules naming one above them (order: {}):\n{}",
        order_line(),
        problems.join("\n")
    );
    let architecture = include_str!("../../ARCHITECTURE.md");
    assert!(
        architecture.contains(&order_line()),
        "ARCHITECTURE.md does not state the layer order `{}`",
        order_line()
    );
}

#[test]
fn the_check_sees_a_module_naming_one_above_it() {
    let code = "use crate::serve::x;\n// crate::pipeline in a comment\nfn f() { crate::error::Error::x(); }\n#[cfg(test)]\nmod tests { use crate::sql; }\n";
    assert_eq!(named(non_test(code)), ["error", "serve"]);
    assert!(layer_of("serve") > layer_of("sink"));
    assert_eq!(module_of("Metrics"), "metrics");
}
