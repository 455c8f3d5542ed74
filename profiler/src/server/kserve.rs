//! The KServe v2 inference protocol over HTTP/REST, as Triton, KServe's runtimes, TorchServe and
//! Seldon speak it: the server's and the model's metadata, a request of the model's inputs (seeded
//! values of their shapes and datatypes, as JSON or through the binary tensor extension), and every
//! answer checked against the model's outputs: a 200 with an output missing, of another datatype or
//! shape, or with too few values (PyTriton under numpy 2 answers empty outputs) is a failed request.

use std::collections::BTreeMap;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use rand::{Rng, SeedableRng};
use serde::Deserialize;
use serde_json::{json, Value};

use super::endpoint::{Answer, Endpoint};
use super::input_data;
use super::Exchange;

/// The server as it names itself (`GET /v2`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ServerInfo {
    pub name: String,
    #[serde(default)]
    pub version: String,
}

/// A tensor of a model's metadata: `-1` marks a dimension of any size.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub datatype: String,
    pub shape: Vec<i64>,
}

/// A model as the server describes it (`GET /v2/models/<name>`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ModelMetadata {
    pub name: String,
    #[serde(default)]
    pub versions: Vec<String>,
    #[serde(default)]
    pub platform: String,
    pub inputs: Vec<TensorSpec>,
    pub outputs: Vec<TensorSpec>,
}

/// How a request's tensors travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Encoding {
    /// Values as JSON numbers in the request and the answer.
    Json,
    /// KServe's binary tensor extension: a JSON header, then the raw little-endian bytes (what
    /// perf_analyzer sends over HTTP; the only way half types travel).
    Binary,
}

impl Encoding {
    pub const NAMES: [&'static str; 2] = ["binary", "json"];

    pub fn as_str(self) -> &'static str {
        match self {
            Encoding::Json => "json",
            Encoding::Binary => "binary",
        }
    }
}

impl std::str::FromStr for Encoding {
    type Err = String;

    fn from_str(s: &str) -> Result<Encoding, String> {
        match s {
            "json" => Ok(Encoding::Json),
            "binary" => Ok(Encoding::Binary),
            other => Err(format!(
                "encoding `{other}`; valid encodings: {}",
                Encoding::NAMES.join(", ")
            )),
        }
    }
}

/// What a request holds, as the user asks for it.
#[derive(Debug, Clone, PartialEq)]
pub struct RequestOptions {
    /// Samples per request, in the batch dimension of a model that batches.
    pub batch: usize,
    /// The sizes of an input's dimensions of any size (`-1`), the batch dimension left out, as
    /// perf_analyzer's `--shape NAME:DIMS` gives them.
    pub shapes: BTreeMap<String, Vec<usize>>,
    pub encoding: Encoding,
    pub seed: u64,
    /// The user's tensors (`--input-data`), one request per entry; inputs an entry leaves out are
    /// seeded.
    pub input_data: Option<input_data::InputData>,
}

/// The server's name and version, and the model's metadata: the model named, or where none is, the
/// one model the server has ready (Triton's repository index lists them).
pub fn discover(endpoint: &Endpoint, model: Option<&str>) -> Result<(ServerInfo, ModelMetadata)> {
    let agent = endpoint.agent();
    let server: ServerInfo = json_of(endpoint.get(&agent, "/v2"), "GET /v2 (the server's metadata)")?;
    let model = match model {
        Some(m) => m.to_string(),
        None => only_ready_model(endpoint, &agent)?,
    };
    let path = format!("/v2/models/{model}");
    let metadata: ModelMetadata = json_of(
        endpoint.get(&agent, &path),
        &format!("GET {path} (the model's metadata)"),
    )?;
    Ok((server, metadata))
}

/// The body of a 200, read as `T`; otherwise what the server said.
fn json_of<T: serde::de::DeserializeOwned>(
    answer: std::result::Result<Answer, super::endpoint::Unanswered>,
    what: &str,
) -> Result<T> {
    let answer = answer.map_err(|e| anyhow!("{what}: {}", e.0))?;
    if answer.status != 200 {
        bail!("{what}: HTTP {}: {}", answer.status, answer.text(300));
    }
    serde_json::from_slice(&answer.body)
        .with_context(|| format!("{what}: not the KServe v2 answer expected: {}", answer.text(300)))
}

