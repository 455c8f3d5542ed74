//! The sweep file: a name, defaults, targets (where to run) and matrices (what to run), in TOML. Read
//! strictly: an unknown key, a wrong type or an impossible value is an error that names the line and
//! the key, so a typo never silently becomes a default.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::cell::spec::DTYPES;
use crate::device::DeviceSpec;
pub use crate::run::given::BatchSize;
use crate::run::given::{self, group_keys, KernelGiven, MeasureGiven, Measuring, Place, WorkloadGiven};
use crate::run::limits;

mod capacity;
mod keyed;
mod programs;
mod servers;
pub use capacity::{CapacitySearch, Served};
pub use programs::Program;
pub use servers::ServerEntry;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepFile {
    /// Recorded in every row as `sweep`.
    pub name: String,
    #[serde(default)]
    pub defaults: Defaults,
    pub targets: Vec<Target>,
    #[serde(default)]
    pub matrix: Vec<Matrix>,
    /// Targets run at once: each matrix cell on every member together.
    #[serde(default)]
    pub groups: Vec<Group>,
    /// Capacity searches: each model's highest rate within a p99 objective on every target run alone.
    #[serde(default)]
    pub capacity: Vec<CapacitySearch>,
    /// The user's own programs, each measured on every target run alone (as `migprof exec`).
    #[serde(default)]
    pub programs: Vec<Program>,
    /// The user's own servers, each started and loaded on every target run alone (as `migprof load
    /// --endpoint --server-cmd`).
    #[serde(default)]
    pub servers: Vec<ServerEntry>,
}

/// A concurrent group: its targets run each matrix cell at the same time (a member's cell process per
/// target, started together), meet after warm-up so that their measured phases overlap, and keep
/// their devices busy until every member has measured. With `busy`, the first target runs the
/// matrix cell and the others run the busy workload as its neighbours (the noisy-neighbour test).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Group {
    /// Recorded in every member's row as `concurrency_group`.
    pub label: String,
    /// Must be `true`: what a group is for (targets that run apart are just targets).
    pub concurrent: bool,
    /// Labels of `[[targets]]`, at least two.
    pub targets: Vec<String>,
    #[serde(default)]
    pub busy: Option<Busy>,
}

/// The neighbours' workload of a noisy-neighbour group.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Busy {
    pub model: String,
    #[serde(default = "train")]
    pub mode: String,
    #[serde(default = "bf16")]
    pub dtype: String,
    pub batch: usize,
    #[serde(default)]
    pub seq_len: Option<usize>,
}

fn train() -> String {
    "train".into()
}

fn bf16() -> String {
    "bf16".into()
}

/// Settings of every cell: how each is measured (`migprof run`'s settings, declared once in
/// [`crate::run::given`], with a sweep's defaults) and how the sweep runs them.
#[derive(Debug, Clone)]
pub struct Defaults {
    pub measure: Measuring,
    /// Independent repetitions of each cell, each a fresh process with the same seed.
    pub repeats: u32,
    /// A cell still running after this long is killed and recorded as `timeout`.
    pub timeout_secs: f64,
    /// Idle time between two cells on one device.
    pub cooldown_secs: f64,
    /// The largest batch a `"max"` search tries.
    pub max_batch_limit: usize,
}

/// The keys of `[defaults]` that are the sweep's own, not a measurement's.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct Own {
    repeats: u32,
    timeout_secs: f64,
    cooldown_secs: f64,
    max_batch_limit: usize,
}

impl Default for Own {
    fn default() -> Self {
        Own {
            repeats: 1,
            timeout_secs: 600.0,
            cooldown_secs: 0.0,
            max_batch_limit: 4096,
        }
    }
}

const OWN_KEYS: [&str; 4] = ["repeats", "timeout_secs", "cooldown_secs", "max_batch_limit"];

impl Default for Defaults {
    fn default() -> Self {
        Defaults::of(MeasureGiven::default(), Own::default())
    }
}

