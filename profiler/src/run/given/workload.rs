//! What is measured, as given ([`WorkloadGiven`]): `migprof run`'s `--model`, `--mode`, `--dtype`,
//! `--batch` and the rest (each a comma-separated list) and a sweep's `[[matrix]]` keys `models`,
//! `modes`, `dtypes`, `batches` and the rest, declared once. A field's name is its key; its flag is
//! the singular (`--model` for `models`, `--kv-layout` for `kv_layouts`). The runs they ask for are
//! one cross product ([`WorkloadGiven::workloads`]), checked in one place, with the defaults of where
//! they were given ([`Place`]).

use std::path::Path;

use anyhow::{bail, Result};
use clap::builder::{PossibleValuesParser, TypedValueParser};
use clap::{Args, CommandFactory, Parser};
use serde::Deserialize;
use workloads::{BlockSize, KvLayout, Lengths, MasterWeights, Mode};

use crate::run::limits;
use crate::run::spec::Precision;

/// The model of `migprof run`'s default set: ResNet-18 inference at batch 1, 4 and 8, training at
/// batch 4 and 8.
pub const DEFAULT_MODEL: &str = "resnet18";

/// The workloads as given: an empty list was not given.
#[derive(Debug, Clone, Default, PartialEq, Args, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WorkloadGiven {
    /// Models to run, comma-separated (see `migprof models`), or hf:DIR: a Hugging Face folder
    /// (config.json and *.safetensors) of a supported language model (a folder whose name has a
    /// comma is taken whole where it exists).
    #[arg(long = "model", value_name = "MODEL", value_parser = parse_model_list)]
    #[serde(default)]
    pub models: Vec<String>,

    /// infer (forward only, no gradients) or train (forward, cross-entropy, backward, AdamW) for image
    /// and encoder models; generate (prefill, then greedy decoding with a KV cache) for language
    /// models, comma-separated. Each model runs in the modes that apply to it; default: infer, or
    /// generate for a language model.
    #[arg(long = "mode", value_name = "MODE", value_delimiter = ',', value_parser = listed::<Mode, 3>(Mode::ALL.map(Mode::as_str)))]
    #[serde(default, deserialize_with = "named_list")]
    pub modes: Vec<Mode>,

    /// Element types, comma-separated. Default f32.
    #[arg(long = "dtype", value_name = "DTYPE", value_delimiter = ',', value_parser = listed::<Precision, 4>(Precision::NAMES))]
    #[serde(default, deserialize_with = "named_list")]
    pub dtypes: Vec<Precision>,

    /// Batch sizes, comma-separated: one run per value (a sweep also takes "max": the largest batch
    /// that fits on its target).
    #[arg(long = "batch", value_name = "BATCH", value_delimiter = ',', allow_negative_numbers = true, value_parser = |s: &str| s.parse::<BatchSize>())]
    #[serde(default)]
    pub batches: Vec<BatchSize>,

    /// Tokens per sequence for token models (BERT), comma-separated; default the model's (128).
    /// Image models in the same list ignore them; with image models alone they are refused.
    #[arg(long = "seq-len", value_name = "TOKENS", value_delimiter = ',', allow_negative_numbers = true, value_parser = |s: &str| tokens("--seq-len", s))]
    #[serde(default, deserialize_with = "token_list")]
    pub seq_lens: Vec<usize>,

    /// Generate runs: tokens of each prompt, prefilled at once, comma-separated. Default 128.
    #[arg(long = "prompt-len", value_name = "TOKENS", value_delimiter = ',', allow_negative_numbers = true, value_parser = |s: &str| tokens("--prompt-len", s))]
    #[serde(default, deserialize_with = "token_list")]
    pub prompt_lens: Vec<usize>,

    /// Generate runs: tokens generated for each prompt, the first by the prefill, each other by a
    /// decode step (at least 2), comma-separated; one run for each prompt and output length. Default 128.
    #[arg(long = "output-len", value_name = "TOKENS", value_delimiter = ',', allow_negative_numbers = true, value_parser = |s: &str| tokens("--output-len", s))]
    #[serde(default, deserialize_with = "token_list")]
    pub output_lens: Vec<usize>,

    /// Generate runs: how the KV cache is kept, comma-separated. contiguous: one tensor per layer,
    /// grown by appending; paged: blocks of --kv-block-size tokens from a pool, a block table per
    /// sequence, as serving stacks keep them. Default contiguous.
    #[arg(long = "kv-layout", value_name = "LAYOUT", value_delimiter = ',', value_parser = PossibleValuesParser::new(KvLayout::NAMES))]
    #[serde(default)]
    pub kv_layouts: Vec<String>,

    /// With a paged KV layout: tokens a block holds, 1 to 4096. Default 16.
    #[arg(long, allow_negative_numbers = true, value_parser = limits::parse_block_size)]
    #[serde(default)]
    pub kv_block_size: Option<BlockSize>,

    /// bf16 and f16 training: over f32 master weights, as PyTorch's autocast trains (f16 with a dynamic
    /// loss scale), or on the half-precision weights themselves (none). f32 training and inference
    /// ignore it. Default f32.
    #[arg(long, value_parser = listed::<MasterWeights, 2>(MasterWeights::ALL.map(MasterWeights::as_str)))]
    #[serde(default, deserialize_with = "named")]
    pub master_weights: Option<MasterWeights>,
}