/// Triton's repository index: the one model that is ready, else an error naming them.
fn only_ready_model(endpoint: &Endpoint, agent: &ureq::Agent) -> Result<String> {
    #[derive(Deserialize)]
    struct Entry {
        name: String,
        #[serde(default)]
        state: String,
    }
    let index = endpoint.post(
        agent,
        "/v2/repository/index",
        &[("Content-Type", "application/json".into())],
        b"{}",
    );
    let entries: Vec<Entry> = json_of(index, "POST /v2/repository/index (the models the server has)")
        .context("name the model with --served-model")?;
    let ready: Vec<&str> = entries
        .iter()
        .filter(|e| e.state.is_empty() || e.state == "READY")
        .map(|e| e.name.as_str())
        .collect();
    match ready.as_slice() {
        [one] => Ok(one.to_string()),
        [] => bail!("the server has no model ready; name the one to measure with --served-model"),
        many => bail!(
            "the server has {} models ready ({}); name the one to measure with --served-model",
            many.len(),
            many.join(", ")
        ),
    }
}

/// A tensor's element type as KServe v2 names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Datatype {
    Bool,
    U8,
    U16,
    U32,
    U64,
    I8,
    I16,
    I32,
    I64,
    F16,
    Bf16,
    F32,
    F64,
    Bytes,
}

const DATATYPES: [(&str, Datatype); 14] = [
    ("BOOL", Datatype::Bool),
    ("UINT8", Datatype::U8),
    ("UINT16", Datatype::U16),
    ("UINT32", Datatype::U32),
    ("UINT64", Datatype::U64),
    ("INT8", Datatype::I8),
    ("INT16", Datatype::I16),
    ("INT32", Datatype::I32),
    ("INT64", Datatype::I64),
    ("FP16", Datatype::F16),
    ("BF16", Datatype::Bf16),
    ("FP32", Datatype::F32),
    ("FP64", Datatype::F64),
    ("BYTES", Datatype::Bytes),
];

impl Datatype {
    fn of(name: &str) -> Result<Datatype> {
        DATATYPES
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, d)| *d)
            .ok_or_else(|| {
                anyhow!(
                    "datatype `{name}` is none of KServe v2's: {}",
                    DATATYPES.map(|(n, _)| n).join(", ")
                )
            })
    }

    /// Bytes an element takes in the binary extension; `None` for BYTES (each its own length).
    fn size(self) -> Option<usize> {
        use Datatype::*;
        Some(match self {
            Bool | U8 | I8 => 1,
            U16 | I16 | F16 | Bf16 => 2,
            U32 | I32 | F32 => 4,
            U64 | I64 | F64 => 8,
            Bytes => return None,
        })
    }
}

/// One input's seeded values: floats uniform in [0, 1); integers 0 or 1, valid for any index input
/// (token ids, token types, masks) of a table of at least two rows; booleans at random; strings of
/// 16 letters. As JSON values and as the binary extension's bytes.
fn values(datatype: Datatype, count: usize, seed: u64) -> (Vec<Value>, Vec<u8>) {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut json = Vec::with_capacity(count);
    let mut bytes = Vec::with_capacity(count * datatype.size().unwrap_or(20));
    for _ in 0..count {
        use Datatype::*;
        match datatype {
            F16 | Bf16 | F32 | F64 => {
                let x: f32 = rng.random();
                json.push(json!(x));
                match datatype {
                    F16 => bytes.extend(half::f16::from_f32(x).to_le_bytes()),
                    Bf16 => bytes.extend(half::bf16::from_f32(x).to_le_bytes()),
                    F32 => bytes.extend(x.to_le_bytes()),
                    _ => bytes.extend(f64::from(x).to_le_bytes()),
                }
            }
            Bool => {
                let b: bool = rng.random();
                json.push(json!(b));
                bytes.push(b as u8);
            }
            Bytes => {
                let s: String = (0..16).map(|_| rng.random_range(b'a'..=b'z') as char).collect();
                bytes.extend((s.len() as u32).to_le_bytes());
                bytes.extend(s.as_bytes());
                json.push(json!(s));
            }
            ints => {
                let v: u8 = rng.random_range(0..2);
                json.push(json!(v));
                let size = ints.size().unwrap_or(1);
                let mut le = vec![0u8; size];
                le[0] = v;
                bytes.extend(le);
            }
        }
    }
    (json, bytes)
}

