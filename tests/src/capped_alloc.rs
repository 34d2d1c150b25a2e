//! A global allocator for tests of parsers of untrusted input: another allocator under two
//! caps, so that a parser allocating by a number read from its input fails the test (the
//! allocation returns null and the process aborts) instead of passing by overcommit.
//!
//! ```no_run
//! #[global_allocator]
//! static GLOBAL: merak_tests::CappedAlloc<std::alloc::System> =
//!     merak_tests::CappedAlloc::new(std::alloc::System);
//! ```

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The largest single allocation.
pub const MAX_ONE: usize = 256 << 20;
/// The most bytes live at once.
pub const MAX_LIVE: usize = 2 << 30;

/// `A` refusing any single allocation above [`MAX_ONE`] and more than [`MAX_LIVE`] live.
pub struct CappedAlloc<A> {
    inner: A,
    live: AtomicUsize,
}

impl<A> CappedAlloc<A> {
    /// `inner` under the caps.
    pub const fn new(inner: A) -> Self {
        Self {
            inner,
            live: AtomicUsize::new(0),
        }
    }

    /// Counts `grow` more bytes live for an allocation of `size`; false past a cap.
    fn reserve(&self, size: usize, grow: usize) -> bool {
        if size > MAX_ONE {
            return false;
        }
        if self.live.fetch_add(grow, Ordering::Relaxed) + grow > MAX_LIVE {
            self.live.fetch_sub(grow, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// `p`, or the reservation of `grow` bytes undone if `p` is null.
    fn settle(&self, p: *mut u8, grow: usize) -> *mut u8 {
        if p.is_null() {
            self.live.fetch_sub(grow, Ordering::Relaxed);
        }
        p
    }
}

// SAFETY: every call goes to `inner` with the caller's arguments, or returns null.
unsafe impl<A: GlobalAlloc> GlobalAlloc for CappedAlloc<A> {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size(), layout.size()) {
            return std::ptr::null_mut();
        }
        self.settle(unsafe { self.inner.alloc(layout) }, layout.size())
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !self.reserve(layout.size(), layout.size()) {
            return std::ptr::null_mut();
        }
        self.settle(unsafe { self.inner.alloc_zeroed(layout) }, layout.size())
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        unsafe { self.inner.dealloc(ptr, layout) };
        self.live.fetch_sub(layout.size(), Ordering::Relaxed);
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let grow = new_size.saturating_sub(layout.size());
        if !self.reserve(new_size, grow) {
            return std::ptr::null_mut();
        }
        let p = self.settle(unsafe { self.inner.realloc(ptr, layout, new_size) }, grow);
        if !p.is_null() {
            self.live
                .fetch_sub(layout.size().saturating_sub(new_size), Ordering::Relaxed);
        }
        p
    }
}

/// Asserts that the process's allocator is capped: one allocation above [`MAX_ONE`] is
/// refused, a small one is not. Each test binary that installs the cap calls it in a test.
pub fn assert_capped() {
    assert!(Vec::<u8>::new().try_reserve(MAX_ONE + 1).is_err());
    assert!(Vec::<u8>::new().try_reserve(1 << 20).is_ok());
}
