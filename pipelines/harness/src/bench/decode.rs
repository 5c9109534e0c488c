//! `steamrf bench decode`: the event decoder with its fast path
//! (`steamrf_schemas::decode`) beside serde alone (`decode_slow`, the
//! reference), on the ingest bench's events, in the same run.

use std::time::Instant;

use steamrf_pipelines::error::{Error, Result};
use steamrf_schemas::{decode, decode_slow};

/// Options of `steamrf bench decode`.
#[derive(Debug, Clone)]
pub struct DecodeBench {
    /// Events decoded per round and path.
    pub events: u64,
    /// Share of dialogue turns among them (the rest are clicks).
    pub turns_share: f64,
    /// Rounds; the two paths alternate, and each reports its median.
    pub rounds: usize,
}

/// Runs the bench; the last line is the `RESULT` line.
///
/// # Errors
/// If either path fails to decode an event, or the two disagree.
pub fn decode_bench(b: &DecodeBench) -> Result<Vec<String>> {
    let payloads: Vec<String> = (0..b.events)
        .map(|i| super::bench_event_mixed(i, b.turns_share).1)
        .collect();
    let bytes: usize = payloads.iter().map(String::len).sum();
    for p in &payloads {
        if decode(p.as_bytes()) != decode_slow(p.as_bytes()) {
            return Err(Error::Internal {
                message: format!("the decoder's two paths disagree on {p}"),
            });
        }
    }
    let time = |f: fn(&[u8]) -> bool| -> Result<f64> {
        let started = Instant::now();
        let ok = payloads.iter().filter(|p| f(p.as_bytes())).count();
        let ns = started.elapsed().as_secs_f64() * 1e9 / payloads.len().max(1) as f64;
        if ok == payloads.len() {
            Ok(ns)
        } else {
            Err(Error::Internal {
                message: format!(
                    "{} of {} bench events did not decode",
                    payloads.len() - ok,
                    payloads.len()
                ),
            })
        }
    };
    let (mut fast, mut slow) = (Vec::new(), Vec::new());
    for round in 0..b.rounds.max(1) {
        // Alternate which path runs first.
        if round % 2 == 0 {
            fast.push(time(|p| decode(p).is_ok())?);
            slow.push(time(|p| decode_slow(p).is_ok())?);
        } else {
            slow.push(time(|p| decode_slow(p).is_ok())?);
            fast.push(time(|p| decode(p).is_ok())?);
        }
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (fast, slow) = (median(&mut fast), median(&mut slow));
    Ok(vec![
        format!(
            "decoded {} events ({:.0}% dialogue turns) of {} bytes on average, {} rounds per path",
            payloads.len(),
            b.turns_share * 100.0,
            bytes / payloads.len().max(1),
            b.rounds.max(1)
        ),
        format!("fast path: {fast:.0} ns/event; serde alone: {slow:.0} ns/event (medians)"),
        format!(
            "RESULT events={} fast_ns_per_event={fast:.0} serde_ns_per_event={slow:.0} ratio={:.3}",
            payloads.len(),
            fast / slow
        ),
    ])
}