/// One request's headers and body, made once and sent again and again.
#[derive(Debug, Clone)]
struct Request {
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

/// The requests to one model (one of seeded inputs, or one per entry of the user's input data, sent
/// in turn), and what their answers must hold.
#[derive(Debug)]
pub struct Kserve {
    path: String,
    requests: Vec<Request>,
    /// The request sent next, counted over every client.
    next: std::sync::atomic::AtomicUsize,
    pub encoding: Encoding,
    /// Each output with the shape the answer must have (`-1`: any size).
    outputs: Vec<TensorSpec>,
    /// The samples a request holds (1 for a model that does not batch).
    pub batch: usize,
    /// The inputs as sent: `name [shape] DATATYPE`, for the row.
    pub described: String,
}

impl Kserve {
    /// The requests of `options` to the model of `metadata`, every input shaped and every choice
    /// checked before anything is sent.
    pub fn new(metadata: &ModelMetadata, options: &RequestOptions) -> Result<Kserve> {
        let batches = metadata.inputs.first().is_some_and(|i| i.shape.first() == Some(&-1));
        if !batches && options.batch != 1 {
            bail!(
                "model `{}` does not batch (its inputs' first dimension is fixed: {}): each request holds what its shape holds; leave --batch out",
                metadata.name,
                describe(&metadata.inputs)
            );
        }
        let unknown = |name: &str, given: &str| {
            anyhow!(
                "{given}: model `{}` has no input `{name}`; its inputs: {}",
                metadata.name,
                describe(&metadata.inputs)
            )
        };
        if let Some(name) = options
            .shapes
            .keys()
            .find(|n| !metadata.inputs.iter().any(|i| &i.name == *n))
        {
            return Err(unknown(name, &format!("--shape {name}")));
        }
        let entries: Vec<Option<&input_data::Entry>> = match &options.input_data {
            Some(data) => data.entries.iter().map(Some).collect(),
            None => vec![None],
        };
        let mut requests = Vec::with_capacity(entries.len());
        let mut described = String::new();
        for (e, entry) in entries.iter().enumerate() {
            let at = |name: &str| format!("--input-data data[{e}].{name}");
            if let Some(name) = entry.and_then(|en| en.keys().find(|n| !metadata.inputs.iter().any(|i| &i.name == *n)))
            {
                return Err(unknown(name, &at(name)));
            }
            let (request, sent) = request(metadata, *entry, &at, batches, options)?;
            if e == 0 {
                described = sent;
            }
            requests.push(request);
        }
        if requests.len() > 1 {
            described = format!(
                "{described} (the first of {} requests of given data, sent in turn)",
                requests.len()
            );
        }
        let mut outputs = metadata.outputs.clone();
        if batches {
            for o in &mut outputs {
                if o.shape.first() == Some(&-1) {
                    o.shape[0] = options.batch as i64;
                }
            }
        }
        Ok(Kserve {
            path: format!("/v2/models/{}/infer", metadata.name),
            requests,
            next: std::sync::atomic::AtomicUsize::new(0),
            encoding: options.encoding,
            outputs,
            batch: if batches { options.batch } else { 1 },
            described,
        })
    }

    /// Whether `answer` holds every output the model's metadata has, of its datatype and shape and
    /// with all its values; what is wrong if not.
    pub fn check(&self, answer: &Answer) -> std::result::Result<(), String> {
        if answer.status != 200 {
            return Err(format!("HTTP {}: {}", answer.status, answer.text(200)));
        }
        let (header, mut blobs) = match answer.inference_header_length {
            Some(n) if n <= answer.body.len() => answer.body.split_at(n),
            Some(n) => {
                return Err(format!(
                    "Inference-Header-Content-Length {n} is beyond the answer's {} bytes",
                    answer.body.len()
                ))
            }
            None => (&answer.body[..], &[][..]),
        };
        #[derive(Deserialize)]
        struct Response {
            #[serde(default)]
            outputs: Vec<Output>,
        }
        let response: Response = serde_json::from_slice(header)
            .map_err(|e| format!("the answer is no KServe v2 response ({e}): {}", answer.text(200)))?;
        for out in &response.outputs {
            if let Some(spec) = self.outputs.iter().find(|o| o.name == out.name) {
                blobs = check_output(spec, out, blobs)?;
            }
        }
        for spec in &self.outputs {
            if !response.outputs.iter().any(|o| o.name == spec.name) {
                let had: Vec<&str> = response.outputs.iter().map(|o| o.name.as_str()).collect();
                return Err(format!(
                    "no output `{}` in the answer (it holds {})",
                    spec.name,
                    if had.is_empty() {
                        "none".to_string()
                    } else {
                        had.join(", ")
                    }
                ));
            }
        }
        Ok(())
    }
}

impl Exchange for Kserve {
    fn exchange(&self, endpoint: &Endpoint, agent: &ureq::Agent) -> std::result::Result<Instant, String> {
        let turn = self.next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let request = &self.requests[turn % self.requests.len()];
        let answer = endpoint
            .post(agent, &self.path, &request.headers, &request.body)
            .map_err(|e| e.0)?;
        self.check(&answer)?;
        Ok(answer.read_at)
    }

