//! `migprof load --endpoint`: a server of the user's own (started first with `--server-cmd`, pinned
//! to `--device`), loaded at each `--concurrency` and `--qps`, or searched for its capacity.

use std::collections::BTreeMap;
use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{bail, Result};
use clap::builder::PossibleValuesParser;
use clap::Args;
use migprof::device::DeviceSpec;
use migprof::load::record::ServerRow;
use migprof::load::settings::{Keys, LoadSettings};
use migprof::provenance;
use migprof::results::parts::Table;
use migprof::run::record::RunContext;
use migprof::server::endpoint::Endpoint;
use migprof::server::job::{self, ServerJob};
use migprof::server::kserve::{self, Encoding, Kserve, RequestOptions};
use migprof::server::launch::Started;
use migprof::server::{Exchange, Protocol};

use super::args::{device_or_default, parse_seconds, report_hint};

#[derive(Debug, Clone, Default, Args)]
#[command(next_help_heading = "A server of your own (--endpoint instead of --model)")]
pub struct ServerArgs {
    /// Load a running server at this base URL (http://HOST:PORT) instead of migprof's engine; with
    /// --server-cmd, the server migprof starts there.
    #[arg(long)]
    pub endpoint: Option<String>,
    /// The server's protocol: kserve (KServe v2 over HTTP: Triton, KServe, TorchServe, MLServer).
    #[arg(long, default_value = "kserve", value_parser = PossibleValuesParser::new(Protocol::NAMES), requires = "endpoint")]
    pub protocol: String,
    /// Start the server with this shell command first, pinned to --device as you would pin it (a GPU
    /// or MIG UUID in CUDA_VISIBLE_DEVICES; mps: as a client of migprof's MPS daemon); its whole
    /// process tree is stopped when migprof ends, however it ends. Its output is kept in
    /// servers/<id>/ under --out.
    #[arg(long, requires = "endpoint")]
    pub server_cmd: Option<String>,
    /// With --server-cmd: how long the server may take to become ready, seconds.
    #[arg(long, default_value_t = 300.0, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--server-timeout", s, true))]
    pub server_timeout: f64,
    /// The model to load, as the server names it (default: the one model a Triton server has ready).
    #[arg(long, requires = "endpoint")]
    pub served_model: Option<String>,
    /// A header every request carries, `Name: value` (an API key); repeat for more.
    #[arg(long = "header", value_name = "NAME: VALUE", requires = "endpoint")]
    pub headers: Vec<String>,
    /// Requests always in flight, comma-separated: one step each (perf_analyzer's
    /// --concurrency-range), before the --qps steps.
    #[arg(long, value_delimiter = ',', requires = "endpoint", allow_negative_numbers = true, value_parser = |s: &str| migprof::run::limits::IN_FLIGHT.parse("--concurrency", s).map(|n| n as usize))]
    pub concurrency: Vec<usize>,
    /// Samples in each request, in the batch dimension of a model that batches.
    #[arg(long, default_value_t = 1, requires = "endpoint", allow_negative_numbers = true, value_parser = |s: &str| migprof::run::limits::BATCH.parse("--batch", s).map(|n| n as usize))]
    pub batch: usize,
    /// The sizes of an input's dimensions of any size, the batch dimension left out, as
    /// perf_analyzer's --shape: NAME:DIM,DIM (repeat for each input).
    #[arg(long = "shape", value_name = "NAME:DIMS", requires = "endpoint")]
    pub shapes: Vec<String>,
    /// How tensors travel: binary (KServe's binary extension, as perf_analyzer sends them) or json.
    #[arg(long, default_value = "binary", value_parser = PossibleValuesParser::new(Encoding::NAMES), requires = "endpoint")]
    pub encoding: String,
    /// A request not answered within this many seconds fails.
    #[arg(long, default_value_t = 30.0, allow_negative_numbers = true, value_parser = |s: &str| parse_seconds("--request-timeout", s, true))]
    pub request_timeout: f64,
    /// At --qps: the most requests in flight (one client connection each); a request due while all
    /// are busy waits in the client, its latency counted from its arrival, and the step says so.
    #[arg(long, default_value_t = 256, allow_negative_numbers = true, value_parser = |s: &str| migprof::run::limits::IN_FLIGHT.parse("--max-in-flight", s).map(|n| n as usize))]
    pub max_in_flight: usize,
}

