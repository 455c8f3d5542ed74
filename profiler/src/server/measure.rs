//! A user's server measured on a target from start to end, as `migprof load --endpoint` and a
//! sweep's `[[servers]]` cell run it: started pinned where migprof starts it and waited on until
//! ready, the model's metadata read and one request checked, the steps run and written, and the
//! server's whole process tree and migprof's MPS daemon stopped however the steps ended (after the
//! rows are written: a stop that goes badly loses no measurement).

use std::collections::BTreeSet;
use std::io::Write;
use std::path::Path;
use std::time::Duration;

use anyhow::{bail, Result};

use super::generation_job::{self, GenerationJob, GenerationOutcome};
use super::given::ServerSettings;
use super::job::{self, Plan, ServerJob, ServerOutcome};
use super::kserve::{self, Kserve};
use super::launch::Started;
use super::openai::{self, PromptForm, Requests, PROMPT_IDS_BELOW};
use super::Exchange;
use crate::device::{DeviceSpec, ProgramTarget};
use crate::load::generation_record::GenerationServer;
use crate::load::record::ServerRow;
use crate::load::settings::{LoadSettings, ServeSettings};
use crate::provenance;
use crate::results::parts::Table;
use crate::run::record::{CellIdentity, RunContext};

/// How a server's steps are offered and judged, by its protocol.
#[derive(Clone, Copy)]
pub enum Offer<'a> {
    /// KServe: warm-up, duration, arrivals, the p99 objective and the search's bounds.
    Requests(&'a LoadSettings),
    /// OpenAI: the requests' lengths, arrivals, warm-up, duration, drain, the TTFT and TPOT
    /// objectives and the search's bounds.
    Generation(&'a ServeSettings),
}

/// What a job measured, in a line's terms.
pub struct Measured {
    /// Each step's achieved requests per second.
    pub rates: Vec<f64>,
    /// A search's capacity (`Some(None)`: none met the objective).
    pub capacity: Option<Option<f64>>,
    /// The objective in words: `p99 50 ms`, `TTFT p99 500 ms and TPOT p99 50 ms`.
    pub within: String,
}

/// What to measure and where the rows go.
pub struct Measure<'a> {
    pub server: &'a ServerSettings,
    pub offer: Offer<'a>,
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
        let (protocol, objective) = match self.offer {
            Offer::Requests(l) => (super::Protocol::Kserve, l.slo_p99_ms.is_some()),
            Offer::Generation(g) => (super::Protocol::Openai, g.slo().is_some()),
        };
        if protocol != self.server.protocol {
            bail!(
                "the {} protocol's server was given the settings of the {} protocol's",
                self.server.protocol.as_str(),
                protocol.as_str()
            );
        }
        super::given::check_steps(
            &self.server.concurrency,
            self.rates,
            self.search,
            protocol,
            objective,
            keys,
        )?;
        if self.server.command.is_none() && matches!(self.device, DeviceSpec::Mps(_)) {
            bail!("device {}: an emulated slice is made by starting the server as a client of migprof's MPS daemon: give the command that starts it (--server-cmd; server_cmd in a sweep file); a server already running computes wherever it was started", self.device);
        }
        Ok(())
    }
}

