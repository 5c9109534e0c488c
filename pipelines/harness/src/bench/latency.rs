//! `steamrf bench ingest --rate R`: the end-to-end latency of events produced
//! at a fixed rate below capacity, from the producer's timestamp to the
//! batch's offsets committed, read from the pipeline's own histogram.

use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::{Duration, Instant};

use steamrf_pipelines::error::{Error, Result};
use steamrf_pipelines::metrics::Metrics;
use steamrf_pipelines::pipeline::{self, RunOptions};

use super::ingest::{IngestBench, bench_config, commits};
use super::produce::produce_in_child;
use super::{reset_peak_rss, rss_bytes, temp_dir};

/// The `q` quantile of histogram `h`, interpolated linearly within its
/// bucket as Prometheus' `histogram_quantile` does (NaN when empty,
/// infinite past the last bucket).
pub(super) fn histogram_quantile(h: &prometheus::Histogram, q: f64) -> f64 {
    use prometheus::core::Metric as _;
    let m = h.metric();
    let hist = m.get_histogram();
    let total = hist.get_sample_count();
    if total == 0 {
        return f64::NAN;
    }
    let rank = q * total as f64;
    let (mut lower, mut below) = (0.0, 0u64);
    for b in hist.get_bucket() {
        let (upper, count) = (b.upper_bound(), b.cumulative_count());
        if count as f64 >= rank {
            let inside = (count - below) as f64;
            return lower + (upper - lower) * (rank - below as f64) / inside.max(1.0);
        }
        (lower, below) = (upper, count);
    }
    f64::INFINITY
}

/// `bench ingest --rate R`: the pipeline runs first; a child process then
/// produces the events at `R`/s, each stamped by its producer; the latency
/// of each record is its Kafka timestamp → its batch's offsets committed
/// (`steamrf_ingest_end_to_end_seconds`, the metric a deployment watches).
pub(super) async fn ingest_latency(
    b: IngestBench,
    topic: String,
    distinct: u64,
) -> Result<Vec<String>> {
    let n = b.events;
    let dir = temp_dir()?;
    let config = bench_config(&b, &topic, dir.path());
    let metrics = Metrics::new(&config.kafka.topics);
    let stop = Arc::new(AtomicBool::new(false));
    let task = tokio::spawn(pipeline::run(
        config.clone(),
        RunOptions::default(),
        metrics.clone(),
        stop.clone(),
    ));
    // Produce only once the group has assigned the partitions, so the
    // latency does not include the pipeline's start-up.
    let ready_by = Instant::now() + Duration::from_secs(120);
    while metrics.assigned_partitions.get() == 0 {
        if task.is_finished() || Instant::now() > ready_by {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            task.await.map_err(|e| Error::Internal {
                message: e.to_string(),
            })??;
            return Err(Error::Internal {
                message: "the pipeline was not assigned its partitions within 120 s".into(),
            });
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    reset_peak_rss();
    let (exe, brokers, t, turns_share, rate) = (
        b.producer.clone(),
        b.brokers.clone(),
        topic.clone(),
        b.turns_share,
        b.rate,
    );
    let started = Instant::now();
    let producer = tokio::task::spawn_blocking(move || {
        produce_in_child(&exe, &brokers, &t, n, distinct, turns_share, rate)
    });
    let deadline = started + Duration::from_secs_f64(n as f64 / b.rate as f64 + 300.0);
    while metrics.records_committed.get() < n && !task.is_finished() {
        if Instant::now() > deadline {
            stop.store(true, std::sync::atomic::Ordering::Relaxed);
            return Err(Error::Internal {
                message: format!(
                    "steamrf committed {} of {n} events within {:.0} s",
                    metrics.records_committed.get(),
                    deadline.duration_since(started).as_secs_f64()
                ),
            });
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let took = started.elapsed().as_secs_f64();
    let peak = rss_bytes("VmHWM:");
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    task.await.map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    let (produced_per_s, avg_bytes) = producer.await.map_err(|e| Error::Internal {
        message: e.to_string(),
    })??;
    let e2e = &metrics.end_to_end;
    let (p50, p99) = (histogram_quantile(e2e, 0.5), histogram_quantile(e2e, 0.99));
    let commits = commits(&metrics);
    let batches = metrics.batch_latency.get_sample_count();
    let mib = |b: u64| b as f64 / f64::from(1u32 << 20);
    Ok(vec![
        format!(
            "produced {n} events ({:.0}% dialogue turns, {avg_bytes} bytes on average) at {produced_per_s:.0}/s (target {}/s) while steamrf ran; all committed {took:.1} s after the first was produced",
            b.turns_share * 100.0,
            b.rate
        ),
        format!(
            "  produce → durable (Kafka timestamp → offsets committed, {} records): p50 {p50:.3} s, p99 {p99:.3} s (interpolated within the histogram's buckets: 0.1 s wide up to 1 s); {batches} batches, {commits} LanceDB commits; peak RSS {:.0} MiB",
            e2e.get_sample_count(),
            mib(peak)
        ),
        format!(
            "RESULT rate={} produced_per_s={produced_per_s:.0} e2e_p50_s={p50:.3} e2e_p99_s={p99:.3} batches={batches} commits={commits} peak_rss_mib={:.0}",
            b.rate,
            mib(peak)
        ),
    ])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_quantiles_interpolate_within_buckets_like_prometheus() {
        let h = prometheus::Histogram::with_opts(
            prometheus::HistogramOpts::new("t", "t").buckets(vec![0.1, 0.5, 1.0]),
        )
        .unwrap();
        assert!(histogram_quantile(&h, 0.5).is_nan(), "empty");
        // 50 in (0, 0.1], 40 in (0.1, 0.5], 10 in (0.5, 1].
        for (v, n) in [(0.05, 50), (0.3, 40), (0.7, 10)] {
            for _ in 0..n {
                h.observe(v);
            }
        }
        let close = |a: f64, b: f64| (a - b).abs() < 1e-9;
        assert!(close(histogram_quantile(&h, 0.5), 0.1));
        // Rank 70 is half-way through the second bucket.
        assert!(close(histogram_quantile(&h, 0.7), 0.3));
        // Rank 99 is 90% through the third.
        assert!(close(histogram_quantile(&h, 0.99), 0.95));
        h.observe(5.0);
        assert!(
            histogram_quantile(&h, 1.0).is_infinite(),
            "past the last bucket"
        );
    }
}
