//! `steamrf bench communities`: the community writer's relation
//! extraction, community maintenance and prototypes, per incremental batch,
//! beside the exact f32 writer on the same batches and a full recomputation,
//! in the same run.

use std::collections::{HashMap, HashSet};
use std::sync::Arc;
use std::time::Instant;

use steamrf_kernels::cpu::CpuKernel;
use steamrf_kernels::ivf::{IvfKernel, IvfKernelParams};
use steamrf_kernels::{Corpus, RowPrecision, SearchParams, SimilarityKernel};
use steamrf_operators::steam::memory::Memory;
use steamrf_operators::steam::relations::Link;
use steamrf_operators::steam::{LinkOutcome, MemoryId, SteamParams, SteamState};
use steamrf_pipelines::error::{Error, Result};
use steamrf_schemas::tenancy::{shard_of, tenant_of};

use super::{Synth, rss_bytes};

mod lance;

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
    /// Score in int8 with exact rescoring (`steam.cpu_precision = "int8"`):
    /// the exhaustive kernel, and the IVF's lists.
    pub int8: bool,
    /// Relation extraction through the IVF (`steam.relation_index = "ivf"`).
    pub ivf: bool,
    /// IVF lists probed per changed memory.
    pub probes: usize,
    /// `steam.max_community` (0: unbounded).
    pub max_community: usize,
    /// Writers, each keeping the tenants `shard_of` gives it, running each
    /// batch at once on their own threads.
    pub writers: usize,
    /// Tenants the users spread over (0: one tenant).
    pub tenants: usize,
    /// Embedded real texts, `dim` values each, in file order: memories mix
    /// neighbouring texts instead of synthetic topics.
    pub texts: Option<Vec<f32>>,
    /// Also extract the last batch's links with LanceDB's IVF_PQ and
    /// IVF_HNSW_SQ indexes on the same memories (one writer).
    pub lancedb: bool,
    /// Keep the exact writers' copy of the state (community agreement, the
    /// exact batch time); without it, the exact links come from the exact
    /// kernel over each writer's own state before its batch is linked
    /// (the same links: extraction reads only the embeddings and owners).
    pub exact_writer: bool,
    /// `steam.index_precision` of the writers (the exact writer keeps f32).
    pub index_precision: RowPrecision,
}

/// Whether `--precision` (auto, f32 or int8, as `steam.cpu_precision`)
/// scores in int8 on this CPU.
pub fn int8_scoring(precision: &str) -> bool {
    use steamrf_kernels::cuda::CpuPrecision;
    match precision {
        "f32" => CpuPrecision::F32,
        "int8" => CpuPrecision::Int8,
        _ => CpuPrecision::Auto,
    }
    .int8()
}

/// `steam.rescore`'s default.
const RESCORE: usize = 4;

fn internal(e: steamrf_kernels::Error) -> Error {
    Error::Internal {
        message: e.to_string(),
    }
}

fn mid(id: u64) -> MemoryId {
    MemoryId(u128::from(id))
}

