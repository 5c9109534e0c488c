//! `steamrf bench communities`: the community writer's relation
//! extraction, community maintenance and prototypes on synthetic memories,
//! incremental batches beside a full recomputation in the same run.

use std::time::Instant;

use steamrf_pipelines::error::{Error, Result};

use super::{Synth, rss_bytes};

/// Options of `steamrf bench communities`.
#[derive(Debug, Clone)]
pub struct CommunitiesBench {
    /// Memories in the corpus before the measured batches.
    pub memories: usize,
    /// New memories per batch.
    pub batch: usize,
    /// Incremental batches measured (the median is reported).
    pub batches: usize,
    /// Run the full recomputation's relation extraction entirely instead of
    /// timing 3 of its query blocks and scaling.
    pub full_recompute: bool,
    /// Embedding dimension.
    pub dim: usize,
    /// Score with the int8 kernel (exact rescoring), and time the f32
    /// kernel's extraction on the same batches beside it.
    pub int8: bool,
}

/// `steamrf bench communities`: time per batch of relation extraction plus
/// community maintenance (and prototypes) on a corpus of `memories`, beside a
/// full recomputation (extraction for every memory, communities from scratch),
/// in the same run.
///
/// # Errors
/// Kernel errors.
pub fn communities(b: &CommunitiesBench) -> Result<Vec<String>> {
    use rand::Rng;
    use steamrf_kernels::cpu::CpuKernel;
    use steamrf_kernels::{Corpus, SearchParams, SimilarityKernel};
    use steamrf_operators::steam::memory::Memory;
    use steamrf_operators::steam::relations::Link;
    use steamrf_operators::steam::{MemoryId, SteamParams, SteamState};

    let internal = |e: steamrf_kernels::Error| Error::Internal {
        message: e.to_string(),
    };
    let mut out = Vec::new();
    let params = SteamParams::default();
    let f32_kernel = CpuKernel::default();
    let int8_kernel = if b.int8 {
        Some(steamrf_kernels::quant::QuantKernel::new(4).map_err(internal)?)
    } else {
        None
    };
    let kernel: &dyn SimilarityKernel = match &int8_kernel {
        Some(k) => k,
        None => &f32_kernel,
    };
    let users = (b.memories / 10).max(10);
    let topics = (b.memories / 200).max(2);
    let mut synth = Synth::new(topics, b.dim);
    let mut state = SteamState::new(params, b.dim);
    let mut by_topic: Vec<Vec<u64>> = vec![Vec::new(); topics];
    let t = Instant::now();
    // Sequential ids: the bench measures the kernel and the graph, not the
    // hash (memory ids are opaque to both).
    let mid = |id: u64| MemoryId(u128::from(id));
    let mk = |id: u64, user: usize, topic: usize, embedding: Vec<f32>| Memory {
        id: mid(id),
        user_id: format!("u{user}"),
        content: String::new(),
        embedding,
        interactions: vec![format!("e{id}")],
        items: vec![format!("i{id}")],
        community: None,
        created_ms: 0,
        updated_ms: 0,
        version: 1,
        facets: [(format!("topic {topic}"), 1)].into_iter().collect(),
        recent: Vec::new(),
    };
    for i in 0..b.memories {
        let topic = synth.rng.random_range(0..topics);
        let e = synth.memory(topic);
        let id = i as u64 + 1;
        by_topic[topic].push(id);
        state
            .restore_memory(mk(id, i % users, topic, e))
            .map_err(internal)?;
    }
    out.push(format!(
        "corpus: {} memories of {} users in {topics} topics, dim {}, generated in {:.1} s",
        b.memories,
        users,
        b.dim,
        t.elapsed().as_secs_f64()
    ));
    // The initial links: cross-topic cosines are ~0 (far below τ), so each
    // memory's global top-k1 lies in its topic; computed per topic.
    let t = Instant::now();
    for members in &by_topic {
        if members.len() < 2 {
            continue;
        }
        let mut rows = Vec::with_capacity(members.len() * b.dim);
        for &id in members {
            if let Some(m) = state.memory(mid(id)) {
                rows.extend_from_slice(&m.embedding);
            }
        }
        let corpus = Corpus::from_rows(&rows, b.dim).map_err(internal)?;
        let user = |id: u64| (id - 1) as usize % users;
        let exclude = |q: usize, c: usize| user(members[q]) == user(members[c]);
        let hits = f32_kernel
            .top_k(
                &rows,
                &corpus,
                &SearchParams {
                    k: params.k1,
                    min_score: params.link_tau,
                    exclude: Some(&exclude),
                },
            )
            .map_err(internal)?;
        for (q, hs) in hits.into_iter().enumerate() {
            let links = hs
                .into_iter()
                .map(|h| Link {
                    from: mid(members[q]),
                    to: mid(members[h.index as usize]),
                    score: h.score,
                })
                .collect();
            state.restore_links(mid(members[q]), links);
        }
    }
    out.push(format!(
        "initial links (per topic): {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let built = state.rebuild();
    let from_scratch_ms = t.elapsed().as_secs_f64() * 1e3;
    let sizes: Vec<usize> = state.communities().iter().map(|(_, m)| m.len()).collect();
    out.push(format!(
        "communities from scratch: {from_scratch_ms:.0} ms ({} communities, largest {}, {} prototypes published)",
        sizes.len(),
        sizes.iter().max().unwrap_or(&0),
        built.prototypes.len()
    ));

    // Incremental batches.
    let mut next_id = b.memories as u64 + 1;
    let mut times = Vec::new();
    let mut f32_times = Vec::new();
    let mut extract_times = Vec::new();
    let (mut links, mut links_found) = (0usize, 0usize);
    if let Some(k) = &int8_kernel {
        // Builds the int8 copy of the corpus outside the timed batches (they
        // then update it from the change log).
        state.link_dry_run(k, &[mid(1)]).map_err(internal)?;
    }
    let mut last = None;
    for _ in 0..b.batches.max(1) {
        let mut ids = Vec::with_capacity(b.batch);
        for _ in 0..b.batch {
            let topic = synth.rng.random_range(0..topics);
            let user = synth.rng.random_range(0..users);
            let e = synth.memory(topic);
            state
                .restore_memory(mk(next_id, user, topic, e))
                .map_err(internal)?;
            ids.push(mid(next_id));
            next_id += 1;
        }
        // The f32 kernel's extraction of the same batch first: the
        // reference time, and the links the int8 kernel's must contain.
        let exact = if int8_kernel.is_some() {
            let t = Instant::now();
            let exact = state.link_dry_run(&f32_kernel, &ids).map_err(internal)?;
            f32_times.push(t.elapsed().as_secs_f64() * 1e3);
            exact
        } else {
            Vec::new()
        };
        let t = Instant::now();
        let o = state.link(kernel, &ids).map_err(internal)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        extract_times.push(o.extract_time.as_secs_f64() * 1e3);
        let got: std::collections::HashSet<_> = o.links.iter().map(|l| (l.from, l.to)).collect();
        links += exact.len();
        links_found += exact
            .iter()
            .filter(|l| got.contains(&(l.from, l.to)))
            .count();
        last = Some(o);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let incremental_ms = sorted[sorted.len() / 2];
    if let Some(o) = last {
        out.push(format!(
            "incremental batch of {} (relation extraction over {} memories + communities + prototypes): median {incremental_ms:.0} ms of {:?} ms; last batch: {} links, {} merges, {} relabelled, {} prototypes rebuilt",
            b.batch,
            state.len(),
            times.iter().map(|t| t.round() as u64).collect::<Vec<_>>(),
            o.links.len(),
            o.delta.merges,
            o.delta.relabelled,
            o.prototypes.len()
        ));
    }

    // Full recomputation: extraction for every memory (query blocks of
    // `batch`), then communities and prototypes from scratch.
    let n = state.len();
    let blocks = n.div_ceil(b.batch);
    let measured = if b.full_recompute {
        blocks
    } else {
        blocks.min(3)
    };
    let all = (1..=n as u64).map(mid).collect::<Vec<_>>();
    let t = Instant::now();
    for block in all.chunks(b.batch).take(measured) {
        // The same call the incremental path makes, for `batch` memories.
        let _ = state.link_dry_run(kernel, block).map_err(internal)?;
    }
    let per_block = t.elapsed().as_secs_f64() * 1e3 / measured as f64;
    let extraction_ms = per_block * blocks as f64;
    let t = Instant::now();
    state.rebuild();
    let rebuild_ms = t.elapsed().as_secs_f64() * 1e3;
    let recompute_ms = extraction_ms + rebuild_ms;
    out.push(format!(
        "full recomputation: relation extraction {extraction_ms:.0} ms ({blocks} query blocks of {}, {}) + communities and prototypes from scratch {rebuild_ms:.0} ms",
        b.batch,
        if measured == blocks {
            "all measured".to_owned()
        } else {
            format!("{measured} measured at {per_block:.0} ms each, scaled")
        }
    ));
    out.push(format!(
        "peak memory (VmHWM): {:.2} GiB",
        rss_bytes("VmHWM:") as f64 / (1u64 << 30) as f64
    ));
    let precision = if b.int8 { "int8" } else { "f32" };
    let mut extra = String::new();
    if b.int8 {
        f32_times.sort_by(f64::total_cmp);
        let f32_ms = f32_times[f32_times.len() / 2];
        let recall = links_found as f64 / links.max(1) as f64;
        extract_times.sort_by(f64::total_cmp);
        let extract_ms = extract_times[extract_times.len() / 2];
        out.push(format!(
            "relation extraction alone, same batches: int8 median {extract_ms:.0} ms, f32 {f32_ms:.0} ms; the int8 kernel found {links_found} of the f32 kernel's {links} links (recall {recall:.4})"
        ));
        extra = format!(
            " f32_extract_ms={f32_ms:.1} ratio_vs_f32={:.3} link_recall={recall:.4}",
            f32_ms / extract_ms
        );
    }
    out.push(format!(
        "RESULT incremental_ms={incremental_ms:.1} recompute_ms={recompute_ms:.0} ratio={:.1} changed_per_s={:.0} precision={precision}{extra}",
        recompute_ms / incremental_ms,
        b.batch as f64 / incremental_ms * 1e3
    ));
    Ok(out)
}
