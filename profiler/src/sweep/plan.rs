//! From a sweep file to the list of cells, in order: target, then matrix, model, mode, dtype, batch,
//! sequence length, repeat. `--only key=value,...` narrows it.

use anyhow::{bail, Result};

use super::cell::{CellSpec, Purpose, CELL_SPEC_VERSION};
use super::file::{BatchSize, SweepFile};
use workloads::TrainConfig;

/// One cell to run: its spec, and the batch as the file wrote it (`max` is searched for first).
#[derive(Debug, Clone)]
pub struct PlannedCell {
    pub spec: CellSpec,
    pub batch: BatchSize,
}

/// Every cell of the file, in order.
pub fn cells(file: &SweepFile) -> Result<Vec<PlannedCell>> {
    let d = &file.defaults;
    let train = TrainConfig::adamw();
    let mut out = Vec::new();
    for target in &file.targets {
        for m in &file.matrix {
            let kernels = m.kernel_options()?.canonical();
            for model in &m.models {
                let (_, info) = workloads::lookup(model)?;
                // Image models have no sequence length: one cell, not one per listed length.
                let seq_lens: Vec<Option<usize>> = match (info.input.seq_len(), m.seq_lens.is_empty()) {
                    (Some(_), false) => m.seq_lens.iter().map(|&l| Some(l)).collect(),
                    _ => vec![None],
                };
                for mode in &m.modes {
                    for dtype in &m.dtypes {
                        for &batch in &m.batches {
                            for &seq_len in &seq_lens {
                                for repeat in 0..d.repeats {
                                    let spec = CellSpec {
                                        version: CELL_SPEC_VERSION,
                                        sweep: file.name.clone(),
                                        target: target.label.clone(),
                                        device: target.device.clone(),
                                        model: model.clone(),
                                        mode: mode.clone(),
                                        dtype: dtype.clone(),
                                        batch: match batch {
                                            BatchSize::Fixed(b) => b,
                                            BatchSize::Max => 0,
                                        },
                                        batch_as_written: batch.to_string(),
                                        seq_len,
                                        repeat,
                                        seed: d.seed,
                                        weights: None,
                                        weights_sha256: None,
                                        optimizer: "adamw".into(),
                                        lr: train.lr,
                                        weight_decay: train.weight_decay,
                                        kernel_options: kernels.clone(),
                                        warmup_secs: d.warmup_secs,
                                        duration_secs: d.duration_secs,
                                        target_precision: d.target_precision,
                                        max_duration_secs: d.target_precision.map(|_| d.max_duration_secs),
                                        sample_interval_ms: d.sample_interval_ms,
                                        purpose: Purpose::Measure,
                                    };
                                    out.push(PlannedCell { spec, batch });
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    // The same cell listed twice (overlapping matrices) runs once.
    let mut seen = std::collections::HashSet::new();
    out.retain(|c| seen.insert(c.spec.cell_id()));
    Ok(out)
}

/// `--only model=resnet50,target=3g`: every pair must match. Keys are cell fields.
#[derive(Debug, Clone, Default)]
pub struct Filter(Vec<(String, String)>);

pub const FILTER_KEYS: [&str; 8] = ["target", "device", "model", "mode", "dtype", "batch", "seq_len", "repeat"];

impl std::str::FromStr for Filter {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Filter> {
        let mut pairs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else { bail!("--only `{part}`: expected key=value (keys: {})", FILTER_KEYS.join(", ")) };
            if !FILTER_KEYS.contains(&k.trim()) {
                bail!("--only: unknown key `{k}`; keys: {}", FILTER_KEYS.join(", "));
            }
            pairs.push((k.trim().to_string(), v.trim().to_string()));
        }
        Ok(Filter(pairs))
    }
}

impl Filter {
    pub fn matches(&self, c: &CellSpec) -> bool {
        self.0.iter().all(|(k, v)| {
            let field = match k.as_str() {
                "target" => c.target.clone(),
                "device" => c.device.clone(),
                "model" => c.model.clone(),
                "mode" => c.mode.clone(),
                "dtype" => c.dtype.clone(),
                "batch" => c.batch_as_written.clone(),
                "seq_len" => c.seq_len.map_or("default".into(), |l| l.to_string()),
                "repeat" => c.repeat.to_string(),
                _ => return false,
            };
            &field == v
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
name = "t"
[defaults]
repeats = 2
[[targets]]
label = "a"
device = "cpu"
[[targets]]
label = "b"
device = "cpu"
[[matrix]]
models = ["resnet_tiny", "bert_tiny"]
batches = [1, "max"]
seq_lens = [16, 32]
[[matrix]]
models = ["resnet_tiny"]
batches = [1]
"#;

    #[test]
    fn the_cross_product_in_order_with_duplicates_once() -> Result<()> {
        let cells = cells(&SweepFile::parse(FILE)?)?;
        // Per target: resnet 2 batches x 2 repeats + bert 2 batches x 2 lengths x 2 repeats = 12;
        // the second matrix repeats resnet batch 1: nothing new.
        assert_eq!(cells.len(), 24);
        let first = &cells[0].spec;
        assert_eq!((first.target.as_str(), first.model.as_str(), first.batch, first.repeat), ("a", "resnet_tiny", 1, 0));
        assert!(cells.iter().filter(|c| c.spec.model == "resnet_tiny").all(|c| c.spec.seq_len.is_none()));
        assert_eq!(cells.iter().filter(|c| c.batch == BatchSize::Max).count(), 12);
        let ids: std::collections::HashSet<String> = cells.iter().map(|c| c.spec.cell_id()).collect();
        assert_eq!(ids.len(), 24);
        Ok(())
    }

    #[test]
    fn only_narrows_by_every_pair_and_refuses_unknown_keys() -> Result<()> {
        let cells = cells(&SweepFile::parse(FILE)?)?;
        let f: Filter = "target=b, model=bert_tiny,seq_len=32".parse()?;
        let kept: Vec<_> = cells.iter().filter(|c| f.matches(&c.spec)).collect();
        assert_eq!(kept.len(), 4);
        assert!(kept.iter().all(|c| c.spec.target == "b" && c.spec.seq_len == Some(32)));
        let e = "gpu=0".parse::<Filter>().unwrap_err().to_string();
        assert!(e.contains("unknown key `gpu`") && e.contains("target, device, model"), "{e}");
        Ok(())
    }
}
