//! A member of a concurrent group: cells that a sweep starts together (one process per target) and
//! that must measure at the same time. The members meet after warm-up, so that their measured phases
//! overlap however long each took to build its model, and after measuring each keeps its device
//! busy until every member has measured, so that no member's measurement ends beside an idle
//! neighbour.
//!
//! They meet through files in a folder the sweep makes for the group instance (named to the members
//! in [`GROUP_DIR_ENV`]): `members` (written by the sweep once every member has started: one line
//! `pid cell_id device` each, the device being the one the sweep keeps cells apart by),
//! `ready-<cell_id>` and `done-<cell_id>` (written by each member). A member that dies is not waited
//! for: meeting fails (the group's measurement would not overlap; the failing member takes its
//! `ready-` back so that no later member meets a ghost), holding ends. Holding also ends at
//! [`HOLD_UNTIL_ENV`] (the sweep sets it inside the cell's timeout), so that a member whose neighbour
//! overruns is not killed with its measurement unwritten.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};

use crate::mps::processes::alive;

/// The folder of the member's group instance.
pub const GROUP_DIR_ENV: &str = "MIGPROF_GROUP_DIR";
/// Seconds since the Unix epoch after which a member stops holding.
pub const HOLD_UNTIL_ENV: &str = "MIGPROF_GROUP_HOLD_UNTIL";

/// How long a member waits for the member list and for the others to warm up.
const MEET_TIMEOUT: Duration = Duration::from_secs(600);

#[derive(Debug, Clone)]
pub struct GroupMember {
    dir: PathBuf,
    /// This member's cell id.
    me: String,
    timeout: Duration,
    marked_done: bool,
    /// When holding must end.
    hold_until: Option<std::time::SystemTime>,
}

/// A member as the list names it.
#[derive(Debug, Clone, PartialEq)]
pub struct Member {
    pub pid: u32,
    pub cell_id: String,
    pub device: String,
}

impl GroupMember {
    pub fn new(dir: &Path, me: &str) -> Self {
        Self {
            dir: dir.to_path_buf(),
            me: me.to_string(),
            timeout: MEET_TIMEOUT,
            marked_done: false,
            hold_until: None,
        }
    }

    /// The member this process is, when a sweep started it in a group.
    pub fn from_env(me: &str) -> Option<Self> {
        let hold_until = std::env::var(HOLD_UNTIL_ENV)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
            .map(|s| std::time::UNIX_EPOCH + Duration::from_secs(s));
        std::env::var_os(GROUP_DIR_ENV).map(|d| Self {
            hold_until,
            ..Self::new(Path::new(&d), me)
        })
    }

    /// The pids of the members on this member's device (this one included): the neighbours the
    /// sampler may find beside it.
    pub fn pids_on_my_device(&self) -> Result<Vec<u32>> {
        let members = self.members()?;
        let mine = members.iter().find(|m| m.cell_id == self.me).map(|m| m.device.clone());
        Ok(members
            .into_iter()
            .filter(|m| Some(&m.device) == mine.as_ref())
            .map(|m| m.pid)
            .collect())
    }

