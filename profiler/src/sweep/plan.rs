//! From a sweep file to the list of cells, in order: target, then matrix, model, mode, dtype, batch,
//! sequence length, repeat; then the concurrent groups' members. `--only key=value,...` narrows it.

use anyhow::{bail, Result};

use super::file::{BatchSize, CapacitySearch, Program, Served, ServerEntry, SweepFile, Target};
use crate::cell::{CellSpec, Purpose, CELL_SPEC_VERSION};
use crate::run::given::Place;
use workloads::TrainConfig;

/// One cell to run: its spec, the batch as the file wrote it (`max` is searched for first), and for a
/// member of a concurrent group the key its group instance shares with the other members.
#[derive(Debug, Clone)]
pub struct PlannedCell {
    pub spec: CellSpec,
    pub batch: BatchSize,
    pub group: Option<String>,
}

/// What varies between the cells of one matrix: everything but the target.
#[derive(Debug, Clone, PartialEq)]
struct Work {
    model: String,
    /// A Hugging Face folder's hash ([`crate::cell::spec::model_sha256`]); `None` for a catalogue model.
    model_sha256: Option<String>,
    mode: String,
    dtype: String,
    batch: BatchSize,
    seq_len: Option<usize>,
    /// A generate cell's prompt and output lengths and its cache's layout.
    lengths: Option<workloads::Lengths>,
    kv_layout: workloads::KvLayout,
    repeat: u32,
    kernels: String,
    master_weights: workloads::MasterWeights,
}

/// What each member of a group instance runs: with `busy`, the first member the matrix cell and
/// the others the busy workload; else every member the matrix cell.
fn members_work(g: &super::file::Group, members: usize, w: &Work) -> Vec<Work> {
    (0..members)
        .map(|i| match (&g.busy, i) {
            (Some(b), i) if i > 0 => Work {
                model: b.model.clone(),
                model_sha256: None,
                mode: b.mode.clone(),
                dtype: b.dtype.clone(),
                batch: BatchSize::Fixed(b.batch),
                seq_len: b.seq_len,
                lengths: None,
                kv_layout: workloads::KvLayout::default(),
                repeat: w.repeat,
                kernels: w.kernels.clone(),
                master_weights: w.master_weights,
            },
            _ => w.clone(),
        })
        .collect()
}

/// A group instance's cells, each naming the group and its neighbours.
fn group_members(file: &SweepFile, g: &super::file::Group, targets: &[&Target], work: &[Work]) -> Vec<CellSpec> {
    let described: Vec<String> = targets.iter().zip(work).map(|(t, w)| w.describe(&t.label)).collect();
    targets
        .iter()
        .zip(work)
        .enumerate()
        .map(|(i, (t, mw))| {
            let mut spec = cell(file, t, mw);
            spec.concurrency_group = Some(g.label.clone());
            spec.neighbours = described
                .iter()
                .enumerate()
                .filter(|(j, _)| *j != i)
                .map(|(_, d)| d.clone())
                .collect();
            spec
        })
        .collect()
}

/// Every cell of the file, in order: each target's cells alone (targets with `alone = false` skip
/// these), then each group's instances, one per matrix cell, its members in the group's order.
pub fn cells(file: &SweepFile) -> Result<Vec<PlannedCell>> {
    let work = matrix_work(file)?;
    let mut out = Vec::new();
    // The same cell listed twice (overlapping matrices) runs once.
    let mut alone = std::collections::HashSet::new();
    for target in file.targets.iter().filter(|t| t.alone) {
        for w in &work {
            let spec = cell(file, target, w);
            if alone.insert(spec.cell_id()) {
                out.push(PlannedCell {
                    spec,
                    batch: w.batch,
                    group: None,
                });
            }
        }
    }
    for search in &file.capacity {
        for target in file.targets.iter().filter(|t| t.alone) {
            for model in &search.models {
                let spec = capacity_cell(file, target, model, search);
                if alone.insert(spec.cell_id()) {
                    out.push(PlannedCell {
                        batch: BatchSize::Fixed(spec.batch),
                        spec,
                        group: None,
                    });
                }
            }
        }
    }
    out.extend(program_cells(file, &mut alone));
    out.extend(server_cells(file, &mut alone));
    let mut instances = std::collections::HashSet::new();
    for g in &file.groups {
        let targets: Vec<&Target> = g
            .targets
            .iter()
            .map(|l| {
                file.targets
                    .iter()
                    .find(|t| &t.label == l)
                    .expect("checked by the file")
            })
            .collect();
        for w in &work {
            let BatchSize::Fixed(_) = w.batch else {
                bail!(
                    "[[groups]] `{}`: batch \"max\" is searched for alone, not in a concurrent group; give numbers",
                    g.label
                )
            };
            let member_work = members_work(g, targets.len(), w);
            let members = group_members(file, g, &targets, &member_work);
            let key = format!(
                "{}#{}",
                g.label,
                members.iter().map(|m| m.cell_id()).collect::<Vec<_>>().join("+")
            );
            // An instance listed twice (overlapping matrices) runs once.
            if !instances.insert(key.clone()) {
                continue;
            }
            out.extend(members.into_iter().zip(&member_work).map(|(spec, mw)| PlannedCell {
                spec,
                batch: mw.batch,
                group: Some(key.clone()),
            }));
        }
    }
    Ok(out)
}

