//! Which rows `compare` compares: the runs table's, a load job's steps, or capacity searches, each
//! with its workload fields (what two rows must share to be compared) and its measures.

use super::WORKLOAD;

/// What a load job served: the model or the server and its request, and migprof's batcher.
const LOAD_JOB: [&str; 12] = [
    "model",
    "family",
    "dtype",
    "seq_len",
    "kernel_options",
    "engine",
    "protocol",
    "request_inputs",
    "encoding",
    "request_batch",
    "max_batch",
    "max_delay_ms",
];
/// What a serving job served: the language model or the server and how it was asked, the request
/// lengths, and migprof's continuous batcher.
const SERVE_JOB: [&str; 14] = [
    "model",
    "family",
    "dtype",
    "kernel_options",
    "engine",
    "protocol",
    "api",
    "prompt_form",
    "output_enforced",
    "prompt_len",
    "output_len",
    "max_batched_tokens",
    "max_seqs",
    "kv_block_size",
];
/// A load step's offer (a concurrency, or a rate and how its requests arrive). A search's steps are
/// left out: their rates differ by target.
const STEP: [&str; 3] = ["concurrency", "offered_qps", "arrival"];
/// What a capacity search searched within.
const SEARCH: [&str; 1] = ["slo_p99_ms"];

/// Which rows are compared: measured runs (throughput in items/s with its interval), a load step's
/// achieved rate (requests/s, migprof's engine or a server of the user's own), a capacity search's
/// capacity (requests/s within the objective), or a language model's serving step's achieved rate
/// with its TTFT (migprof's engine or an OpenAI-compatible server).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Kind {
    Runs,
    Load,
    Capacity,
    Serve,
}

impl Kind {
    pub const NAMES: [&'static str; 4] = ["runs", "load", "capacity", "serve"];
    pub const ALL: [Kind; 4] = [Kind::Runs, Kind::Load, Kind::Capacity, Kind::Serve];

    pub fn table(self) -> crate::results::parts::Table {
        use crate::results::parts::Table;
        match self {
            Kind::Runs => Table::Runs,
            Kind::Load => Table::Load,
            Kind::Capacity => Table::Capacity,
            Kind::Serve => Table::Serve,
        }
    }

    /// The column of a row's id.
    pub(super) fn id_column(self) -> &'static str {
        match self {
            Kind::Runs => "run_id",
            Kind::Load => "load_id",
            Kind::Capacity => "capacity_id",
            Kind::Serve => "serve_id",
        }
    }

    /// Whether a row is one step of a job of several (a load's or a serving job's), each the job's
    /// cell at its concurrency or rate, a search's steps left out.
    pub(super) fn stepped(self) -> bool {
        matches!(self, Kind::Load | Kind::Serve)
    }

    /// The fields two rows must share to be compared.
    pub(super) fn workload(self) -> Vec<&'static str> {
        match self {
            Kind::Runs => WORKLOAD.to_vec(),
            Kind::Load => LOAD_JOB.iter().chain(&STEP).copied().collect(),
            Kind::Capacity => LOAD_JOB.iter().chain(&SEARCH).copied().collect(),
            Kind::Serve => SERVE_JOB.iter().chain(&STEP).copied().collect(),
        }
    }

    /// The throughput, its 95% interval's ends, the p50 and the p99 columns.
    pub(super) fn columns(
        self,
    ) -> (
        &'static str,
        Option<(&'static str, &'static str)>,
        Option<&'static str>,
        &'static str,
    ) {
        match self {
            Kind::Runs => (
                "throughput",
                Some(("throughput_ci_low", "throughput_ci_high")),
                Some("p50_ms"),
                "p99_ms",
            ),
            Kind::Load => ("achieved_qps", None, Some("p50_ms"), "p99_ms"),
            Kind::Capacity => ("capacity_qps", None, None, "p99_at_capacity_ms"),
            Kind::Serve => ("achieved_qps", None, Some("ttft_p50_ms"), "ttft_p99_ms"),
        }
    }
}