impl Defaults {
    fn of(given: MeasureGiven, own: Own) -> Defaults {
        Defaults {
            measure: given.resolve(&given::SWEEP),
            repeats: own.repeats,
            timeout_secs: own.timeout_secs,
            cooldown_secs: own.cooldown_secs,
            max_batch_limit: own.max_batch_limit,
        }
    }
}

/// Read key by key ([`keyed`]): the measurement's keys by their group, checked as `migprof run`
/// checks its flags, the sweep's own beside them.
impl<'de> Deserialize<'de> for Defaults {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let (measure_keys, own_keys) = (group_keys::<MeasureGiven>(), OWN_KEYS.map(String::from).to_vec());
        let measure = |t: toml::Table| keyed::typed::<MeasureGiven>(t)?.check("[defaults]");
        let own = |t: toml::Table| keyed::typed::<Own>(t).map(|_| ());
        let table = keyed::read(
            d,
            &[
                keyed::Group::new(measure_keys.clone(), &measure),
                keyed::Group::new(own_keys.clone(), &own),
            ],
        )?;
        let given: MeasureGiven = keyed::take(&table, &measure_keys).map_err(D::Error::custom)?;
        given.check_together("[defaults]").map_err(D::Error::custom)?;
        let own: Own = keyed::take(&table, &own_keys).map_err(D::Error::custom)?;
        Ok(Defaults::of(given, own))
    }
}

/// Where cells run.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Target {
    /// Recorded in every row as `target`.
    pub label: String,
    /// Anything `--device` takes.
    pub device: String,
    /// `false`: the target runs only in its groups, not alone (e.g. the seven members of a 7×1g group).
    #[serde(default = "yes")]
    pub alone: bool,
    /// The target the report's scaling chart and comparisons measure the others against (at most
    /// one; none: the one with the most SMs). Recorded in its rows as `baseline`.
    #[serde(default)]
    pub baseline: bool,
    /// On a cluster backend: the GPU product to run on, as the scheduler names it (the Kubernetes
    /// label `nvidia.com/gpu.product`, e.g. `NVIDIA-H100-80GB-HBM3`; a Slurm feature).
    #[serde(default)]
    pub product: Option<String>,
}

fn yes() -> bool {
    true
}

/// A cross product of cells; several add up: what runs, and the kernels it runs with (the
/// `--attention` and friends of `migprof run`, declared once in [`crate::run::given`]).
#[derive(Debug, Clone)]
pub struct Matrix {
    /// What runs (`migprof run`'s `--model`, `--batch` and the rest, declared once in
    /// [`crate::run::given`]): the cross product of its lists.
    pub cells: WorkloadGiven,
    pub kernels: KernelGiven,
}

/// Read key by key ([`keyed`]): the cells' keys and the kernel options', each value at its line.
impl<'de> Deserialize<'de> for Matrix {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        use serde::de::Error;
        let (cell_keys, kernel_keys) = (keyed::keys_of::<WorkloadGiven>(), group_keys::<KernelGiven>());
        let cells = |t: toml::Table| keyed::typed::<WorkloadGiven>(t).map(|_| ());
        let kernels = |t: toml::Table| keyed::typed::<KernelGiven>(t).map(|_| ());
        let table = keyed::read(
            d,
            &[
                keyed::Group::new(cell_keys.clone(), &cells),
                keyed::Group::new(kernel_keys.clone(), &kernels),
            ],
        )?;
        Ok(Matrix {
            cells: keyed::take(&table, &cell_keys).map_err(D::Error::custom)?,
            kernels: keyed::take(&table, &kernel_keys).map_err(D::Error::custom)?,
        })
    }
}

impl SweepFile {
    pub fn read(path: &Path) -> Result<SweepFile> {
        let text =
            std::fs::read_to_string(path).with_context(|| format!("reading the sweep file {}", path.display()))?;
        Self::parse(&text).with_context(|| format!("in the sweep file {}", path.display()))
    }

    /// Parses and checks a sweep file's text. TOML's own errors carry the line, column and key.
    pub fn parse(text: &str) -> Result<SweepFile> {
        let file: SweepFile = toml::from_str(text).map_err(|e| anyhow::anyhow!("{e}"))?;
        file.check()?;
        Ok(file)
    }

