//! `migprof capacity`: its flags, the capacities they point at (measured folders or a CSV), the plan,
//! and where the plan is kept.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Result;
use clap::Args;
use migprof::capacity::source::ServingSlo;
use migprof::capacity::Objectives;
use migprof::provenance;
use migprof::run::spec::Precision;

use super::args::{parse_positive, parse_share, DTypeArg, MemoryEmulationArg};

#[derive(Debug, Clone, Args)]
pub struct CapacityArgs {
    /// The GPU to plan for, by its checked-in MIG profile table (a100-40gb, a100-80gb, a30-24gb,
    /// h100-80gb, h200-141gb).
    #[arg(long)]
    pub gpu: String,
    /// The load to serve: model=requests/s, comma-separated (resnet50=20000,bert_base=3000).
    #[arg(long, value_delimiter = ',', required = true, value_parser = migprof::capacity::parse_demand)]
    pub demand: Vec<(String, f64)>,
    /// The p99 objective the capacities of models served one forward pass per request were measured
    /// for, milliseconds.
    #[arg(long, value_parser = parse_positive)]
    pub slo_p99_ms: Option<f64>,
    /// The TTFT p99 objective language models' capacities were searched within, milliseconds (with
    /// --slo-tpot-p99-ms).
    #[arg(long, value_parser = parse_positive, requires = "slo_tpot_p99_ms")]
    pub slo_ttft_p99_ms: Option<f64>,
    /// The TPOT p99 objective language models' capacities were searched within, milliseconds (with
    /// --slo-ttft-p99-ms).
    #[arg(long, value_parser = parse_positive, requires = "slo_ttft_p99_ms")]
    pub slo_tpot_p99_ms: Option<f64>,
    /// Results folders with `load --search` capacities (the capacity table, and language models'
    /// serve_capacity table).
    #[arg(long = "from", conflicts_with = "capacities")]
    pub from: Vec<PathBuf>,
    /// A CSV with the columns model,profile,qps instead of measured capacities.
    #[arg(long)]
    pub capacities: Option<PathBuf>,
    /// Only capacities measured at this dtype (needed when a folder holds several).
    #[arg(long, value_enum)]
    pub dtype: Option<DTypeArg>,
    /// Also estimate capacities from closed-loop runs where no search measured one (labelled: the
    /// highest throughput of a batch whose p99, doubled for the wait in the queue, is within the
    /// objective).
    #[arg(long)]
    pub closed_loop_estimates: bool,
    /// Plan each instance to at most this share of its capacity.
    #[arg(long, default_value_t = 0.8, value_parser = parse_share)]
    pub headroom: f64,
    /// Which capacities of emulated slices to plan from where a folder has both: `partitioned`
    /// (mps-mem:, the slice's share of the memory bandwidth: the lower bound) or `alone` (mps:, all of
    /// the GPU's: the upper bound). Default: partitioned where both were searched, and said.
    #[arg(long, value_enum)]
    pub memory_emulation: Option<MemoryEmulationArg>,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the plan's layouts as a mig-parted file (one named config per distinct layout) for
    /// `migprof mig apply` or the GPU operator.
    #[arg(long)]
    pub emit_layouts: Option<PathBuf>,
}

