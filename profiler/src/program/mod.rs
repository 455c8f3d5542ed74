//! A program migprof did not write, measured on a target (`migprof exec`): started pinned to the
//! target as a user pins it ([`crate::device::DeviceSpec::for_program`]), its output kept and
//! shown, the target sampled while it runs, its whole process tree kept and stopped ([`keeper`],
//! [`tree`]), and the steps it reports ([`steps`]) turned into the rows `migprof run` writes
//! ([`rows`]).

pub mod keeper;
pub mod launch;
pub mod rows;
pub mod steps;
pub mod tree;

use std::ffi::OsString;
use std::time::Duration;

use workloads::Mode;

use crate::run::spec::Precision;
use steps::Pattern;

/// How a program is run and read.
#[derive(Debug, Clone)]
pub struct ProgramOptions {
    /// The command and its arguments.
    pub command: Vec<OsString>,
    /// The rows' `model`.
    pub name: String,
    /// The phase of a step that names none.
    pub mode: Mode,
    /// What the program computes in, as the user says (migprof cannot see it); `None`: not said.
    pub precision: Option<Precision>,
    /// Steps read from the output instead of the step file.
    pub pattern: Option<Pattern>,
    /// Measured steps of each phase and size left out at its start as warm-up; `None`: one, unless
    /// the program marked warm-up steps itself (then none).
    pub warmup_steps: Option<usize>,
    /// The program is stopped (SIGTERM, then SIGKILL) after this long.
    pub timeout: Option<Duration>,
    /// The GPU sampler's interval; `None`: off.
    pub sample_interval: Option<Duration>,
}

/// The settings that change what a program's row measures without changing its cell, as its row
/// records them (`cell_settings`): `migprof exec`'s and a sweep's program cell's alike.
pub fn cell_settings(warmup_steps: Option<usize>, sample_interval_ms: u64) -> String {
    let warmup = warmup_steps.map_or("auto".to_string(), |n| n.to_string());
    format!("warmup_steps={warmup};sample_interval_ms={sample_interval_ms}")
}

/// The fewest measured steps a row is made of: fewer say nothing about a distribution.
pub const MIN_STEPS: usize = 3;

/// The name of a program given none: its script's (`python train.py` is `train`), else its
/// command's file name.
pub fn default_name(command: &[OsString]) -> String {
    let path = |a: &OsString| std::path::Path::new(a).to_path_buf();
    let script = command.iter().skip(1).map(path).find(|p| {
        p.extension()
            .is_some_and(|e| ["py", "sh"].contains(&e.to_string_lossy().as_ref()))
    });
    match script {
        Some(s) => s.file_stem().map(|n| n.to_string_lossy().into_owned()),
        None => command
            .first()
            .map(path)
            .and_then(|p| p.file_name().map(|n| n.to_string_lossy().into_owned())),
    }
    .unwrap_or_else(|| "program".into())
}

/// The command as one line, each argument quoted where a shell would need it.
pub fn command_line<S: AsRef<std::ffi::OsStr>>(command: &[S]) -> String {
    command
        .iter()
        .map(|a| {
            let a = a.as_ref().to_string_lossy();
            let plain = !a.is_empty() && a.chars().all(|c| c.is_ascii_alphanumeric() || "-_./=:,+@%".contains(c));
            if plain {
                a.into_owned()
            } else {
                format!("'{}'", a.replace('\'', r"'\''"))
            }
        })
        .collect::<Vec<_>>()
        .join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_command_is_named_and_written_as_a_shell_reads_it() {
        let cmd: Vec<OsString> = ["/usr/bin/python3", "train.py", "--lr", "1e-3", "it's here", ""]
            .map(OsString::from)
            .to_vec();
        assert_eq!(default_name(&cmd), "train");
        assert_eq!(
            default_name(&[OsString::from("./serve"), OsString::from("-v")]),
            "serve"
        );
        assert_eq!(
            command_line(&cmd),
            r"/usr/bin/python3 train.py --lr 1e-3 'it'\''s here' ''"
        );
        assert_eq!(default_name(&[]), "program");
    }
}
