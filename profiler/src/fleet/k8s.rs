//! Sweeps on Kubernetes: per target, a ConfigMap holding its cells' specs and an indexed Job whose
//! pod `i` runs cell `i` with `migprof cell` into the results volume. The resource asked for is NVIDIA's
//! device plugin's: `nvidia.com/mig-<profile>` under the mixed MIG strategy, or `nvidia.com/gpu`
//! with the `nvidia.com/gpu.product` node label under the single one (the GPU operator's mig-manager
//! sets the layouts, from files of the mig-parted format `migprof capacity --emit-layouts` writes).

use std::io::Write;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::request::Request;
use super::{cluster_cells, slug};
use crate::cell::CellSpec;
use crate::sweep::file::SweepFile;
use crate::sweep::Options;

/// How MIG slices are exposed by the device plugin.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MigStrategy {
    /// Each profile its own resource, `nvidia.com/mig-3g.40gb`.
    Mixed,
    /// Every slice of a node the same profile, as `nvidia.com/gpu`; the product label names it.
    Single,
}

#[derive(Debug, Clone)]
pub struct K8sOptions {
    pub image: String,
    pub namespace: String,
    pub results_pvc: String,
    pub strategy: MigStrategy,
    /// One pod per node at a time (a pod anti-affinity on the sweep's label).
    pub one_per_node: bool,
    /// The sweep's `timeout_secs`: each pod's deadline.
    pub timeout_secs: f64,
}

/// Where the specs are mounted and the results volume is, inside the pod.
const SPECS: &str = "/etc/migprof/cells";
const RESULTS: &str = "/results";

/// Writes `<dir>/<target>.yaml` (a ConfigMap and an indexed Job) for every target with cells not done.
pub fn emit(
    file: &SweepFile,
    opts: &Options,
    k: &K8sOptions,
    dir: &Path,
    log: &mut dyn Write,
) -> Result<Vec<std::path::PathBuf>> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let cells = cluster_cells(file, opts)?;
    let invocation = crate::provenance::run_id(crate::provenance::now());
    let mut written = Vec::new();
    for target in &file.targets {
        let todo: Vec<CellSpec> = cells
            .iter()
            .filter(|(c, done)| c.target == target.label && !done)
            .map(|(c, _)| CellSpec {
                scheduled: true,
                ..c.clone()
            })
            .collect();
        if todo.is_empty() {
            continue;
        }
        let request = Request::of(target)?;
        let docs = manifests(&file.name, &target.label, &request, &todo, &invocation, k)?;
        let text: Vec<String> = docs
            .iter()
            .map(serde_yaml::to_string)
            .collect::<std::result::Result<_, _>>()?;
        let path = dir.join(format!("{}.yaml", slug(&target.label)));
        crate::files::write_atomically(&path, text.join("---\n").as_bytes())?;
        writeln!(
            log,
            "{}: {} cell(s): {}  (apply with: kubectl apply -f {})",
            target.label,
            todo.len(),
            path.display(),
            path.display()
        )?;
        written.push(path);
    }
    if written.is_empty() {
        writeln!(log, "nothing to emit: every cell is done")?;
    }
    Ok(written)
}

/// What a target's pod asks for and where it may run: a GPU, a MIG slice as the device plugin's
/// strategy exposes it, or nothing (CPU cells).
fn resources(request: &Request, strategy: MigStrategy, label: &str) -> Result<(Value, Value)> {
    Ok(match (request, strategy) {
        (Request::Cpu, _) => (json!({}), json!({})),
        (Request::Gpu { product }, _) => (
            json!({ "nvidia.com/gpu": 1 }),
            product
                .as_ref()
                .map_or(json!({}), |p| json!({ "nvidia.com/gpu.product": p })),
        ),
        (Request::Mig { profile, product }, MigStrategy::Mixed) => (
            json!({ format!("nvidia.com/mig-{profile}"): 1 }),
            product
                .as_ref()
                .map_or(json!({}), |p| json!({ "nvidia.com/gpu.product": p })),
        ),
        (Request::Mig { profile, product }, MigStrategy::Single) => {
            let Some(p) = product else {
                bail!("target `{label}`: under the single MIG strategy a slice is `nvidia.com/gpu` on a node whose product label names the profile; give product = \"NVIDIA-H100-80GB-HBM3\" (the GPU's label) so the selector can be NVIDIA-H100-80GB-HBM3-MIG-{profile}")
            };
            (
                json!({ "nvidia.com/gpu": 1 }),
                json!({ "nvidia.com/gpu.product": format!("{p}-MIG-{profile}") }),
            )
        }
    })
}

