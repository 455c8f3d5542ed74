//! A sweep file's `[[programs]]` tables: a user's own programs, each run on every target that runs
//! alone as `migprof exec` runs it, a cell per batch (or one), each in a process of its own.

use anyhow::{bail, Result};
use serde::Deserialize;

use crate::cell::spec::DTYPES;
use crate::program::steps::Pattern;
use crate::run::limits;

/// What `{batch}` in a program's command is replaced by: each of its `batches`.
pub const BATCH: &str = "{batch}";

/// A program of the sweep.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Program {
    /// The rows' `model`.
    pub name: String,
    /// The program and its arguments; `{batch}` stands for each of `batches`.
    pub command: Vec<String>,
    /// One cell per batch: the command with it, and the steps of that many items its row.
    #[serde(default)]
    pub batches: Vec<usize>,
    /// The phase of the steps a cell measures (and of those that name none).
    #[serde(default = "infer")]
    pub mode: String,
    /// What the program computes in, as `migprof exec --dtype` records it.
    #[serde(default)]
    pub dtype: Option<String>,
    /// Steps read from its output, as `migprof exec --step-pattern`.
    #[serde(default)]
    pub step_pattern: Option<String>,
    /// As `migprof exec --warmup-steps`.
    #[serde(default)]
    pub warmup_steps: Option<usize>,
}

fn infer() -> String {
    "infer".into()
}

impl Program {
    /// What TOML cannot say, each problem named with `at`.
    pub fn check(&self, at: &str) -> Result<()> {
        if self.name.trim().is_empty() {
            bail!("{at}: name is empty: give the program a name, which its rows record as `model`");
        }
        let Some(first) = self.command.first().filter(|c| !c.is_empty()) else {
            bail!("{at}: command is empty: give the program and its arguments, e.g. command = [\"python3\", \"train.py\"]");
        };
        if first.contains(BATCH) {
            bail!("{at}: command: {BATCH} stands for an argument, not the program");
        }
        workloads::Mode::parse(&self.mode).map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
        if let Some(d) = self.dtype.as_deref().filter(|d| !DTYPES.contains(d)) {
            bail!("{at}: dtype `{d}`; valid dtypes: {}", DTYPES.join(", "));
        }
        if let Some(p) = &self.step_pattern {
            p.parse::<Pattern>()
                .map_err(|e| anyhow::anyhow!("{at}: step_pattern: {e}"))?;
        }
        let placeholder = self.command.iter().any(|a| a.contains(BATCH));
        match (placeholder, self.batches.is_empty()) {
            (true, true) => bail!("{at}: command has {BATCH} but there are no batches to put there: give batches = [..]"),
            (false, false) => bail!(
                "{at}: batches without {BATCH} in the command would run the same command for each: put {BATCH} where the program takes its batch"
            ),
            _ => {}
        }
        for (i, &b) in self.batches.iter().enumerate() {
            limits::BATCH
                .check(&format!("{at}: batches"), b as u64)
                .map_err(anyhow::Error::msg)?;
            if self.batches[..i].contains(&b) {
                bail!("{at}: batches lists {b} more than once");
            }
        }
        Ok(())
    }

    /// The batches of its cells: each of `batches`, or one cell of whatever it runs (`None`).
    pub fn cells(&self) -> Vec<Option<usize>> {
        match self.batches.is_empty() {
            true => vec![None],
            false => self.batches.iter().map(|&b| Some(b)).collect(),
        }
    }

    /// Its command for the cell of `batch`.
    pub fn command_for(&self, batch: Option<usize>) -> Vec<String> {
        match batch {
            Some(b) => self.command.iter().map(|a| a.replace(BATCH, &b.to_string())).collect(),
            None => self.command.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn program(toml: &str) -> Program {
        toml::from_str(toml).unwrap()
    }

    #[test]
    fn a_cell_per_batch_with_the_batch_in_its_command() {
        let p =
            program("name = \"train\"\ncommand = [\"python3\", \"train.py\", \"--batch={batch}\"]\nbatches = [8, 32]");
        p.check("[[programs]] #1").unwrap();
        assert_eq!(p.cells(), [Some(8), Some(32)]);
        assert_eq!(p.command_for(Some(32)), ["python3", "train.py", "--batch=32"]);
        let one = program("name = \"serve\"\ncommand = [\"./serve\"]");
        one.check("x").unwrap();
        assert_eq!((one.cells(), one.mode.as_str()), (vec![None], "infer"));
    }

    #[test]
    fn what_cannot_run_is_refused_naming_the_table() {
        let e = |toml: &str| program(toml).check("[[programs]] #2").unwrap_err().to_string();
        assert!(e("name = \"\"\ncommand = [\"x\"]").contains("name is empty"));
        assert!(e("name = \"a\"\ncommand = []").contains("command is empty"));
        assert!(e("name = \"a\"\ncommand = [\"x\", \"{batch}\"]").contains("no batches"));
        assert!(e("name = \"a\"\ncommand = [\"x\"]\nbatches = [4]").contains("put {batch}"));
        assert!(e("name = \"a\"\ncommand = [\"x\", \"{batch}\"]\nbatches = [4, 4]").contains("4 more than once"));
        assert!(e("name = \"a\"\ncommand = [\"x\", \"{batch}\"]\nbatches = [0]").contains("batches"));
        assert!(e("name = \"a\"\ncommand = [\"x\"]\nmode = \"eval\"").contains("valid modes"));
        assert!(e("name = \"a\"\ncommand = [\"x\"]\ndtype = \"fp8\"").contains("valid dtypes"));
        assert!(e("name = \"a\"\ncommand = [\"x\"]\nstep_pattern = \"(?P<items>\\\\d+)\"").contains("(?P<ms>"));
        assert!(toml::from_str::<Program>("name = \"a\"\ncommand = [\"x\"]\nargs = []").is_err());
    }
}