    #[cfg(test)]
    fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Every member, once the sweep has written the list.
    pub fn members(&self) -> Result<Vec<Member>> {
        let path = self.dir.join("members");
        let started = Instant::now();
        loop {
            if let Ok(text) = std::fs::read_to_string(&path) {
                return text
                    .lines()
                    .map(|l| {
                        let mut parts = l.splitn(3, ' ');
                        match (parts.next().map(str::parse::<u32>), parts.next(), parts.next()) {
                            (Some(Ok(pid)), Some(id), Some(device)) => Ok(Member {
                                pid,
                                cell_id: id.to_string(),
                                device: device.to_string(),
                            }),
                            _ => bail!("{}: `{l}` is not `pid cell_id device`", path.display()),
                        }
                    })
                    .collect();
            }
            if started.elapsed() > self.timeout {
                bail!(
                    "the concurrent group's member list {} did not appear within {} s",
                    path.display(),
                    self.timeout.as_secs()
                )
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Says this member is warm and waits for every other member to say so too.
    pub fn meet(&mut self) -> Result<()> {
        let ready = self.dir.join(format!("ready-{}", self.me));
        touch(&ready)?;
        let met = self.wait_for_all();
        if met.is_err() {
            // No later member may take this one for warm and measure without it.
            let _ = std::fs::remove_file(&ready);
        }
        met
    }

    fn wait_for_all(&self) -> Result<()> {
        let members = self.members()?;
        let started = Instant::now();
        loop {
            // A member that is gone counts as missing, warm or not.
            if let Some(m) = members.iter().find(|m| !alive(m.pid)) {
                bail!(
                    "a member of the concurrent group (cell {}, pid {}) ended before the measured phase: the group's measurements would not overlap",
                    m.cell_id,
                    m.pid
                )
            }
            if members
                .iter()
                .all(|m| self.dir.join(format!("ready-{}", m.cell_id)).exists())
            {
                return Ok(());
            }
            if started.elapsed() > self.timeout {
                bail!(
                    "the concurrent group's members did not all warm up within {} s",
                    self.timeout.as_secs()
                )
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
        if self.hold_until.is_some_and(|t| std::time::SystemTime::now() >= t) {
            return Ok(false);
        }
        let members = self.members()?;
        Ok(members
            .iter()
            .any(|m| !self.dir.join(format!("done-{}", m.cell_id)).exists() && alive(m.pid)))
    }
}

/// The sweep's side: the member list, written whole (a temporary file renamed into place).
pub fn write_members(dir: &Path, members: &[Member]) -> Result<()> {
    let text: String = members
        .iter()
        .map(|m| format!("{} {} {}\n", m.pid, m.cell_id, m.device))
        .collect();
    let tmp = dir.join(".members.tmp");
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, dir.join("members"))?;
    Ok(())
}

fn touch(path: &Path) -> Result<()> {
    std::fs::write(path, b"").with_context(|| format!("writing {}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(pid: u32, id: &str, device: &str) -> Member {
        Member {
            pid,
            cell_id: id.into(),
            device: device.into(),
        }
    }

    #[test]
    fn holding_ends_at_its_deadline() {
        let dir = tempfile::tempdir().unwrap();
        write_members(
            dir.path(),
            &[
                member(std::process::id(), "a", "g"),
                member(std::process::id(), "b", "g"),
            ],
        )
        .unwrap();
        let mut a = GroupMember::new(dir.path(), "a");
        assert!(a.hold().unwrap(), "b has not measured");
        a.hold_until = Some(std::time::SystemTime::now());
        assert!(!a.hold().unwrap(), "past the deadline");
    }

    #[test]
    fn members_meet_after_warm_up_and_hold_until_all_have_measured() {
        let dir = tempfile::tempdir().unwrap();
        let me = std::process::id();
        write_members(dir.path(), &[member(me, "a", "gpu0"), member(me, "b", "gpu0")]).unwrap();
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
        assert!(
            before.elapsed() >= Duration::from_millis(90),
            "a waited for b's warm-up"
        );
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
        write_members(
            dir.path(),
            &[member(std::process::id(), "a", "gpu0"), member(gone_pid, "b", "gpu1")],
        )
        .unwrap();
        // b had said it was warm before it died: it is still missing.
        touch(&dir.path().join("ready-b")).unwrap();
        let mut a = GroupMember::new(dir.path(), "a").with_timeout(Duration::from_secs(5));
        let e = a.meet().unwrap_err().to_string();
        assert!(
            e.contains(&format!("(cell b, pid {gone_pid}) ended before the measured phase")),
            "{e}"
        );
        assert!(
            !dir.path().join("ready-a").exists(),
            "a failed meeting takes its ready back"
        );
        assert_eq!(
            a.pids_on_my_device().unwrap(),
            vec![std::process::id()],
            "b is on another device"
        );
        assert!(!a.hold().unwrap(), "a dead member is not held for");
        // No member list at all: a bounded wait, then a clear error.
        let empty = tempfile::tempdir().unwrap();
        let e = GroupMember::new(empty.path(), "a")
            .with_timeout(Duration::from_millis(50))
            .members()
            .unwrap_err()
            .to_string();
        assert!(e.contains("member list") && e.contains("did not appear"), "{e}");
    }
}