/// The ConfigMap and the indexed Job of one target.
pub fn manifests(
    sweep: &str,
    label: &str,
    request: &Request,
    cells: &[CellSpec],
    invocation: &str,
    k: &K8sOptions,
) -> Result<Vec<Value>> {
    let name = format!("migprof-{}-{}", slug(sweep), slug(label));
    // Kubernetes names: at most 63 characters of lowercase alphanumerics and '-'.
    let name: String = name
        .replace('.', "-")
        .chars()
        .take(52)
        .collect::<String>()
        .trim_end_matches('-')
        .to_string();
    let mut data = serde_json::Map::new();
    for (i, c) in cells.iter().enumerate() {
        data.insert(format!("cell-{i}.json"), Value::String(c.to_json()?));
    }
    let labels = json!({ "app.kubernetes.io/name": "migprof", "migprof/sweep": slug(sweep).replace('.', "-") });
    let config_map = json!({
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": { "name": format!("{name}-cells"), "namespace": k.namespace, "labels": labels },
        "data": data,
    });
    let (limits, selector) = resources(request, k.strategy, label)?;
    let mut pod_spec = json!({
        "restartPolicy": "Never",
        // The sweep's per-cell timeout, with a minute for the pod around the cell.
        "activeDeadlineSeconds": k.timeout_secs.ceil() as u64 + 60,
        "containers": [{
            "name": "cell",
            "image": k.image,
            "command": ["/bin/sh", "-c"],
            "args": [format!(
                "migprof cell --spec {SPECS}/cell-$JOB_COMPLETION_INDEX.json --out {RESULTS} --invocation {invocation} || {{ code=$?; migprof cell-ended --spec {SPECS}/cell-$JOB_COMPLETION_INDEX.json --out {RESULTS} --invocation {invocation} --exit-code $code; exit $code; }}"
            )],
            "resources": { "limits": limits },
            "volumeMounts": [
                { "name": "cells", "mountPath": SPECS, "readOnly": true },
                { "name": "results", "mountPath": RESULTS },
            ],
        }],
        "volumes": [
            { "name": "cells", "configMap": { "name": format!("{name}-cells") } },
            { "name": "results", "persistentVolumeClaim": { "claimName": k.results_pvc } },
        ],
    });
    if selector.as_object().is_some_and(|o| !o.is_empty()) {
        pod_spec["nodeSelector"] = selector;
    }
    if k.one_per_node {
        pod_spec["affinity"] = json!({
            "podAntiAffinity": { "requiredDuringSchedulingIgnoredDuringExecution": [{
                "labelSelector": { "matchLabels": labels },
                "topologyKey": "kubernetes.io/hostname",
            }]}
        });
    }
    let job = json!({
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": { "name": name, "namespace": k.namespace, "labels": labels },
        "spec": {
            "completionMode": "Indexed",
            "completions": cells.len(),
            // Cells of a GPU target each get a device of their own; CPU cells would share a node's
            // cores and disturb each other, so they run one at a time, as a local sweep runs them.
            "parallelism": if matches!(request, Request::Cpu) { 1 } else { cells.len() },
            "backoffLimit": 0,
            "template": { "metadata": { "labels": labels }, "spec": pod_spec },
        },
    });
    Ok(vec![config_map, job])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn options(strategy: MigStrategy) -> K8sOptions {
        K8sOptions {
            image: "registry.example/migprof:0.1".into(),
            namespace: "bench".into(),
            results_pvc: "migprof-results".into(),
            strategy,
            one_per_node: true,
            timeout_secs: 600.0,
        }
    }

    #[test]
    fn a_target_becomes_a_config_map_and_an_indexed_job_asking_for_its_slice() -> Result<()> {
        let cells = vec![
            crate::cell::spec::tests::cell(),
            CellSpec {
                batch: 8,
                ..crate::cell::spec::tests::cell()
            },
        ];
        let mig = Request::Mig {
            profile: "3g.40gb".into(),
            product: Some("NVIDIA-H100-80GB-HBM3".into()),
        };
        let docs = manifests("slices", "3g", &mig, &cells, "inv", &options(MigStrategy::Mixed))?;
        assert_eq!(docs[0]["kind"], "ConfigMap");
        assert!(docs[0]["data"]["cell-1.json"]
            .as_str()
            .unwrap()
            .contains("\"batch\": 8"));
        let job = &docs[1];
        assert_eq!(
            (
                job["spec"]["completionMode"].as_str(),
                job["spec"]["completions"].as_u64()
            ),
            (Some("Indexed"), Some(2))
        );
        let pod = &job["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["resources"]["limits"]["nvidia.com/mig-3g.40gb"], 1);
        assert_eq!(pod["nodeSelector"]["nvidia.com/gpu.product"], "NVIDIA-H100-80GB-HBM3");
        assert!(pod["containers"][0]["args"][0]
            .as_str()
            .unwrap()
            .contains("$JOB_COMPLETION_INDEX"));
        assert_eq!(
            pod["volumes"][1]["persistentVolumeClaim"]["claimName"],
            "migprof-results"
        );
        assert!(pod["affinity"]["podAntiAffinity"].is_object());
        assert_eq!(pod["activeDeadlineSeconds"], 660);
        assert_eq!(job["spec"]["parallelism"], 2);
        let cpu = manifests(
            "slices",
            "cpu",
            &Request::Cpu,
            &cells,
            "inv",
            &options(MigStrategy::Mixed),
        )?;
        assert_eq!(cpu[1]["spec"]["parallelism"], 1);
        let single = manifests("slices", "3g", &mig, &cells, "inv", &options(MigStrategy::Single))?;
        let pod = &single[1]["spec"]["template"]["spec"];
        assert_eq!(pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"], 1);
        assert_eq!(
            pod["nodeSelector"]["nvidia.com/gpu.product"],
            "NVIDIA-H100-80GB-HBM3-MIG-3g.40gb"
        );
        let no_product = Request::Mig {
            profile: "3g.40gb".into(),
            product: None,
        };
        assert!(
            manifests("s", "3g", &no_product, &cells, "i", &options(MigStrategy::Single))
                .unwrap_err()
                .to_string()
                .contains("product")
        );
        Ok(())
    }
}