impl std::str::FromStr for Kind {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Kind, String> {
        match s {
            "runs" => Ok(Kind::Runs),
            "load" => Ok(Kind::Load),
            "capacity" => Ok(Kind::Capacity),
            "serve" => Ok(Kind::Serve),
            other => Err(format!("table `{other}`; valid tables: {}", Kind::NAMES.join(", "))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::{compare_rows, Selector};
    use super::*;
    use polars::prelude::*;

    /// Load rows of a server at concurrency 1 and 2 on two targets, a search's step beside them.
    fn load_rows() -> DataFrame {
        df!(
            "status" => vec!["ok"; 5],
            "cell_id" => ["f", "f", "s", "s", "s"],
            "load_id" => ["l1", "l2", "l3", "l4", "l5"],
            "target" => ["full", "full", "3g", "3g", "3g"],
            "model" => vec!["resnet50"; 5],
            "family" => vec!["server"; 5],
            "engine" => vec!["triton 2.51.0"; 5],
            "request_batch" => vec![8i64; 5],
            "concurrency" => [Some(1i64), Some(2), Some(1), Some(2), None],
            "offered_qps" => [None, None, None, None, Some(30.0)],
            "capacity_id" => [None, None, None, None, Some("c1")],
            "achieved_qps" => [40.0, 60.0, 30.0, 45.0, 29.0],
            "p50_ms" => [20.0, 30.0, 25.0, 40.0, 30.0],
            "p99_ms" => [25.0, 40.0, 30.0, 50.0, 35.0],
        )
        .unwrap()
    }

    #[test]
    fn a_server_s_steps_compare_by_concurrency_and_a_search_s_steps_stay_out() {
        let b: Selector = "target=full".parse().unwrap();
        let t: Selector = "target=3g".parse().unwrap();
        let c = compare_rows(&load_rows(), Kind::Load, &b, &t).unwrap();
        assert_eq!(c.rows.len(), 2, "concurrency 1 and 2; the search's step has no twin");
        let at = |n: &str| c.rows.iter().find(|r| r.cell["concurrency"] == n).unwrap();
        assert!((at("1").ratio - 0.75).abs() < 1e-12);
        assert!((at("2").ratio - 0.75).abs() < 1e-12);
        assert_eq!(at("2").target.p50_ms, Some(40.0));
        assert_eq!(c.target_only, 0);
        let text = c.render(super::super::render::Format::Text).unwrap();
        assert!(
            text.contains("family=server") && text.contains("engine=triton 2.51.0"),
            "{text}"
        );
    }

    #[test]
    fn rates_offered_by_other_arrival_processes_are_other_steps() {
        let mut rows = load_rows();
        let arrival = Column::new(
            "arrival".into(),
            ["poisson", "poisson", "constant", "poisson", "poisson"],
        );
        rows.with_column(arrival).unwrap();
        let b: Selector = "target=full".parse().unwrap();
        let t: Selector = "target=3g".parse().unwrap();
        let c = compare_rows(&rows, Kind::Load, &b, &t).unwrap();
        assert_eq!(
            c.rows.len(),
            1,
            "concurrency 1 arrived otherwise on the 3g: only concurrency 2 matches"
        );
        assert_eq!(c.rows[0].cell["concurrency"], "2");
        assert_eq!((c.baseline_only, c.target_only), (1, 1));
    }

    #[test]
    fn capacities_compare_within_one_objective() {
        let rows = df!(
            "status" => vec!["ok"; 3],
            "cell_id" => ["f", "s", "s2"],
            "capacity_id" => ["c1", "c2", "c3"],
            "target" => ["full", "1g", "1g"],
            "model" => vec!["resnet50"; 3],
            "slo_p99_ms" => [50.0, 50.0, 100.0],
            "capacity_qps" => [Some(22.5), Some(17.7), Some(30.0)],
            "p99_at_capacity_ms" => [46.1, 48.2, 90.0],
        )
        .unwrap();
        let b: Selector = "target=full".parse().unwrap();
        let t: Selector = "target=1g".parse().unwrap();
        let c = compare_rows(&rows, Kind::Capacity, &b, &t).unwrap();
        assert_eq!(c.rows.len(), 1);
        assert!((c.rows[0].ratio - 17.7 / 22.5).abs() < 1e-12);
        assert_eq!(c.rows[0].target.p50_ms, None);
        assert_eq!(c.target_only, 1, "another objective is another search");
        let text = c.render(super::super::render::Format::Md).unwrap();
        assert!(text.contains("| - |"), "a capacity has no p50: {text}");
    }

    #[test]
    fn a_table_is_named_by_its_name() {
        assert_eq!("load".parse::<Kind>(), Ok(Kind::Load));
        assert_eq!("serve".parse::<Kind>(), Ok(Kind::Serve));
        assert!("plans"
            .parse::<Kind>()
            .unwrap_err()
            .contains("runs, load, capacity, serve"));
    }

    #[test]
    fn serving_steps_compare_engine_with_engine_and_server_with_server() {
        let rows = df!(
            "status" => vec!["ok"; 5],
            "cell_id" => ["a", "b", "c", "d", "d"],
            "serve_id" => ["s1", "s2", "s3", "s4", "s5"],
            "target" => ["full", "3g", "full", "3g", "3g"],
            "model" => ["llama_3_2_1b", "llama_3_2_1b", "llama", "llama", "llama"],
            "family" => ["llama", "llama", "server", "server", "server"],
            "engine" => [None, None, Some("llamacpp"), Some("llamacpp"), Some("llamacpp")],
            "prompt_len" => vec!["512"; 5],
            "output_len" => vec!["128"; 5],
            "concurrency" => [None, None, Some(4i64), Some(4), None],
            "offered_qps" => [Some(2.0), Some(2.0), None, None, Some(3.0)],
            "capacity_id" => [None, None, None, None, Some("c")],
            "achieved_qps" => [2.0, 1.5, 4.0, 2.0, 2.9],
            "ttft_p50_ms" => [30.0, 45.0, 20.0, 40.0, 50.0],
            "ttft_p99_ms" => [60.0, 90.0, 40.0, 80.0, 99.0],
        )
        .unwrap();
        let b: Selector = "target=full".parse().unwrap();
        let t: Selector = "target=3g".parse().unwrap();
        let c = compare_rows(&rows, Kind::Serve, &b, &t).unwrap();
        assert_eq!(
            c.rows.len(),
            2,
            "the engine at 2/s, the server at concurrency 4; the search's step stays out"
        );
        let server = c.rows.iter().find(|r| r.cell["concurrency"] == "4").unwrap();
        assert!((server.ratio - 0.5).abs() < 1e-12);
        assert_eq!(server.target.p50_ms, Some(40.0), "TTFT's p50");
    }
}