impl Work {
    /// How a group member names this work on `target` among its neighbours:
    /// `target:model/mode/dtype/batch`, then `/seq N`, the kernel options and the master weights where
    /// they are not the defaults, so that two instances never name their neighbours alike.
    fn describe(&self, target: &str) -> String {
        let mut d = format!("{target}:{}/{}/{}/{}", self.model, self.mode, self.dtype, self.batch);
        if let Some(l) = self.seq_len {
            d += &format!("/seq {l}");
        }
        if let Some(l) = self.lengths {
            d += &format!("/prompt {}/output {}", l.prompt, l.output);
            if let Some(b) = self.kv_layout.block_size() {
                d += &format!("/paged {b}");
            }
        }
        if self.kernels != workloads::kernels::KernelOptions::default().canonical() {
            d += &format!("/{}", self.kernels);
        }
        if crate::cell::spec::masters_apply(&self.mode, &self.dtype)
            && self.master_weights != workloads::MasterWeights::default()
        {
            d += &format!("/masters {}", self.master_weights.as_str());
        }
        d
    }
}

/// The cells of the matrices, target aside, in order: matrix, then the matrix's runs in
/// [`crate::run::given::WorkloadGiven::workloads`]'s order, then repeat.
fn matrix_work(file: &SweepFile) -> Result<Vec<Work>> {
    let mut out = Vec::new();
    for (i, m) in file.matrix.iter().enumerate() {
        let kernels = m.kernels.options().canonical();
        let at = format!("[[matrix]] #{}", i + 1);
        let mut model_sha256 = std::collections::HashMap::new();
        for w in m.cells.workloads(Place::Matrix(&at))? {
            if !model_sha256.contains_key(&w.model) {
                model_sha256.insert(w.model.clone(), crate::cell::spec::model_sha256(&w.model)?);
            }
            for repeat in 0..file.defaults.repeats {
                out.push(Work {
                    model: w.model.clone(),
                    model_sha256: model_sha256[&w.model].clone(),
                    mode: w.mode.as_str().to_string(),
                    dtype: w.precision.as_str().to_string(),
                    batch: w.batch,
                    seq_len: w.seq_len,
                    lengths: w.lengths,
                    kv_layout: w.kv_layout,
                    repeat,
                    kernels: kernels.clone(),
                    master_weights: w.master_weights,
                });
            }
        }
    }
    Ok(out)
}

/// The spec of `w` on `target`.
fn cell(file: &SweepFile, target: &Target, w: &Work) -> CellSpec {
    let d = &file.defaults;
    let train = TrainConfig::adamw();
    CellSpec {
        version: CELL_SPEC_VERSION,
        sweep: file.name.clone(),
        target: target.label.clone(),
        device: target.device.clone(),
        model: w.model.clone(),
        mode: w.mode.clone(),
        dtype: w.dtype.clone(),
        batch: match w.batch {
            BatchSize::Fixed(b) => b,
            BatchSize::Max => 0,
        },
        batch_as_written: w.batch.to_string(),
        seq_len: w.seq_len,
        prompt_len: w.lengths.map(|l| l.prompt),
        output_len: w.lengths.map(|l| l.output),
        kv_layout: w.lengths.map(|_| w.kv_layout.as_str().to_string()),
        kv_block_size: w.lengths.and(w.kv_layout.block_size()),
        repeat: w.repeat,
        seed: d.measure.seed,
        weights: None,
        weights_sha256: w.model_sha256.clone(),
        optimizer: "adamw".into(),
        lr: train.lr,
        weight_decay: train.weight_decay,
        master_weights: w.master_weights.as_str().to_string(),
        kernel_options: w.kernels.clone(),
        warmup_secs: d.measure.warmup_secs,
        duration_secs: d.measure.duration_secs,
        target_precision: d.measure.target_precision,
        max_duration_secs: d.measure.target_precision.map(|_| d.measure.max_duration_secs),
        sample_interval_ms: d.measure.sample_interval_ms,
        purpose: Purpose::Measure,
        concurrency_group: None,
        neighbours: Vec::new(),
        baseline: target.baseline,
        job: crate::cell::Job::Measure,
        timeout_secs: Some(file.defaults.timeout_secs),
        scheduled: false,
    }
}