fn memory(id: u64, user_id: String, topic: usize, embedding: Vec<f32>) -> Memory {
    Memory {
        id: mid(id),
        user_id,
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

/// Community sizes over every writer: (largest, median, 99th percentile,
/// communities).
fn sizes(states: &[SteamState]) -> (usize, usize, usize, usize) {
    let mut s: Vec<usize> = states
        .iter()
        .flat_map(|st| st.communities().iter().map(|(_, m)| m.len()))
        .collect();
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
/// community maintenance (and prototypes) on a corpus of `memories`, by
/// `writers` writers at once (each holding the tenants it is the shard of),
/// beside the exact f32 kernel's writers on the same batches (link recall,
/// community agreement) and a full recomputation, in the same run.
///
/// # Errors
/// Kernel errors.
pub fn communities(b: &CommunitiesBench) -> Result<Vec<String>> {
    use rand::Rng;

    let mut out = Lines::default();
    let writers = b.writers.max(1);
    let separator = (b.tenants > 0).then_some(':');
    let params = SteamParams {
        max_community: b.max_community,
        tenant_separator: separator,
        index_precision: b.index_precision,
        ..SteamParams::default()
    };
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    // The exact reference runs alone, on every core.
    let f32_kernel: Arc<dyn SimilarityKernel> = Arc::new(CpuKernel::default());
    // Each writer's kernel gets its share of the cores, as a process of its own would.
    let threads = (cores / writers).max(1);
    let mut bases: Vec<Arc<dyn SimilarityKernel>> = Vec::new();
    let mut kernels: Vec<Arc<dyn SimilarityKernel>> = Vec::new();
    for _ in 0..writers {
        let base: Arc<dyn SimilarityKernel> = if b.int8 {
            let mut k = steamrf_kernels::quant::QuantKernel::new(RESCORE).map_err(internal)?;
            k.threads = threads;
            Arc::new(k)
        } else {
            Arc::new(CpuKernel {
                threads,
                ..CpuKernel::default()
            })
        };
        let ivf_params = IvfKernelParams {
            probes: b.probes,
            int8_rescore: b.int8.then_some(RESCORE),
            ..IvfKernelParams::default()
        };
        kernels.push(if b.ivf {
            Arc::new(IvfKernel::new(ivf_params, base.clone()))
        } else {
            base.clone()
        });
        bases.push(base);
    }
    let users = (b.memories / 10).max(10);
    let user_id = |u: usize| match separator {
        Some(_) => format!("t{}:u{u}", u % b.tenants),
        None => format!("u{u}"),
    };
    let writer_of = |user: &str| shard_of(tenant_of(user, separator), writers as u32) as usize;
    // A memory's topic: its window of texts, or a synthetic centre. The
    // same generator again draws the same memories.
    let new_synth = || match &b.texts {
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
    let (mut synth, topics) = new_synth();
    let draw = |synth: &mut Synth| -> (Vec<f32>, usize) {
        if synth.text_count() > 0 {
            synth.text_memory()
        } else {
            let topic = synth.rng.random_range(0..topics);
            (synth.memory(topic), topic)
        }
    };
    // Initial memory `i` (a sequential id: the bench measures the kernel and
    // the graph, not the hash, and memory ids are opaque to both), its
    // writer and topic.
    let initial_memory = |i: usize, synth: &mut Synth| -> (usize, usize, Memory) {
        let (e, topic) = draw(synth);
        let user = user_id(i % users);
        let w = writer_of(&user);
        (w, topic, memory(i as u64 + 1, user, topic, e))
    };
    // The heap in use after each phase of building the writers' state: what
    // each part of the state costs per memory, apart from what malloc keeps
    // free (a phase's temporaries).
    let heap = || steamrf_pipelines::alloc::in_use().unwrap_or(0);
    let heap_at_start = heap();
    let mut phases: Vec<(&str, u64)> = Vec::new();
    let mut states: Vec<SteamState> = (0..writers)
        .map(|_| SteamState::new(params, b.dim).lean())
        .collect();
    // Per writer, per topic: the initial memories, with their users.
    let mut by_topic: Vec<Vec<Vec<(u64, usize)>>> = match b.texts {
        Some(_) => vec![Vec::new(); writers],
        None => vec![vec![Vec::new(); topics]; writers],
    };
    let t = Instant::now();
    for i in 0..b.memories {
        let (w, topic, m) = initial_memory(i, &mut synth);
        // Real texts are linked through an index over the whole state; only
        // synthetic topics are linked topic by topic.
        if b.texts.is_none() {
            by_topic[w][topic].push((i as u64 + 1, i % users));
        }
        states[w].restore_memory(m).map_err(internal)?;
    }
    let corpus_kind = match &b.texts {
        Some(_) => format!(
            "memories mixing 1-3 of {} real texts (windows of {})",
            synth.text_count(),
            super::TEXT_WINDOW
        ),
        None => format!("synthetic memories in {topics} topics"),
    };
    phases.push((
        "memories (each with its embedding, kept once in the relation index, and items)",
        heap(),
    ));
    let held: Vec<usize> = states.iter().map(SteamState::len).collect();
    out.push(format!(
        "corpus: {} {corpus_kind}, {users} users{}, dim {}, generated in {:.1} s; {writers} writer(s) holding {held:?} memories, {threads} kernel thread(s) each",
        b.memories,
        match separator {
            Some(_) => format!(" in {} tenants", b.tenants),
            None => String::new(),
        },
        b.dim,
        t.elapsed().as_secs_f64()
    ));
    // The indexes are built (and the int8 copies made) outside the timed
    // batches, and before the initial links, which real texts find with
    // the writer's own index.
    let t = Instant::now();
    for (state, kernel) in states.iter().zip(&kernels) {
        if let Some(first) = state.user_ids().next().and_then(|u| state.user(u)) {
            let some = first
                .memories
                .first()
                .map(|m| m.id)
                .into_iter()
                .collect::<Vec<_>>();
            state
                .link_dry_run(kernel.as_ref(), &some)
                .map_err(internal)?;
        }
    }
    let warm_s = t.elapsed().as_secs_f64();
    phases.push((
        "relation index (corpus copy, IVF lists, int8 codes)",
        heap(),
    ));
    let t = Instant::now();
    let mut initial = String::new();
    for (w, state) in states.iter_mut().enumerate() {
        initial = initial_links(
            b,
            state,
            &by_topic[w],
            &f32_kernel,
            (&kernels[w], &bases[w]),
        )?;
    }
    out.push(format!(
        "initial links ({initial}): {:.1} s",
        t.elapsed().as_secs_f64()
    ));
    phases.push(("links", heap()));
    let t = Instant::now();
    let mut published = 0;
    for state in &mut states {
        published += state.rebuild().prototypes.len();
    }
    let from_scratch_ms = t.elapsed().as_secs_f64() * 1e3;
    phases.push(("communities, prototypes and tallies", heap()));
    let (largest, median, p99, count) = sizes(&states);
    out.push(format!(
        "communities from scratch (cap {}): {from_scratch_ms:.0} ms; {count} communities, sizes median {median}, p99 {p99}, largest {largest}; {published} prototypes published",
        b.max_community,
    ));
    let mut before = heap_at_start;
    let parts: Vec<String> = phases
        .iter()
        .map(|&(what, at)| {
            let grew = at.saturating_sub(before);
            before = at;
            format!(
                "{what} {:.0} MiB ({:.0} B per memory)",
                grew as f64 / f64::from(1u32 << 20),
                grew as f64 / b.memories.max(1) as f64
            )
        })
        .collect();
    out.push(format!(
        "writer state by phase (growth of the heap malloc has handed out, a large buffer at its capacity; {} B per memory is one f32 vector): {}",
        b.dim * 4,
        parts.join(", ")
    ));
    let heap_mib = heap().saturating_sub(heap_at_start) as f64 / (1u64 << 20) as f64;
    let untrimmed_mib = rss_bytes("VmRSS:") as f64 / (1u64 << 20) as f64;
    // What malloc keeps free goes back, as `steamrf communities` hands it
    // back after restoring its state.
    steamrf_pipelines::alloc::trim();
    let rss_mib = rss_bytes("VmRSS:") as f64 / (1u64 << 20) as f64;
    let vectors_mib = (b.memories * b.dim * 4) as f64 / (1u64 << 20) as f64;
    out.push(format!(
        "writer state before the batches: {rss_mib:.0} MiB resident after malloc_trim ({untrimmed_mib:.0} MiB before; the state's heap {heap_mib:.0} MiB), all writers ({vectors_mib:.0} MiB of f32 vectors); indexes built in {warm_s:.1} s"
    ));
    // The exact writers: the same states, linked by the exact f32 kernel.
    // Writers with bf16 rows get exact writers with f32 rows: the same
    // memories drawn again, the same initial links and communities.
    let bf16 = b.index_precision == RowPrecision::Bf16;
    let compare = b.ivf || b.int8 || bf16;
    let mut exact_states: Vec<SteamState> = match (compare && b.exact_writer, bf16) {
        (false, _) => Vec::new(),
        (true, false) => states.clone(),
        (true, true) => {
            let f32_params = SteamParams {
                index_precision: RowPrecision::F32,
                ..params
            };
            let mut exact: Vec<SteamState> = (0..writers)
                .map(|_| SteamState::new(f32_params, b.dim).lean())
                .collect();
            let (mut again, _) = new_synth();
            for i in 0..b.memories {
                let (w, _, m) = initial_memory(i, &mut again);
                exact[w].restore_memory(m).map_err(internal)?;
            }
            for (x, s) in exact.iter_mut().zip(&states) {
                for id in (0..b.memories).map(|i| mid(i as u64 + 1)) {
                    let links = s.links_from(id);
                    if !links.is_empty() {
                        x.restore_links(id, links);
                    }
                }
                x.rebuild();
            }
            exact
        }
    };

    let mut next_id = b.memories as u64 + 1;
    let (mut times, mut exact_times) = (Vec::new(), Vec::new());
    let (mut extract_times, mut exact_extract_times) = (Vec::new(), Vec::new());
    let (mut community_times, mut prototype_times) = (Vec::new(), Vec::new());
    let (mut links, mut links_found) = (0usize, 0usize);
    let mut substitute_gaps: Vec<f64> = Vec::new();
    let mut batch_ids = Vec::new();
    let mut last: Vec<LinkOutcome> = Vec::new();
    let (mut last_ids, mut last_exact) = (Vec::new(), Vec::new());
    for _ in 0..b.batches.max(1) {
        let mut ids: Vec<Vec<MemoryId>> = vec![Vec::new(); writers];
        for _ in 0..b.batch {
            let (e, topic) = draw(&mut synth);
            let user = user_id(synth.rng.random_range(0..users));
            let w = writer_of(&user);
            let m = memory(next_id, user, topic, e);
            if let Some(x) = exact_states.get_mut(w) {
                x.restore_memory(m.clone()).map_err(internal)?;
            }
            states[w].restore_memory(m).map_err(internal)?;
            ids[w].push(mid(next_id));
            next_id += 1;
        }
        let mut exact_links = Vec::new();
        if compare && !b.exact_writer {
            // The exact kernel over each writer's own state, before the
            // writer links the batch.
            let t = Instant::now();
            for (s, ids) in states.iter().zip(&ids) {
                exact_links.extend(s.link_dry_run(f32_kernel.as_ref(), ids).map_err(internal)?);
            }
            exact_extract_times.push(t.elapsed().as_secs_f64() * 1e3);
        } else if compare {
            // One after another, each on every core.
            let (mut total, mut extract) = (0.0, 0.0f64);
            for (x, ids) in exact_states.iter_mut().zip(&ids) {
                let t = Instant::now();
                let o = x.link(f32_kernel.as_ref(), ids).map_err(internal)?;
                total += t.elapsed().as_secs_f64() * 1e3;
                extract += o.extract_time.as_secs_f64() * 1e3;
                exact_links.extend(o.links);
            }
            exact_times.push(total);
            exact_extract_times.push(extract);
        }
        // The writers at once, as separate processes would run.
        let t = Instant::now();
        let outcomes: Vec<std::result::Result<LinkOutcome, steamrf_kernels::Error>> =
            std::thread::scope(|scope| {
                let handles: Vec<_> = states
                    .iter_mut()
                    .zip(&kernels)
                    .zip(&ids)
                    .map(|((state, kernel), ids)| {
                        scope.spawn(move || state.link(kernel.as_ref(), ids))
                    })
                    .collect();
                handles
                    .into_iter()
                    .map(|h| h.join().expect("a writer thread panicked"))
                    .collect()
            });
        times.push(t.elapsed().as_secs_f64() * 1e3);
        let outcomes = outcomes
            .into_iter()
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(internal)?;
        let slowest = |f: &dyn Fn(&LinkOutcome) -> std::time::Duration| {
            outcomes
                .iter()
                .map(f)
                .max()
                .unwrap_or_default()
                .as_secs_f64()
                * 1e3
        };
        extract_times.push(slowest(&|o| o.extract_time));
        community_times.push(slowest(&|o| o.community_time));
        prototype_times.push(slowest(&|o| o.prototype_time));
        let got: HashSet<_> = outcomes
            .iter()
            .flat_map(|o| o.links.iter().map(|l| (l.from, l.to)))
            .collect();
        links += exact_links.len();
        links_found += exact_links
            .iter()
            .filter(|l| got.contains(&(l.from, l.to)))
            .count();
        // A link found instead of an exact one: how far its f32 cosine
        // (from the exact writer's rows) falls below the weakest exact link
        // of its memory. Near 0: a near-tie reordered, not a worse link.
        if !exact_states.is_empty() {
            let mut weakest: HashMap<MemoryId, f32> = HashMap::new();
            let mut exact_pairs = HashSet::new();
            for l in &exact_links {
                let w = weakest.entry(l.from).or_insert(f32::INFINITY);
                *w = w.min(l.score);
                exact_pairs.insert((l.from, l.to));
            }
            let cosine = |a: MemoryId, b: MemoryId| {
                let x = exact_states.iter().find_map(|s| s.embedding(a))?;
                let y = exact_states.iter().find_map(|s| s.embedding(b))?;
                Some(steamrf_kernels::dot(&x, &y))
            };
            for l in outcomes.iter().flat_map(|o| &o.links) {
                if exact_pairs.contains(&(l.from, l.to)) {
                    continue;
                }
                if let Some(c) = cosine(l.from, l.to) {
                    let floor = weakest.get(&l.from).copied().unwrap_or(params.link_tau);
                    substitute_gaps.push(f64::from((floor - c).max(0.0)));
                }
            }
        }
        last_ids = ids.iter().flatten().copied().collect();
        batch_ids.extend(ids.into_iter().flatten());
        last_exact = exact_links;
        last = outcomes;
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(0.0)
    };
    let incremental_ms = median(&mut times.clone());
    let total = state_len(&states);
    if !last.is_empty() {
        let sum = |f: &dyn Fn(&LinkOutcome) -> u64| last.iter().map(f).sum::<u64>();
        out.push(format!(
            "incremental batch of {} (relation extraction over {total} memories + communities + prototypes, {writers} writer(s) at once): median {incremental_ms:.0} ms of {:?} ms (medians of the slowest writer: extraction {:.0} ms, communities {:.0} ms, prototypes {:.0} ms); last batch: {} links, {} merges, {} refused by the cap, {} relabelled, {} prototypes rebuilt",
            b.batch,
            times.iter().map(|t| t.round() as u64).collect::<Vec<_>>(),
            median(&mut extract_times.clone()),
            median(&mut community_times.clone()),
            median(&mut prototype_times.clone()),
            sum(&|o| o.links.len() as u64),
            sum(&|o| o.delta.merges),
            sum(&|o| o.delta.refused),
            sum(&|o| o.delta.relabelled),
            sum(&|o| o.prototypes.len() as u64),
        ));
    }
    let (largest, median_size, p99, count) = sizes(&states);
    out.push(format!(
        "communities after the batches: {count}, sizes median {median_size}, p99 {p99}, largest {largest}"
    ));
    let mut extra = String::new();
    let approx = format!(
        "{}{}{}",
        if b.ivf {
            "the IVF"
        } else {
            "the exhaustive kernel"
        },
        if b.int8 { " in int8" } else { "" },
        if bf16 { " over bf16 rows" } else { "" }
    );
    if compare {
        let exact_extract_ms = median(&mut exact_extract_times);
        let extract_ms = median(&mut extract_times);
        let recall = links_found as f64 / links.max(1) as f64;
        if b.exact_writer {
            let exact_ms = median(&mut exact_times);
            // Agreement over the memories of every community a batch memory is
            // in, on either side: the part of the graph the batches changed.
            let owner = |m: MemoryId| {
                states
                    .iter()
                    .position(|s| s.memory(m).is_some())
                    .unwrap_or(0)
            };
            let mut touched: HashSet<MemoryId> = HashSet::new();
            for &m in &batch_ids {
                let w = owner(m);
                for s in [&states[w], &exact_states[w]] {
                    if let Some(c) = s.communities().community_of(m) {
                        touched.extend(s.communities().members(c).into_iter().flatten());
                    }
                }
            }
            let pairs: Vec<(MemoryId, MemoryId)> = touched
                .iter()
                .filter_map(|&m| {
                    let w = owner(m);
                    Some((
                        states[w].communities().community_of(m)?,
                        exact_states[w].communities().community_of(m)?,
                    ))
                })
                .collect();
            let ari = adjusted_rand(&pairs);
            let same = touched
                .iter()
                .filter(|&&m| {
                    let w = owner(m);
                    community(&states[w], m) == community(&exact_states[w], m)
                })
                .count() as f64
                / touched.len().max(1) as f64;
            out.push(format!(
                "exact f32 writer(s), same batches{}: median {exact_ms:.0} ms (extraction {exact_extract_ms:.0} ms); {} is {:.2}x its batch, {:.2}x its extraction; found {links_found} of its {links} links (recall {recall:.4}); over the {} memories of the communities the batches touched: adjusted Rand index {ari:.4}, {:.4} in an identical community",
                if writers > 1 {
                    ", one writer after another on every core"
                } else {
                    ""
                },
                approx,
                exact_ms / incremental_ms,
                exact_extract_ms / extract_ms,
                touched.len(),
                same
            ));
            substitute_gaps.sort_by(f64::total_cmp);
            let at = |q: f64| {
                let i = ((substitute_gaps.len() as f64 - 1.0) * q).round().max(0.0) as usize;
                substitute_gaps.get(i).copied().unwrap_or(0.0)
            };
            let (gap_median, gap_p99, gap_max) = (at(0.5), at(0.99), at(1.0));
            out.push(format!(
                "links found instead of exact ones: {}; their f32 cosine is below their memory's weakest exact link by median {gap_median:.4}, p99 {gap_p99:.4}, max {gap_max:.4}",
                substitute_gaps.len()
            ));
            extra = format!(
                " exact_incremental_ms={exact_ms:.1} exact_extract_ms={exact_extract_ms:.1} extract_ms={extract_ms:.1} ratio_vs_exact={:.3} extract_ratio_vs_exact={:.3} link_recall={recall:.4} community_agreement={ari:.4} substitute_gap_p99={gap_p99:.4}",
                exact_ms / incremental_ms,
                exact_extract_ms / extract_ms
            );
        } else {
            out.push(format!(
                "exact kernel over the same states' rows before each batch (no exact writer kept: community agreement not measured{}): extraction median {exact_extract_ms:.0} ms, {:.2}x {}'s; found {links_found} of its {links} links (recall {recall:.4})",
                if bf16 {
                    "; the rows are bf16, so the rounding is not in this recall"
                } else {
                    ""
                },
                exact_extract_ms / extract_ms,
                approx,
            ));
            extra = format!(
                " exact_extract_ms={exact_extract_ms:.1} extract_ms={extract_ms:.1} extract_ratio_vs_exact={:.3} link_recall={recall:.4}",
                exact_extract_ms / extract_ms
            );
        }
    }
    drop(exact_states);
    if b.lancedb && compare && writers == 1 {
        let extract_ms = median(&mut extract_times.clone());
        for m in lance::compare(&states[0], b.dim, &last_ids, &last_exact, b.probes)? {
            out.push(format!(
                "LanceDB {} on the same memories: index built in {:.1} s; the last batch appended and indexed (optimize) in {:.0} ms, then its {} changed memories queried one by one in {:.0} ms ({:.1}x the writer's extraction), link recall {:.4} against the exact writer",
                m.kind,
                m.build_s,
                m.update_ms,
                last_ids.len(),
                m.query_ms,
                m.query_ms / extract_ms.max(1e-9),
                m.recall
            ));
            extra.push_str(&format!(
                " lancedb_{0}_build_s={1:.1} lancedb_{0}_update_ms={2:.0} lancedb_{0}_query_ms={3:.0} lancedb_{0}_link_recall={4:.4}",
                m.kind, m.build_s, m.update_ms, m.query_ms, m.recall
            ));
        }
    }

    // Full recomputation: extraction for every memory (query blocks of
    // `batch`), then communities and prototypes from scratch, writer after
    // writer.
    let (mut extraction_ms, mut rebuild_ms, mut blocks, mut measured) = (0.0, 0.0, 0, 0);
    for (state, kernel) in states.iter_mut().zip(&kernels) {
        let mut all: Vec<MemoryId> = state
            .user_ids()
            .filter_map(|u| state.user(u))
            .flat_map(|u| u.memories.iter().map(|m| m.id))
            .collect();
        all.sort_unstable();
        let n_blocks = all.len().div_ceil(b.batch);
        let n_measured = if b.full_recompute {
            n_blocks
        } else {
            n_blocks.min(3)
        };
        let t = Instant::now();
        for block in all.chunks(b.batch).take(n_measured) {
            // The same call the incremental path makes, for `batch` memories.
            let _ = state
                .link_dry_run(kernel.as_ref(), block)
                .map_err(internal)?;
        }
        let per_block = t.elapsed().as_secs_f64() * 1e3 / n_measured.max(1) as f64;
        extraction_ms += per_block * n_blocks as f64;
        let t = Instant::now();
        state.rebuild();
        rebuild_ms += t.elapsed().as_secs_f64() * 1e3;
        blocks += n_blocks;
        measured += n_measured;
    }
    let recompute_ms = extraction_ms + rebuild_ms;
    out.push(format!(
        "full recomputation: relation extraction {extraction_ms:.0} ms ({blocks} query blocks of {}, {}) + communities and prototypes from scratch {rebuild_ms:.0} ms",
        b.batch,
        if measured == blocks {
            "all measured".to_owned()
        } else {
            format!("{measured} measured, scaled")
        }
    ));
    let peak_mib = rss_bytes("VmHWM:") as f64 / (1u64 << 20) as f64;
    out.push(format!(
        "peak memory (VmHWM): {peak_mib:.0} MiB{}",
        if compare && b.exact_writer {
            " (the exact writers' copies of the state included)"
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
        "RESULT memories={} changed_per_s={:.0} incremental_ms={incremental_ms:.1} recompute_ms={recompute_ms:.0} ratio={:.1} index={index} precision={} index_precision={}{extra} max_community={largest} cap={} writers={writers} tenants={} writer_rss_mib={rss_mib:.0} peak_rss_mib={peak_mib:.0}",
        b.memories,
        b.batch as f64 / incremental_ms * 1e3,
        recompute_ms / incremental_ms,
        if b.int8 { "int8" } else { "f32" },
        b.index_precision.as_str(),
        b.max_community,
        b.tenants.max(1),
    ));
    Ok(out.0)
}

/// The report's lines, each also logged as it is known: a run of hours
/// that is stopped (or runs out of memory) still shows how far it got.
#[derive(Default)]
struct Lines(Vec<String>);

impl Lines {
    fn push(&mut self, line: String) {
        tracing::info!("bench communities: {line}");
        self.0.push(line);
    }
}

fn state_len(states: &[SteamState]) -> usize {
    states.iter().map(SteamState::len).sum()
}

/// The links before the measured batches, restored into `state`; returns
/// how they were found. Synthetic topics: exact per topic (cross-topic
/// cosines are ~0, far below τ, so each memory's global top-k1 lies in its
/// topic), never to the same user or another tenant. Real texts: by the
/// writer's own IVF (`kernel`, its index already built), as if the writer
/// had linked every memory as it came; with the exact index, by an IVF
/// probing 32 lists (exhaustive search of 1M memories would take an hour).
/// Either way the initial graph is approximate; the batches' links are
/// compared against the exact kernel all the same.
fn initial_links(
    b: &CommunitiesBench,
    state: &mut SteamState,
    by_topic: &[Vec<(u64, usize)>],
    f32_kernel: &Arc<dyn SimilarityKernel>,
    (kernel, base): (&Arc<dyn SimilarityKernel>, &Arc<dyn SimilarityKernel>),
) -> Result<String> {
    let params = *state.params();
    if b.texts.is_some() {
        let (ivf, how): (Arc<dyn SimilarityKernel>, String) = if b.ivf {
            (
                kernel.clone(),
                format!("the writer's IVF, {} probes", b.probes),
            )
        } else {
            let ivf = IvfKernel::new(
                IvfKernelParams {
                    probes: 32,
                    min_rows: 1,
                    ..IvfKernelParams::default()
                },
                base.clone(),
            );
            (Arc::new(ivf), "IVF, 32 probes".to_owned())
        };
        let mut all: Vec<MemoryId> = state
            .user_ids()
            .filter_map(|u| state.user(u))
            .flat_map(|u| u.memories.iter().map(|m| m.id))
            .collect();
        all.sort_unstable();
        // Restored block by block: the links found are never held all at
        // once beside the state (at 10M memories that would be gigabytes).
        for block in all.chunks(16_384) {
            let mut found: HashMap<MemoryId, Vec<Link>> = HashMap::new();
            for l in state.link_dry_run(ivf.as_ref(), block).map_err(internal)? {
                found.entry(l.from).or_default().push(l);
            }
            for (from, links) in found {
                state.restore_links(from, links);
            }
        }
        return Ok(how);
    }
    let tenants = b.tenants.max(1);
    for members in by_topic {
        if members.len() < 2 {
            continue;
        }
        let mut rows = Vec::with_capacity(members.len() * b.dim);
        for &(id, _) in members {
            if let Some(e) = state.embedding(mid(id)) {
                rows.extend_from_slice(&e);
            }
        }
        let corpus = Corpus::from_rows(&rows, b.dim).map_err(internal)?;
        let exclude = |q: usize, c: usize| {
            let (a, b) = (members[q].1, members[c].1);
            a == b || a % tenants != b % tenants
        };
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
                    from: mid(members[q].0),
                    to: mid(members[h.index as usize].0),
                    score: h.score,
                })
                .collect();
            state.restore_links(mid(members[q].0), links);
        }
    }
    Ok("exact, per topic".to_owned())
}
