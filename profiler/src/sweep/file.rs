//! The sweep file: a name, defaults, targets (where to run) and matrices (what to run), in TOML. Read
//! strictly: an unknown key, a wrong type or an impossible value is an error that names the line and
//! the key, so a typo never silently becomes a default.

use std::path::Path;

use anyhow::{bail, Context, Result};
use serde::Deserialize;

use crate::device::DeviceSpec;

#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SweepFile {
    /// Recorded in every row as `sweep`.
    pub name: String,
    #[serde(default)]
    pub defaults: Defaults,
    pub targets: Vec<Target>,
    pub matrix: Vec<Matrix>,
}

/// Settings of every cell.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Defaults {
    pub warmup_secs: f64,
    pub duration_secs: f64,
    /// Independent repetitions of each cell, each a fresh process with the same seed.
    pub repeats: u32,
    /// A cell still running after this long is killed and recorded as `timeout`.
    pub timeout_secs: f64,
    /// Idle time between two cells on one device.
    pub cooldown_secs: f64,
    /// The largest batch a `"max"` search tries.
    pub max_batch_limit: usize,
    pub seed: u64,
    pub sample_interval_ms: u64,
    /// Measure until the throughput's 95% interval is within ± this many percent (after
    /// `duration_secs`), at most `max_duration_secs`; none: `duration_secs` alone.
    pub target_precision: Option<f64>,
    pub max_duration_secs: f64,
}

impl Default for Defaults {
    fn default() -> Self {
        Self {
            warmup_secs: 2.0,
            duration_secs: 10.0,
            repeats: 1,
            timeout_secs: 600.0,
            cooldown_secs: 0.0,
            max_batch_limit: 4096,
            seed: 0,
            sample_interval_ms: 100,
            target_precision: None,
            max_duration_secs: 60.0,
        }
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
}

/// A cross product of cells; several add up.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Matrix {
    pub models: Vec<String>,
    #[serde(default = "infer")]
    pub modes: Vec<String>,
    #[serde(default = "f32")]
    pub dtypes: Vec<String>,
    pub batches: Vec<BatchSize>,
    /// Tokens per sequence for token models; image models ignore them. Default: the model's.
    #[serde(default)]
    pub seq_lens: Vec<usize>,
    /// Kernel options as `--attention` and friends take them; default: the defaults.
    #[serde(default)]
    pub attention: Option<String>,
    #[serde(default)]
    pub encoder_layers: Option<String>,
    #[serde(default)]
    pub gemm_algorithm: Option<String>,
}

fn infer() -> Vec<String> {
    vec!["infer".into()]
}

fn f32() -> Vec<String> {
    vec!["f32".into()]
}

/// A batch size as written: a number, or `"max"` (the largest that fits on the target).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchSize {
    Fixed(usize),
    Max,
}

impl std::fmt::Display for BatchSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchSize::Fixed(n) => write!(f, "{n}"),
            BatchSize::Max => f.write_str("max"),
        }
    }
}

impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Text(String),
        }
        match Raw::deserialize(d)? {
            Raw::Number(n) if n > 0 => Ok(BatchSize::Fixed(n as usize)),
            Raw::Text(t) if t == "max" => Ok(BatchSize::Max),
            Raw::Number(n) => Err(serde::de::Error::custom(format!("a batch size is a positive integer or \"max\", not {n}"))),
            Raw::Text(t) => Err(serde::de::Error::custom(format!("a batch size is a positive integer or \"max\", not \"{t}\""))),
        }
    }
}