    fn batch(&self) -> usize {
        self.batch
    }
}

/// A request's headers and body: the inputs as JSON, or the binary extension's JSON header (asking
/// every output back as bytes) then the inputs' bytes.
#[allow(clippy::type_complexity)]
fn encode(
    encoding: Encoding,
    json_inputs: Vec<Value>,
    header_inputs: Vec<Value>,
    blob: Vec<u8>,
    outputs: &[TensorSpec],
) -> Result<(Vec<(&'static str, String)>, Vec<u8>)> {
    Ok(match encoding {
        Encoding::Json => (
            vec![("Content-Type", "application/json".to_string())],
            serde_json::to_vec(&json!({"inputs": json_inputs}))?,
        ),
        Encoding::Binary => {
            let wanted: Vec<Value> = outputs
                .iter()
                .map(|o| json!({"name": o.name, "parameters": {"binary_data": true}}))
                .collect();
            let mut body = serde_json::to_vec(&json!({"inputs": header_inputs, "outputs": wanted}))?;
            let header_length = body.len();
            body.extend(blob);
            (
                vec![
                    ("Content-Type", "application/octet-stream".to_string()),
                    ("Inference-Header-Content-Length", header_length.to_string()),
                ],
                body,
            )
        }
    })
}

/// An output as an answer holds it.
#[derive(Deserialize)]
struct Output {
    name: String,
    datatype: String,
    shape: Vec<i64>,
    #[serde(default)]
    data: Option<Value>,
    #[serde(default)]
    parameters: Option<Value>,
}

/// Whether `out` is `spec`'s datatype and shape with all its values (in JSON, or the first bytes of
/// `blobs`); the bytes after its own.
fn check_output<'b>(spec: &TensorSpec, out: &Output, blobs: &'b [u8]) -> std::result::Result<&'b [u8], String> {
    if out.datatype != spec.datatype {
        return Err(format!(
            "output `{}` is {}, not the {} of the model's metadata",
            out.name, out.datatype, spec.datatype
        ));
    }
    let fits = out.shape.len() == spec.shape.len()
        && out
            .shape
            .iter()
            .zip(&spec.shape)
            .all(|(&got, &want)| want == -1 || got == want);
    if !fits || out.shape.iter().any(|&d| d < 0) {
        return Err(format!(
            "output `{}` has shape {:?}, not {:?}",
            out.name, out.shape, spec.shape
        ));
    }
    let count: usize = out.shape.iter().map(|&d| d as usize).product();
    let binary_size = out
        .parameters
        .as_ref()
        .and_then(|p| p.get("binary_data_size"))
        .and_then(Value::as_u64);
    match (binary_size, &out.data) {
        (Some(size), _) => {
            let size = size as usize;
            if size > blobs.len() {
                return Err(format!(
                    "output `{}`: {size} bytes announced, {} left in the answer",
                    out.name,
                    blobs.len()
                ));
            }
            let elem = Datatype::of(&out.datatype).ok().and_then(Datatype::size);
            if let Some(elem) = elem.filter(|e| count * e != size) {
                return Err(format!(
                    "output `{}` of shape {:?} holds {size} bytes, not the {} its {count} values take",
                    out.name,
                    out.shape,
                    count * elem
                ));
            }
            Ok(&blobs[size..])
        }
        (None, Some(data)) => match leaves(data) {
            n if n == count => Ok(blobs),
            n => Err(format!(
                "output `{}` of shape {:?} holds {n} values, not {count}",
                out.name, out.shape
            )),
        },
        (None, None) => Err(format!("output `{}` holds no data", out.name)),
    }
}

/// Values in a JSON array, nested arrays flattened.
fn leaves(v: &Value) -> usize {
    match v {
        Value::Array(items) => items.iter().map(leaves).sum(),
        _ => 1,
    }
}