/// A batch size as given: a number, or `max` (the largest that fits on the target, which a sweep
/// searches).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BatchSize {
    Fixed(usize),
    Max,
}

/// One run of the cross product.
#[derive(Debug, Clone, PartialEq)]
pub struct Workload {
    pub model: String,
    pub mode: Mode,
    pub precision: Precision,
    pub batch: BatchSize,
    /// A token model's sequence length where one was given; `None`: the model's own.
    pub seq_len: Option<usize>,
    /// A generate run's lengths; `None` for the other modes.
    pub lengths: Option<Lengths>,
    /// A generate run's cache; the default for the other modes.
    pub kv_layout: KvLayout,
    pub master_weights: MasterWeights,
}

/// Where the workloads were given, which names them in messages and sets what was not given.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Place<'a> {
    /// `migprof run`'s flags. Nothing given: the default set ([`DEFAULT_MODEL`]); no batch: 1.
    Run,
    /// A sweep file's `[[matrix]]`, named by the text: models and batches must be given.
    Matrix(&'a str),
}

impl Place<'_> {
    /// The setting whose key is `key`, as this place names it (`--batch`, `[[matrix]] 2: batches`).
    pub fn name(self, key: &str) -> String {
        match self {
            Place::Run => flag(key),
            Place::Matrix(at) => format!("{at}: {key}"),
        }
    }

    /// A message that names settings by their flags, named as this place names them.
    fn named(self, message: &str) -> String {
        match self {
            Place::Run => message.to_string(),
            Place::Matrix(at) => {
                let mut m = message.to_string();
                for key in keys() {
                    m = m.replace(&flag(&key), &key);
                }
                format!("{at}: {m}")
            }
        }
    }
}

/// The keys of the group, in its order.
pub fn keys() -> Vec<String> {
    Flags::command()
        .get_arguments()
        .map(|a| a.get_id().to_string())
        .collect()
}

/// The flag of the setting whose key is `key` (`--batch` for `batches`).
fn flag(key: &str) -> String {
    Flags::command()
        .get_arguments()
        .find(|a| a.get_id() == key)
        .and_then(|a| a.get_long())
        .map_or_else(|| format!("--{key}"), |long| format!("--{long}"))
}

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    given: WorkloadGiven,
}

impl WorkloadGiven {
    /// Whether nothing that picks the runs was given: `migprof run`'s default set.
    pub fn is_default_set(&self) -> bool {
        self.models.is_empty() && self.modes.is_empty() && self.batches.is_empty()
    }

    /// The models as given: on the command line each `--model` is a list ([`split_models`]), in a
    /// file each item one model.
    pub fn models(&self, place: Place) -> Result<Vec<String>> {
        match place {
            Place::Run => split_models(&self.models).map_err(anyhow::Error::msg),
            Place::Matrix(_) => Ok(self.models.clone()),
        }
    }

