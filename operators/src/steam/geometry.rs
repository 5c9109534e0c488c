//! The embedding geometry STEAM's thresholds act on.
//!
//! Sentence embeddings of one catalogue share a common direction (the same
//! template, the same domain words), so every cosine between two items is
//! inflated: with all-MiniLM-L6-v2 and the AgentCF CD template the median
//! item-item cosine is ~0.53, and the paper's τ = 0.5 merges most of a
//! user's items into one memory. Two remedies the issue tracker asked to
//! measure (issue 17, docs/results.md *STEAM ranking*, the geometry ablation):
//!
//! - [`mean_centre`]: subtract the catalogue's mean vector and re-normalise,
//!   so cosines spread around 0;
//! - [`cosine_quantile`]: read τ off the observed distribution of item-item
//!   cosines instead of fixing it.

/// Subtracts the mean of `vectors` from each and re-normalises it to unit
/// length (a vector equal to the mean is left at zero). All vectors must
/// have one length.
pub fn mean_centre(vectors: &mut [&mut [f32]]) {
    let Some(dim) = vectors.first().map(|v| v.len()) else {
        return;
    };
    let mut mean = vec![0.0f64; dim];
    for v in vectors.iter() {
        debug_assert_eq!(v.len(), dim);
        for (m, x) in mean.iter_mut().zip(v.iter()) {
            *m += f64::from(*x);
        }
    }
    let n = vectors.len() as f64;
    for v in vectors.iter_mut() {
        for (x, m) in v.iter_mut().zip(&mean) {
            *x = (f64::from(*x) - m / n) as f32;
        }
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        if norm > f32::EPSILON {
            v.iter_mut().for_each(|x| *x /= norm);
        }
    }
}

/// The `q` quantile (nearest rank, `q` in [0, 1]) of the cosines between
/// pairs of `vectors` (unit length): every pair among the first `m`, the
/// largest `m` with at most `max_pairs` pairs, so the answer depends only on
/// the order the caller gives. `None` with fewer than two vectors.
#[must_use]
pub fn cosine_quantile(vectors: &[&[f32]], q: f32, max_pairs: usize) -> Option<f32> {
    let mut m = vectors.len();
    while m > 1 && m * (m - 1) / 2 > max_pairs.max(1) {
        m -= 1;
    }
    if m < 2 {
        return None;
    }
    let mut cos = Vec::with_capacity(m * (m - 1) / 2);
    for (i, a) in vectors[..m].iter().enumerate() {
        for b in &vectors[i + 1..m] {
            cos.push(a.iter().zip(b.iter()).map(|(x, y)| x * y).sum::<f32>());
        }
    }
    let rank = ((cos.len() - 1) as f32 * q.clamp(0.0, 1.0)).round() as usize;
    let (_, v, _) = cos.select_nth_unstable_by(rank, f32::total_cmp);
    Some(*v)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn unit(v: &[f32]) -> Vec<f32> {
        let n = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        v.iter().map(|x| x / n).collect()
    }

    #[test]
    fn centring_removes_the_shared_direction() {
        // Three vectors that share a large common component.
        let mut vs: Vec<Vec<f32>> = [[1.0, 0.2, 0.0], [1.0, -0.1, 0.1], [1.0, 0.0, -0.2]]
            .iter()
            .map(|v| unit(v))
            .collect();
        let before =
            cosine_quantile(&vs.iter().map(Vec::as_slice).collect::<Vec<_>>(), 0.0, 10).unwrap();
        assert!(before > 0.9, "inflated: {before}");
        let mut refs: Vec<&mut [f32]> = vs.iter_mut().map(Vec::as_mut_slice).collect();
        mean_centre(&mut refs);
        for v in &vs {
            let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "unit length: {norm}");
        }
        for d in 0..3 {
            let s: f32 = vs.iter().map(|v| v[d]).sum();
            assert!(s.abs() < 1.0, "roughly centred in dimension {d}: {s}");
        }
        let after =
            cosine_quantile(&vs.iter().map(Vec::as_slice).collect::<Vec<_>>(), 1.0, 10).unwrap();
        assert!(after < 0.5, "spread out: {after}");
    }

    #[test]
    fn the_quantile_is_read_off_the_pairs_in_the_given_order() {
        let a = [1.0, 0.0];
        let b = [0.0, 1.0];
        let c = unit(&[1.0, 1.0]);
        let vs: Vec<&[f32]> = vec![&a, &b, &c];
        // Pairs: a·b = 0, a·c = b·c = 0.707.
        assert_eq!(cosine_quantile(&vs, 0.0, 10), Some(0.0));
        let top = cosine_quantile(&vs, 1.0, 10).unwrap();
        assert!((top - std::f32::consts::FRAC_1_SQRT_2).abs() < 1e-6);
        // One pair allowed: only a and b count.
        assert_eq!(cosine_quantile(&vs, 1.0, 1), Some(0.0));
        assert_eq!(cosine_quantile(&vs[..1], 0.5, 10), None);
    }
}
