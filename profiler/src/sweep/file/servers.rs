//! A sweep file's `[[servers]]` tables: a user's server started on every target that runs alone, as
//! `migprof load --endpoint --server-cmd` starts it, and loaded at its concurrencies and rates or
//! searched for its capacity: one cell per target (and repeat), each a child of its own that starts
//! the server, measures it and stops its whole process tree. Its keys are `migprof load`'s server
//! flags by their names ([`ServerGiven`]), how requests are offered ([`Offered`]), the objective,
//! and the steps (`qps`, `search`).

use anyhow::{bail, Result};
use serde::Deserialize;

use super::keyed;
use crate::load::given::{given_keys, Offered, PassGiven, ServeGiven};
use crate::load::settings::{Keys, LoadSettings, ServeSettings};
use crate::run::given::group_keys;
use crate::run::limits;
use crate::server::given::ServerGiven;

/// A server of the sweep.
#[derive(Debug, Clone)]
pub struct ServerEntry {
    pub server: ServerGiven,
    pub offered: Offered,
    /// A KServe server's objective and a search step's requests (the batcher's keys are the
    /// server's own).
    pub pass: PassGiven,
    /// A language model's server's requests' lengths, drain and objectives (the batcher's and the
    /// cache's keys are the server's own).
    pub serve: ServeGiven,
    /// Open-loop rates, after the concurrencies.
    pub qps: Vec<f64>,
    /// Search the capacity within `slo_p99_ms`.
    pub search: bool,
}

/// The keys of a server that are the sweep's steps.
#[derive(Deserialize)]
struct Own {
    #[serde(default)]
    qps: Vec<f64>,
    #[serde(default)]
    search: bool,
}

const OWN_KEYS: [&str; 2] = ["qps", "search"];

/// Read key by key ([`keyed`]), as `[[capacity]]` is.
impl<'de> Deserialize<'de> for ServerEntry {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let own_keys = OWN_KEYS.map(String::from).to_vec();
        let (server, offered, pass, serve) = (
            group_keys::<ServerGiven>(),
            group_keys::<Offered>(),
            group_keys::<PassGiven>(),
            group_keys::<ServeGiven>(),
        );
        let own = |t: toml::Table| keyed::typed::<Own>(t).map(|_| ());
        let server_read = |t: toml::Table| keyed::typed::<ServerGiven>(t).map(|_| ());
        let offered_read = |t: toml::Table| keyed::typed::<Offered>(t).map(|_| ());
        let pass_read = |t: toml::Table| keyed::typed::<PassGiven>(t).map(|_| ());
        let serve_read = |t: toml::Table| keyed::typed::<ServeGiven>(t).map(|_| ());
        let table = keyed::read(
            d,
            &[
                keyed::Group::new(own_keys.clone(), &own),
                keyed::Group::new(server.clone(), &server_read),
                keyed::Group::new(offered.clone(), &offered_read),
                keyed::Group::new(pass.clone(), &pass_read),
                keyed::Group::new(serve.clone(), &serve_read),
            ],
        )?;
        let own: Own = keyed::take(&table, &own_keys).map_err(D::Error::custom)?;
        Ok(ServerEntry {
            server: keyed::take(&table, &server).map_err(D::Error::custom)?,
            offered: keyed::take(&table, &offered).map_err(D::Error::custom)?,
            pass: keyed::take(&table, &pass).map_err(D::Error::custom)?,
            serve: keyed::take(&table, &serve).map_err(D::Error::custom)?,
            qps: own.qps,
            search: own.search,
        })
    }
}

impl ServerEntry {
    /// The model it measures, as the server names it: the cells' `model`.
    pub fn model(&self) -> &str {
        self.server.served_model.as_deref().unwrap_or_default()
    }

    /// Its load settings: `migprof load`'s defaults where a key is not given.
    pub fn load_settings(&self, seed: u64) -> LoadSettings {
        LoadSettings::given(&self.offered, &self.pass, seed)
    }

    /// A language model's server's settings (`protocol = "openai"`): `migprof load`'s defaults
    /// where a key is not given; `None` for a KServe server.
    pub fn generation_settings(&self, seed: u64) -> Option<ServeSettings> {
        (self.protocol() == Some(crate::server::Protocol::Openai))
            .then(|| ServeSettings::given(&self.offered, &self.serve, seed))
    }

    /// Its protocol, where it names a valid one (the default's where it names none).
    fn protocol(&self) -> Option<crate::server::Protocol> {
        match &self.server.protocol {
            Some(p) => p.parse().ok(),
            None => Some(crate::server::given::DEFAULTS.protocol),
        }
    }