    /// The master weights, the default where none was given.
    pub fn master_weights(&self) -> MasterWeights {
        self.master_weights.unwrap_or_default()
    }

    /// Every run asked for, in order: model, mode, dtype, batch, sequence length, then each pair of
    /// prompt and output lengths with each cache layout. Each model runs in the modes that apply to
    /// it; one that none applies to, a setting that applies to none of the runs, a value given twice
    /// and a length a model cannot hold are refused, named as `place` names them.
    pub fn workloads(&self, place: Place) -> Result<Vec<Workload>> {
        self.check_lists(place)?;
        let default_set = place == Place::Run && self.is_default_set();
        let models = match self.models(place)? {
            none if none.is_empty() => vec![DEFAULT_MODEL.to_string()],
            models => models,
        };
        let dtypes = match self.dtypes.is_empty() {
            true => vec![Precision::F32],
            false => self.dtypes.clone(),
        };
        let layouts: Vec<&str> = self.kv_layouts.iter().map(String::as_str).collect();
        let layouts = KvLayout::from_names(&layouts, self.kv_block_size, ["--kv-layout", "--kv-block-size"])
            .map_err(|e| anyhow::anyhow!(place.named(&e)))?;
        let mut out = Vec::new();
        for model in &models {
            let (_, info) = workloads::lookup(model).map_err(|e| anyhow::anyhow!(place.named(&e.to_string())))?;
            let modes = match (self.modes.is_empty(), default_set, info.family.is_decoder()) {
                (false, _, _) => Mode::fitting(&self.modes, &info).map_err(|why| match place {
                    Place::Run => anyhow::anyhow!(why),
                    Place::Matrix(at) => anyhow::anyhow!("{at}: no mode of the matrix runs `{model}`: {why}"),
                })?,
                (true, true, _) => vec![Mode::Infer, Mode::Train],
                (true, false, true) => vec![Mode::Generate],
                (true, false, false) => vec![Mode::Infer],
            };
            // Image models have no sequence length: one run, not one per length given.
            let seq_lens: Vec<Option<usize>> = match (info.input.seq_len(), self.seq_lens.is_empty()) {
                (Some(_), false) => self.seq_lens.iter().map(|&l| Some(l)).collect(),
                _ => vec![None],
            };
            for &seq_len in seq_lens.iter().flatten() {
                workloads::lookup_with(model, Some(seq_len))
                    .map_err(|e| anyhow::anyhow!(place.named(&e.to_string())))?;
            }
            for mode in modes {
                let generate = mode == Mode::Generate;
                let lengths: Vec<Option<Lengths>> = match generate {
                    true => self.lengths().into_iter().map(Some).collect(),
                    false => vec![None],
                };
                if let (true, workloads::InputShape::Prompt { max_positions, .. }) = (generate, info.input) {
                    for l in lengths.iter().flatten() {
                        l.check(model, max_positions)
                            .map_err(|e| anyhow::anyhow!(place.named(&e)))?;
                    }
                }
                let layouts = match generate {
                    true => layouts.clone(),
                    false => vec![KvLayout::default()],
                };
                for &precision in &dtypes {
                    for batch in self.batches(mode, default_set) {
                        for &seq_len in &seq_lens {
                            for &lengths in &lengths {
                                for &kv_layout in &layouts {
                                    out.push(Workload {
                                        model: model.clone(),
                                        mode,
                                        precision,
                                        batch,
                                        seq_len,
                                        lengths,
                                        kv_layout,
                                        master_weights: self.master_weights(),
                                    });
                                }
                            }
                        }
                    }
                }
            }
        }
        self.check_applies(place, &out)?;
        Ok(out)
    }

