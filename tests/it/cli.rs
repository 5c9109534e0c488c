//! What a user meets at the command line (issue 49): a failing command says
//! each cause once, one per line, and exits with a documented code.

use std::path::Path;
use std::process::Command;

use crate::support::*;

/// `steamrf ARGS` in `dir`, logs off: exit code, stdout, stderr.
fn steamrf(dir: &Path, args: &[&str]) -> (i32, String, String) {
    let out = Command::new(steamrf_bin())
        .current_dir(dir)
        .args(args)
        .env("STEAMRF_LOG", "off")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `stderr` is one `error: …` (with its continuation lines) and then
/// `  caused by: …` lines, none of which repeats what an earlier one said.
fn assert_each_cause_once(stderr: &str) {
    let mut said: Vec<String> = Vec::new();
    for line in stderr.lines() {
        if let Some(first) = line.strip_prefix("error: ") {
            assert!(said.is_empty(), "a second error line:\n{stderr}");
            said.push(first.to_owned());
        } else if let Some(cause) = line.strip_prefix("  caused by: ") {
            assert!(
                !said.iter().any(|s| s.contains(cause.trim())),
                "{cause:?} was already said:\n{stderr}"
            );
            said.push(cause.to_owned());
        } else {
            // A multi-line message (a configuration's problems).
            let last = said.last_mut().expect("stderr starts with error:");
            last.push('\n');
            last.push_str(line);
        }
    }
    assert!(!said.is_empty(), "no error printed");
}

#[test]
fn failing_commands_say_each_cause_once_and_exit_with_documented_codes() {
    let dir = tempfile::tempdir().unwrap();
    let lance = dir.path().join("lancedb");
    std::fs::create_dir_all(&lance).unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(
        &config,
        format!("[lancedb]\nuri = {:?}\n", lance.display().to_string()),
    )
    .unwrap();
    let c = config.to_str().unwrap();

    // Bad SQL: the planner's message once (it was printed four times).
    let (code, _, err) = steamrf(dir.path(), &["sql", "--config", c, "SELECT nope"]);
    assert_eq!(code, 1, "{err}");
    assert_each_cause_once(&err);
    assert_eq!(err.matches("No field named nope").count(), 1, "{err}");

    // A table that is not there (three times before).
    let (code, _, err) = steamrf(
        dir.path(),
        &["sql", "--config", c, "SELECT count(*) FROM prototypes"],
    );
    assert_eq!(code, 1, "{err}");
    assert_each_cause_once(&err);
    assert_eq!(err.matches("not found").count(), 1, "{err}");

    // A bad configuration: every problem, exit 2, from validate and run.
    let bad = dir.path().join("bad.toml");
    std::fs::write(&bad, "[serve]\nmax_k = 0\nbogus = 1\n").unwrap();
    let b = bad.to_str().unwrap();
    let (code, _, err) = steamrf(dir.path(), &["validate", b]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("bogus"), "{err}");
    let (code, _, err) = steamrf(dir.path(), &["run", "--config", b]);
    assert_eq!(code, 2, "{err}");
    assert!(err.starts_with("error: invalid configuration"), "{err}");
    assert_each_cause_once(&err);

    // A valid file: ok, no Debug dump; --print gives TOML that loads back.
    let (code, out, err) = steamrf(dir.path(), &["validate", c]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(out.trim(), format!("{c}: ok"));
    let (code, out, err) = steamrf(dir.path(), &["validate", "--print", c]);
    assert_eq!(code, 0, "{err}");
    assert!(
        !out.contains("Config {") && out.contains("[serve.rfmem]"),
        "{out}"
    );
    let printed = dir.path().join("printed.toml");
    std::fs::write(&printed, out.split_once('\n').unwrap().1).unwrap();
    let (code, _, err) = steamrf(dir.path(), &["validate", printed.to_str().unwrap()]);
    assert_eq!(
        code, 0,
        "the printed configuration does not load back: {err}"
    );

    // An unreachable broker, with a short timeout: the Kafka error once.
    let unreachable = dir.path().join("unreachable.toml");
    std::fs::write(
        &unreachable,
        format!(
            "[kafka]\nbrokers = \"127.0.0.1:1\"\ntopics = [\"t\"]\nconnect_timeout = \"2s\"\n[lancedb]\nuri = {:?}\n",
            lance.display().to_string()
        ),
    )
    .unwrap();
    let started = std::time::Instant::now();
    let (code, _, err) = steamrf(
        dir.path(),
        &["run", "--config", unreachable.to_str().unwrap()],
    );
    assert_eq!(code, 1, "{err}");
    assert!(started.elapsed().as_secs() < 30, "{err}");
    assert_each_cause_once(&err);
    assert!(err.contains("127.0.0.1:1"), "the broker is named: {err}");

    // The codes are documented where a user looks.
    let (_, help, _) = steamrf(dir.path(), &["--help"]);
    assert!(help.contains("Exit codes: 0 success; 1 an error"), "{help}");
}
