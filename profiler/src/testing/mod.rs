//! Stand-ins for what tests cannot have: a clock and a step of scripted duration ([`clock`]), and
//! NVML's MIG calls on a GPU whose layout may change ([`nvml`]). Behind the same traits as the real
//! things, so the code under test cannot tell.

pub mod clock;
pub mod nvml;

/// Taken first by each test that builds a workload or reads a memory estimate: the heap is counted
/// for the whole process (`heap`), so a workload built in one test would show in another's estimate.
pub fn heap_alone() -> std::sync::MutexGuard<'static, ()> {
    static HEAP: std::sync::Mutex<()> = std::sync::Mutex::new(());
    HEAP.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}