    /// What TOML cannot say: names that must exist, values that must fit.
    fn check(&self) -> Result<()> {
        self.check_defaults()?;
        let labels = self.check_targets()?;
        let mut group_labels = std::collections::HashSet::new();
        for (i, g) in self.groups.iter().enumerate() {
            let at = format!("[[groups]] #{} `{}`", i + 1, g.label);
            if g.label.is_empty() || !group_labels.insert(g.label.as_str()) {
                bail!("{at}: label is empty or used twice; each group needs its own");
            }
            self.check_group(&at, g, &labels)?;
        }
        if self.targets.iter().all(|t| !t.alone) && self.groups.is_empty() {
            bail!("every target has alone = false and there is no [[groups]]: nothing would run");
        }
        if self.matrix.is_empty() && self.capacity.is_empty() && self.programs.is_empty() && self.servers.is_empty() {
            bail!("no [[matrix]], [[capacity]], [[programs]] or [[servers]]: give at least one, e.g. [[matrix]] models = [\"resnet18\"] batches = [1, 8]");
        }
        if !(self.capacity.is_empty() && self.programs.is_empty() && self.servers.is_empty())
            && self.targets.iter().all(|t| !t.alone)
        {
            bail!("[[capacity]] searches, [[programs]] and [[servers]] run on targets alone, and every target has alone = false");
        }
        let foreign = match (self.programs.is_empty(), self.servers.is_empty()) {
            (false, _) => Some("[[programs]] run on every target alone, and a program"),
            (true, false) => Some("[[servers]] run on every target alone, and a server"),
            (true, true) => None,
        };
        if let Some((t, foreign)) = foreign.and_then(|f| {
            self.targets
                .iter()
                .find(|t| {
                    t.alone
                        && t.device
                            .trim()
                            .starts_with(crate::mps::MemoryEmulation::Partitioned.prefix())
                })
                .map(|t| (t, f))
        }) {
            bail!(
                "[[targets]] `{}`: device {}: {foreign} migprof did not write cannot be held to a memory-partitioned slice's bandwidth (its neighbour is calibrated against migprof's own kernels); use mps: for it, or alone = false",
                t.label,
                t.device
            );
        }
        for (i, server) in self.servers.iter().enumerate() {
            server.check(
                &format!("[[servers]] #{}", i + 1),
                self.defaults.measure.seed,
                self.defaults.timeout_secs,
            )?;
        }
        let mut names = std::collections::HashSet::new();
        for (i, p) in self.programs.iter().enumerate() {
            let at = format!("[[programs]] #{} `{}`", i + 1, p.name);
            p.check(&at)?;
            if !names.insert((p.name.as_str(), &p.command)) {
                bail!("{at}: the same name and command twice: they would be the same cells");
            }
        }
        for (i, c) in self.capacity.iter().enumerate() {
            c.check(&format!("[[capacity]] #{}", i + 1), self.defaults.measure.seed)?;
        }
        for (i, m) in self.matrix.iter().enumerate() {
            m.check(&format!("[[matrix]] #{}", i + 1))?;
        }
        Ok(())
    }

    /// `[defaults]` and the sweep's name.
    fn check_defaults(&self) -> Result<()> {
        let d = &self.defaults;
        for (key, v, positive) in [
            ("timeout_secs", d.timeout_secs, true),
            ("cooldown_secs", d.cooldown_secs, false),
        ] {
            limits::seconds(&format!("[defaults] {key}"), v, positive).map_err(anyhow::Error::msg)?;
        }
        limits::BATCH
            .check("[defaults] max_batch_limit", d.max_batch_limit as u64)
            .map_err(anyhow::Error::msg)?;
        if d.repeats == 0 {
            bail!("[defaults] repeats = 0: expected at least 1");
        }
        if self.name.trim().is_empty() {
            bail!(
                "name = \"{}\": give the sweep a name (e.g. name = \"slices\"); every row records it as `sweep`",
                self.name
            );
        }
        Ok(())
    }