impl<'a> Measure<'a> {
    /// The steps asked for on the server, and what watches it.
    fn plan(&self, server_pids: Option<&'a dyn Fn() -> BTreeSet<u32>>) -> Plan<'a> {
        let s = self.server;
        Plan {
            endpoint: &s.endpoint,
            concurrencies: &s.concurrency,
            rates: self.rates,
            search: self.search.then(|| self.rates.first().copied()),
            max_in_flight: s.max_in_flight,
            server_pids,
            sample_interval: self.sample_interval,
            cell: self.cell,
        }
    }
}

/// Measures the server of `m` on its device, starting it first where it has a command.
pub fn measure(m: &Measure, log: &mut dyn Write) -> Result<Measured> {
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

/// Runs the steps the server's protocol runs.
fn steps(
    m: &Measure,
    device: &crate::device::DeviceInfo,
    started: Option<&mut Started>,
    log: &mut dyn Write,
) -> Result<Measured> {
    let pids = started.map(|server| move || server.pids());
    let pids: Option<&dyn Fn() -> BTreeSet<u32>> = pids.as_ref().map(|f| f as &dyn Fn() -> BTreeSet<u32>);
    let mut context = RunContext::new_invocation(device);
    if let Some(invocation) = m.invocation {
        context.invocation_id = invocation.to_string();
    }
    match m.offer {
        Offer::Requests(load) => {
            let outcome = kserve_steps(m, load, device, pids, &context, log)?;
            Ok(Measured {
                rates: outcome.steps.iter().map(|s| s.achieved_qps).collect(),
                capacity: outcome.capacity,
                within: format!("p99 {} ms", load.slo_p99_ms.unwrap_or_default()),
            })
        }
        Offer::Generation(settings) => {
            let outcome = openai_steps(m, settings, device, pids, &context, log)?;
            Ok(Measured {
                rates: outcome.steps.iter().map(|(_, s)| s.request_rate).collect(),
                capacity: outcome.capacity,
                within: format!(
                    "TTFT p99 {} ms and TPOT p99 {} ms",
                    settings.slo_ttft_p99_ms.unwrap_or_default(),
                    settings.slo_tpot_p99_ms.unwrap_or_default()
                ),
            })
        }
    }
}

/// Reads the model's metadata, checks one request, and runs the steps of a KServe server.
fn kserve_steps(
    m: &Measure,
    load: &LoadSettings,
    device: &crate::device::DeviceInfo,
    pids: Option<&dyn Fn() -> BTreeSet<u32>>,
    context: &RunContext,
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
    let job = ServerJob {
        plan: m.plan(pids),
        exchange: &request,
        server: &server,
        model: &metadata.name,
        settings: load,
    };
    job::run(&job, device, context, m.out, log)
}

/// Reads the served model, checks one request of the lengths' means, and runs the steps of an
/// OpenAI-compatible server.
fn openai_steps(
    m: &Measure,
    settings: &ServeSettings,
    device: &crate::device::DeviceInfo,
    pids: Option<&dyn Fn() -> BTreeSet<u32>>,
    context: &RunContext,
    log: &mut dyn Write,
) -> Result<GenerationOutcome> {
    let s = m.server;
    let o = s.openai;
    let served = openai::discover(&s.endpoint, s.served_model.as_deref())?;
    let requests = Requests {
        api: o.api,
        form: o.form,
        model: served.model.clone(),
        vocab: served.vocab.map_or(PROMPT_IDS_BELOW, |v| v.min(PROMPT_IDS_BELOW)),
        enforce_length: o.enforce_output,
    };
    let (output, first) = first_request(s, &requests, settings)?;
    let engine = served.engine();
    writeln!(
        log,
        "migprof {}: {engine} model `{}` at {} on {}: {} requests with prompts of {} ({}) tokens for {} tokens{}; rows to {}",
        provenance::VERSION,
        served.model,
        s.endpoint.url,
        device.name,
        o.api.as_str(),
        settings.prompt,
        o.form.as_str(),
        settings.output,
        if o.enforce_output { ", asked for exactly" } else { " at most" },
        m.out.join(Table::Serve.dir_name()).display()
    )?;
    if first.tokens < output {
        writeln!(
            log,
            "note: the first request came back with {} of the {output} tokens it asked for{}: the rows count such requests as short",
            first.tokens,
            if o.enforce_output { " although asked for exactly that many" } else { "" }
        )?;
    }
    let server = GenerationServer {
        engine,
        protocol: s.protocol.as_str().to_string(),
        endpoint: s.endpoint.url.clone(),
        command: s.command.clone(),
        api: o.api.as_str().to_string(),
        prompt_form: o.form.as_str().to_string(),
        output_enforced: o.enforce_output,
    };
    let job = GenerationJob {
        plan: m.plan(pids),
        requests: &requests,
        server: &server,
        settings,
    };
    generation_job::run(&job, device, context, m.out, log)
}

/// One request of the lengths' means before any step: a server that refuses what it is sent fails
/// here, with what it said (and the setting that may help). The tokens asked for, and the answer.
fn first_request(s: &ServerSettings, requests: &Requests, settings: &ServeSettings) -> Result<(u32, openai::Streamed)> {
    let o = s.openai;
    let mean = |d: crate::load::lengths::LengthDist| (d.mean().round() as u32).max(1);
    let (prompt, output) = (mean(settings.prompt), mean(settings.output));
    let first = requests
        .send(&s.endpoint, &s.endpoint.agent(), prompt, output, rand::random())
        .map_err(|why| {
            anyhow::anyhow!(
                "the first request to model `{}` ({prompt} prompt tokens, {output} output tokens) failed: {}{}",
                requests.model,
                why.reason(),
                match (&why, o.enforce_output) {
                    (openai::Unserved::Refused(_), true) => " (a server that refuses min_tokens or ignore_eos takes --no-enforce-output, enforce_output = false in a sweep file)",
                    (openai::Unserved::Refused(_), false) if o.form == PromptForm::Ids => " (a server that takes no token ids takes --prompt-form text)",
                    _ => "",
                }
            )
        })?;
    Ok((output, first))
}
