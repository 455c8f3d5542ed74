//! A user's server measured on a target from start to end, as `migprof load --endpoint` and a
//! sweep's `[[servers]]` cell run it: started pinned where migprof starts it and waited on until
//! ready, the model's metadata read and one request checked, the steps run and written, and the
//! server's whole process tree and migprof's MPS daemon stopped however the steps ended (after the
//! rows are written: a stop that goes badly loses no measurement).

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};

use super::given::ServerSettings;
use super::job::{self, ServerJob, ServerOutcome};
use super::kserve::{self, Kserve};
use super::launch::Started;
use super::Exchange;
use crate::device::{DeviceSpec, ProgramTarget};
use crate::load::record::ServerRow;
use crate::load::settings::LoadSettings;
use crate::provenance;
use crate::results::parts::Table;
use crate::run::record::{CellIdentity, RunContext};

/// What to measure and where the rows go.
pub struct Measure<'a> {
    pub server: &'a ServerSettings,
    /// Warm-up, duration, arrivals, the objective and the search's bounds.
    pub load: &'a LoadSettings,
    /// Open-loop rates, after the concurrencies.
    pub rates: &'a [f64],
    /// Search the capacity within `load.slo_p99_ms` (from the first rate, or concurrency 1's).
    pub search: bool,
    pub device: &'a DeviceSpec,
    /// The GPU sampler's interval; `None`: off.
    pub sample_interval: Option<Duration>,
    pub out: &'a Path,
    /// A sweep's cell: the identity its rows carry.
    pub cell: Option<&'a CellIdentity>,
    /// The invocation the rows belong to (a sweep's); `None`: a new one.
    pub invocation: Option<&'a str>,
}

impl Measure<'_> {
    /// What no measurement could take, before anything starts.
    pub fn check(&self) -> Result<()> {
        let keys = match self.cell {
            Some(_) => crate::load::settings::Keys::SweepFile,
            None => crate::load::settings::Keys::Flags,
        };
        super::given::check_steps(
            &self.server.concurrency,
            self.rates,
            self.search,
            self.load.slo_p99_ms,
            keys,
        )?;
        if self.server.command.is_none() && matches!(self.device, DeviceSpec::Mps(_)) {
            bail!("device {}: an emulated slice is made by starting the server as a client of migprof's MPS daemon: give the command that starts it (--server-cmd; server_cmd in a sweep file); a server already running computes wherever it was started", self.device);
        }
        Ok(())
    }
}

/// Measures the server of `m` on its device, starting it first where it has a command.
pub fn measure(m: &Measure, log: &mut dyn Write) -> Result<ServerOutcome> {
    m.check()?;
    crate::files::ensure_writable_dir(m.out)?;
    let target = m.device.for_program()?;
    let mut started = match &m.server.command {
        Some(cmd) => Some(start(m, cmd, &target, log)?),
        None => None,
    };
    let measured = steps(m, &target.info, started.as_mut(), log);
    if let Some(server) = started {
        let ended = server.stop();
        writeln!(log, "server: stopped ({})", ended.describe())?;
    }
    let stopped = target.daemon.map(|d| d.stop());
    let outcome = measured?;
    if let Some(stopped) = stopped {
        stopped?;
        writeln!(log, "MPS: daemon stopped")?;
    }
    Ok(outcome)
}

/// Starts the server `cmd` on `target` and waits until it is ready.
fn start(m: &Measure, cmd: &str, target: &ProgramTarget, log: &mut dyn Write) -> Result<Started> {
    crate::program::launch::check_command(&["sh"])?;
    // A server already there would answer the readiness check of the one started here, and be
    // measured in its place (on whatever device it runs).
    if m.server.endpoint.listening() {
        bail!(
            "something already answers at {}: stop it first, or measure it as it runs (without a command that starts a server)",
            m.server.endpoint.url
        );
    }
    let mut server = Started::start(cmd, target, m.out)?;
    writeln!(
        log,
        "server: started `{cmd}` on {} [{}]; output in {}",
        m.device,
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
        &m.server.endpoint,
        &m.server.protocol.ready_path(m.server.served_model.as_deref()),
        m.server.server_timeout,
    )?;
    writeln!(log, "server: ready after {:.1} s", waited.as_secs_f64())?;
    Ok(server)
}

/// Reads the model's metadata, checks one request, and runs the steps.
fn steps(
    m: &Measure,
    device: &crate::device::DeviceInfo,
    started: Option<&mut Started>,
    log: &mut dyn Write,
) -> Result<ServerOutcome> {
    let s = m.server;
    let (info, metadata) = kserve::discover(&s.endpoint, s.served_model.as_deref())?;
    let request = Kserve::new(&metadata, &s.request)?;
    let engine = format!("{} {}", info.name, info.version).trim().to_string();
    // One request before any step: a server that answers wrongly fails here, with its answer.
    request
        .exchange(&s.endpoint, &s.endpoint.agent())
        .map_err(|why| anyhow::anyhow!("the first request to model `{}` failed: {why}", metadata.name))?;
    let server = ServerRow {
        engine: engine.clone(),
        protocol: s.protocol.as_str().to_string(),
        endpoint: s.endpoint.url.clone(),
        command: s.command.clone(),
        inputs: request.described.clone(),
        encoding: request.encoding.as_str().to_string(),
        request_batch: request.batch,
    };
    writeln!(
        log,
        "migprof {}: {engine} model `{}` at {} on {}: requests of {} ({}); rows to {}",
        provenance::VERSION,
        metadata.name,
        s.endpoint.url,
        device.name,
        request.described,
        request.encoding.as_str(),
        m.out.join(Table::Load.dir_name()).display()
    )?;
    let pids = started.map(|server| move || server.pids());
    let pids_ref: Option<&dyn Fn() -> std::collections::BTreeSet<u32>> =
        pids.as_ref().map(|f| f as &dyn Fn() -> std::collections::BTreeSet<u32>);
    let job = ServerJob {
        endpoint: &s.endpoint,
        exchange: &request,
        server: &server,
        model: &metadata.name,
        settings: m.load,
        concurrencies: &s.concurrency,
        rates: m.rates,
        search: m.search.then(|| m.rates.first().copied()),
        max_in_flight: s.max_in_flight,
        server_pids: pids_ref,
        sample_interval: m.sample_interval,
        cell: m.cell,
    };
    let mut context = RunContext::new_invocation(device);
    if let Some(invocation) = m.invocation {
        context.invocation_id = invocation.to_string();
    }
    job::run(&job, device, &context, m.out, log)
}
