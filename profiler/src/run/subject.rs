//! What a run measured: one of migprof's models, or a program migprof did not write (`migprof
//! exec`), whose steps it reported. Both give the same row; the columns that only one of them can
//! fill are null in the other's.

use std::time::Duration;

use workloads::ModelInfo;

/// The subject of a run.
#[derive(Debug, Clone)]
pub enum Subject {
    Model(ModelInfo),
    Program(Program),
}

/// A program as its run records it.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// As given by `--name`, or the command's file name: the row's `model`.
    pub name: String,
    /// The command line, each argument quoted where a shell would need it.
    pub command: String,
    /// Its exit code, when it exited; the signal that ended it, when one did.
    pub exit_code: Option<i32>,
    pub exit_signal: Option<i32>,
    /// From its start to its end; `None` where it did not run to an end migprof saw.
    pub wall: Option<Duration>,
    /// Where its steps came from.
    pub steps: StepsFrom,
    /// The regular expression its steps were read from its output by, if they were.
    pub step_pattern: Option<String>,
    /// The most device memory its processes held at once, as NVML lists them; `None` where nothing
    /// was sampled or none of them was seen on the device.
    pub device_memory_max_mib: Option<f64>,
    /// Its processes NVML listed on the target; `None` where nothing was sampled.
    pub pids_seen: Option<u32>,
}

/// Where a program's steps came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StepsFrom {
    /// Lines of JSON in the step file (the step protocol).
    Protocol,
    /// Its output lines, read by `--step-pattern`.
    Pattern,
    /// It reported none: its one step is its whole run.
    None,
}

impl StepsFrom {
    pub fn as_str(self) -> &'static str {
        match self {
            StepsFrom::Protocol => "protocol",
            StepsFrom::Pattern => "pattern",
            StepsFrom::None => "none",
        }
    }
}

/// The family a program's row records.
pub const PROGRAM_FAMILY: &str = "program";

impl Subject {
    /// The row's `model`: the model's name, or the program's.
    pub fn name(&self) -> &str {
        match self {
            Subject::Model(m) => &m.name,
            Subject::Program(p) => &p.name,
        }
    }

    /// The row's `family`.
    pub fn family(&self) -> &'static str {
        match self {
            Subject::Model(m) => m.family.as_str(),
            Subject::Program(_) => PROGRAM_FAMILY,
        }
    }

    pub fn model(&self) -> Option<&ModelInfo> {
        match self {
            Subject::Model(m) => Some(m),
            Subject::Program(_) => None,
        }
    }

    pub fn program(&self) -> Option<&Program> {
        match self {
            Subject::Model(_) => None,
            Subject::Program(p) => Some(p),
        }
    }
}