/// What `migprof load` asks of a server besides its own flags: how requests are offered, the
/// objective, the device and where the rows go.
pub struct Asked<'a> {
    pub offered: &'a migprof::load::given::Offered,
    pub pass: &'a migprof::load::given::PassGiven,
    pub qps: &'a [f64],
    pub search: bool,
    pub seed: u64,
    pub device: Option<&'a DeviceSpec>,
    pub sample_interval_ms: u64,
    pub out: &'a std::path::Path,
}

/// Loads the server `s` names, starting it first where asked, and stops it however this ends.
pub fn exec(s: &ServerArgs, args: Asked, log: &mut dyn Write) -> Result<ExitCode> {
    let endpoint = Endpoint::new(
        s.endpoint.as_deref().unwrap_or_default(),
        &s.headers,
        Duration::from_secs_f64(s.request_timeout),
    )?;
    let protocol: Protocol = s.protocol.parse().map_err(anyhow::Error::msg)?;
    let options = RequestOptions {
        batch: s.batch,
        shapes: shapes(&s.shapes)?,
        encoding: s.encoding.parse().map_err(anyhow::Error::msg)?,
        seed: args.seed,
    };
    let settings = LoadSettings::given(args.offered, args.pass, args.seed);
    settings.check(Keys::Flags)?;
    if s.concurrency.is_empty() && args.qps.is_empty() && !args.search {
        bail!("say how to load the server: --concurrency 1,2,4, --qps 10,20, or --search with --slo-p99-ms");
    }
    if args.search && settings.slo_p99_ms.is_none() {
        bail!("--search needs the objective it searches within: --slo-p99-ms");
    }
    for &qps in args.qps {
        migprof::run::limits::step_requests("--qps", qps, "--duration", settings.duration_secs)
            .map_err(anyhow::Error::msg)?;
    }
    migprof::files::ensure_writable_dir(args.out)?;
    let device = device_or_default(args.device, log)?;
    if s.server_cmd.is_none() && matches!(device, DeviceSpec::Mps(_)) {
        bail!("--device {device}: an emulated slice is made by starting the server as a client of migprof's MPS daemon: give --server-cmd (a server already running computes wherever it was started)");
    }
    let target = device.for_program()?;
    let mut started = match &s.server_cmd {
        Some(cmd) => Some(start(s, cmd, &device, &target, &endpoint, protocol, args.out, log)?),
        None => None,
    };
    let measured = measure(
        s,
        &args,
        &endpoint,
        &options,
        &settings,
        &target.info,
        started.as_mut(),
        log,
    );
    if let Some(server) = started {
        let ended = server.stop();
        writeln!(log, "server: stopped ({})", ended.describe())?;
    }
    // Stopped after the rows are written: a daemon that stops badly loses no measurement.
    let stopped = target.daemon.map(|d| d.stop());
    measured?;
    if let Some(stopped) = stopped {
        stopped?;
        writeln!(log, "MPS: daemon stopped")?;
    }
    writeln!(log, "{}", report_hint(args.out))?;
    Ok(ExitCode::SUCCESS)
}

/// Starts the server `cmd` on `target` and waits until it is ready.
#[allow(clippy::too_many_arguments)]
fn start(
    s: &ServerArgs,
    cmd: &str,
    device: &DeviceSpec,
    target: &migprof::device::ProgramTarget,
    endpoint: &Endpoint,
    protocol: Protocol,
    out: &std::path::Path,
    log: &mut dyn Write,
) -> Result<Started> {
    migprof::program::launch::check_command(&["sh"])?;
    let mut server = Started::start(cmd, target, out)?;
    writeln!(
        log,
        "server: started `{cmd}` on {device} [{}]; output in {}",
        target.info.name,
        server.dir.display()
    )?;
    if let Some(e) = &target.info.emulation {
        writeln!(
            log,
            "MPS: the server is a client of migprof's daemon with {}; not verified: the SMs and memory it reached (migprof measures its own clients' reach, not a server's)",
            e.share.describe()
        )?;
    }
    let waited = server.wait_ready(
        endpoint,
        &protocol.ready_path(s.served_model.as_deref()),
        Duration::from_secs_f64(s.server_timeout),
    )?;
    writeln!(log, "server: ready after {:.1} s", waited.as_secs_f64())?;
    Ok(server)
}

