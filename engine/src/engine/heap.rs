//! The process heap's policy for returning freed memory to the OS: glibc's default gives it
//! back at once, and every step's buffers then come back as fresh pages that fault in again.
//!
//! A forward pass allocates its activations at the start of a step and frees them at the end
//! (`model::host`). glibc trims the top of its heap whenever the free space there passes
//! `M_TRIM_THRESHOLD` (128 KiB, raised only when a freed chunk was an mmap), and serves any
//! allocation over `M_MMAP_THRESHOLD` from a fresh mmap. So a step's buffers were new pages
//! each step: on stories260K a 128-token prefill took 40-67 page faults (3 µs each on the
//! bench VM), 0.1-0.2 ms of a 0.5-0.6 ms step, and how many depended on the heap's history
//! (benchmarks/history/2026-11-29-stories-prefill.md). Fixed thresholds keep freed memory in
//! the heap for the next step; a serving process reuses it at once, so holding it costs no
//! more than the step's peak.

use std::sync::OnceLock;

/// Largest allocation served from the heap: glibc's own ceiling for its dynamic threshold
/// (32 MiB on 64-bit). Larger ones (KV caches, weights) still get their own mmap.
const MMAP_THRESHOLD_BYTES: i32 = 32 << 20;

/// Free space kept at the heap's top before glibc trims it: twice the mmap threshold, the
/// ratio glibc's dynamic rule keeps.
const TRIM_THRESHOLD_BYTES: i32 = 64 << 20;

/// Sets the thresholds once per process, unless the user set malloc's own (environment
/// `MALLOC_*THRESHOLD_` or `GLIBC_TUNABLES=glibc.malloc.*`), which then stand. Returns whether this
/// process runs with the engine's thresholds.
pub(crate) fn keep_freed_heap() -> bool {
    static SET: OnceLock<bool> = OnceLock::new();
    *SET.get_or_init(|| !user_set() && set_thresholds())
}

/// Whether the environment carries the user's own malloc thresholds.
fn user_set() -> bool {
    std::env::vars_os().any(|(k, v)| {
        let (k, v) = (k.to_string_lossy(), v.to_string_lossy());
        (k.starts_with("MALLOC_") && k.ends_with("THRESHOLD_"))
            || (k == "GLIBC_TUNABLES" && v.contains("glibc.malloc."))
    })
}

#[cfg(all(target_os = "linux", target_env = "gnu"))]
fn set_thresholds() -> bool {
    // glibc's malloc.h; not in every libc crate version's bindings.
    const M_TRIM_THRESHOLD: i32 = -1;
    const M_MMAP_THRESHOLD: i32 = -3;
    extern "C" {
        fn mallopt(param: i32, value: i32) -> i32;
    }
    // SAFETY: mallopt takes plain integers and is thread-safe (it takes the arena locks).
    unsafe {
        mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            && mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1
    }
}

#[cfg(not(all(target_os = "linux", target_env = "gnu")))]
fn set_thresholds() -> bool {
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    fn glibc_takes_the_thresholds_once() {
        if user_set() {
            eprintln!("malloc thresholds set in the environment: they stand, nothing to test");
            return;
        }
        assert!(keep_freed_heap(), "mallopt refused the thresholds");
        assert!(
            keep_freed_heap(),
            "a second call reports the first's result"
        );
    }
}
