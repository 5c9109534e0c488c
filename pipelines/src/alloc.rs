//! Returning freed memory to the operating system.
//!
//! glibc's malloc keeps freed memory in its arenas for reuse. A writer that
//! allocates and frees tens of MiB per micro-batch (Arrow buffers, LanceDB's
//! encodings, DataFusion's merge) otherwise keeps its peak RSS for good and
//! drifts upwards through fragmentation; `malloc_trim` after each batch hands
//! the free pages back (docs/reliability.md has the measurements).

/// Releases free heap memory to the OS (glibc only; elsewhere a no-op).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[allow(unsafe_code)]
    // SAFETY: malloc_trim only walks glibc's own free lists; it takes no
    // pointers from us and is thread-safe (it locks each arena).
    unsafe {
        libc::malloc_trim(0);
    }
}