/// An input's shape as sent: the batch for its first dimension where the model batches, `dims`
/// (given as `given` names them) for the rest, each dimension of any size given.
fn shape_of(
    input: &TensorSpec,
    batches: bool,
    batch: usize,
    dims: Option<&Vec<usize>>,
    given: &str,
) -> Result<Vec<usize>> {
    if batches && input.shape.is_empty() {
        bail!(
            "input `{}` is a scalar (shape []) beside inputs that batch: a request cannot give it a batch dimension",
            input.name
        );
    }
    let rest = if batches { &input.shape[1..] } else { &input.shape[..] };
    let dims: Vec<usize> = match dims {
        Some(dims) => {
            let fits = dims.len() == rest.len()
                && dims
                    .iter()
                    .zip(rest)
                    .all(|(&g, &want)| want == -1 || want as usize == g);
            if !fits {
                bail!(
                    "{given}: shape {:?} does not fit the input's {:?}{}; give a size for each dimension, the same for the fixed ones",
                    dims,
                    input.shape,
                    if batches { " (the batch dimension first, which --batch sets)" } else { "" },
                );
            }
            dims.clone()
        }
        None => {
            if rest.iter().any(|&d| d < 0) {
                bail!(
                    "{}input `{}` has dimensions of any size ({:?}): give them with --shape {}:{}{}",
                    if given == "--shape" {
                        String::new()
                    } else {
                        format!("{given}: ")
                    },
                    input.name,
                    input.shape,
                    input.name,
                    rest.iter()
                        .map(|&d| if d < 0 { "N".to_string() } else { d.to_string() })
                        .collect::<Vec<_>>()
                        .join(","),
                    if given == "--shape" {
                        ""
                    } else {
                        " or a \"shape\" in the entry"
                    }
                );
            }
            rest.iter().map(|&d| d as usize).collect()
        }
    };
    let mut shape = Vec::with_capacity(dims.len() + 1);
    if batches {
        shape.push(batch);
    }
    shape.extend(dims);
    Ok(shape)
}

/// A given tensor's values for an input of `shape`: all of them, or, where the model batches, one
/// sample's repeated for each sample; as JSON values and as the binary extension's bytes.
fn given_values(
    datatype: Datatype,
    shape: &[usize],
    batches: bool,
    tensor: &input_data::GivenTensor,
) -> std::result::Result<(Vec<Value>, Vec<u8>), String> {
    let count: usize = shape.iter().product();
    let sample = if batches { count / shape[0].max(1) } else { count };
    let repeat = match tensor.values.len() {
        n if n == count => 1,
        n if batches && n == sample => shape[0],
        n => {
            return Err(format!(
                "{n} values, where shape {shape:?} takes {count}{}",
                if batches {
                    format!(" (or one sample's {sample})")
                } else {
                    String::new()
                }
            ))
        }
    };
    let mut json = Vec::with_capacity(count);
    let mut bytes = Vec::with_capacity(count * datatype.size().unwrap_or(20));
    for (k, v) in tensor.values.iter().enumerate() {
        let (j, b) = given_value(datatype, v).map_err(|why| format!("value {k}: {why}"))?;
        json.push(j);
        bytes.extend(b);
    }
    let json = (0..repeat).flat_map(|_| json.iter().cloned()).collect();
    Ok((json, bytes.repeat(repeat)))
}

/// The request of one entry of given data (`None`: every input seeded), and its inputs as sent;
/// `at` names an input of the entry in an error.
fn request(
    metadata: &ModelMetadata,
    entry: Option<&input_data::Entry>,
    at: &dyn Fn(&str) -> String,
    batches: bool,
    options: &RequestOptions,
) -> Result<(Request, String)> {
    let mut json_inputs = Vec::new();
    let mut header_inputs = Vec::new();
    let mut blob = Vec::new();
    let mut sent = Vec::new();
    for (i, input) in metadata.inputs.iter().enumerate() {
        let datatype = Datatype::of(&input.datatype).with_context(|| format!("input `{}`", input.name))?;
        if options.encoding == Encoding::Json && matches!(datatype, Datatype::F16 | Datatype::Bf16) {
            bail!(
                "input `{}` is {}, which travels only through the binary extension: --encoding binary",
                input.name,
                input.datatype
            );
        }
        let (shape, json_values, bytes) = match entry.and_then(|en| en.get(&input.name)) {
            Some(tensor) => {
                let dims = tensor.shape.as_ref().or(options.shapes.get(&input.name));
                let shape = shape_of(input, batches, options.batch, dims, &at(&input.name))?;
                let (json_values, bytes) = given_values(datatype, &shape, batches, tensor)
                    .map_err(|why| anyhow!("{}: {why}", at(&input.name)))?;
                (shape, json_values, bytes)
            }
            None => {
                let shape = shape_of(
                    input,
                    batches,
                    options.batch,
                    options.shapes.get(&input.name),
                    "--shape",
                )?;
                let seed = options.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
                let (json_values, bytes) = values(datatype, shape.iter().product(), seed);
                (shape, json_values, bytes)
            }
        };
        json_inputs.push(json!({"name": input.name, "shape": shape, "datatype": input.datatype, "data": json_values}));
        header_inputs.push(json!({"name": input.name, "shape": shape, "datatype": input.datatype,
                                  "parameters": {"binary_data_size": bytes.len()}}));
        blob.extend(bytes);
        sent.push(format!("{} {:?} {}", input.name, shape, input.datatype));
    }
    let (headers, body) = encode(options.encoding, json_inputs, header_inputs, blob, &metadata.outputs)?;
    Ok((Request { headers, body }, sent.join(", ")))
}