/// The cell of a capacity search of `model` on `target`: a model served one forward pass per request
/// runs inference at the search's max batch with its load settings; a language model generates, up
/// to its `max_seqs` sequences at once, with its serving settings and the kernel options `migprof
/// load` serves with.
fn capacity_cell(file: &SweepFile, target: &Target, model: &str, search: &CapacitySearch) -> CellSpec {
    let (seed, served) = (file.defaults.measure.seed, Served::of(model));
    let defaults = workloads::kernels::KernelOptions::default();
    let (mode, batch, kernels) = match served {
        Served::Passes => ("infer", search.load_settings(seed).max_batch, defaults),
        Served::Generation => (
            "generate",
            search.serve_settings(seed).max_seqs as usize,
            defaults.serving(),
        ),
    };
    let work = Work {
        model: model.to_string(),
        model_sha256: None,
        mode: mode.into(),
        dtype: search.dtype.clone(),
        batch: BatchSize::Fixed(batch),
        // A token model's default length; image models and language models take none.
        seq_len: search.seq_len.filter(|_| {
            served == Served::Passes && workloads::lookup(model).is_ok_and(|(_, i)| i.input.seq_len().is_some())
        }),
        lengths: None,
        kv_layout: workloads::KvLayout::default(),
        repeat: 0,
        kernels: kernels.canonical(),
        master_weights: workloads::MasterWeights::default(),
    };
    let mut cell = cell(file, target, &work);
    match served {
        Served::Passes => cell.job = crate::cell::Job::Load(search.load_settings(seed)),
        Served::Generation => cell.serve_with(search.serve_settings(seed)),
    }
    cell
}

/// The cells of the file's programs on every target that runs alone, each once (`alone` holds the
/// ids planned so far).
fn program_cells(file: &SweepFile, alone: &mut std::collections::HashSet<String>) -> Vec<PlannedCell> {
    let repeats = 0..file.defaults.repeats;
    once_each(
        file.programs.iter().flat_map(|program| {
            let repeats = repeats.clone();
            file.targets.iter().filter(|t| t.alone).flat_map(move |target| {
                let repeats = repeats.clone();
                program.cells().into_iter().flat_map(move |batch| {
                    repeats
                        .clone()
                        .map(move |repeat| program_cell(file, target, program, batch, repeat))
                })
            })
        }),
        alone,
    )
}

/// `specs` planned, each whose id `alone` does not hold yet.
fn once_each(specs: impl Iterator<Item = CellSpec>, alone: &mut std::collections::HashSet<String>) -> Vec<PlannedCell> {
    specs
        .filter(|spec| alone.insert(spec.cell_id()))
        .map(|spec| PlannedCell {
            batch: BatchSize::Fixed(spec.batch),
            spec,
            group: None,
        })
        .collect()
}

/// The cell of a user's program on `target` at `batch` (`None`: what it runs): its name as the
/// model, its command with the batch, no kernel options of migprof's.
fn program_cell(file: &SweepFile, target: &Target, p: &Program, batch: Option<usize>, repeat: u32) -> CellSpec {
    let work = users_work(
        &p.name,
        &p.mode,
        p.dtype.as_deref().unwrap_or_default(),
        batch.unwrap_or(0),
        repeat,
    );
    let mut cell = cell(file, target, &work);
    cell.job = crate::cell::Job::Program(crate::cell::spec::ProgramJob {
        command: p.command_for(batch),
        step_pattern: p.step_pattern.clone(),
        warmup_steps: p.warmup_steps,
    });
    cell
}

/// The work of a cell of the user's own (a program, a server): its name, phase, dtype and batch;
/// none of migprof's weights, lengths or kernel options.
fn users_work(name: &str, mode: &str, dtype: &str, batch: usize, repeat: u32) -> Work {
    Work {
        model: name.to_string(),
        model_sha256: None,
        mode: mode.to_string(),
        dtype: dtype.to_string(),
        batch: BatchSize::Fixed(batch),
        seq_len: None,
        lengths: None,
        kv_layout: workloads::KvLayout::default(),
        repeat,
        kernels: String::new(),
        master_weights: workloads::MasterWeights::default(),
    }
}

