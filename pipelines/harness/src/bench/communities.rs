//! `steamrf bench communities`: the community writer's relation
//! extraction, community maintenance and prototypes, per incremental batch,
//! beside the exact f32 writer on the same batches and a full recomputation,
//! in the same run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::{IvfKernel, IvfKernelParams};
use steamrf_kernels::{Corpus, SearchParams, SimilarityKernel};
use steamrf_operators::steam::memory::Memory;
use steamrf_operators::steam::relations::Link;
use steamrf_operators::steam::{MemoryId, SteamParams, SteamState};
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
    /// Score with the int8 kernel (exact rescoring) where the search is
    /// exhaustive.
    pub int8: bool,
    /// Relation extraction through the IVF (`steam.relation_index = "ivf"`).
    pub ivf: bool,
    /// IVF lists probed per changed memory.
    pub probes: usize,
    /// `steam.max_community` (0: unbounded).
    pub max_community: usize,
    /// Embedded real texts, `dim` values each, in file order: memories mix
    /// neighbouring texts instead of synthetic topics.
    pub texts: Option<Vec<f32>>,
}

fn internal(e: steamrf_kernels::Error) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

fn mid(id: u64) -> MemoryId {
    MemoryId(u128::from(id))
}

fn memory(id: u64, user: usize, topic: usize, embedding: Vec<f32>) -> Memory {
    Memory {
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
    }
}

/// Community sizes: (largest, median, 99th percentile, communities).
fn sizes(state: &SteamState) -> (usize, usize, usize, usize) {
    let mut s: Vec<usize> = state.communities().iter().map(|(_, m)| m.len()).collect();
    s.sort_unstable();
    let at = |q: f64| {
        s.get(((s.len() as f64 - 1.0) * q) as usize)
            .copied()
            .unwrap_or(0)
    };
    (s.last().copied().unwrap_or(0), at(0.5), at(0.99), s.len())
}

/// The members of `m`'s community.
fn community(s: &SteamState, m: MemoryId) -> Option<&std::collections::BTreeSet<MemoryId>> {
    let c = s.communities().community_of(m)?;
    s.communities().members(c)
}

/// Adjusted Rand index of two labelings of the same items.
fn adjusted_rand(pairs: &[(MemoryId, MemoryId)]) -> f64 {
    let c2 = |n: u64| (n * n.saturating_sub(1)) as f64 / 2.0;
    let mut joint: HashMap<(MemoryId, MemoryId), u64> = HashMap::new();
    let (mut a, mut b): (HashMap<MemoryId, u64>, HashMap<MemoryId, u64>) = Default::default();
    for &(x, y) in pairs {
        *joint.entry((x, y)).or_default() += 1;
        *a.entry(x).or_default() += 1;
        *b.entry(y).or_default() += 1;
    }
    let index: f64 = joint.values().map(|&n| c2(n)).sum();
    let (sa, sb): (f64, f64) = (
        a.values().map(|&n| c2(n)).sum(),
        b.values().map(|&n| c2(n)).sum(),
    );
    let expected = sa * sb / c2(pairs.len() as u64).max(1.0);
    let max = (sa + sb) / 2.0;
    if (max - expected).abs() < f64::EPSILON {
        return 1.0;
    }
    (index - expected) / (max - expected)
}