    /// Each list on its own: the values a flag's parser holds (for a file's), none twice, none of
    /// `max` on the command line, models and batches given in a matrix.
    fn check_lists(&self, place: Place) -> Result<()> {
        if let Place::Matrix(_) = place {
            for (key, empty) in [("models", self.models.is_empty()), ("batches", self.batches.is_empty())] {
                if empty {
                    bail!("{} is empty: give at least one", place.name(key));
                }
            }
        }
        let models = self.models(place)?;
        for model in &models {
            workloads::check_name(model).map_err(|e| anyhow::anyhow!("{}: {e}", place.name("models")))?;
        }
        for (key, lengths) in [
            ("seq_lens", &self.seq_lens),
            ("prompt_lens", &self.prompt_lens),
            ("output_lens", &self.output_lens),
        ] {
            for &l in lengths {
                limits::TOKENS
                    .check(&place.name(key), l as u64)
                    .map_err(anyhow::Error::msg)?;
            }
        }
        if place == Place::Run && self.batches.contains(&BatchSize::Max) {
            bail!(
                "--batch max: the largest batch that fits is searched by a sweep (batches = [\"max\"] in a [[matrix]]); give sizes"
            );
        }
        let modes: Vec<&str> = self.modes.iter().map(|m| m.as_str()).collect();
        let dtypes: Vec<&str> = self.dtypes.iter().map(|d| d.as_str()).collect();
        refuse_repeats(&place.name("models"), &models)?;
        refuse_repeats(&place.name("modes"), &modes)?;
        refuse_repeats(&place.name("dtypes"), &dtypes)?;
        refuse_repeats(&place.name("batches"), &self.batches)?;
        refuse_repeats(&place.name("seq_lens"), &self.seq_lens)?;
        refuse_repeats(&place.name("prompt_lens"), &self.prompt_lens)?;
        refuse_repeats(&place.name("output_lens"), &self.output_lens)?;
        refuse_repeats(&place.name("kv_layouts"), &self.kv_layouts)?;
        Ok(())
    }

    /// On the command line, a setting given for runs of which none was asked for is a mistake, not
    /// a default. A matrix is often a template its models share (the guide's example gives
    /// `seq_lens` beside image models): there each run takes what applies to it.
    fn check_applies(&self, place: Place, runs: &[Workload]) -> Result<()> {
        if place != Place::Run {
            return Ok(());
        }
        if !self.seq_lens.is_empty() && runs.iter().all(|w| w.seq_len.is_none()) {
            bail!(
                "{} applies to token models (bert_*) only, and none was asked for",
                place.name("seq_lens")
            );
        }
        let generates = runs.iter().any(|w| w.lengths.is_some());
        for (key, given) in [
            ("prompt_lens", !self.prompt_lens.is_empty()),
            ("output_lens", !self.output_lens.is_empty()),
            ("kv_layouts", !self.kv_layouts.is_empty()),
            ("kv_block_size", self.kv_block_size.is_some()),
        ] {
            if given && !generates {
                bail!(
                    "{} applies to generate runs of language models only, and none was asked for",
                    place.name(key)
                );
            }
        }
        Ok(())
    }

    /// A generate run's lengths: every pair of prompt and output lengths, the defaults where one is
    /// not given.
    pub fn lengths(&self) -> Vec<Lengths> {
        let or = |v: &[usize], d: usize| if v.is_empty() { vec![d] } else { v.to_vec() };
        let prompts = or(&self.prompt_lens, workloads::generation::DEFAULT_PROMPT_LEN);
        let outputs = or(&self.output_lens, workloads::generation::DEFAULT_OUTPUT_LEN);
        prompts
            .iter()
            .flat_map(|&prompt| outputs.iter().map(move |&output| Lengths { prompt, output }))
            .collect()
    }

    /// The batches of a run in `mode`: those given; else the default set's (training at 4 and 8,
    /// the rest at 1, 4 and 8), else 1.
    fn batches(&self, mode: Mode, default_set: bool) -> Vec<BatchSize> {
        match (self.batches.is_empty(), default_set, mode) {
            (false, _, _) => self.batches.clone(),
            (true, true, Mode::Train) => vec![BatchSize::Fixed(4), BatchSize::Fixed(8)],
            (true, true, _) => [1, 4, 8].map(BatchSize::Fixed).to_vec(),
            (true, false, _) => vec![BatchSize::Fixed(1)],
        }
    }
}

