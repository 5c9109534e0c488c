//! The options of `steamrf eval steam`: the task, the data, and the
//! ablations of the item geometry and of `recommend`'s scoring.

use std::path::PathBuf;

use steamrf_operators::steam::SteamParams;
use steamrf_pipelines::config::EmbedConfig;

/// Options of `steamrf eval steam`.
#[derive(Debug, Clone)]
pub struct SteamEval {
    /// The amazon_cds_agentcf directory, or ml-100k's.
    pub data: PathBuf,
    /// cds-dense, cds-sparse, ml100k-catalogue (negatives from the whole
    /// catalogue), ml100k-users (negatives from the sampled users' items) or
    /// ml100k-paper (the paper's sample: 5 history ratings and the target
    /// per user, nothing else learned from).
    pub subset: String,
    /// Shuffle seeds.
    pub seeds: Vec<u64>,
    /// The embedder.
    pub embed: EmbedConfig,
    /// Where the markdown table and the plot go.
    pub out: PathBuf,
    /// ranking, simulation (the AFL protocol) or diversity.
    pub task: String,
    /// Where to write the fused ranker's fitted weights as a config file
    /// (`[serve.ranker]`), for `steamrf serve -c`.
    pub fit_out: Option<PathBuf>,
    /// The embedding-geometry ablation; the default is the paper's set-up.
    pub geometry: Geometry,
    /// Overrides of `recommend`'s neighbours term (the defaults otherwise).
    pub scoring: Scoring,
    /// Stop after the fused ranker's validation fit (ranking only): print
    /// each signal's and the fits' validation NDCG@10; no test user is
    /// scored. What STEAM's parameters are chosen with.
    pub fit_only: bool,
    /// `steam.index_precision` of the STEAM states built.
    pub index_precision: steamrf_kernels::RowPrecision,
}

/// Overrides of `recommend`'s neighbours(c) term (`RecommendParams`), for
/// the ablation and the validation sweep that chose its defaults.
#[derive(Debug, Clone, Copy, Default)]
pub struct Scoring {
    /// δ (default `RecommendParams::default().neighbour_weight`).
    pub neighbour_weight: Option<f32>,
    /// k_n (default `RecommendParams::default().k_neighbours`).
    pub k_neighbours: Option<usize>,
}

/// The embedding-geometry ablation (issue 17; `steam::geometry` in the
/// operators explains why): how item texts are written, whether item
/// vectors are mean-centred, and whether τ is read off the distribution of
/// item-item cosines.
#[derive(Debug, Clone, Copy, Default)]
pub struct Geometry {
    /// Item text `"{title}. {category}"` instead of the data set's sentence
    /// template (the AgentCF and STEAM prompts' wording).
    pub plain_text: bool,
    /// Mean-centre the item vectors over the items the run embeds.
    pub centre: bool,
    /// τ for formation, links and recommendation alike (the paper uses one
    /// τ) = this quantile of the item-item cosines; `None`: the paper's 0.5.
    pub tau_quantile: Option<f32>,
}

impl Geometry {
    /// One line for the report.
    pub(super) fn describe(&self, tau: Option<f32>) -> String {
        format!(
            "item text {}, {}, τ {}",
            if self.plain_text {
                "plain"
            } else {
                "templated"
            },
            if self.centre {
                "mean-centred"
            } else {
                "not centred"
            },
            match (self.tau_quantile, tau) {
                (Some(q), Some(t)) => format!("{t:.3} (the {q} quantile of item-item cosines)"),
                _ => format!("{} (the paper's)", SteamParams::default().link_tau),
            }
        )
    }
}
