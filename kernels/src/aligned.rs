//! Buffers that start on a cache line.
//!
//! An AMX tile load reads 16 rows of 64 bytes. A row that starts on a
//! 64-byte boundary is one cache line; one that does not straddles two, and
//! the loads of a GEMM then move twice the lines from L2. `Vec<u16>` and
//! `Vec<u8>` promise only their element's alignment, and glibc places large
//! allocations 16 bytes past a page, so the packed weights and activations
//! of the AMX paths live in [`Aligned`] instead (measured: the bf16 GEMM at
//! 512 × 384 × 1,152 ran at ~560 GFLOP/s with its weights 16 bytes off a
//! line and ~1,050 with them on one; docs/results.md).

use std::fmt;
use std::marker::PhantomData;
use std::ops::{Deref, DerefMut};

/// One cache line of storage.
#[repr(C, align(64))]
#[derive(Clone, Copy)]
struct Line([u8; 64]);

/// Element types an [`Aligned`] may hold: plain numbers, for which every
/// bit pattern (all zeros included) is a value, with no padding, whose size
/// divides 64.
pub(crate) trait Plain: Copy + PartialEq + fmt::Debug + 'static {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for i32 {}
impl Plain for f32 {}

/// A `Vec<T>`-like buffer whose first element sits on a 64-byte boundary.
#[derive(Clone)]
pub(crate) struct Aligned<T: Plain> {
    lines: Vec<Line>,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Plain> Aligned<T> {
    const PER_LINE: usize = 64 / size_of::<T>();

    /// `len` zeros.
    pub(crate) fn zeroed(len: usize) -> Self {
        Self {
            lines: vec![Line([0; 64]); len.div_ceil(Self::PER_LINE)],
            len,
            _t: PhantomData,
        }
    }

    /// An empty buffer.
    pub(crate) const fn new() -> Self {
        Self {
            lines: Vec::new(),
            len: 0,
            _t: PhantomData,
        }
    }

    /// As `Vec::resize`: new elements are `value`.
    pub(crate) fn resize(&mut self, len: usize, value: T) {
        let old = self.len;
        let lines = len.div_ceil(Self::PER_LINE);
        if lines > self.lines.len() {
            self.lines.resize(lines, Line([0; 64]));
        }
        self.len = len;
        if len > old {
            self[old..].fill(value);
        }
    }

    /// As `Vec::truncate`.
    pub(crate) fn truncate(&mut self, len: usize) {
        if len < self.len {
            self.len = len;
            self.lines.truncate(len.div_ceil(Self::PER_LINE));
        }
    }
}

impl<T: Plain> Default for Aligned<T> {
    fn default() -> Self {
        Self::new()
    }
}

impl<T: Plain> Deref for Aligned<T> {
    type Target = [T];

    fn deref(&self) -> &[T] {
        // SAFETY: `lines` holds at least `len · size_of::<T>()` initialised
        // bytes (every resize keeps `lines.len() · 64 >= len · size_of::<T>()`),
        // aligned to 64 ≥ `align_of::<T>()`, and every bit pattern is a `T`
        // (`Plain`).
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as in `deref`, through the unique borrow of `lines`.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<T>(), self.len) }
    }
}

impl<T: Plain> PartialEq for Aligned<T> {
    fn eq(&self, other: &Self) -> bool {
        **self == **other
    }
}

impl<T: Plain> fmt::Debug for Aligned<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Aligned").field("len", &self.len).finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn starts_on_a_line_and_behaves_like_a_vec() {
        let mut a: Aligned<u16> = Aligned::zeroed(45);
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert!(a.iter().all(|&v| v == 0));
        a[44] = 7;
        a.resize(100, 3);
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert_eq!((a.len(), a[44], a[45], a[99]), (100, 7, 3, 3));
        a.truncate(40);
        assert_eq!(a.len(), 40);
        a.resize(41, 9);
        assert_eq!(a[40], 9, "a regrown element takes the new value");
        let b = a.clone();
        assert_eq!(a, b);
        let mut e: Aligned<f32> = Aligned::new();
        assert!(e.is_empty());
        e.resize(3, 1.5);
        assert_eq!(&*e, &[1.5, 1.5, 1.5]);
    }
}