/// Reads the model's metadata, checks one request, and runs the steps.
#[allow(clippy::too_many_arguments)]
fn measure(
    s: &ServerArgs,
    args: &Asked,
    endpoint: &Endpoint,
    options: &RequestOptions,
    settings: &LoadSettings,
    device: &migprof::device::DeviceInfo,
    started: Option<&mut Started>,
    log: &mut dyn Write,
) -> Result<()> {
    let (info, metadata) = kserve::discover(endpoint, s.served_model.as_deref())?;
    let request = Kserve::new(&metadata, options)?;
    let engine = format!("{} {}", info.name, info.version).trim().to_string();
    // One request before any step: a server that answers wrongly fails here, with its answer.
    request
        .exchange(endpoint, &endpoint.agent())
        .map_err(|why| anyhow::anyhow!("the first request to model `{}` failed: {why}", metadata.name))?;
    let server = ServerRow {
        engine: engine.clone(),
        protocol: s.protocol.clone(),
        endpoint: endpoint.url.clone(),
        command: s.server_cmd.clone(),
        inputs: request.described.clone(),
        encoding: request.encoding.as_str().to_string(),
        request_batch: request.batch,
    };
    writeln!(
        log,
        "migprof {}: {engine} model `{}` at {} on {}: requests of {} ({}); rows to {}",
        provenance::VERSION,
        metadata.name,
        endpoint.url,
        device.name,
        request.described,
        request.encoding.as_str(),
        args.out.join(Table::Load.dir_name()).display()
    )?;
    let pids = started.map(|server| move || server.pids());
    let pids_ref: Option<&dyn Fn() -> std::collections::BTreeSet<u32>> =
        pids.as_ref().map(|f| f as &dyn Fn() -> std::collections::BTreeSet<u32>);
    let job = ServerJob {
        endpoint,
        exchange: &request,
        server: &server,
        model: &metadata.name,
        settings,
        concurrencies: &s.concurrency,
        rates: args.qps,
        search: args.search.then(|| args.qps.first().copied()),
        max_in_flight: s.max_in_flight,
        server_pids: pids_ref,
        sample_interval: (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms)),
    };
    let context = RunContext::new_invocation(device);
    job::run(&job, device, &context, args.out, log)?;
    Ok(())
}

/// `--shape NAME:DIM,DIM` as a map.
fn shapes(given: &[String]) -> Result<BTreeMap<String, Vec<usize>>> {
    let mut out = BTreeMap::new();
    for g in given {
        let parsed = g.rsplit_once(':').and_then(|(name, dims)| {
            let dims: Option<Vec<usize>> = dims
                .split(',')
                .map(|d| d.trim().parse().ok().filter(|&d: &usize| d > 0))
                .collect();
            Some((name.trim().to_string(), dims?))
        });
        match parsed {
            Some((name, dims)) if !name.is_empty() && !dims.is_empty() => {
                if out.insert(name.clone(), dims).is_some() {
                    bail!("--shape {name} is given twice");
                }
            }
            _ => bail!("--shape {g:?}: give it as NAME:DIM,DIM with positive sizes, e.g. input_ids:128"),
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_are_read_and_bad_ones_named() {
        let m = shapes(&["input_ids:128".into(), "pixels:3,224,224".into()]).unwrap();
        assert_eq!(m["input_ids"], vec![128]);
        assert_eq!(m["pixels"], vec![3, 224, 224]);
        for bad in ["x", "x:", ":3", "x:0", "x:a"] {
            assert!(
                shapes(&[bad.into()]).unwrap_err().to_string().contains("NAME:DIM"),
                "{bad}"
            );
        }
        assert!(shapes(&["a:1".into(), "a:2".into()])
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }
}
