//! The commands that print what there is: `models` (the catalogue), `devices` (the GPUs and their
//! MIG devices), `profiles` (a GPU's MIG profiles) and `plan` (where a set of GPU instances goes).

use std::io::Write;
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;

#[derive(Debug, Args)]
pub struct DevicesArgs {
    /// Print the topology as JSON (the format MIGPROF_TOPOLOGY replays).
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    #[command(flatten)]
    pub table: TableArgs,
    /// GPU-instance profiles, comma-separated (e.g. 3g.40gb,2g.20gb,1g.10gb,1g.10gb).
    #[arg(value_delimiter = ',', required_unless_present = "list")]
    pub profiles: Vec<String>,
    /// List every valid layout to which no instance can be added.
    #[arg(long, conflicts_with = "profiles")]
    pub list: bool,
}

#[derive(Debug, Clone, Args)]
pub struct TableArgs {
    /// A GPU with a checked-in profile table (a100-40gb, a100-80gb, a30-24gb, h100-80gb, h200-141gb);
    /// default: this machine's GPU.
    #[arg(long)]
    pub gpu: Option<String>,
    /// Which of this machine's GPUs, when --gpu is not given.
    #[arg(long, default_value_t = 0, conflicts_with = "gpu")]
    pub index: u32,
}

/// `migprof devices`: the GPU tree, or why there is none (not an error: a CPU machine is a valid place
/// to run migprof).
pub fn devices(args: DevicesArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    match migprof::gpu::discover() {
        Ok(t) if args.json => writeln!(stdout, "{}", t.to_json())?,
        Ok(t) => {
            write!(stdout, "{}", t.tree())?;
            writeln!(stdout, "{}", mps_status(&migprof::mps::processes::Proc))?;
        }
        // Still the recording format (no driver, no GPUs), with the reason beside it.
        Err(e) if args.json => writeln!(
            stdout,
            "{}",
            serde_json::to_string_pretty(&serde_json::json!({
                "driver_version": null,
                "gpus": [],
                "reason": format!("no NVIDIA GPU here: {e:#}"),
            }))?
        )?,
        Err(e) => writeln!(
            stdout,
            "no NVIDIA GPU here: {e:#}\nmigprof runs on the CPU (--device cpu)."
        )?,
    }
    Ok(ExitCode::SUCCESS)
}

/// Whether slices can be emulated with MPS here, and which MPS daemons run (migprof's or another's).
fn mps_status(procs: &dyn migprof::mps::processes::ProcessTable) -> String {
    use migprof::mps::daemon::{base_dir, control_program};
    let available = match control_program() {
        Ok(p) => format!(
            "MPS: available ({}), for emulated slices: --device mps:<profile> or mps:<percent>%",
            p.display()
        ),
        Err(e) => format!("MPS: {e:#}"),
    };
    let running = procs.mps_processes();
    if running.is_empty() {
        return format!("{available}\nMPS: no daemon running");
    }
    let base = base_dir();
    let each: Vec<String> = running
        .iter()
        .map(|p| {
            format!(
                "  {} {}",
                p.describe(),
                if p.is_under(&base) {
                    "(migprof's)"
                } else {
                    "(not migprof's)"
                }
            )
        })
        .collect();
    format!("{available}\nMPS: running:\n{}", each.join("\n"))
}

/// The profile table `--gpu` names, or this machine's GPU's from NVML.
fn profile_table(args: &TableArgs) -> Result<migprof::mig::ProfileTable> {
    match &args.gpu {
        Some(gpu) => migprof::mig::table(gpu),
        None => migprof::gpu::nvml::profile_table(args.index).map_err(|e| {
            let known: Vec<&str> = migprof::mig::GPUS.iter().map(|(n, _)| *n).collect();
            anyhow::anyhow!(
                "{e:#}\nfor a GPU that is not here, name a known one: --gpu {}",
                known.join(" | --gpu ")
            )
        }),
    }
}

/// `migprof profiles`.
pub fn profiles(args: TableArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    write!(stdout, "{}", profile_table(&args)?.render())?;
    Ok(ExitCode::SUCCESS)
}

/// `migprof plan`: the plan, or why the layout does not fit (then a failure).
pub fn plan(args: PlanArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    plan_fits(&args, stdout).map(super::exit_code)
}

fn plan_fits(args: &PlanArgs, stdout: &mut dyn Write) -> Result<bool> {
    let table = profile_table(&args.table)?;
    if args.list {
        let layouts = migprof::mig::maximal_layouts(&table);
        writeln!(stdout, "{} maximal layouts of the {}:", layouts.len(), table.product)?;
        for l in layouts {
            writeln!(stdout, "  {}", l.join(","))?;
        }
        return Ok(true);
    }
    let names: Vec<&str> = args.profiles.iter().map(|s| s.trim()).collect();
    // An unknown profile is a usage error, not a layout that does not fit.
    for n in &names {
        table.profile(n)?;
    }
    match migprof::mig::plan(&table, &names) {
        Ok(p) => {
            write!(stdout, "{}", p.render(&table))?;
            Ok(true)
        }
        Err(why) => {
            writeln!(stdout, "does not fit the {}: {why:#}", table.product)?;
            Ok(false)
        }
    }
}