/// The cells of the file's servers: one per target that runs alone and repeat, each starting the
/// server there (`alone` holds the ids planned so far).
fn server_cells(file: &SweepFile, alone: &mut std::collections::HashSet<String>) -> Vec<PlannedCell> {
    let repeats = 0..file.defaults.repeats;
    once_each(
        file.servers.iter().flat_map(|entry| {
            let repeats = repeats.clone();
            file.targets.iter().filter(|t| t.alone).flat_map(move |target| {
                repeats
                    .clone()
                    .map(move |repeat| server_cell(file, target, entry, repeat))
            })
        }),
        alone,
    )
}

/// The cell of a user's server on `target`: the served model's name as the model, its requests'
/// batch, no kernel options of migprof's.
fn server_cell(file: &SweepFile, target: &Target, entry: &ServerEntry, repeat: u32) -> CellSpec {
    let seed = file.defaults.measure.seed;
    let batch = entry.server.batch.unwrap_or(crate::server::given::DEFAULTS.batch);
    let work = users_work(entry.model(), workloads::Mode::Infer.as_str(), "", batch, repeat);
    let mut cell = cell(file, target, &work);
    cell.job = crate::cell::Job::Server(Box::new(crate::cell::spec::ServerJob {
        server: entry.server.clone(),
        load: entry.load_settings(seed),
        generation: entry.generation_settings(seed),
        rates: entry.qps.clone(),
        search: entry.search,
    }));
    cell
}

/// `--only model=resnet50,target=3g`: every pair must match. Keys are cell fields.
#[derive(Debug, Clone, Default)]
pub struct Filter(Vec<(String, String)>);

pub const FILTER_KEYS: [&str; 9] = [
    "target", "device", "model", "mode", "dtype", "batch", "seq_len", "repeat", "group",
];

impl std::str::FromStr for Filter {
    type Err = anyhow::Error;

