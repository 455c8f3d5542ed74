//! Where and when a result was made: host, time, migprof version and commit, and unique run ids.

use std::sync::atomic::{AtomicU32, Ordering};

use chrono::{DateTime, Utc};

pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// `git describe --always --dirty` of the source migprof was built from, or "unknown".
pub const GIT_COMMIT: &str = env!("MIGPROF_GIT_COMMIT");
/// The candle-core version this build links.
pub const CANDLE_VERSION: &str = env!("MIGPROF_CANDLE_VERSION");

pub fn now() -> DateTime<Utc> {
    Utc::now()
}

/// The machine's host name, or "unknown".
pub fn host() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .map(|h| h.trim().to_string())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "unknown".to_string())
}

/// A run id that sorts by start time and stays unique across processes and hosts writing into one
/// folder: UTC start time, a per-process counter (orders runs started within one millisecond), then
/// 32 random bits (tells processes apart).
pub fn run_id(started: DateTime<Utc>) -> String {
    static COUNTER: AtomicU32 = AtomicU32::new(0);
    let n = COUNTER.fetch_add(1, Ordering::Relaxed);
    format!(
        "{}-{n:06}-{:08x}",
        started.format("%Y%m%dT%H%M%S%.3fZ"),
        rand::random::<u32>()
    )
}

/// The first `model name` of /proc/cpuinfo (Linux x86 and most Arm kernels).
pub fn cpu_model() -> Option<String> {
    let info = std::fs::read_to_string("/proc/cpuinfo").ok()?;
    info.lines().find_map(|l| {
        l.strip_prefix("model name")
            .and_then(|r| r.split_once(':'))
            .map(|(_, v)| v.trim().to_string())
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn run_ids_are_unique_and_sort_by_time() {
        let t = now();
        let a = run_id(t);
        let b = run_id(t);
        assert_ne!(a, b);
        let later = run_id(t + chrono::Duration::seconds(1));
        assert!(a < later && b < later);
        assert!(a.is_ascii() && !a.contains('/'), "usable in a file name: {a}");
    }
}
