//! The heap's bytes in use and their high-water mark, counted by the process's allocator: what a
//! CPU run's memory estimate measures. The resident set it read before kept what the allocator had
//! freed and reused it unevenly, so the same probe twice gave estimates six-fold apart.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

/// The system allocator, counting.
pub struct Counting;

static IN_USE: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(bytes: usize) {
    let now = IN_USE.fetch_add(bytes, Ordering::Relaxed).saturating_add(bytes);
    PEAK.fetch_max(now, Ordering::Relaxed);
}

/// Never below zero: a count that wrapped would read as the whole address space in use.
fn shrank(bytes: usize) {
    let _ = IN_USE.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| Some(n.saturating_sub(bytes)));
}

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on unchanged.
        let p = unsafe { System.alloc(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.alloc_zeroed(layout) };
        if !p.is_null() {
            grew(layout.size());
        }
        p
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: as `alloc`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as `alloc`.
        let p = unsafe { System.realloc(ptr, layout, new_size) };
        if !p.is_null() {
            shrank(layout.size());
            grew(new_size);
        }
        p
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Bytes allocated and not yet freed.
pub fn in_use() -> usize {
    IN_USE.load(Ordering::Relaxed)
}

/// The most bytes in use at once since the last [`reset_peak`].
pub fn peak() -> usize {
    PEAK.load(Ordering::Relaxed)
}

/// Starts the high-water mark again from what is in use now.
pub fn reset_peak() {
    PEAK.store(in_use(), Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_buffer_is_counted_in_use_and_in_the_peak() {
        // Its 64 MiB would show in an estimate probed beside it.
        let _heap = crate::testing::heap_alone();
        // Other tests run beside this one: the peak is never reset here, and only what no other
        // thread can undo is asserted.
        let buffer = vec![1u8; 64 << 20];
        let (now, most) = (in_use(), peak());
        assert!(now >= 64 << 20 && most >= 64 << 20, "{now} in use, {most} at most");
        drop(buffer);
    }
}