/// Refuses a list that names a value more than once, naming the values.
fn refuse_repeats<T: PartialEq + std::fmt::Display>(name: &str, values: &[T]) -> Result<()> {
    let mut repeated: Vec<String> = Vec::new();
    for (i, v) in values.iter().enumerate() {
        if values[..i].contains(v) && !repeated.contains(&v.to_string()) {
            repeated.push(v.to_string());
        }
    }
    if !repeated.is_empty() {
        bail!(
            "{name} names {} more than once: give each value once",
            repeated.join(", ")
        );
    }
    Ok(())
}

/// A parser that accepts exactly `names` (clap lists them in the help and in its errors) and parses
/// the one given.
fn listed<T, const N: usize>(names: [&'static str; N]) -> impl TypedValueParser<Value = T>
where
    T: std::str::FromStr<Err = String> + Clone + Send + Sync + 'static,
{
    PossibleValuesParser::new(names).map(|name| name.parse::<T>().expect("clap accepted a listed name"))
}

fn tokens(flag: &str, s: &str) -> Result<usize, String> {
    limits::TOKENS.parse(flag, s).map(|l| l as usize)
}

/// A list of choices as a file writes it: their names, each parsed as its flag parses it.
fn named_list<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = String>,
{
    Vec::<String>::deserialize(d)?
        .iter()
        .map(|name| name.parse().map_err(serde::de::Error::custom))
        .collect()
}

/// A choice as a file writes it.
fn named<'de, D, T>(d: D) -> Result<Option<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: std::str::FromStr<Err = String>,
{
    String::deserialize(d)?
        .parse()
        .map(Some)
        .map_err(serde::de::Error::custom)
}

/// Lengths in tokens as a file writes them, within the flags' bounds.
fn token_list<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<usize>, D::Error> {
    Vec::<i64>::deserialize(d)?
        .into_iter()
        .map(|l| {
            u64::try_from(l)
                .map_err(|_| format!("a length in tokens is at least 1, not {l}"))
                .and_then(|l| limits::TOKENS.check("length", l).map(|l| l as usize))
                .map_err(serde::de::Error::custom)
        })
        .collect()
}

/// `--model` as given (each occurrence a comma-separated list) as models: a piece `hf:DIR` takes the
/// pieces after it while the folder with their commas exists and the folder without them does not,
/// so a Hugging Face folder whose name has a comma is one model. Each is checked by [`parse_model`].
pub fn split_models(given: &[String]) -> Result<Vec<String>, String> {
    let mut models: Vec<String> = Vec::new();
    for list in given {
        let mut pieces = list.split(',').map(str::to_string).peekable();
        while let Some(mut model) = pieces.next() {
            if let Some(dir) = model.strip_prefix(workloads::FOLDER_PREFIX) {
                let mut dir = dir.to_string();
                while let Some(next) = pieces.peek() {
                    let longer = format!("{dir},{next}");
                    if Path::new(&dir).is_dir() || !Path::new(&longer).is_dir() {
                        break;
                    }
                    dir = longer;
                    pieces.next();
                }
                model = format!("{}{dir}", workloads::FOLDER_PREFIX);
            }
            let model = model.trim().to_string();
            parse_model(&model)?;
            models.push(model);
        }
    }
    Ok(models)
}

/// One `--model` as given, checked whole (every model of its list) and kept as written:
/// [`split_models`] makes the list.
pub fn parse_model_list(s: &str) -> Result<String, String> {
    split_models(&[s.to_string()]).map(|_| s.to_string())
}

/// A model as `--model` takes it: a catalogue name or `hf:DIR`; the error names the valid ones.
pub fn parse_model(s: &str) -> Result<String, String> {
    workloads::check_name(s).map(|()| s.to_string())
}

impl std::fmt::Display for BatchSize {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BatchSize::Fixed(n) => write!(f, "{n}"),
            BatchSize::Max => f.write_str("max"),
        }
    }
}

/// As `--batch` takes one: a size within [`limits::BATCH`], or `max`.
impl std::str::FromStr for BatchSize {
    type Err = String;