/// The model catalogue as tables: the image and encoder models, then the language models with the
/// memory their bf16 weights take.
pub fn models(stdout: &mut dyn Write) -> Result<ExitCode> {
    let (decoders, others): (Vec<_>, Vec<_>) = workloads::models().into_iter().partition(|m| m.family.is_decoder());
    let header = format!(
        "{:<12} {:<8} {:<14} {:>13} {:>14} {:>9}",
        "model", "family", "input", "params", "GFLOPs/sample", "preset"
    );
    writeln!(stdout, "{header}")?;
    writeln!(stdout, "{}", "-".repeat(header.len()))?;
    for m in &others {
        let input = match m.input {
            workloads::InputShape::Image {
                channels,
                height,
                width,
            } => format!("{channels}x{height}x{width}"),
            workloads::InputShape::Tokens { seq_len, .. } => format!("{seq_len} tokens"),
            workloads::InputShape::Prompt { .. } => unreachable!("partitioned out"),
        };
        writeln!(
            stdout,
            "{:<12} {:<8} {:<14} {:>13} {:>14.3} {:>9}",
            m.name,
            m.family.as_str(),
            input,
            thousands(m.params),
            m.flops_per_sample as f64 / 1e9,
            if m.tiny { "tiny" } else { "published" }
        )?;
    }
    writeln!(stdout, "\nGFLOPs/sample: forward pass, a multiply-add counted as 2 FLOPs (torchvision counts it once); a training step counts 3x.")?;
    writeln!(stdout, "params include the classification head: 1000 classes for images; for BERT, Hugging Face's BertModel (with pooler) plus a 2-label head on the pooled output (bert_base: 109,482,240 + 1,538).")?;

    let header = format!(
        "{:<13} {:<6} {:>15} {:>15} {:>13} {:>13} {:>9}",
        "model", "family", "params", "bf16 weights", "KV/token", "positions", "preset"
    );
    writeln!(
        stdout,
        "\nlanguage models (--mode generate; or hf:DIR, a Hugging Face folder of one):"
    )?;
    writeln!(stdout, "{header}")?;
    writeln!(stdout, "{}", "-".repeat(header.len()))?;
    for m in &decoders {
        let cfg = m.decoder.as_ref().expect("a decoder's model has its config");
        writeln!(
            stdout,
            "{:<13} {:<6} {:>15} {:>15} {:>13} {:>13} {:>9}",
            m.name,
            m.family.as_str(),
            thousands(m.params),
            bf16_size(m.params * 2),
            format!(
                "{} KiB",
                cfg.kv_bytes_per_token(candle_core::DType::BF16) as f64 / 1024.0
            ),
            thousands(cfg.max_position_embeddings as u64),
            if m.tiny { "tiny" } else { "published" }
        )?;
    }
    writeln!(stdout, "\nparams: transformers' num_parameters() (a tied output head counted once). KV/token: keys and values of one token in bf16, every layer.")?;
    writeln!(stdout, "FLOPs per token: 2 x (the projections' and output head's weights) + 4 x layers x context x heads x head_dim (docs/schema.md).")?;
    Ok(ExitCode::SUCCESS)
}

/// Bytes in GiB, or MiB below one GiB (a tiny preset's weights are a fraction of a MiB).
fn bf16_size(bytes: u64) -> String {
    let gib = bytes as f64 / (1u64 << 30) as f64;
    if gib >= 1.0 {
        format!("{gib:.2} GiB")
    } else {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    }
}

fn thousands(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, c) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(c);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn thousands_separators() {
        assert_eq!(thousands(11_689_512), "11,689,512");
        assert_eq!(thousands(999), "999");
        assert_eq!(thousands(1000), "1,000");
    }

    #[test]
    fn models_lists_exact_counts() -> Result<()> {
        let mut out = Vec::new();
        models(&mut out)?;
        let text = String::from_utf8(out)?;
        assert!(
            text.lines()
                .any(|l| l.starts_with("resnet18 ") && l.contains("11,689,512")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("resnet50 ") && l.contains("25,557,032")),
            "{text}"
        );
        // Language models with their bf16 weights: 1,235,814,400 × 2 bytes = 2.30 GiB.
        assert!(
            text.lines().any(|l| l.starts_with("llama_3_2_1b ")
                && l.contains("1,235,814,400")
                && l.contains("2.30 GiB")
                && l.contains("32 KiB")
                && l.contains("131,072")),
            "{text}"
        );
        assert!(
            text.lines()
                .any(|l| l.starts_with("qwen2_5_1_5b ") && l.contains("1,543,714,304") && l.contains("qwen2")),
            "{text}"
        );
        Ok(())
    }
}