    /// What the file must say of a server that runs on every target, and every value checked as
    /// `migprof load` checks its flags; problems named with `at`.
    pub fn check(&self, at: &str, seed: u64, timeout_secs: f64) -> Result<()> {
        let s = &self.server;
        if s.served_model.as_deref().is_none_or(|m| m.trim().is_empty()) {
            bail!(
                "{at}: served_model: name the model to measure as the server names it; its rows record it as `model`"
            );
        }
        if s.server_cmd.is_none() {
            bail!("{at}: server_cmd: a sweep starts the server on every target, pinned there: give the shell command that starts it");
        }
        let resolved = s
            .resolve(seed, Keys::SweepFile)
            .map_err(|e| anyhow::anyhow!("{at}: {e:#}"))?;
        let within = |e: anyhow::Error| anyhow::anyhow!("{at}: {e:#}");
        crate::server::given::refuse_foreign(
            resolved.protocol,
            &given_keys(&self.pass),
            &given_keys(&self.serve),
            Keys::SweepFile,
        )
        .map_err(within)?;
        // Each step's seconds: a language model's also its drain.
        let (step_secs, duration_secs, objective) = match self.generation_settings(seed) {
            Some(g) => {
                g.check(self.search, Keys::SweepFile).map_err(within)?;
                (g.duration_secs + g.drain_secs, g.duration_secs, g.slo().is_some())
            }
            None => {
                let load = self.load_settings(seed);
                load.check(Keys::SweepFile).map_err(within)?;
                (
                    load.warmup_secs + load.duration_secs,
                    load.duration_secs,
                    load.slo_p99_ms.is_some(),
                )
            }
        };
        crate::server::given::check_steps(
            &s.concurrency,
            &self.qps,
            self.search,
            resolved.protocol,
            objective,
            Keys::SweepFile,
        )
        .map_err(within)?;
        // The sweep's time limit kills a cell whose server is still starting or stepping.
        let steps = (s.concurrency.len() + self.qps.len()) as f64 * step_secs;
        let ready = resolved.server_timeout.as_secs_f64();
        if ready + steps > timeout_secs {
            bail!(
                "{at}: the server may take server_timeout {ready} s to get ready and its steps take {steps} s, {} s in all, past [defaults] timeout_secs {timeout_secs}: raise timeout_secs or lower server_timeout",
                ready + steps
            );
        }
        for (i, &qps) in self.qps.iter().enumerate() {
            limits::step_requests("qps", qps, "duration_secs", duration_secs)
                .map_err(|e| anyhow::anyhow!("{at}: {e}"))?;
            if self.qps[..i].contains(&qps) {
                bail!("{at}: qps lists {qps} more than once");
            }
        }
        if let Some(n) = s
            .concurrency
            .iter()
            .enumerate()
            .find_map(|(i, n)| s.concurrency[..i].contains(n).then_some(n))
        {
            bail!("{at}: concurrency lists {n} more than once");
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const BASE: &str =
        "endpoint = \"http://127.0.0.1:8000\"\nserver_cmd = \"python3 serve.py\"\nserved_model = \"dense\"\n";

    fn entry(extra: &str) -> std::result::Result<ServerEntry, String> {
        toml::from_str::<ServerEntry>(&format!("{BASE}{extra}")).map_err(|e| e.to_string())
    }

    #[test]
    fn a_server_s_keys_are_load_s_flags_by_name() {
        let e = entry("concurrency = [1, 2]\nbatch = 8\nqps = [5.0]\nwarmup_secs = 2\nduration_secs = 5\nsearch = true\nslo_p99_ms = 50\nshapes = [\"x:16\"]").unwrap();
        e.check("[[servers]] #1", 0, 600.0).unwrap();
        let slow = e.check("[[servers]] #1", 0, 300.0).unwrap_err().to_string();
        assert!(
            slow.contains("server_timeout 300 s") && slow.contains("timeout_secs 300"),
            "{slow}"
        );
        assert_eq!(e.server.concurrency, vec![1, 2]);
        assert_eq!(e.qps, vec![5.0]);
        assert!(e.search);
        let load = e.load_settings(3);
        assert_eq!(
            (load.warmup_secs, load.duration_secs, load.slo_p99_ms),
            (2.0, 5.0, Some(50.0))
        );
        assert_eq!(e.model(), "dense");
    }

    #[test]
    fn what_a_sweep_s_server_must_say_is_named() {
        let bad = entry("batches = [1]").unwrap_err();
        assert!(bad.contains("batches"), "{bad}");
        let check = |extra: &str| {
            entry(extra)
                .unwrap()
                .check("[[servers]] #2", 0, 600.0)
                .unwrap_err()
                .to_string()
        };
        assert!(check("").contains("say how to load the server"));
        assert!(check("search = true").contains("slo_p99_ms"));
        assert!(check("concurrency = [1]\nmax_batch = 8").contains("batches as it is configured"));
        assert!(check("concurrency = [1, 1]").contains("more than once"));
        assert!(check("qps = [1.0, 1.0]").contains("more than once"));
        assert!(check("concurrency = [0]").contains("[[servers]] #2: concurrency"));
        assert!(check("concurrency = [1]\nencoding = \"xml\"").contains("[[servers]] #2: encoding"));
        let no_cmd =
            toml::from_str::<ServerEntry>("endpoint = \"http://h:1\"\nserved_model = \"m\"\nconcurrency = [1]")
                .unwrap()
                .check("[[servers]] #1", 0, 600.0)
                .unwrap_err()
                .to_string();
        assert!(no_cmd.contains("server_cmd"), "{no_cmd}");
        let no_model =
            toml::from_str::<ServerEntry>("endpoint = \"http://h:1\"\nserver_cmd = \"x\"\nconcurrency = [1]")
                .unwrap()
                .check("[[servers]] #1", 0, 600.0)
                .unwrap_err()
                .to_string();
        assert!(no_model.contains("served_model"), "{no_model}");
    }
}
