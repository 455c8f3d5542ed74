//! `migprof mig apply|destroy|export`: MIG layouts on this machine's GPUs, through NVML; dry runs unless
//! `--yes`.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::{Args, Subcommand};

#[derive(Debug, Subcommand)]
pub enum MigCommand {
    /// Bring the GPUs a layout file names to its layout: print each action and the nvidia-smi command
    /// that does the same; act only with --yes, as root, on idle GPUs; read NVML back afterwards and
    /// fail unless the layout is there.
    Apply {
        /// A mig-parted file (`version: v1`, `mig-configs: ...`).
        file: PathBuf,
        /// Which of the file's configs; may be left out when it has one.
        #[arg(long, short = 'c')]
        config: Option<String>,
        #[command(flatten)]
        act: ActArgs,
        /// Allow turning MIG mode on. It may only take effect after a GPU reset, which migprof never
        /// does: it prints the command instead.
        #[arg(long)]
        enable_mig: bool,
        /// Allow turning MIG mode off (for a config with `mig-enabled: false`).
        #[arg(long)]
        disable_mig: bool,
    },
    /// Destroy every compute and GPU instance of the GPUs given (default: every GPU with MIG on).
    /// MIG mode stays as it is.
    Destroy {
        /// GPU indices, comma-separated.
        #[arg(long, value_delimiter = ',')]
        gpu: Vec<u32>,
        #[command(flatten)]
        act: ActArgs,
    },
    /// Write the current MIG layout as a mig-parted file (to stdout, or --out).
    Export {
        /// The file to write.
        #[arg(long)]
        out: Option<PathBuf>,
        /// The name of the config in the file.
        #[arg(long, default_value = "current")]
        name: String,
    },
}

#[derive(Debug, Clone, Copy, Args)]
pub struct ActArgs {
    /// Carry the plan out (as root); without it, print the plan only.
    #[arg(long)]
    pub yes: bool,
}

/// `migprof mig ...` against this machine's NVML.
pub fn exec(cmd: MigCommand, stdout: &mut dyn Write, stderr: &mut dyn Write) -> Result<ExitCode> {
    use migprof::mig::apply::{self, Options};
    use migprof::mig::config::MigPartedFile;
    let root = is_root();
    let opts = |yes: bool, enable_mig: bool, disable_mig: bool| Options {
        yes,
        enable_mig,
        disable_mig,
        root,
    };
    let done = match &cmd {
        MigCommand::Apply {
            file,
            config,
            act,
            enable_mig,
            disable_mig,
        } => {
            // The file first: a bad file is reported on any machine, with or without a driver.
            let layout = MigPartedFile::read(file)?;
            let mut nvml = migprof::gpu::mig_control::NvmlControl::new()?;
            apply::apply(
                &mut nvml,
                &layout,
                config.as_deref(),
                &opts(act.yes, *enable_mig, *disable_mig),
                stdout,
            )
        }
        MigCommand::Destroy { gpu, act } => {
            let mut nvml = migprof::gpu::mig_control::NvmlControl::new()?;
            apply::destroy(&mut nvml, gpu, &opts(act.yes, false, false), stdout)
        }
        MigCommand::Export { out, name } => {
            let mut nvml = migprof::gpu::mig_control::NvmlControl::new()?;
            let (file, warnings) = apply::export(&mut nvml, name)?;
            for w in warnings {
                writeln!(stderr, "warning: {w}")?;
            }
            let yaml = file.to_yaml()?;
            match out {
                Some(path) => {
                    migprof::files::write_atomically(path, yaml.as_bytes())?;
                    writeln!(stderr, "wrote {}", path.display())?;
                }
                None => write!(stdout, "{yaml}")?,
            }
            Ok(())
        }
    };
    done.map(|()| ExitCode::SUCCESS)
}

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() == 0 }
}