    /// The targets, each with its own label and a device that parses, at most one the baseline:
    /// their labels.
    fn check_targets(&self) -> Result<std::collections::HashSet<&str>> {
        if self.targets.is_empty() {
            bail!("no [[targets]]: name at least one, e.g. [[targets]] label = \"cpu\" device = \"cpu\"");
        }
        let mut labels = std::collections::HashSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            if t.label.is_empty() || !labels.insert(t.label.as_str()) {
                bail!(
                    "[[targets]] #{}: label `{}` is empty or used twice; each target needs its own",
                    i + 1,
                    t.label
                );
            }
            t.device
                .parse::<DeviceSpec>()
                .with_context(|| format!("[[targets]] `{}`: device", t.label))?;
        }
        let baselines: Vec<&str> = self
            .targets
            .iter()
            .filter(|t| t.baseline)
            .map(|t| t.label.as_str())
            .collect();
        if baselines.len() > 1 {
            bail!(
                "[[targets]]: baseline = true on {}; at most one target is the baseline",
                baselines.join(", ")
            );
        }
        Ok(labels)
    }

    /// One group (`at` names it) of targets among `labels`: concurrent, two or more members each
    /// once, emulated members of one GPU emulated one way, a busy neighbour that runs.
    fn check_group(&self, at: &str, g: &Group, labels: &std::collections::HashSet<&str>) -> Result<()> {
        if !g.concurrent {
            bail!("{at}: concurrent = false; a group runs its targets at once (targets that run apart need no group)");
        }
        if g.targets.len() < 2 {
            bail!("{at}: targets: a group needs at least two");
        }
        let mut seen = std::collections::HashSet::new();
        for t in &g.targets {
            if !labels.contains(t.as_str()) {
                let known: Vec<&str> = self.targets.iter().map(|t| t.label.as_str()).collect();
                bail!("{at}: targets: no target `{t}`; targets: {}", known.join(", "));
            }
            if !seen.insert(t.as_str()) {
                bail!("{at}: targets: `{t}` twice; a target is one device and runs one member");
            }
        }
        // The mps-mem: members of a GPU share one memory-system neighbour on the SMs none of
        // them has; an mps: member beside them would run on those SMs too.
        let mut ways: std::collections::HashMap<String, (crate::mps::MemoryEmulation, &str)> =
            std::collections::HashMap::new();
        for t in &g.targets {
            let device = self
                .targets
                .iter()
                .find(|x| &x.label == t)
                .map_or("", |x| x.device.as_str());
            let Some(Ok(target)) = crate::mps::MpsTarget::parse_device(device) else {
                continue;
            };
            let gpu = target.gpu.clone().unwrap_or_else(|| "0".into());
            match ways.get(&gpu) {
                Some((way, other)) if *way != target.memory => bail!(
                    "{at}: targets `{other}` and `{t}` emulate slices of one GPU, one alone (mps:) and one memory-partitioned (mps-mem:); a group's emulated members on a GPU are all mps: or all mps-mem: (the mps-mem: members share one memory-system neighbour on the SMs none of them has)"
                ),
                Some(_) => {}
                None => {
                    ways.insert(gpu, (target.memory, t.as_str()));
                }
            }
        }
        if let Some(b) = &g.busy {
            if !workloads::model_names().contains(&b.model.as_str()) {
                bail!(
                    "{at}: busy: unknown model `{}`; valid models: {}",
                    b.model,
                    workloads::model_names().join(", ")
                );
            }
            if workloads::lookup(&b.model).is_ok_and(|(_, info)| info.family.is_decoder()) {
                bail!("{at}: busy: `{}` is a language model; a busy neighbour runs an image or encoder model (mode infer or train)", b.model);
            }
            if !["infer", "train"].contains(&b.mode.as_str())
                || !DTYPES.contains(&b.dtype.as_str())
                || limits::BATCH.check("batch", b.batch as u64).is_err()
            {
                bail!(
                    "{at}: busy: mode infer|train, dtype one of {}, a batch from 1 to {}",
                    DTYPES.join(", "),
                    limits::BATCH.max
                );
            }
        }

        Ok(())
    }
}