    fn from_str(s: &str) -> Result<BatchSize, String> {
        match s.trim() {
            "max" => Ok(BatchSize::Max),
            n => limits::BATCH
                .parse("--batch", n)
                .map(|b| BatchSize::Fixed(b as usize))
                .map_err(|e| format!("{e} (or \"max\" in a sweep)")),
        }
    }
}

/// As a file writes one: a positive integer within [`limits::BATCH`], or `"max"`.
impl<'de> Deserialize<'de> for BatchSize {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            Number(i64),
            Fraction(f64),
            Text(String),
        }
        let wrong = |what: String| {
            serde::de::Error::custom(format!("a batch size is a positive integer or \"max\", not {what}"))
        };
        match Raw::deserialize(d)? {
            Raw::Text(t) if t == "max" => Ok(BatchSize::Max),
            Raw::Number(n) if n > 0 => limits::BATCH
                .check("size", n as u64)
                .map(|b| BatchSize::Fixed(b as usize))
                .map_err(serde::de::Error::custom),
            Raw::Number(n) => Err(wrong(n.to_string())),
            Raw::Fraction(x) => Err(wrong(x.to_string())),
            Raw::Text(t) => Err(wrong(format!("\"{t}\""))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn flags(line: &str) -> WorkloadGiven {
        Flags::try_parse_from(std::iter::once("x").chain(line.split_whitespace()))
            .unwrap()
            .given
    }

    fn flag_error(line: &str) -> String {
        match Flags::try_parse_from(std::iter::once("x").chain(line.split_whitespace())) {
            Ok(_) => panic!("{line} parsed"),
            Err(e) => e.to_string(),
        }
    }

    const EVERY_KEY: &str = "models = [\"llama_tiny\"]\nmodes = [\"generate\"]\ndtypes = [\"f32\", \"bf16\"]\n\
        batches = [1, 4]\nseq_lens = [32]\nprompt_lens = [16, 24]\noutput_lens = [8]\n\
        kv_layouts = [\"contiguous\", \"paged\"]\nkv_block_size = 32\nmaster_weights = \"none\"";

    /// A setting added to the group is a flag and a key at once; one renamed on one side fails here.
    #[test]
    fn flags_and_keys_give_the_same_settings() {
        let given = flags(
            "--model llama_tiny --mode generate --dtype f32,bf16 --batch 1,4 --seq-len 32 --prompt-len 16,24 \
             --output-len 8 --kv-layout contiguous,paged --kv-block-size 32 --master-weights none",
        );
        let file: WorkloadGiven = toml::from_str(EVERY_KEY).unwrap();
        assert_eq!(given, file);
        let mut keys: Vec<String> = toml::from_str::<toml::Table>(EVERY_KEY)
            .unwrap()
            .keys()
            .cloned()
            .collect();
        let mut ids = super::keys();
        keys.sort();
        ids.sort();
        assert_eq!(ids, keys, "the flags' ids are the keys");
        assert_eq!(flag("batches"), "--batch");
        assert_eq!(flag("kv_block_size"), "--kv-block-size");
    }

    #[test]
    fn one_cross_product_in_order_for_both_places() {
        let file: WorkloadGiven = toml::from_str(EVERY_KEY).unwrap();
        let from_file = file.workloads(Place::Matrix("[[matrix]] #1")).unwrap();
        // llama_tiny generates: 2 dtypes × 2 batches × 2 prompt lengths × 2 layouts; seq_lens is a
        // token model's, which a matrix's language model ignores.
        assert_eq!(from_file.len(), 16);
        let first = &from_file[0];
        assert_eq!(
            (first.mode, first.precision, first.batch, first.seq_len),
            (Mode::Generate, Precision::F32, BatchSize::Fixed(1), None)
        );
        assert_eq!(first.lengths, Some(Lengths { prompt: 16, output: 8 }));
        assert_eq!(from_file[1].kv_layout.block_size(), Some(BlockSize::new(32).unwrap()));
        assert_eq!(from_file[2].lengths, Some(Lengths { prompt: 24, output: 8 }));
        assert_eq!(first.master_weights, MasterWeights::None);
        let mut given = file.clone();
        given.seq_lens.clear();
        assert_eq!(
            given.workloads(Place::Run).unwrap(),
            from_file,
            "the command line makes the same runs"
        );
    }

    #[test]
    fn what_is_not_given_takes_the_place_s_defaults() {
        let none = WorkloadGiven::default();
        let set = none.workloads(Place::Run).unwrap();
        let runs: Vec<(Mode, String)> = set.iter().map(|w| (w.mode, w.batch.to_string())).collect();
        assert_eq!(
            runs,
            [
                (Mode::Infer, "1"),
                (Mode::Infer, "4"),
                (Mode::Infer, "8"),
                (Mode::Train, "4"),
                (Mode::Train, "8")
            ]
            .map(|(m, b)| (m, b.to_string()))
        );
        assert!(set
            .iter()
            .all(|w| w.model == DEFAULT_MODEL && w.precision == Precision::F32));
        // A model alone: its own mode, batch 1; a language model generates at the default lengths.
        let one = flags("--model resnet_tiny,llama_tiny").workloads(Place::Run).unwrap();
        assert_eq!(
            one.iter().map(|w| w.mode).collect::<Vec<_>>(),
            [Mode::Infer, Mode::Generate]
        );
        assert_eq!(
            one[1].lengths,
            Some(Lengths {
                prompt: 128,
                output: 128
            })
        );
        assert_eq!(one[1].kv_layout, KvLayout::Contiguous);
        let lm: WorkloadGiven = toml::from_str("models = [\"llama_tiny\"]\nbatches = [1]").unwrap();
        assert_eq!(lm.workloads(Place::Matrix("m")).unwrap()[0].mode, Mode::Generate);
        let e = none.workloads(Place::Matrix("[[matrix]] #2")).unwrap_err().to_string();
        assert_eq!(e, "[[matrix]] #2: models is empty: give at least one");
    }

    #[test]
    fn a_mistake_is_named_as_its_place_names_it() {
        let run = |line: &str| flags(line).workloads(Place::Run).unwrap_err().to_string();
        let file = |text: &str| {
            toml::from_str::<WorkloadGiven>(text)
                .unwrap()
                .workloads(Place::Matrix("[[matrix]] #1"))
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            run("--batch 1,2,1"),
            "--batch names 1 more than once: give each value once"
        );
        assert_eq!(
            file("models = [\"resnet_tiny\"]\nbatches = [1, 2, 1]"),
            "[[matrix]] #1: batches names 1 more than once: give each value once"
        );
        assert!(run("--batch max").contains("searched by a sweep"));
        assert!(run("--model resnet_tiny --seq-len 32").contains("--seq-len applies to token models"));
        assert!(run("--model bert_tiny --kv-layout paged").contains("--kv-layout applies to generate runs"));
        let e = run("--model llama_tiny --kv-block-size 8");
        assert!(e.contains("--kv-block-size 8 applies to a paged cache"), "{e}");
        let e = file("models = [\"llama_tiny\"]\nbatches = [1]\nkv_block_size = 8");
        assert!(
            e.starts_with("[[matrix]] #1: kv_block_size 8 applies to a paged cache"),
            "{e}"
        );
        let e = file("models = [\"llama_tiny\"]\nbatches = [1]\nprompt_lens = [1000000]");
        assert!(e.contains("prompt_lens") && !e.contains("--prompt-len"), "{e}");
        let e = run("--model resnet_tiny --mode generate");
        assert!(e.contains("not a language model"), "{e}");
        let e = flag_error("--mode serve");
        assert!(e.contains("infer") && e.contains("generate"), "{e}");
        let e = flag_error("--batch 0");
        assert!(e.contains("--batch") && e.contains("max"), "{e}");
        let e = toml::from_str::<WorkloadGiven>("modes = [\"serve\"]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("valid modes: infer, train, generate"), "{e}");
        let e = toml::from_str::<WorkloadGiven>("seq_lens = [0]")
            .unwrap_err()
            .to_string();
        assert!(e.contains("length `0`"), "{e}");
    }
}
