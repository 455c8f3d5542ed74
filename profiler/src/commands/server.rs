//! `migprof load --endpoint`: a server of the user's own (started first with `--server-cmd`, pinned
//! to `--device`), loaded at each `--concurrency` and `--qps`, or searched for its capacity. The
//! flags are [`ServerGiven`], turned into the library's settings here, once.

use std::io::Write;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Result;
use migprof::device::DeviceSpec;
use migprof::load::given::given_keys;
use migprof::load::settings::{Keys, LoadSettings, ServeSettings};
use migprof::server::given::{refuse_foreign, ServerGiven};
use migprof::server::measure::{measure, Measure, Offer};
use migprof::server::Protocol;

use super::args::{device_or_default, report_hint};

/// What `migprof load` asks of a server besides its own flags: how requests are offered, the
/// objective, the device and where the rows go.
pub struct Asked<'a> {
    pub offered: &'a migprof::load::given::Offered,
    pub pass: &'a migprof::load::given::PassGiven,
    pub serving: &'a migprof::load::given::ServeGiven,
    pub qps: &'a [f64],
    pub search: bool,
    pub seed: u64,
    pub device: Option<&'a DeviceSpec>,
    pub sample_interval_ms: u64,
    pub out: &'a std::path::Path,
}

/// Loads the server `given` names, starting it first where asked, and stops it however this ends.
pub fn exec(given: &ServerGiven, args: Asked, log: &mut dyn Write) -> Result<ExitCode> {
    let server = given.resolve(args.seed, Keys::Flags)?;
    refuse_foreign(
        server.protocol,
        &given_keys(args.pass),
        &given_keys(args.serving),
        Keys::Flags,
    )?;
    // The flags made into the settings of the server's protocol, once.
    let load = LoadSettings::given(args.offered, args.pass, args.seed);
    let generation = ServeSettings::given(args.offered, args.serving, args.seed);
    let (offer, duration_secs) = match server.protocol {
        Protocol::Kserve => {
            load.check(Keys::Flags)?;
            (Offer::Requests(&load), load.duration_secs)
        }
        Protocol::Openai => {
            generation.check(args.search, Keys::Flags)?;
            (Offer::Generation(&generation), generation.duration_secs)
        }
    };
    for &qps in args.qps {
        migprof::run::limits::step_requests("--qps", qps, "--duration", duration_secs).map_err(anyhow::Error::msg)?;
    }
    let device = device_or_default(args.device, log)?;
    let m = Measure {
        server: &server,
        offer,
        rates: args.qps,
        search: args.search,
        device: &device,
        sample_interval: (args.sample_interval_ms > 0).then(|| Duration::from_millis(args.sample_interval_ms)),
        out: args.out,
        cell: None,
        invocation: None,
    };
    measure(&m, log)?;
    writeln!(log, "{}", report_hint(args.out))?;
    Ok(ExitCode::SUCCESS)
}
