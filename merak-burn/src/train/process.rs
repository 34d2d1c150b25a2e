//! This process's memory statistics: page faults and peak resident memory read from `/proc`
//! (Linux; elsewhere they read as 0), and the allocator's high-water mark when the program
//! installs [`CountingAllocator`].

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// Minor page faults of this process so far (field 10 of `/proc/self/stat`): each one is a
/// page the kernel mapped, usually zeroed, for memory touched the first time. A training step
/// whose buffers are reused makes few.
pub fn minor_faults() -> u64 {
    std::fs::read_to_string("/proc/self/stat")
        .ok()
        .and_then(|s| {
            // The command name (field 2) is in parentheses and may hold spaces.
            let rest = &s[s.rfind(')')? + 1..];
            rest.split_whitespace().nth(7)?.parse().ok()
        })
        .unwrap_or(0)
}

/// Peak resident memory of this process in bytes (`VmHWM` of `/proc/self/status`).
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmHWM:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|kb| kb.parse::<u64>().ok())
        })
        .map_or(0, |kb| kb * 1024)
}

static LIVE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

/// An allocator (`A`, for example `std::alloc::System` or mimalloc) counting the bytes
/// allocated through it and their high-water mark, which `memory.json` then reports
/// (`alloc_peak_mib`). Install it in a program with `#[global_allocator] static A:
/// CountingAllocator<System> = CountingAllocator::new(System);` (`merak` does, over mimalloc).
/// It costs two atomic additions per allocation and counts what Rust allocates: buffers of C
/// libraries (MPI's) are not in it, and neither is memory the allocator keeps after a free;
/// peak resident memory includes both.
pub struct CountingAllocator<A>(A);

impl<A> CountingAllocator<A> {
    /// Counts the allocations of `inner`.
    pub const fn new(inner: A) -> Self {
        Self(inner)
    }

    fn grew(by: usize) {
        let now = LIVE.fetch_add(by, Ordering::Relaxed) + by;
        PEAK.fetch_max(now, Ordering::Relaxed);
    }
}

// SAFETY: every call is forwarded to the inner allocator unchanged; the counters only observe
// sizes.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CountingAllocator<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract is the inner allocator's.
        let p = unsafe { self.0.alloc(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { self.0.alloc_zeroed(layout) };
        if !p.is_null() {
            INSTALLED.store(true, Ordering::Relaxed);
            Self::grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator, that is from the inner one, with `layout`.
        unsafe { self.0.dealloc(ptr, layout) };
        LIVE.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `dealloc`, and `new_size` is the caller's, as the inner `realloc` asks.
        let p = unsafe { self.0.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            if new_size >= layout.size() {
                Self::grew(new_size - layout.size());
            } else {
                LIVE.fetch_sub(layout.size() - new_size, Ordering::Relaxed);
            }
        }
        p
    }
}

/// The most bytes allocated at once so far through [`CountingAllocator`]; `None` when the
/// program did not install it.
pub fn alloc_peak_bytes() -> Option<u64> {
    INSTALLED
        .load(Ordering::Relaxed)
        .then(|| PEAK.load(Ordering::Relaxed) as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_counting_allocator_tracks_live_bytes_and_their_peak() {
        use std::alloc::System;
        let a = CountingAllocator::new(System);
        let layout = Layout::from_size_align(8 << 20, 8).expect("layout");
        let live = LIVE.load(Ordering::Relaxed);
        // SAFETY: a non-zero size; freed below with the same layout.
        let p = unsafe { a.alloc(layout) };
        assert!(!p.is_null());
        let peak = alloc_peak_bytes().expect("installed once it allocated");
        assert!(peak >= (live + (8 << 20)) as u64, "{peak}");
        // SAFETY: `p` came from `a` with `layout`; the new size is non-zero.
        let q = unsafe { a.realloc(p, layout, 4 << 20) };
        assert!(!q.is_null());
        let small = Layout::from_size_align(4 << 20, 8).expect("layout");
        // SAFETY: `q` came from `a` with `small`.
        unsafe { a.dealloc(q, small) };
        assert!(
            alloc_peak_bytes().expect("peak") >= peak,
            "the peak never falls"
        );
    }

    #[test]
    fn touching_fresh_memory_counts_faults_and_raises_the_peak() {
        let before = minor_faults();
        let v = vec![1u8; 64 << 20];
        assert!(v.iter().step_by(4096).all(|&b| b == 1));
        let after = minor_faults();
        assert!(after > before, "{before} -> {after}");
        assert!(peak_rss_bytes() >= 64 << 20);
    }
}
