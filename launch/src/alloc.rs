//! The memory allocator of `merak`: mimalloc, told to keep freed memory, its allocations
//! counted.
//!
//! A training step frees and allocates the same large buffers (logits, activations, gradients)
//! every step. With the system allocator, or with mimalloc's default of returning freed memory
//! to the kernel after 10 ms (`purge_delay`), those buffers are unmapped and faulted in again,
//! page by page and zeroed, every step: measured on the 4-layer GPT of `bench-vs-pytorch`,
//! about 3,600 page faults per step with the default and 0 with purging off (see
//! benches/README.md). A training process keeps its peak working set anyway, so purging off
//! costs no memory at the peak.

/// The process's allocator, counted: `memory.json` reports its high-water mark.
#[cfg(not(test))]
#[global_allocator]
static GLOBAL: merak_burn::train::process::CountingAllocator<mimalloc::MiMalloc> =
    merak_burn::train::process::CountingAllocator::new(mimalloc::MiMalloc);

/// The unit tests' allocator: mimalloc (whose page faults a test below measures) under the
/// caps of the tests of parsers of untrusted input ([`merak_tests::CappedAlloc`]).
#[cfg(test)]
#[global_allocator]
static GLOBAL: merak_tests::CappedAlloc<mimalloc::MiMalloc> =
    merak_tests::CappedAlloc::new(mimalloc::MiMalloc);

/// `mi_option_purge_delay` in the option enumeration of the mimalloc bundled with
/// libmimalloc-sys 0.1.49 (`mimalloc.h`, v2 and v3 alike); `libmimalloc-sys` names no
/// constant for it.
const MI_OPTION_PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;

/// Tells mimalloc never to return freed memory to the kernel (purge delay -1), unless the
/// user set `MIMALLOC_PURGE_DELAY` themselves. Call before the first step.
pub fn keep_freed_memory() {
    if std::env::var_os("MIMALLOC_PURGE_DELAY").is_none() {
        // SAFETY: mi_option_set only stores the value; any option id and value are accepted.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Minor page faults of this thread (tests run in parallel threads of one process, so the
    /// process's count would include the others').
    fn minor_faults() -> u64 {
        let s = std::fs::read_to_string("/proc/thread-self/stat").expect("/proc/thread-self/stat");
        let rest = &s[s.rfind(')').expect("command name") + 1..];
        rest.split_whitespace()
            .nth(7)
            .and_then(|f| f.parse().ok())
            .expect("minflt")
    }

    /// Page faults of allocating, touching and freeing a 48 MiB buffer, after doing it once.
    fn faults_of_a_reused_buffer() -> u64 {
        let touch = || {
            let v = vec![1u8; 48 << 20];
            assert!(v.iter().step_by(4096).all(|&b| b == 1));
        };
        touch();
        std::thread::sleep(std::time::Duration::from_millis(50));
        let before = minor_faults();
        touch();
        minor_faults() - before
    }

    #[test]
    fn the_unit_tests_run_under_the_allocation_caps() {
        merak_tests::assert_capped();
    }

    /// With purging on (delay 0) a freed buffer comes back as fresh pages; with
    /// [`keep_freed_memory`] it comes back without page faults.
    #[test]
    fn a_freed_large_buffer_is_reused_without_page_faults() {
        // SAFETY: as in keep_freed_memory.
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, 0) };
        let purged = faults_of_a_reused_buffer();
        unsafe { libmimalloc_sys::mi_option_set(MI_OPTION_PURGE_DELAY, -1) };
        // Other tests' threads may take the cached segment meanwhile (which only adds
        // faults): the fewest of three tries.
        let kept = (0..3)
            .map(|_| faults_of_a_reused_buffer())
            .min()
            .unwrap_or(0);
        eprintln!("page faults: {purged} purged, {kept} kept");
        assert!(purged > 10, "purging should cost page faults ({purged})");
        assert!(kept * 10 < purged, "{kept} page faults with purging off");
    }
}