pub fn exec(args: CapacityArgs, stdout: &mut dyn Write) -> Result<ExitCode> {
    let table = migprof::mig::profile::table(&args.gpu)?;
    let dtype = args.dtype.map(|d| Precision::from(d).as_str());
    let mut seen = std::collections::BTreeSet::new();
    if let Some((m, _)) = args.demand.iter().find(|(m, _)| !seen.insert(m.as_str())) {
        anyhow::bail!("--demand names {m} twice: give each model once, with its whole rate");
    }
    anyhow::ensure!(
        args.capacities.is_none() || (dtype.is_none() && !args.closed_loop_estimates),
        "--dtype and --closed-loop-estimates choose among measured capacities (--from); a CSV's are taken as they are"
    );
    let objectives = Objectives {
        p99_ms: args.slo_p99_ms,
        serving: args
            .slo_ttft_p99_ms
            .zip(args.slo_tpot_p99_ms)
            .map(|(ttft_p99_ms, tpot_p99_ms)| ServingSlo {
                ttft_p99_ms,
                tpot_p99_ms,
            }),
    };
    anyhow::ensure!(
        objectives != Objectives::default(),
        "which objective were the capacities measured for? give --slo-p99-ms, or for language models --slo-ttft-p99-ms and --slo-tpot-p99-ms (or all three)"
    );
    let gathered = gather(&args, &table, &objectives, dtype)?;
    if objectives.serving.is_none() {
        if let Some((m, _)) = args
            .demand
            .iter()
            .find(|(m, _)| workloads::lookup(m).is_ok_and(|(_, info)| info.family.is_decoder()))
        {
            anyhow::bail!(
                "{m} is a language model: its capacities are searched within a TTFT and a TPOT objective; give --slo-ttft-p99-ms and --slo-tpot-p99-ms"
            );
        }
    }
    migprof::capacity::check_demand(&args.demand, &gathered)?;
    let report = migprof::capacity::plan(&table, &gathered, &args.demand, objectives, args.headroom)?;
    if report.gpus > migprof::capacity::SANE_GPUS {
        eprintln!(
            "warning: the plan needs {} GPUs, more than {}: is a demand (requests/s) or a capacity off by a factor?",
            report.gpus,
            migprof::capacity::SANE_GPUS
        );
    }
    if args.json {
        writeln!(stdout, "{}", serde_json::to_string_pretty(&report)?)?;
    } else {
        write!(stdout, "{}", report.to_text())?;
    }
    if let Some(path) = &args.emit_layouts {
        migprof::files::write_atomically(path, report.mig_parted().to_yaml()?.as_bytes())?;
        if !args.json {
            writeln!(
                stdout,
                "layouts: {} (apply with `migprof mig apply {} -c migprof-plan-1`)",
                path.display(),
                path.display()
            )?;
        }
    }
    // The report of the folder shows the latest plan made from it.
    if let Some(dir) = args.from.first() {
        let path = dir
            .join("plans")
            .join(format!("plan-{}.json", provenance::run_id(provenance::now())));
        let kept = migprof::files::write_atomically(&path, serde_json::to_string_pretty(&report)?.as_bytes());
        match (kept, args.json) {
            (Ok(()), false) => writeln!(stdout, "plan: {}", path.display())?,
            (Ok(()), true) => {}
            // The plan is printed already; a folder that cannot keep it costs only the report's copy.
            (Err(e), _) => eprintln!("warning: could not keep the plan: {e:#}"),
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The capacities a plan is made from: a CSV's, or those measured in `--from` folders for each
/// objective given.
fn gather(
    args: &CapacityArgs,
    table: &migprof::mig::profile::ProfileTable,
    objectives: &Objectives,
    dtype: Option<&'static str>,
) -> Result<migprof::capacity::source::Gathered> {
    let memory = args.memory_emulation.map(MemoryEmulationArg::into);
    Ok(match (&args.capacities, args.from.is_empty()) {
        (Some(csv), _) => migprof::capacity::source::csv::from_csv(csv, table, objectives)?,
        (None, false) => {
            let served_per_request = match objectives.p99_ms {
                Some(ms) => migprof::capacity::source::from_folders(
                    &args.from,
                    ms,
                    dtype,
                    &table.product,
                    args.closed_loop_estimates,
                    memory,
                )?,
                None => Default::default(),
            };
            let generating = match objectives.serving {
                Some(slo) => {
                    migprof::capacity::source::serving_from_folders(&args.from, slo, dtype, &table.product, memory)?
                }
                None => Default::default(),
            };
            served_per_request.and(generating)
        }
        (None, true) => anyhow::bail!("where do the capacities come from? give --from DIR (results of `migprof load --search`) or --capacities FILE.csv"),
    })
}