impl Matrix {
    /// One matrix (`at` names it): its cells (the kernel options were checked as they were read).
    fn check(&self, at: &str) -> Result<()> {
        self.cells.workloads(Place::Matrix(at)).map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::load::lengths::LengthDist;

    const EXAMPLE: &str = r#"
name = "resnet-slices"
[defaults]
warmup_secs = 2
duration_secs = 10
repeats = 2
[[targets]]
label = "full"
device = "0"
[[targets]]
label = "3g"
device = "3g.40gb"
[[matrix]]
models = ["resnet50", "vit_b_16"]
modes = ["infer", "train"]
dtypes = ["bf16"]
batches = [1, 8, 32, 128, "max"]
seq_lens = [128]
"#;

    #[test]
    fn the_documented_example_reads() {
        let f = SweepFile::parse(EXAMPLE).unwrap();
        assert_eq!(f.name, "resnet-slices");
        assert_eq!(
            (f.defaults.repeats, f.defaults.timeout_secs, f.defaults.max_batch_limit),
            (2, 600.0, 4096)
        );
        assert_eq!(f.targets[1].device, "3g.40gb");
        assert_eq!(
            f.matrix[0].cells.batches,
            vec![
                BatchSize::Fixed(1),
                BatchSize::Fixed(8),
                BatchSize::Fixed(32),
                BatchSize::Fixed(128),
                BatchSize::Max
            ]
        );
    }

    #[test]
    fn programs_are_checked_with_the_file() {
        let file = |targets: &str, programs: &str| {
            SweepFile::parse(&format!("name = \"p\"\n{targets}\n{programs}")).map_err(|e| format!("{e:#}"))
        };
        let cpu = "[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"";
        let program =
            "[[programs]]\nname = \"train\"\ncommand = [\"python3\", \"train.py\", \"{batch}\"]\nbatches = [8]";
        assert_eq!(file(cpu, program).unwrap().programs.len(), 1);
        let e = file("[[targets]]\nlabel = \"1g\"\ndevice = \"mps-mem:1g.10gb\"", program).unwrap_err();
        assert!(e.contains("`1g`") && e.contains("memory-partitioned"), "{e}");
        let e = file(cpu, &format!("{program}\n{program}")).unwrap_err();
        assert!(e.contains("[[programs]] #2 `train`") && e.contains("twice"), "{e}");
        let e = file(cpu, "[[programs]]\nname = \"x\"\ncommand = [\"x\", \"{batch}\"]").unwrap_err();
        assert!(e.contains("[[programs]] #1 `x`") && e.contains("no batches"), "{e}");
    }

    #[test]
    fn errors_name_the_line_and_the_key() {
        let err = |text: &str| format!("{:#}", SweepFile::parse(text).unwrap_err());
        // A typo in a key: TOML's error names the line and the unknown key with the valid ones.
        let e = err(&EXAMPLE.replace("duration_secs = 10", "duraton_secs = 10"));
        assert!(
            e.contains("line 5") && e.contains("duraton_secs") && e.contains("duration_secs"),
            "{e}"
        );
        // A sweep without a name: its rows could not be told from a plain run's.
        let first = EXAMPLE.lines().find(|l| l.starts_with("name = ")).unwrap();
        let e = err(&EXAMPLE.replace(first, "name = \" \""));
        assert!(e.contains("give the sweep a name"), "{e}");
        let e = err(&EXAMPLE.replace("repeats = 2", "repeats = \"two\""));
        assert!(e.contains("line 6") && e.contains("repeats"), "{e}");
        let e = err(&EXAMPLE.replace("\"max\"]", "\"biggest\"]"));
        assert!(
            e.contains("line 17") && e.contains("batches") && e.contains("\"max\""),
            "{e}"
        );
        let e = err(&EXAMPLE.replace("\"vit_b_16\"", "\"vit_b_17\""));
        assert!(
            e.contains("[[matrix]] #1") && e.contains("vit_b_17") && e.contains("vit_b_16"),
            "{e}"
        );
        let e = err(&EXAMPLE.replace("device = \"3g.40gb\"", "device = \"tpu\""));
        assert!(
            e.contains("`3g`") && e.contains("tpu") && e.contains("MIG-<uuid>"),
            "{e}"
        );
        let e = err(&EXAMPLE.replace("label = \"3g\"", "label = \"full\""));
        assert!(e.contains("used twice"), "{e}");
        let e = err(&EXAMPLE.replace("dtypes = [\"bf16\"]", "dtypes = [\"fp8\"]"));
        assert!(e.contains("fp8") && e.contains("f32, bf16, f16, tf32"), "{e}");
        // A fraction or a size beyond the bound, in migprof's words.
        let e = err(&EXAMPLE.replace("\"max\"]", "1.5]"));
        assert!(
            e.contains("a batch size is a positive integer or \"max\", not 1.5"),
            "{e}"
        );
        let e = err(&EXAMPLE.replace("\"max\"]", "100000]"));
        assert!(
            e.contains("line 17")
                && e.contains("batches: size `100000`: a batch size is a whole number from 1 to 65536"),
            "{e}"
        );
    }

    #[test]
    fn capacity_searches_take_each_kinds_keys_and_refuse_the_others() {
        let with = |search: &str| {
            SweepFile::parse(&format!(
                "name = \"c\"\n[[targets]]\nlabel = \"cpu\"\ndevice = \"cpu\"\n[[capacity]]\n{search}\n"
            ))
        };
        let err = |search: &str| format!("{:#}", with(search).unwrap_err());
        // A language model's search: `migprof load`'s defaults where a key is not given.
        let f = with(
            "models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = \"lognormal:64,0.5\"\noutput_len = 32\nmax_steps = 6",
        )
        .unwrap();
        let s = f.capacity[0].serve_settings(7);
        assert_eq!(
            s.prompt,
            LengthDist::Lognormal {
                mean: 64.0,
                spread: 0.5
            }
        );
        assert_eq!(s.output, LengthDist::Fixed(32));
        assert_eq!((s.max_steps, s.arrival_seed, s.slo_ttft_p99_ms), (6, 7, Some(500.0)));
        let d = &crate::load::settings::SERVE_DEFAULTS;
        assert_eq!(
            (
                s.max_seqs,
                s.max_batched_tokens,
                s.chunked_prefill,
                s.duration_secs,
                s.resolution
            ),
            (
                d.max_seqs,
                d.max_batched_tokens,
                d.chunked_prefill,
                d.duration_secs,
                d.resolution
            )
        );
        // Both kinds in one search, each with its objectives.
        assert!(with(
            "models = [\"llama_tiny\", \"bert_tiny\"]\nslo_p99_ms = 50\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 64\noutput_len = 32"
        )
        .is_ok());
        let e = err("models = [\"llama_tiny\", \"bert_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50");
        assert!(e.contains("slo_p99_ms") && e.contains("required"), "{e}");
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500");
        assert!(e.contains("both objectives"), "{e}");
        // A key of the other kind is refused, with the kind it applies to.
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nmax_batch = 8");
        assert!(
            e.contains("max_batch applies to models served one forward pass per request") && e.contains("(llama_tiny)"),
            "{e}"
        );
        let e = err("models = [\"bert_tiny\"]\nslo_p99_ms = 50\nmax_seqs = 8");
        assert!(e.contains("max_seqs applies to language models"), "{e}");
        // A value that is no number is given all the same.
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nslo_p99_ms = nan");
        assert!(
            e.contains("slo_p99_ms applies to models served one forward pass"),
            "{e}"
        );
        // Serving settings are checked as `migprof load` checks them, named as the file names them.
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nmax_seqs = 64\nmax_batched_tokens = 32");
        assert!(e.contains("max_batched_tokens 32 must be at least max_seqs 64"), "{e}");
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nwarmup_secs = 5\nduration_secs = 5");
        assert!(
            e.contains("warmup_secs 5 s must be shorter than duration_secs 5 s"),
            "{e}"
        );
        for span in ["duration_secs = nan", "duration_secs = inf", "drain_secs = 1e300"] {
            let e = err(&format!(
                "models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\n{span}"
            ));
            assert!(e.contains("expected seconds from 0 to a day"), "{span}: {e}");
        }
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 32.5");
        assert!(e.contains("32.5") && e.contains("lognormal:MEAN,SPREAD"), "{e}");
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = 512");
        assert!(
            e.contains("640 tokens on average; llama_tiny holds 256 positions"),
            "{e}"
        );
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nprompt_len = \"zipf:3\"");
        assert!(e.contains("prompt_len") && e.contains("lognormal:MEAN,SPREAD"), "{e}");
        let e = err("models = [\"llama_tiny\"]\nslo_ttft_p99_ms = 500\nslo_tpot_p99_ms = 50\nresolution_pct = 100");
        assert!(e.contains("resolution_pct 100: expected a percentage"), "{e}");
    }

