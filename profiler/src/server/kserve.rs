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

/// A request to one model, made once and sent again and again, and what its answer must hold.
#[derive(Debug, Clone)]
pub struct Kserve {
    path: String,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
    pub encoding: Encoding,
    /// Each output with the shape the answer must have (`-1`: any size).
    outputs: Vec<TensorSpec>,
    /// The samples a request holds (1 for a model that does not batch).
    pub batch: usize,
    /// The inputs as sent: `name [shape] DATATYPE`, for the row.
    pub described: String,
}

impl Kserve {
    /// The request of `options` to the model of `metadata`, every input shaped and every choice
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
        for name in options.shapes.keys() {
            if !metadata.inputs.iter().any(|i| &i.name == name) {
                bail!(
                    "--shape {name}: model `{}` has no such input; its inputs: {}",
                    metadata.name,
                    describe(&metadata.inputs)
                );
            }
        }
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
            let shape = shape_of(input, batches, options)?;
            let count: usize = shape.iter().product();
            let (json_values, bytes) = values(
                datatype,
                count,
                options.seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
            );
            json_inputs
                .push(json!({"name": input.name, "shape": shape, "datatype": input.datatype, "data": json_values}));
            header_inputs.push(json!({"name": input.name, "shape": shape, "datatype": input.datatype,
                                      "parameters": {"binary_data_size": bytes.len()}}));
            blob.extend(bytes);
            sent.push(format!("{} {:?} {}", input.name, shape, input.datatype));
        }
        let mut outputs = metadata.outputs.clone();
        if batches {
            for o in &mut outputs {
                if o.shape.first() == Some(&-1) {
                    o.shape[0] = options.batch as i64;
                }
            }
        }
        let (headers, body) = encode(options.encoding, json_inputs, header_inputs, blob, &metadata.outputs)?;
        Ok(Kserve {
            path: format!("/v2/models/{}/infer", metadata.name),
            headers,
            body,
            encoding: options.encoding,
            outputs,
            batch: if batches { options.batch } else { 1 },
            described: sent.join(", "),
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
        let answer = endpoint
            .post(agent, &self.path, &self.headers, &self.body)
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

/// An input's shape as sent: the batch for its first dimension where the model batches, the
/// `--shape` given for the rest, each dimension of any size given.
fn shape_of(input: &TensorSpec, batches: bool, options: &RequestOptions) -> Result<Vec<usize>> {
    let rest = if batches { &input.shape[1..] } else { &input.shape[..] };
    let dims: Vec<usize> =
        match options.shapes.get(&input.name) {
            Some(given) => {
                let fits = given.len() == rest.len()
                    && given
                        .iter()
                        .zip(rest)
                        .all(|(&g, &want)| want == -1 || want as usize == g);
                if !fits {
                    bail!(
                    "--shape {}:{}: the input's shape is {:?}{}; give a size for each dimension, {} for the fixed ones",
                    input.name,
                    given.iter().map(usize::to_string).collect::<Vec<_>>().join(","),
                    input.shape,
                    if batches { " (the batch dimension first, which --batch sets)" } else { "" },
                    "the same"
                );
                }
                given.clone()
            }
            None => {
                if rest.iter().any(|&d| d < 0) {
                    bail!(
                        "input `{}` has dimensions of any size ({:?}): give them with --shape {}:{}",
                        input.name,
                        input.shape,
                        input.name,
                        rest.iter()
                            .map(|&d| if d < 0 { "N".to_string() } else { d.to_string() })
                            .collect::<Vec<_>>()
                            .join(",")
                    );
                }
                rest.iter().map(|&d| d as usize).collect()
            }
        };
    let mut shape = Vec::with_capacity(dims.len() + 1);
    if batches {
        shape.push(options.batch);
    }
    shape.extend(dims);
    Ok(shape)
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
        let header_length: usize = r
            .headers
            .iter()
            .find(|h| h.0 == "Inference-Header-Content-Length")
            .unwrap()
            .1
            .parse()
            .unwrap();
        let header: Value = serde_json::from_slice(&r.body[..header_length]).unwrap();
        assert_eq!(header["inputs"][0]["shape"], json!([2, 16]));
        assert_eq!(header["inputs"][0]["parameters"]["binary_data_size"], json!(2 * 16 * 4));
        assert_eq!(header["outputs"][0]["parameters"]["binary_data"], json!(true));
        assert_eq!(r.body.len(), header_length + 2 * 16 * 4);
        assert_eq!(r.described, "x [2, 16] FP32");
        let same = Kserve::new(&metadata(), &options(Encoding::Binary)).unwrap();
        assert_eq!(r.body, same.body, "seeded");
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
}