    fn from_str(s: &str) -> Result<Filter> {
        let mut pairs = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let Some((k, v)) = part.split_once('=') else {
                bail!("--only `{part}`: expected key=value (keys: {})", FILTER_KEYS.join(", "))
            };
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
                "group" => c.concurrency_group.clone().unwrap_or_default(),
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
    fn a_neighbour_says_master_weights_only_where_they_change_the_training() {
        let work = |dtype: &str, masters| Work {
            model_sha256: None,
            model: "resnet50".into(),
            mode: "train".into(),
            dtype: dtype.into(),
            batch: BatchSize::Fixed(32),
            seq_len: None,
            lengths: None,
            kv_layout: workloads::KvLayout::default(),
            repeat: 0,
            kernels: workloads::kernels::KernelOptions::default().canonical(),
            master_weights: masters,
        };
        use workloads::MasterWeights::{None as Halves, F32};
        assert_eq!(
            work("bf16", Halves).describe("1g"),
            "1g:resnet50/train/bf16/32/masters none"
        );
        assert_eq!(work("bf16", F32).describe("1g"), "1g:resnet50/train/bf16/32");
        assert_eq!(work("f32", Halves).describe("1g"), "1g:resnet50/train/f32/32");
    }

    #[test]
    fn the_cross_product_in_order_with_duplicates_once() -> Result<()> {
        let cells = cells(&SweepFile::parse(FILE)?)?;
        // Per target: resnet 2 batches x 2 repeats + bert 2 batches x 2 lengths x 2 repeats = 12;
        // the second matrix repeats resnet batch 1: nothing new.
        assert_eq!(cells.len(), 24);
        let first = &cells[0].spec;
        assert_eq!(
            (first.target.as_str(), first.model.as_str(), first.batch, first.repeat),
            ("a", "resnet_tiny", 1, 0)
        );
        assert!(cells
            .iter()
            .filter(|c| c.spec.model == "resnet_tiny")
            .all(|c| c.spec.seq_len.is_none()));
        assert_eq!(cells.iter().filter(|c| c.batch == BatchSize::Max).count(), 12);
        let ids: std::collections::HashSet<String> = cells.iter().map(|c| c.spec.cell_id()).collect();
        assert_eq!(ids.len(), 24);
        Ok(())
    }

    #[test]
    fn a_group_runs_each_matrix_cell_on_every_member_and_a_busy_group_gives_neighbours_their_work() -> Result<()> {
        let text = r#"
name = "g"
[[targets]]
label = "a"
device = "cpu"
[[targets]]
label = "b"
device = "cpu"
alone = false
[[targets]]
label = "c"
device = "cpu"
alone = false
[[matrix]]
models = ["resnet_tiny"]
batches = [1, 2]
[[groups]]
label = "pair"
concurrent = true
targets = ["a", "b"]
[[groups]]
label = "noisy"
concurrent = true
targets = ["a", "b", "c"]
busy = { model = "bert_tiny", batch = 4, dtype = "f32" }
"#;
        let cells = cells(&SweepFile::parse(text)?)?;
        // Alone: target a only (2 cells); pair: 2 instances of 2; noisy: 2 instances of 3.
        assert_eq!(cells.len(), 2 + 4 + 6);
        assert!(cells[..2].iter().all(|c| c.group.is_none() && c.spec.target == "a"));
        let pair: Vec<&PlannedCell> = cells
            .iter()
            .filter(|c| c.spec.concurrency_group.as_deref() == Some("pair"))
            .collect();
        assert_eq!(pair[0].group, pair[1].group);
        assert_ne!(pair[0].group, pair[2].group);
        assert_eq!(pair[0].spec.neighbours, vec!["b:resnet_tiny/infer/f32/1".to_string()]);
        assert_eq!(pair[1].spec.neighbours, vec!["a:resnet_tiny/infer/f32/1".to_string()]);
        let noisy: Vec<&PlannedCell> = cells
            .iter()
            .filter(|c| c.spec.concurrency_group.as_deref() == Some("noisy"))
            .collect();
        assert_eq!(
            (
                noisy[0].spec.model.as_str(),
                noisy[1].spec.model.as_str(),
                noisy[1].spec.mode.as_str(),
                noisy[2].spec.batch
            ),
            ("resnet_tiny", "bert_tiny", "train", 4)
        );
        assert_eq!(
            noisy[0].spec.neighbours,
            vec![
                "b:bert_tiny/train/f32/4".to_string(),
                "c:bert_tiny/train/f32/4".to_string()
            ]
        );
        // A member's id differs from the same cell alone, and every id is distinct.
        assert_ne!(pair[0].spec.cell_id(), cells[0].spec.cell_id());
        let ids: std::collections::HashSet<String> = cells.iter().map(|c| c.spec.cell_id()).collect();
        assert_eq!(ids.len(), cells.len());
        // Two matrices listing the same cells: each instance once, whole.
        let twice = text.replace(
            "[[groups]]\nlabel = \"pair\"",
            "[[matrix]]\nmodels = [\"resnet_tiny\"]\nbatches = [2]\n[[groups]]\nlabel = \"pair\"",
        );
        assert_eq!(cells_of(&twice).len(), cells.len());
        // Instances that differ only in the measured cell's sequence length keep their neighbours.
        let seqs = text.replace(
            "models = [\"resnet_tiny\"]\nbatches = [1, 2]",
            "models = [\"bert_tiny\"]\nbatches = [1]\nseq_lens = [8, 16]",
        );
        let noisy: Vec<PlannedCell> = cells_of(&seqs)
            .into_iter()
            .filter(|c| c.spec.concurrency_group.as_deref() == Some("noisy"))
            .collect();
        assert_eq!(noisy.len(), 6, "two instances of three members");
        assert!(
            noisy[1].spec.neighbours[0].ends_with("/seq 8") && noisy[4].spec.neighbours[0].ends_with("/seq 16"),
            "{:?}",
            noisy[1].spec.neighbours
        );
        // "max" has no place in a group.
        let e = cells_err(&text.replace("batches = [1, 2]", "batches = [1, \"max\"]"));
        assert!(e.contains("batch \"max\" is searched for alone"), "{e}");
        Ok(())
    }

    fn cells_of(text: &str) -> Vec<PlannedCell> {
        cells(&SweepFile::parse(text).unwrap()).unwrap()
    }

    fn cells_err(text: &str) -> String {
        format!("{:#}", cells(&SweepFile::parse(text).unwrap()).unwrap_err())
    }

    #[test]
    fn only_narrows_by_every_pair_and_refuses_unknown_keys() -> Result<()> {
        let cells = cells(&SweepFile::parse(FILE)?)?;
        let f: Filter = "target=b, model=bert_tiny,seq_len=32".parse()?;
        let kept: Vec<_> = cells.iter().filter(|c| f.matches(&c.spec)).collect();
        assert_eq!(kept.len(), 4);
        assert!(kept.iter().all(|c| c.spec.target == "b" && c.spec.seq_len == Some(32)));
        let e = "gpu=0".parse::<Filter>().unwrap_err().to_string();
        assert!(
            e.contains("unknown key `gpu`") && e.contains("target, device, model"),
            "{e}"
        );
        Ok(())
    }
}
