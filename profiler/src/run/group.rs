//! A member of a concurrent group: cells that a sweep starts together (one process per target) and
//! that must measure at the same time. The members meet after warm-up, so that their measured phases
//! overlap however long each took to build its model, and after measuring each keeps its device
//! busy until every member has measured, so that no member's measurement ends beside an idle
//! neighbour.
//!
//! They meet through files in a folder the sweep makes for the group instance (named to the members
//! in [`GROUP_DIR_ENV`]): `members` (written by the sweep once every member has started: one line
//! `pid cell_id` each), `ready-<cell_id>` and `done-<cell_id>` (written by each member). A member that
//! dies is not waited for: meeting fails (the group's measurement would not overlap), holding ends.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

/// The folder of the member's group instance.
pub const GROUP_DIR_ENV: &str = "MIGPROF_GROUP_DIR";

/// How long a member waits for the member list and for the others to warm up.
const MEET_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct GroupMember {
    dir: PathBuf,
    /// This member's cell id.
    me: String,
    timeout: Duration,
    marked_done: bool,
}

impl GroupMember {
    pub fn new(dir: &Path, me: &str) -> Self {
        Self { dir: dir.to_path_buf(), me: me.to_string(), timeout: MEET_TIMEOUT, marked_done: false }
    }

    /// The member this process is, when a sweep started it in a group.
    pub fn from_env(me: &str) -> Option<Self> {
        std::env::var_os(GROUP_DIR_ENV).map(|d| Self::new(Path::new(&d), me))
    }

    #[cfg(test)]
    fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Every member's pid and cell id, once the sweep has written them.
    pub fn members(&self) -> Result<Vec<(u32, String)>> {
        let path = self.dir.join("members");
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                return text
                    .lines()
                    .map(|l| {
                        let (pid, id) = l.split_once(' ').with_context(|| format!("{}: `{l}`", path.display()))?;
                        Ok((pid.parse()?, id.to_string()))
                    })
                    .collect();
            }
            if started.elapsed() > self.timeout {
                bail!("the concurrent group's member list {} did not appear within {} s", path.display(), self.timeout.as_secs())
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Says this member is warm and waits for every other member to say so too.
    pub fn meet(&mut self) -> Result<()> {
        touch(&self.dir.join(format!("ready-{}", self.me)))?;
        let members = self.members()?;
        let started = Instant::now();
        loop {
            let waiting: Vec<&(u32, String)> = members.iter().filter(|(_, id)| !self.dir.join(format!("ready-{id}")).exists()).collect();
            if waiting.is_empty() {
                return Ok(());
            }
            if let Some((pid, id)) = waiting.iter().find(|(pid, _)| !alive(*pid)) {
                bail!("a member of the concurrent group (cell {id}, pid {pid}) ended before its measured phase: the group's measurements would not overlap")
            }
            if started.elapsed() > self.timeout {
                bail!("the concurrent group's members did not all warm up within {} s", self.timeout.as_secs())
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// After this member's measured phase: whether to keep the device busy (another member, still
    /// alive, has not finished measuring). The first call says this member is done.
    pub fn hold(&mut self) -> Result<bool> {
        if !self.marked_done {
            touch(&self.dir.join(format!("done-{}", self.me)))?;
            self.marked_done = true;
        }
        let members = self.members()?;
        Ok(members.iter().any(|(pid, id)| !self.dir.join(format!("done-{id}")).exists() && alive(*pid)))
    }
}

/// The sweep's side: the member list, written whole (a temporary file renamed into place).
pub fn write_members(dir: &Path, members: &[(u32, String)]) -> Result<()> {
    let text: String = members.iter().map(|(pid, id)| format!("{pid} {id}\n")).collect();
    let tmp = dir.join(".members.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join("members"))?;
    Ok(())
}

fn touch(path: &Path) -> Result<()> {
    std::fs::write(path, b"").with_context(|| format!("writing {}", path.display()))
}

fn alive(pid: u32) -> bool {
    // SAFETY: signal 0 sends nothing; it asks whether the process exists.
    unsafe { libc::kill(pid as libc::pid_t, 0) == 0 }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn members_meet_after_warm_up_and_hold_until_all_have_measured() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        write_members(dir.path(), &[(me, "a".into()), (me, "b".into())]).unwrap();
        let mut a = GroupMember::new(dir.path(), "a");
        let b = std::thread::spawn({
            let dir = dir.path().to_path_buf();
            move || {
                let mut b = GroupMember::new(&dir, "b");
                std::thread::sleep(Duration::from_millis(100)); // a slower warm-up
                b.meet().unwrap();
                let met = Instant::now();
                std::thread::sleep(Duration::from_millis(100)); // b measures longer
                assert!(!b.hold().unwrap(), "a has measured by now");
                met
            }
        });
        let before = Instant::now();
        a.meet().unwrap();
        assert!(before.elapsed() >= Duration::from_millis(90), "a waited for b's warm-up");
        // a measures briefly, then holds while b still measures.
        assert!(a.hold().unwrap());
        let met = b.join().unwrap();
        assert!(met.elapsed() >= Duration::from_millis(100));
        assert!(!a.hold().unwrap());
    }

    #[test]
    fn a_member_that_died_is_not_waited_for() {
        let dir = tempfile::tempdir().unwrap();
        let gone = std::process::Command::new("true").spawn().unwrap();
        let gone_pid = gone.id();
        drop(gone.wait_with_output());
        write_members(dir.path(), &[(std::process::id(), "a".into()), (gone_pid, "b".into())]).unwrap();
        let mut a = GroupMember::new(dir.path(), "a").with_timeout(Duration::from_secs(5));
        let e = a.meet().unwrap_err().to_string();
        assert!(e.contains(&format!("(cell b, pid {gone_pid}) ended before its measured phase")), "{e}");
        assert!(!a.hold().unwrap(), "a dead member is not held for");
        // No member list at all: a bounded wait, then a clear error.
        let empty = tempfile::tempdir().unwrap();
        let e = GroupMember::new(empty.path(), "a").with_timeout(Duration::from_millis(50)).members().unwrap_err().to_string();
        assert!(e.contains("member list") && e.contains("did not appear"), "{e}");
    }
}
