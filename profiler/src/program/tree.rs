//! A process tree as Linux shows it in `/proc`: the processes below a process, and stopping them.
//! A program's tree is every process it started, whatever process group or session each moved to
//! (the keeper is their subreaper, so none leaves the tree by losing its parent).

use std::time::{Duration, Instant};

/// The parent of `pid` as `/proc/<pid>/stat` gives it; `None` for a process gone, unreadable, or
/// a zombie (ended, waiting to be reaped: no longer running).
fn parent(pid: u32) -> Option<u32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // `pid (comm) state ppid …`: the name may hold spaces and parentheses, so read after the last.
    let mut fields = stat[stat.rfind(')')? + 1..].split_whitespace();
    if fields.next()? == "Z" {
        return None;
    }
    fields.next()?.parse().ok()
}

/// Every process below `root` (`root` itself not included), parents before their children.
pub fn descendants(root: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let parents: Vec<(u32, u32)> = dir
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter_map(|pid| Some((pid, parent(pid)?)))
        .collect();
    let mut tree = Vec::new();
    let mut frontier = vec![root];
    while let Some(p) = frontier.pop() {
        for &(child, _) in parents.iter().filter(|(_, pp)| *pp == p) {
            tree.push(child);
            frontier.push(child);
        }
    }
    tree
}

/// Sends `signal` to each of `pids`.
pub fn signal(pids: &[u32], signal: i32) {
    for &pid in pids {
        // SAFETY: kill has no memory effects; a pid gone since it was read gets ESRCH.
        unsafe { libc::kill(pid as libc::pid_t, signal) };
    }
}

/// Stops every process below `root`: SIGTERM, then after `grace` SIGKILL to what is left, reaping
/// the ones that are this process's children (a subreaper's). The number of processes that were
/// running when it began.
pub fn stop_below(root: u32, grace: Duration) -> usize {
    let first = descendants(root);
    if first.is_empty() {
        return 0;
    }
    signal(&first, libc::SIGTERM);
    let deadline = Instant::now() + grace;
    loop {
        reap();
        let left = descendants(root);
        if left.is_empty() {
            break;
        }
        if Instant::now() >= deadline {
            signal(&left, libc::SIGKILL);
            // SIGKILL cannot be caught: the tree is gone once its members are reaped.
            let until = Instant::now() + Duration::from_secs(5);
            while !descendants(root).is_empty() && Instant::now() < until {
                reap();
                std::thread::sleep(Duration::from_millis(10));
            }
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    reap();
    first.len()
}

/// Reaps every child of this process that has ended, so that none stays a zombie in the tree.
pub fn reap() {
    loop {
        let mut status = 0;
        // SAFETY: waitpid writes the status into a local.
        let pid = unsafe { libc::waitpid(-1, &mut status, libc::WNOHANG) };
        if pid <= 0 {
            return;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;

    #[test]
    fn a_tree_is_found_and_stopped_whatever_group_its_members_moved_to() {
        // A shell that starts a sleeper in a session of its own and one beside it, then waits.
        let mut shell = Command::new("sh")
            .args(["-c", "setsid sleep 300 & sleep 300 & wait"])
            .spawn()
            .unwrap();
        let root = shell.id();
        let deadline = Instant::now() + Duration::from_secs(10);
        while descendants(root).len() < 2 && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        let tree = descendants(root);
        assert!(tree.len() >= 2, "{tree:?}");
        // The shell is a child of this test; its own children are below it.
        assert!(descendants(std::process::id()).contains(&root));
        signal(&[root], libc::SIGKILL);
        let _ = shell.wait();
        // With the shell gone its children went to init, out of this tree: stop them by pid.
        signal(&tree, libc::SIGKILL);
        // Gone, or a zombie its new parent has yet to reap.
        let gone = |pid: u32| parent(pid).is_none();
        let deadline = Instant::now() + Duration::from_secs(5);
        while !tree.iter().all(|&p| gone(p)) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(tree.iter().all(|&p| gone(p)), "{tree:?}");
        assert_eq!(parent(u32::MAX), None);
    }
}