/// `steamrf bench communities`: time per batch of relation extraction plus
/// community maintenance (and prototypes) on a corpus of `memories`, beside
/// the exact f32 kernel's writer on the same batches (link recall,
/// community agreement) and a full recomputation, in the same run.
///
/// # Errors
/// Kernel errors.
pub fn communities(b: &CommunitiesBench) -> Result<Vec<String>> {
    use rand::Rng;

    let mut out = Vec::new();
    let params = SteamParams {
        max_community: b.max_community,
        ..SteamParams::default()
    };
    let f32_kernel: Arc<dyn SimilarityKernel> = Arc::new(CpuKernel::default());
    let base: Arc<dyn SimilarityKernel> = if b.int8 {
        Arc::new(steamrf_kernels::quant::QuantKernel::new(4).map_err(internal)?)
    } else {
        f32_kernel.clone()
    };
    let ivf_params = IvfKernelParams {
        probes: b.probes,
        ..IvfKernelParams::default()
    };
    let kernel: Arc<dyn SimilarityKernel> = if b.ivf {
        Arc::new(IvfKernel::new(ivf_params, base.clone()))
    } else {
        base.clone()
    };
    let users = (b.memories / 10).max(10);
    // A memory's topic: its window of texts, or a synthetic centre.
    let (mut synth, topics) = match &b.texts {
        Some(v) => {
            let s = Synth::from_texts(v.clone(), b.dim);
            let windows = s.text_count().div_ceil(super::TEXT_WINDOW);
            (s, windows)
        }
        None => {
            let topics = (b.memories / 200).max(2);
            (Synth::new(topics, b.dim), topics)
        }
    };
    let draw = |synth: &mut Synth| -> (Vec<f32>, usize) {
        if synth.text_count() > 0 {
            synth.text_memory()
        } else {
            let topic = synth.rng.random_range(0..topics);
            (synth.memory(topic), topic)
        }
    };
    let mut state = SteamState::new(params, b.dim);
    let mut by_topic: Vec<Vec<u64>> = vec![Vec::new(); topics];
    let t = Instant::now();
    // Sequential ids: the bench measures the kernel and the graph, not the
    // hash (memory ids are opaque to both).
    for i in 0..b.memories {
        let (e, topic) = draw(&mut synth);
        let id = i as u64 + 1;
        by_topic[topic].push(id);
        state
            .restore_memory(memory(id, i % users, topic, e))
            .map_err(internal)?;
    }
    let corpus_kind = match &b.texts {
        Some(_) => format!(
            "memories mixing 1-3 of {} real texts (windows of {})",
            synth.text_count(),
            super::TEXT_WINDOW
        ),
        None => format!("synthetic memories in {topics} topics"),
    };
    out.push(format!(
        "corpus: {} {corpus_kind}, {users} users, dim {}, generated in {:.1} s",
        b.memories,
        b.dim,
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let initial = initial_links(b, &mut state, &by_topic, users, &f32_kernel, &base)?;
    out.push(format!(
        "initial links ({initial}): {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    let t = Instant::now();
    let built = state.rebuild();
    let from_scratch_ms = t.elapsed().as_secs_f64() * 1e3;
    let (largest, median, p99, count) = sizes(&state);
    out.push(format!(
        "communities from scratch (cap {}): {from_scratch_ms:.0} ms; {count} communities, sizes median {median}, p99 {p99}, largest {largest}; {} prototypes published",
        b.max_community,
        built.prototypes.len()
    ));

    // The index is built (and the int8 copy made) outside the timed batches.
    let t = Instant::now();
    state
        .link_dry_run(kernel.as_ref(), &[mid(1)])
        .map_err(internal)?;
    let warm_s = t.elapsed().as_secs_f64();
    let rss_mib = rss_bytes("VmRSS:") as f64 / (1u64 << 20) as f64;
    let vectors_mib = (b.memories * b.dim * 4) as f64 / (1u64 << 20) as f64;
    out.push(format!(
        "writer state before the batches: {rss_mib:.0} MiB resident ({vectors_mib:.0} MiB of f32 vectors); index built in {warm_s:.1} s"
    ));
    // The exact writer: the same state, linked by the exact f32 kernel.
    let compare = b.ivf || b.int8;
    let mut exact_state = if compare { Some(state.clone()) } else { None };

    let mut next_id = b.memories as u64 + 1;
    let (mut times, mut exact_times) = (Vec::new(), Vec::new());
    let (mut extract_times, mut exact_extract_times) = (Vec::new(), Vec::new());
    let (mut community_times, mut prototype_times) = (Vec::new(), Vec::new());
    let (mut links, mut links_found) = (0usize, 0usize);
    let mut batch_ids = Vec::new();
    let mut last = None;
    for _ in 0..b.batches.max(1) {
        let mut ids = Vec::with_capacity(b.batch);
        for _ in 0..b.batch {
            let (e, topic) = draw(&mut synth);
            let m = memory(next_id, synth.rng.random_range(0..users), topic, e);
            if let Some(x) = &mut exact_state {
                x.restore_memory(m.clone()).map_err(internal)?;
            }
            state.restore_memory(m).map_err(internal)?;
            ids.push(mid(next_id));
            next_id += 1;
        }
        let mut exact_links = Vec::new();
        if let Some(x) = &mut exact_state {
            let t = Instant::now();
            let o = x.link(f32_kernel.as_ref(), &ids).map_err(internal)?;
            exact_times.push(t.elapsed().as_secs_f64() * 1e3);
            exact_extract_times.push(o.extract_time.as_secs_f64() * 1e3);
            exact_links = o.links;
        }
        let t = Instant::now();
        let o = state.link(kernel.as_ref(), &ids).map_err(internal)?;
        times.push(t.elapsed().as_secs_f64() * 1e3);
        extract_times.push(o.extract_time.as_secs_f64() * 1e3);
        community_times.push(o.community_time.as_secs_f64() * 1e3);
        prototype_times.push(o.prototype_time.as_secs_f64() * 1e3);
        let got: HashSet<_> = o.links.iter().map(|l| (l.from, l.to)).collect();
        links += exact_links.len();
        links_found += exact_links
            .iter()
            .filter(|l| got.contains(&(l.from, l.to)))
            .count();
        batch_ids.extend(ids);
        last = Some(o);
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let incremental_ms = median(&mut times.clone());
    if let Some(o) = last {
        out.push(format!(
            "incremental batch of {} (relation extraction over {} memories + communities + prototypes): median {incremental_ms:.0} ms of {:?} ms (medians: extraction {:.0} ms, communities {:.0} ms, prototypes {:.0} ms); last batch: {} links, {} merges, {} refused by the cap, {} relabelled, {} prototypes rebuilt",
            b.batch,
            state.len(),
            times.iter().map(|t| t.round() as u64).collect::<Vec<_>>(),
            median(&mut extract_times.clone()),
            median(&mut community_times.clone()),
            median(&mut prototype_times.clone()),
            o.links.len(),
            o.delta.merges,
            o.delta.refused,
            o.delta.relabelled,
            o.prototypes.len()
        ));
    }
    let (largest, median_size, p99, count) = sizes(&state);
    out.push(format!(
        "communities after the batches: {count}, sizes median {median_size}, p99 {p99}, largest {largest}"
    ));
    let mut extra = String::new();
    if let Some(x) = &exact_state {
        let exact_ms = median(&mut exact_times);
        let exact_extract_ms = median(&mut exact_extract_times);
        let extract_ms = median(&mut extract_times);
        let recall = links_found as f64 / links.max(1) as f64;
        // Agreement over the memories of every community a batch memory is
        // in, on either side: the part of the graph the batches changed.
        let mut touched: HashSet<MemoryId> = HashSet::new();
        for &m in &batch_ids {
            for s in [&state, x] {
                if let Some(c) = s.communities().community_of(m) {
                    touched.extend(s.communities().members(c).into_iter().flatten());
                }
            }
        }
        let pairs: Vec<(MemoryId, MemoryId)> = touched
            .iter()
            .filter_map(|&m| {
                Some((
                    state.communities().community_of(m)?,
                    x.communities().community_of(m)?,
                ))
            })
            .collect();
        let ari = adjusted_rand(&pairs);
        let same = touched
            .iter()
            .filter(|&&m| community(&state, m) == community(x, m))
            .count() as f64
            / touched.len().max(1) as f64;
        out.push(format!(
            "exact f32 writer, same batches: median {exact_ms:.0} ms (extraction {exact_extract_ms:.0} ms); {} is {:.2}x its batch, {:.2}x its extraction; found {links_found} of its {links} links (recall {recall:.4}); over the {} memories of the communities the batches touched: adjusted Rand index {ari:.4}, {:.4} in an identical community",
            if b.ivf { "the IVF" } else { "int8" },
            exact_ms / incremental_ms,
            exact_extract_ms / extract_ms,
            touched.len(),
            same
        ));
        extra = format!(
            " exact_incremental_ms={exact_ms:.1} exact_extract_ms={exact_extract_ms:.1} extract_ms={extract_ms:.1} ratio_vs_exact={:.3} extract_ratio_vs_exact={:.3} link_recall={recall:.4} community_agreement={ari:.4}",
            exact_ms / incremental_ms,
            exact_extract_ms / extract_ms
        );
    }
    drop(exact_state);

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
        let _ = state
            .link_dry_run(kernel.as_ref(), block)
            .map_err(internal)?;
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
    let peak_mib = rss_bytes("VmHWM:") as f64 / (1u64 << 20) as f64;
    out.push(format!(
        "peak memory (VmHWM): {peak_mib:.0} MiB{}",
        if compare {
            " (the exact writer's copy of the state included)"
        } else {
            ""
        }
    ));
    let index = if b.ivf {
        format!("ivf probes={}", b.probes)
    } else {
        "exact".to_owned()
    };
    out.push(format!(
        "RESULT memories={} changed_per_s={:.0} incremental_ms={incremental_ms:.1} recompute_ms={recompute_ms:.0} ratio={:.1} index={index} precision={}{extra} max_community={largest} cap={} writers=1 writer_rss_mib={rss_mib:.0} peak_rss_mib={peak_mib:.0}",
        b.memories,
        b.batch as f64 / incremental_ms * 1e3,
        recompute_ms / incremental_ms,
        if b.int8 { "int8" } else { "f32" },
        b.max_community
    ));
    Ok(out)
}

/// The links before the measured batches, restored into `state`; returns
/// how they were found. Synthetic topics: exact per topic (cross-topic
/// cosines are ~0, far below τ, so each memory's global top-k1 lies in its
/// topic). Real texts: by an IVF probing 32 lists (exhaustive search of 1M
/// memories would take an hour), so the initial graph is approximate; the
/// batches' links are compared against the exact kernel all the same.
fn initial_links(
    b: &CommunitiesBench,
    state: &mut SteamState,
    by_topic: &[Vec<u64>],
    users: usize,
    f32_kernel: &Arc<dyn SimilarityKernel>,
    base: &Arc<dyn SimilarityKernel>,
) -> Result<String> {
    let params = *state.params();
    if b.texts.is_some() {
        let ivf = IvfKernel::new(
            IvfKernelParams {
                probes: 32,
                min_rows: 1,
                ..IvfKernelParams::default()
            },
            base.clone(),
        );
        let all: Vec<MemoryId> = (1..=b.memories as u64).map(mid).collect();
        let mut found: HashMap<MemoryId, Vec<Link>> = HashMap::new();
        for block in all.chunks(8192) {
            for l in state.link_dry_run(&ivf, block).map_err(internal)? {
                found.entry(l.from).or_default().push(l);
            }
        }
        for (from, links) in found {
            state.restore_links(from, links);
        }
        return Ok("IVF, 32 probes".to_owned());
    }
    for members in by_topic {
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
    Ok("exact, per topic".to_owned())
}
