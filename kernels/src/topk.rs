//! A bounded top-k collector in rank order ([`Hit::cmp_rank`]).

use std::collections::BinaryHeap;

use crate::Hit;

/// Heap entry ordered so that the *worst* kept hit is at the top.
#[derive(Debug, Clone, Copy)]
struct Worst(Hit);

impl PartialEq for Worst {
    fn eq(&self, other: &Self) -> bool {
        self.0.cmp_rank(&other.0).is_eq()
    }
}
impl Eq for Worst {}
impl PartialOrd for Worst {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Worst {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        // Greater = ranks later = worse.
        self.0.cmp_rank(&other.0)
    }
}

/// Keeps the best `k` hits offered.
#[derive(Debug, Clone)]
pub struct TopK {
    k: usize,
    heap: BinaryHeap<Worst>,
}

impl TopK {
    /// An empty collector for `k` hits.
    pub fn new(k: usize) -> Self {
        Self {
            k,
            heap: BinaryHeap::with_capacity(k.min(1 << 16) + 1),
        }
    }

    /// The score a new hit must reach to be considered (it may still lose a
    /// tie on index): `-inf` until `k` hits are held.
    #[inline]
    pub fn threshold(&self) -> f32 {
        if self.heap.len() < self.k {
            f32::NEG_INFINITY
        } else {
            self.heap.peek().map_or(f32::INFINITY, |w| w.0.score)
        }
    }

    /// Offers a hit.
    #[inline]
    pub fn push(&mut self, hit: Hit) {
        if self.k == 0 {
            return;
        }
        if self.heap.len() < self.k {
            self.heap.push(Worst(hit));
        } else if let Some(mut worst) = self.heap.peek_mut()
            && hit.better_than(&worst.0)
        {
            *worst = Worst(hit);
        }
    }

    /// Merges another collector's hits.
    pub fn merge(&mut self, other: TopK) {
        for w in other.heap {
            self.push(w.0);
        }
    }

    /// The hits, best first.
    pub fn into_sorted(self) -> Vec<Hit> {
        let mut v: Vec<Hit> = self.heap.into_iter().map(|w| w.0).collect();
        v.sort_by(Hit::cmp_rank);
        v
    }
}
