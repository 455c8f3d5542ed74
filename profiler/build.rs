//! Records the git commit migprof is built from, so every result row can name its source.
use std::process::Command;

fn main() {
    let commit = Command::new("git")
        .args(["describe", "--always", "--dirty", "--abbrev=12"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=MIGPROF_GIT_COMMIT={commit}");
    // The candle this build links, from the lock file (candle exports no version constant).
    let lock = std::fs::read_to_string("../Cargo.lock").unwrap_or_default();
    let candle = lock
        .split("[[package]]")
        .find(|p| p.contains("name = \"candle-core\""))
        .and_then(|p| p.lines().find_map(|l| l.trim().strip_prefix("version = ")))
        .map(|v| v.trim_matches('"').to_string())
        .unwrap_or_else(|| "unknown".to_string());
    println!("cargo:rustc-env=MIGPROF_CANDLE_VERSION={candle}");
    println!("cargo:rerun-if-changed=../Cargo.lock");
    // Re-run when a commit or checkout moves HEAD, the index changes, or the sources change (which
    // is what makes a build `-dirty`).
    println!("cargo:rerun-if-changed=src");
    println!("cargo:rerun-if-changed=../workloads/src");
    for p in ["../.git/HEAD", "../.git/logs/HEAD", "../.git/index"] {
        if std::path::Path::new(p).exists() {
            println!("cargo:rerun-if-changed={p}");
        }
    }
}
