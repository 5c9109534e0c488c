//! Returning freed memory to the operating system.
//!
//! glibc's malloc keeps freed memory in its arenas for reuse. A writer that
//! allocates and frees tens of MiB per micro-batch (Arrow buffers, LanceDB's
//! encodings, DataFusion's merge) otherwise keeps its peak RSS for good and
//! drifts upwards through fragmentation; `malloc_trim` after each batch hands
//! the free pages back (docs/reliability.md has the measurements).

/// Caps glibc's malloc arenas at `n` (0: glibc's default, 8 per core). Each
/// thread that meets contention gets an arena of its own, and memory freed
/// in one is reused only there: a process whose large allocations move
/// between threads (the service builds each snapshot on whichever blocking
/// thread is free) fragments across them. glibc only; elsewhere a no-op.
pub fn limit_arenas(n: usize) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    if n > 0 {
        let n = libc::c_int::try_from(n).unwrap_or(libc::c_int::MAX);
        #[allow(unsafe_code)]
        // SAFETY: mallopt sets a glibc tunable; it takes no pointers and is
        // safe to call at any time (arenas already created stay).
        let ok = unsafe { libc::mallopt(libc::M_ARENA_MAX, n) };
        if ok != 1 {
            tracing::warn!(
                arenas = n,
                "mallopt(M_ARENA_MAX) failed; glibc's default applies."
            );
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = n;
}

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

/// Bytes the allocator has handed out and not had back (glibc's
/// `mallinfo2`: small blocks in use plus mmapped ones), for accounting what
/// a data structure holds apart from what malloc keeps free; `None`
/// elsewhere.
pub fn in_use() -> Option<u64> {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        #[allow(unsafe_code)]
        // SAFETY: mallinfo2 only reads glibc's own counters (under each
        // arena's lock) and returns them by value.
        let info = unsafe { libc::mallinfo2() };
        Some((info.uordblks + info.hblkhd) as u64)
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    None
}
