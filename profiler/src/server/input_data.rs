//! The requests' tensors from a user's file (`--input-data`), in the form perf_analyzer reads with
//! its own `--input-data`, so that a file made for it serves here unchanged:
//!
//! ```json
//! {"data": [{"INPUT0": [1, 2, 3], "INPUT1": {"content": [0.5, 0.25], "shape": [2]}}, ...]}
//! ```
//!
//! Each entry of `data` is one request's inputs, sent in turn. A tensor is its values (nested arrays
//! are read in row-major order) or `content` with the `shape` of its dimensions of any size (as
//! `--shape` gives them, the batch dimension left out). Values are numbers, booleans, or strings
//! for BYTES inputs. A model that batches takes one sample's values, repeated for each sample of a
//! request, or a whole request's.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;

/// The largest file read: a file of requests is its tensors' values as text, and one beyond this
/// would hold more than any server's request limit.
const MAX_FILE_BYTES: u64 = 1 << 30;

/// One request's given tensors.
pub type Entry = BTreeMap<String, GivenTensor>;

/// A file's requests.
#[derive(Debug, Clone, PartialEq)]
pub struct InputData {
    pub entries: Vec<Entry>,
}

/// One input's values as the file gives them.
#[derive(Debug, Clone, PartialEq)]
pub struct GivenTensor {
    /// Row-major.
    pub values: Vec<Value>,
    /// The dimensions of any size, where the file gives them.
    pub shape: Option<Vec<usize>>,
}

impl InputData {
    pub fn read(path: &Path) -> Result<InputData> {
        let size = std::fs::metadata(path)
            .map_err(|e| crate::files::io_error(e, path))?
            .len();
        if size > MAX_FILE_BYTES {
            bail!(
                "{}: {} MB is more than the {} MB an input file may hold",
                path.display(),
                size >> 20,
                MAX_FILE_BYTES >> 20
            );
        }
        let text = std::fs::read_to_string(path).map_err(|e| crate::files::io_error(e, path))?;
        let value: Value = serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
        InputData::parse_value(&value).with_context(|| format!("{}", path.display()))
    }

    /// The requests of a file's JSON.
    pub fn parse_value(value: &Value) -> Result<InputData> {
        const FORM: &str = "give {\"data\": [{\"INPUT\": [values]}, ...]}, one entry per request";
        let Some(data) = value.get("data").and_then(Value::as_array) else {
            bail!("no `data` array: {FORM}");
        };
        if data.is_empty() {
            bail!("`data` is empty: {FORM}");
        }
        let mut entries = Vec::with_capacity(data.len());
        for (i, entry) in data.iter().enumerate() {
            let Some(tensors) = entry.as_object() else {
                bail!("data[{i}] is not an object of inputs: {FORM}");
            };
            let mut read = Entry::new();
            for (name, tensor) in tensors {
                read.insert(
                    name.clone(),
                    given_tensor(tensor).with_context(|| format!("data[{i}].{name}"))?,
                );
            }
            entries.push(read);
        }
        Ok(InputData { entries })
    }
}

fn given_tensor(tensor: &Value) -> Result<GivenTensor> {
    let (content, shape) = match tensor {
        Value::Object(o) => {
            if o.contains_key("b64") {
                bail!("base64 content is not read: give the values themselves");
            }
            let content = o
                .get("content")
                .ok_or_else(|| anyhow!("an object needs `content` (and `shape`)"))?;
            let shape = match o.get("shape") {
                Some(s) => Some(
                    s.as_array()
                        .and_then(|dims| {
                            dims.iter()
                                .map(|d| d.as_u64().filter(|&d| d > 0).map(|d| d as usize))
                                .collect::<Option<Vec<usize>>>()
                        })
                        .ok_or_else(|| anyhow!("`shape` must be an array of positive whole numbers"))?,
                ),
                None => None,
            };
            (content, shape)
        }
        other => (other, None),
    };
    let mut values = Vec::new();
    flatten(content, &mut values)?;
    if values.is_empty() {
        bail!("no values");
    }
    Ok(GivenTensor { values, shape })
}

/// `value`'s scalars in row-major order.
fn flatten(value: &Value, out: &mut Vec<Value>) -> Result<()> {
    match value {
        Value::Array(items) => items.iter().try_for_each(|v| flatten(v, out)),
        Value::Number(_) | Value::Bool(_) | Value::String(_) => {
            out.push(value.clone());
            Ok(())
        }
        other => bail!("{other} is no value: give numbers, booleans or strings"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn perf_analyzer_s_form_is_read() {
        let data = InputData::parse_value(&json!({"data": [
            {"a": [[1, 2], [3, 4]], "b": {"content": [0.5, 0.25], "shape": [2]}},
            {"a": [5, 6, 7, 8], "s": ["x"]}
        ]}))
        .unwrap();
        assert_eq!(data.entries.len(), 2);
        assert_eq!(
            data.entries[0]["a"].values,
            vec![json!(1), json!(2), json!(3), json!(4)]
        );
        assert_eq!(data.entries[0]["b"].shape, Some(vec![2]));
        assert_eq!(data.entries[1]["s"].values, vec![json!("x")]);
    }

    #[test]
    fn what_is_not_that_form_is_named() {
        let e = |v: Value| format!("{:#}", InputData::parse_value(&v).unwrap_err());
        assert!(e(json!({"inputs": []})).contains("no `data` array"));
        assert!(e(json!({"data": []})).contains("empty"));
        assert!(e(json!({"data": [1]})).contains("data[0] is not an object"));
        assert!(e(json!({"data": [{"a": {"b64": "AAA="}}]})).contains("base64"));
        assert!(e(json!({"data": [{"a": {"content": [1], "shape": [0]}}]})).contains("positive"));
        assert!(e(json!({"data": [{"a": [null]}]})).contains("data[0].a"));
        assert!(e(json!({"data": [{"a": []}]})).contains("no values"));
    }

    #[test]
    fn a_file_that_is_not_there_or_not_json_is_named() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("none.json");
        assert!(format!("{:#}", InputData::read(&missing).unwrap_err()).contains("none.json"));
        let bad = dir.path().join("bad.json");
        std::fs::write(&bad, "{").unwrap();
        assert!(format!("{:#}", InputData::read(&bad).unwrap_err()).contains("not JSON"));
    }
}
