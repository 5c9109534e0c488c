//! Reproducible test vectors shared by the backends' tests.

/// `n · dim` values uniform in [-1, 1) by splitmix64 from `seed`: no
/// structure across rows.
pub(crate) fn uniform(n: usize, dim: usize, seed: u64) -> Vec<f32> {
    (0..(n * dim) as u64)
        .map(|i| {
            let mut z = (i ^ (seed << 40)).wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            (z ^ (z >> 31)) as f32 / u64::MAX as f32 * 2.0 - 1.0
        })
        .collect()
}