/// One given value as `datatype` holds it: as JSON, and as the binary extension's bytes.
fn given_value(datatype: Datatype, v: &Value) -> std::result::Result<(Value, Vec<u8>), String> {
    use Datatype::*;
    let integer = |low: i128, high: i128| -> std::result::Result<i128, String> {
        let n = v
            .as_i64()
            .map(i128::from)
            .or_else(|| v.as_u64().map(i128::from))
            .or_else(|| v.as_bool().map(i128::from))
            .ok_or_else(|| format!("{v} is no whole number"))?;
        match (low..=high).contains(&n) {
            true => Ok(n),
            false => Err(format!("{n} is beyond {low}..={high}")),
        }
    };
    Ok(match datatype {
        Bytes => {
            let s = v
                .as_str()
                .ok_or_else(|| format!("{v} is no string (a BYTES input takes strings)"))?;
            let mut b = (s.len() as u32).to_le_bytes().to_vec();
            b.extend(s.as_bytes());
            (json!(s), b)
        }
        Bool => {
            let b = v.as_bool().map_or_else(|| integer(0, 1).map(|n| n == 1), Ok)?;
            (json!(b), vec![b as u8])
        }
        F16 | Bf16 | F32 | F64 => {
            let x = v.as_f64().ok_or_else(|| format!("{v} is no number"))?;
            let (held, b) = match datatype {
                F16 => (
                    half::f16::from_f64(x).to_f64(),
                    half::f16::from_f64(x).to_le_bytes().to_vec(),
                ),
                Bf16 => (
                    half::bf16::from_f64(x).to_f64(),
                    half::bf16::from_f64(x).to_le_bytes().to_vec(),
                ),
                F32 => ((x as f32) as f64, (x as f32).to_le_bytes().to_vec()),
                _ => (x, x.to_le_bytes().to_vec()),
            };
            // A value the type cannot hold would travel as infinity.
            if !held.is_finite() {
                return Err(format!("{x} is beyond what the input's type holds"));
            }
            (json!(x), b)
        }
        U8 => int_bytes(integer(0, u8::MAX.into())?, 1),
        U16 => int_bytes(integer(0, u16::MAX.into())?, 2),
        U32 => int_bytes(integer(0, u32::MAX.into())?, 4),
        U64 => int_bytes(integer(0, u64::MAX.into())?, 8),
        I8 => int_bytes(integer(i8::MIN.into(), i8::MAX.into())?, 1),
        I16 => int_bytes(integer(i16::MIN.into(), i16::MAX.into())?, 2),
        I32 => int_bytes(integer(i32::MIN.into(), i32::MAX.into())?, 4),
        I64 => int_bytes(integer(i64::MIN.into(), i64::MAX.into())?, 8),
    })
}

/// A whole number as JSON and as its `size` little-endian bytes (two's complement).
fn int_bytes(n: i128, size: usize) -> (Value, Vec<u8>) {
    let json = match i64::try_from(n) {
        Ok(i) => json!(i),
        Err(_) => json!(n as u64),
    };
    (json, n.to_le_bytes()[..size].to_vec())
}

