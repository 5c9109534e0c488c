//! Batch similarity kernels for steamrf.
//!
//! Placeholder crate for the kernels issue: the `SimilarityKernel` trait, a
//! scalar reference, the blocked SIMD CPU kernel and the CUDA kernels through
//! cudarc land here. Architecture invariant: no tokio, Kafka or LanceDB.
