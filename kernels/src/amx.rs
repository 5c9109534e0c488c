//! What the AMX paths share: feature detection, Linux's permission for the
//! tile data state, the tile configuration, and the tile instructions as
//! inline assembly (Rust's AMX intrinsics are not stable).
//!
//! AMX (Intel Xeon 4th generation and later) adds eight tile registers of up
//! to 16 rows × 64 bytes and multiplies whole tiles: `tdpbf16ps` (bf16 pairs
//! summed into f32) and `tdpbusd` (u8 × i8 quadruples summed into i32), each
//! 16 × 16 × 64 bytes of products per instruction. Measured here (Intel
//! Xeon with `amx_bf16 amx_int8 amx_tile`, one core): `tdpbf16ps` on
//! register-resident tiles 3.1–3.2 TFLOP/s, against ~170 GFLOP/s for
//! AVX-512 f32 FMA.
//!
//! Linux (5.16+) gives a process the tile data state only when asked
//! (`arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)`): [`available`]
//! asks once per process, and a refusal (an older kernel, a hypervisor that
//! hides the state) makes every AMX path unavailable, so callers choose
//! another one.

use std::sync::OnceLock;

/// The AMX instruction groups a path needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Amx {
    /// `tdpbf16ps`.
    Bf16,
    /// `tdpbusd` and friends.
    Int8,
}

/// Whether this CPU has AMX-TILE and the `which` group, and Linux granted
/// this process the tile data state. Decided once per process.
pub fn available(which: Amx) -> bool {
    static GRANTED: OnceLock<(bool, bool)> = OnceLock::new();
    let (bf16, int8) = *GRANTED.get_or_init(|| {
        #[cfg(all(target_arch = "x86_64", target_os = "linux"))]
        {
            let (bf16, int8) = cpu_groups();
            if !(bf16 || int8) {
                return (false, false);
            }
            if request_permission() {
                (bf16, int8)
            } else {
                tracing::warn!(
                    "the CPU has AMX but Linux refused the tile data state \
                     (arch_prctl ARCH_REQ_XCOMP_PERM); the AMX paths are off"
                );
                (false, false)
            }
        }
        #[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
        {
            (false, false)
        }
    });
    match which {
        Amx::Bf16 => bf16,
        Amx::Int8 => int8,
    }
}

/// CPUID leaf 7, EDX: bit 24 AMX-TILE, bit 22 AMX-BF16, bit 25 AMX-INT8.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn cpu_groups() -> (bool, bool) {
    // Leaf 7 is queried only when the maximum leaf (leaf 0's EAX) has it.
    if std::arch::x86_64::__cpuid(0).eax < 7 {
        return (false, false);
    }
    let edx = std::arch::x86_64::__cpuid_count(7, 0).edx;
    let tile = edx & (1 << 24) != 0;
    (tile && edx & (1 << 22) != 0, tile && edx & (1 << 25) != 0)
}

/// Asks Linux for the tile data state (XTILEDATA, feature 18) for this
/// process; true when granted (or granted before).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn request_permission() -> bool {
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: arch_prctl with ARCH_REQ_XCOMP_PERM takes a feature number and
    // touches no memory of ours; an unknown request returns an error.
    let r = unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        )
    };
    r == 0
}

/// A tile configuration (palette 1) giving all eight tiles 16 rows of 64
/// bytes: the only shape the AMX paths use.
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
#[repr(C, align(64))]
pub(crate) struct Config([u8; 64]);

#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
impl Config {
    pub(crate) fn full() -> Self {
        let mut c = [0u8; 64];
        c[0] = 1;
        for t in 0..8 {
            c[16 + 2 * t..18 + 2 * t].copy_from_slice(&64u16.to_le_bytes());
            c[48 + t] = 16;
        }
        Self(c)
    }

    /// Loads the configuration into this thread's tile state.
    ///
    /// # Safety
    /// The CPU must have AMX-TILE and this process the tile data permission
    /// ([`available`]); the caller ends its tile work with [`release`].
    pub(crate) unsafe fn load(&self) {
        // SAFETY: the caller's contract; `self.0` is a 64-byte configuration
        // of palette 1 with valid shapes (16 rows, 64 bytes per row).
        unsafe {
            std::arch::asm!("ldtilecfg [{}]", in(reg) self.0.as_ptr(), options(nostack, readonly));
        }
    }
}

/// Releases this thread's tile state (after [`Config::load`]).
///
/// # Safety
/// As [`Config::load`].
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
pub(crate) unsafe fn release() {
    // SAFETY: the caller's contract.
    unsafe { std::arch::asm!("tilerelease", options(nostack, nomem)) }
}

/// `tileloadd tmm$tile, [$ptr + $stride]`: 16 rows of 64 bytes, `$stride`
/// bytes apart. Unsafe: the rows must be readable.
macro_rules! tile_load {
    ($tile:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(
            concat!("tileloadd tmm", $tile, ", [{p} + {s}]"),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack, readonly),
        )
    };
}

/// `tilestored [$ptr + $stride], tmm$tile`. Unsafe: the rows must be
/// writable and owned.
macro_rules! tile_store {
    ($tile:literal, $ptr:expr, $stride:expr) => {
        std::arch::asm!(
            concat!("tilestored [{p} + {s}], tmm", $tile),
            p = in(reg) $ptr,
            s = in(reg) $stride,
            options(nostack),
        )
    };
}

/// `tilezero tmm$tile`.
macro_rules! tile_zero {
    ($tile:literal) => {
        std::arch::asm!(concat!("tilezero tmm", $tile), options(nostack, nomem))
    };
}

/// `$op tmm$c, tmm$a, tmm$b` (`tdpbf16ps`, `tdpbusd`): C += A · B.
macro_rules! tile_dot {
    ($op:literal, $c:literal, $a:literal, $b:literal) => {
        std::arch::asm!(
            concat!($op, " tmm", $c, ", tmm", $a, ", tmm", $b),
            options(nostack, nomem),
        )
    };
}

pub(crate) use {tile_dot, tile_load, tile_store, tile_zero};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn detection_is_stable_and_logged() {
        let (b, i) = (available(Amx::Bf16), available(Amx::Int8));
        eprintln!("AMX on this machine: bf16 {b}, int8 {i}");
        assert_eq!((b, i), (available(Amx::Bf16), available(Amx::Int8)));
    }
}