/// Tensors as `name [shape] DATATYPE`, comma-separated.
fn describe(tensors: &[TensorSpec]) -> String {
    tensors
        .iter()
        .map(|t| format!("{} {:?} {}", t.name, t.shape, t.datatype))
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn metadata() -> ModelMetadata {
        serde_json::from_str(
            r#"{"name":"dense","versions":["1"],"platform":"python",
                "inputs":[{"name":"x","datatype":"FP32","shape":[-1,16]}],
                "outputs":[{"name":"y","datatype":"FP32","shape":[-1,4]}]}"#,
        )
        .unwrap()
    }

    fn options(encoding: Encoding) -> RequestOptions {
        RequestOptions {
            batch: 2,
            shapes: BTreeMap::new(),
            encoding,
            seed: 0,
            input_data: None,
        }
    }

    fn answer(status: u16, header: &str, blob: &[u8], binary: bool) -> Answer {
        let mut body = header.as_bytes().to_vec();
        body.extend_from_slice(blob);
        Answer {
            status,
            inference_header_length: binary.then_some(header.len()),
            body,
            read_at: Instant::now(),
        }
    }

    #[test]
    fn a_binary_request_holds_its_header_then_each_input_s_bytes() {
        let r = Kserve::new(&metadata(), &options(Encoding::Binary)).unwrap();
        let one = &r.requests[0];
        let header_length: usize = one
            .headers
            .iter()
            .find(|h| h.0 == "Inference-Header-Content-Length")
            .unwrap()
            .1
            .parse()
            .unwrap();
        let header: Value = serde_json::from_slice(&one.body[..header_length]).unwrap();
        assert_eq!(header["inputs"][0]["shape"], json!([2, 16]));
        assert_eq!(header["inputs"][0]["parameters"]["binary_data_size"], json!(2 * 16 * 4));
        assert_eq!(header["outputs"][0]["parameters"]["binary_data"], json!(true));
        assert_eq!(one.body.len(), header_length + 2 * 16 * 4);
        assert_eq!(r.described, "x [2, 16] FP32");
        let same = Kserve::new(&metadata(), &options(Encoding::Binary)).unwrap();
        assert_eq!(one.body, same.requests[0].body, "seeded");
    }

    #[test]
    fn an_answer_must_hold_every_output_of_its_shape_with_all_its_values() {
        let r = Kserve::new(&metadata(), &options(Encoding::Json)).unwrap();
        let json_ok = r#"{"model_name":"dense","outputs":[{"name":"y","datatype":"FP32","shape":[2,4],"data":[1,2,3,4,5,6,7,8]}]}"#;
        assert_eq!(r.check(&answer(200, json_ok, &[], false)), Ok(()));
        let bin = r#"{"outputs":[{"name":"y","datatype":"FP32","shape":[2,4],"parameters":{"binary_data_size":32}}]}"#;
        assert_eq!(r.check(&answer(200, bin, &[0; 32], true)), Ok(()));
        let wrong = |status: u16, header: &str, blob: &[u8], binary: bool| {
            r.check(&answer(status, header, blob, binary)).unwrap_err()
        };
        assert!(wrong(200, r#"{"outputs":[]}"#, &[], false).contains("no output `y` in the answer (it holds none)"));
        assert!(wrong(200, &json_ok.replace("[2,4]", "[2,3]"), &[], false).contains("has shape [2, 3], not [2, 4]"));
        assert!(wrong(200, &json_ok.replace(",7,8", ""), &[], false).contains("holds 6 values, not 8"));
        assert!(wrong(200, &json_ok.replace("\"FP32\"", "\"FP16\""), &[], false).contains("is FP16, not the FP32"));
        assert!(wrong(200, bin, &[0; 16], true).contains("32 bytes announced, 16 left"));
        assert!(wrong(200, &bin.replace("32}", "16}"), &[0; 16], true).contains("holds 16 bytes, not the 32"));
        assert!(wrong(500, r#"{"error":"boom"}"#, &[], false).contains("HTTP 500: {\"error\":\"boom\"}"));
        assert!(wrong(200, "not json", &[], false).contains("no KServe v2 response"));
    }

    #[test]
    fn shapes_batches_and_encodings_that_cannot_be_sent_are_refused_naming_the_way() {
        let mut m = metadata();
        m.inputs[0].shape = vec![-1, -1];
        let e = Kserve::new(&m, &options(Encoding::Binary)).unwrap_err().to_string();
        assert!(e.contains("--shape x:N"), "{e}");
        let mut o = options(Encoding::Binary);
        o.shapes.insert("z".into(), vec![7]);
        let e = Kserve::new(&m, &o).unwrap_err().to_string();
        assert!(
            e.contains("--shape z: model `dense` has no input `z`; its inputs: x"),
            "{e}"
        );
        let mut o = options(Encoding::Binary);
        o.shapes.insert("x".into(), vec![7]);
        assert_eq!(Kserve::new(&m, &o).unwrap().described, "x [2, 7] FP32");
        o.shapes.insert("x".into(), vec![7, 7]);
        assert!(Kserve::new(&m, &o)
            .unwrap_err()
            .to_string()
            .contains("give a size for each dimension"));
        m.inputs[0].shape = vec![16];
        let e = Kserve::new(&m, &options(Encoding::Binary)).unwrap_err().to_string();
        assert!(e.contains("does not batch"), "{e}");
        let mut m = metadata();
        m.inputs[0].datatype = "FP16".into();
        let e = Kserve::new(&m, &options(Encoding::Json)).unwrap_err().to_string();
        assert!(e.contains("--encoding binary"), "{e}");
        m.inputs[0].datatype = "FP8".into();
        let e = format!("{:#}", Kserve::new(&m, &options(Encoding::Binary)).unwrap_err());
        assert!(e.contains("FP8") && e.contains("BF16"), "{e}");
    }

    /// Requests of `data` (JSON of perf_analyzer's form) to `m`.
    fn given(m: &ModelMetadata, data: Value, encoding: Encoding) -> Result<Kserve> {
        let mut o = options(encoding);
        o.input_data = Some(input_data::InputData::parse_value(&data).unwrap());
        Kserve::new(m, &o)
    }

    #[test]
    fn given_data_is_sent_in_turn_one_sample_repeated_or_whole() {
        let mut m = metadata();
        m.inputs[0].shape = vec![-1, 2];
        m.inputs.push(TensorSpec {
            name: "ids".into(),
            datatype: "INT64".into(),
            shape: vec![-1, -1],
        });
        let data = json!({"data": [
            {"x": [0.5, 1.5], "ids": {"content": [1, 2, 3], "shape": [3]}},
            {"x": [[1, 2], [3, 4]], "ids": {"content": [-1, 0, 0, 7, 8, 9], "shape": [3]}}
        ]});
        let r = given(&m, data.clone(), Encoding::Json).unwrap();
        assert_eq!(r.requests.len(), 2);
        assert!(
            r.described
                .starts_with("x [2, 2] FP32, ids [2, 3] INT64 (the first of 2 requests"),
            "{}",
            r.described
        );
        let body = |k: usize| -> Value { serde_json::from_slice(&r.requests[k].body).unwrap() };
        assert_eq!(
            body(0)["inputs"][0]["data"],
            json!([0.5, 1.5, 0.5, 1.5]),
            "one sample, repeated"
        );
        assert_eq!(body(0)["inputs"][1]["data"], json!([1, 2, 3, 1, 2, 3]));
        assert_eq!(
            body(1)["inputs"][0]["data"],
            json!([1.0, 2.0, 3.0, 4.0]),
            "the whole request"
        );
        assert_eq!(body(1)["inputs"][1]["data"], json!([-1, 0, 0, 7, 8, 9]));
        let bin = given(&m, data, Encoding::Binary).unwrap();
        let tail = &bin.requests[1].body[bin.requests[1].body.len() - 48..];
        assert_eq!(
            &tail[..8],
            &(-1i64).to_le_bytes(),
            "INT64 little-endian, two's complement"
        );
        let nowhere = Endpoint::new("http://127.0.0.1:9", &[], std::time::Duration::from_millis(50)).unwrap();
        let agent = nowhere.agent();
        for _ in 0..3 {
            let _ = bin.exchange(&nowhere, &agent);
        }
        assert_eq!(
            bin.next.load(std::sync::atomic::Ordering::Relaxed),
            3,
            "each send takes the next"
        );
    }

    #[test]
    fn given_data_that_does_not_fit_the_model_is_named_by_entry_and_input() {
        let m = metadata();
        let e = |data: Value| format!("{:#}", given(&m, data, Encoding::Json).unwrap_err());
        let msg = e(json!({"data": [{"x": vec![1.0; 16]}, {"x": [1, 2, 3]}]}));
        assert!(
            msg.contains("--input-data data[1].x: 3 values, where shape [2, 16] takes 32 (or one sample's 16)"),
            "{msg}"
        );
        let msg = e(json!({"data": [{"w": [1]}]}));
        assert!(
            msg.contains("data[0].w: model `dense` has no input `w`; its inputs: x"),
            "{msg}"
        );
        let msg = e(json!({"data": [{"x": {"content": [1.0, 2.0], "shape": [2]}}]}));
        assert!(
            msg.contains("data[0].x: shape [2] does not fit the input's [-1, 16]"),
            "{msg}"
        );
        let mut ints = metadata();
        ints.inputs[0].datatype = "UINT8".into();
        let msg = format!(
            "{:#}",
            given(&ints, json!({"data": [{"x": vec![300; 16]}]}), Encoding::Json).unwrap_err()
        );
        assert!(msg.contains("value 0: 300 is beyond 0..=255"), "{msg}");
        let msg = format!(
            "{:#}",
            given(&ints, json!({"data": [{"x": vec![0.5; 16]}]}), Encoding::Json).unwrap_err()
        );
        assert!(msg.contains("is no whole number"), "{msg}");
    }
}