impl SweepFile {
    pub fn read(path: &Path) -> Result<SweepFile> {
        let text = std::fs::read_to_string(path).with_context(|| format!("reading the sweep file {}", path.display()))?;
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
        let d = &self.defaults;
        for (key, v) in [("warmup_secs", d.warmup_secs), ("duration_secs", d.duration_secs), ("timeout_secs", d.timeout_secs), ("cooldown_secs", d.cooldown_secs)] {
            if !v.is_finite() || v < 0.0 {
                bail!("[defaults] {key} = {v}: expected a non-negative number of seconds");
            }
        }
        if d.target_precision.is_some_and(|p| !(p > 0.0 && p < 100.0)) {
            bail!("[defaults] target_precision: expected a percentage above 0 and below 100 (e.g. 2 for ±2%)");
        }
        if d.repeats == 0 {
            bail!("[defaults] repeats = 0: expected at least 1");
        }
        if d.timeout_secs == 0.0 {
            bail!("[defaults] timeout_secs = 0: a cell needs time to run");
        }
        if self.targets.is_empty() {
            bail!("no [[targets]]: name at least one, e.g. [[targets]] label = \"cpu\" device = \"cpu\"");
        }
        let mut labels = std::collections::HashSet::new();
        for (i, t) in self.targets.iter().enumerate() {
            if t.label.is_empty() || !labels.insert(t.label.as_str()) {
                bail!("[[targets]] #{}: label `{}` is empty or used twice; each target needs its own", i + 1, t.label);
            }
            t.device.parse::<DeviceSpec>().with_context(|| format!("[[targets]] `{}`: device", t.label))?;
        }
        if self.matrix.is_empty() {
            bail!("no [[matrix]]: give at least one, e.g. [[matrix]] models = [\"resnet18\"] batches = [1, 8]");
        }
        let names = workloads::model_names();
        for (i, m) in self.matrix.iter().enumerate() {
            let at = format!("[[matrix]] #{}", i + 1);
            for model in &m.models {
                if !names.contains(&model.as_str()) {
                    bail!("{at}: models: unknown model `{model}`; valid models: {}", names.join(", "));
                }
            }
            for mode in &m.modes {
                if !["infer", "train"].contains(&mode.as_str()) {
                    bail!("{at}: modes: unknown mode `{mode}`; valid modes: infer, train");
                }
            }
            for dtype in &m.dtypes {
                if !DTYPES.contains(&dtype.as_str()) {
                    bail!("{at}: dtypes: unknown dtype `{dtype}`; valid dtypes: {}", DTYPES.join(", "));
                }
            }
            for (key, list) in [("models", m.models.len()), ("modes", m.modes.len()), ("dtypes", m.dtypes.len()), ("batches", m.batches.len())] {
                if list == 0 {
                    bail!("{at}: {key} is empty");
                }
            }
            if m.seq_lens.contains(&0) {
                bail!("{at}: seq_lens: a sequence holds at least one token");
            }
            m.kernel_options().with_context(|| at.clone())?;
        }
        Ok(())
    }
}

/// The dtypes a cell may ask for, as `--dtype` spells them.
pub const DTYPES: [&str; 4] = ["f32", "bf16", "f16", "tf32"];

impl Matrix {
    pub fn kernel_options(&self) -> Result<workloads::kernels::KernelOptions> {
        use workloads::kernels::options::{Attention, EncoderLayers, GemmAlgorithm};
        let mut k = workloads::kernels::KernelOptions::default();
        if let Some(a) = &self.attention {
            k.attention = a.parse::<Attention>().map_err(|e| anyhow::anyhow!("attention: {e}"))?;
        }
        if let Some(l) = &self.encoder_layers {
            k.layers = l.parse::<EncoderLayers>().map_err(|e| anyhow::anyhow!("encoder_layers: {e}"))?;
        }
        if let Some(g) = &self.gemm_algorithm {
            k.gemm = g.parse::<GemmAlgorithm>().map_err(|e| anyhow::anyhow!("gemm_algorithm: {e}"))?;
        }
        Ok(k)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!((f.defaults.repeats, f.defaults.timeout_secs, f.defaults.max_batch_limit), (2, 600.0, 4096));
        assert_eq!(f.targets[1].device, "3g.40gb");
        assert_eq!(f.matrix[0].batches, vec![BatchSize::Fixed(1), BatchSize::Fixed(8), BatchSize::Fixed(32), BatchSize::Fixed(128), BatchSize::Max]);
    }

    #[test]
    fn errors_name_the_line_and_the_key() {
        let err = |text: &str| format!("{:#}", SweepFile::parse(text).unwrap_err());
        // A typo in a key: TOML's error names the line and the unknown key with the valid ones.
        let e = err(&EXAMPLE.replace("duration_secs = 10", "duraton_secs = 10"));
        assert!(e.contains("line 5") && e.contains("duraton_secs") && e.contains("duration_secs"), "{e}");
        let e = err(&EXAMPLE.replace("repeats = 2", "repeats = \"two\""));
        assert!(e.contains("line 6") && e.contains("repeats"), "{e}");
        let e = err(&EXAMPLE.replace("\"max\"]", "\"biggest\"]"));
        assert!(e.contains("line 17") && e.contains("batches") && e.contains("\"max\""), "{e}");
        let e = err(&EXAMPLE.replace("\"vit_b_16\"", "\"vit_b_17\""));
        assert!(e.contains("[[matrix]] #1") && e.contains("vit_b_17") && e.contains("vit_b_16"), "{e}");
        let e = err(&EXAMPLE.replace("device = \"3g.40gb\"", "device = \"tpu\""));
        assert!(e.contains("`3g`") && e.contains("tpu") && e.contains("MIG-<uuid>"), "{e}");
        let e = err(&EXAMPLE.replace("label = \"3g\"", "label = \"full\""));
        assert!(e.contains("used twice"), "{e}");
        let e = err(&EXAMPLE.replace("dtypes = [\"bf16\"]", "dtypes = [\"fp8\"]"));
        assert!(e.contains("fp8") && e.contains("f32, bf16, f16, tf32"), "{e}");
    }
}