    #[test]
    fn groups_name_known_targets_and_say_what_is_wrong() {
        let err = |group: &str| {
            format!(
                "{:#}",
                SweepFile::parse(&format!("{EXAMPLE}[[groups]]\n{group}")).unwrap_err()
            )
        };
        let ok = format!("{EXAMPLE}[[groups]]\nlabel = \"g\"\nconcurrent = true\ntargets = [\"full\", \"3g\"]\n");
        assert_eq!(SweepFile::parse(&ok).unwrap().groups[0].targets, vec!["full", "3g"]);
        let e = err("label = \"g\"\nconcurrent = true\ntargets = [\"full\", \"2g\"]");
        assert!(e.contains("no target `2g`; targets: full, 3g"), "{e}");
        let e = err("label = \"g\"\nconcurrent = false\ntargets = [\"full\", \"3g\"]");
        assert!(e.contains("concurrent = false"), "{e}");
        let e = err("label = \"g\"\nconcurrent = true\ntargets = [\"full\"]");
        assert!(e.contains("at least two"), "{e}");
        let e = err("label = \"g\"\nconcurrent = true\ntargets = [\"full\", \"full\"]");
        assert!(e.contains("`full` twice"), "{e}");
        let e = err("label = \"g\"\nconcurrent = true\ntargets = [\"full\", \"3g\"]\nbusy = { model = \"resnet51\", batch = 128 }");
        assert!(e.contains("busy: unknown model `resnet51`"), "{e}");
        let e = err("label = \"g\"\nconcurrent = true\ntargets = [\"full\", \"3g\"]\nbusy = { model = \"resnet50\", batch = 128, speed = 1 }");
        assert!(e.contains("speed"), "{e}");
        // Memory-partitioned members of a GPU share its neighbour; beside an mps: member they cannot.
        let emulated = |devices: [&str; 3], group: &str| {
            let targets: String = devices
                .iter()
                .enumerate()
                .map(|(i, d)| format!("[[targets]]\nlabel = \"e{i}\"\ndevice = \"{d}\"\n"))
                .collect();
            SweepFile::parse(&format!(
                "{EXAMPLE}{targets}[[groups]]\nlabel = \"g\"\nconcurrent = true\ntargets = {group}\n"
            ))
        };
        let mem = ["mps-mem:1g.10gb", "mps-mem:2g.20gb", "mps:3g.40gb@1"];
        assert!(emulated(mem, r#"["e0", "e1", "e2"]"#).is_ok());
        let mixed = ["mps-mem:1g.10gb", "mps:2g.20gb", "mps:3g.40gb@1"];
        let e = format!("{:#}", emulated(mixed, r#"["e0", "e1"]"#).unwrap_err());
        assert!(
            e.contains("targets `e0` and `e1` emulate slices of one GPU") && e.contains("all mps: or all mps-mem:"),
            "{e}"
        );
        assert!(emulated(mixed, r#"["e0", "e2"]"#).is_ok(), "another GPU");
        let two = EXAMPLE
            .replace("device = \"0\"", "device = \"0\"\nbaseline = true")
            .replace("device = \"3g.40gb\"", "device = \"3g.40gb\"\nbaseline = true");
        let e = format!("{:#}", SweepFile::parse(&two).unwrap_err());
        assert!(e.contains("baseline = true on full, 3g"), "{e}");
    }
}
