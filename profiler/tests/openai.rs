//! `migprof load --endpoint --protocol openai`: a language model's server over streaming
//! completions. A real one, llama.cpp's server on a tiny model the test writes with the `gguf`
//! package (.ci/run builds it: scripts/setup-llama-server.sh, naming its binary in
//! MIGPROF_LLAMA_SERVER and its python in MIGPROF_OPENAI_PYTHON), started pinned by migprof, with
//! completions and chat, a sweep's server entry, and the official `openai` client beside migprof;
//! and a server of the test's own for what a real one will not do on demand: die mid-stream, send
//! chunks that are not JSON, refuse, stop short, coalesce tokens.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Output;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

/// How the test's own server answers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    /// Every token asked for, one chunk each, usage last.
    Whole,
    /// Half the tokens asked for, then `finish_reason: stop` (a server that ignores `min_tokens`).
    Short,
    /// Two tokens a chunk.
    Coalesced,
    /// Every third request: two chunks, then the connection closes without `[DONE]`.
    Dies,
    /// Every third request: a chunk that is not JSON.
    Malformed,
    /// Prompts over 40 tokens: HTTP 400.
    Refuses,
}

/// An OpenAI-compatible server of the test's own on a port of its own, answering until the test
/// ends; each token a millisecond.
fn fake_server(mode: Mode) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let served = Arc::new(AtomicUsize::new(0));
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let served = Arc::clone(&served);
            std::thread::spawn(move || {
                let _ = answer(stream, mode, &served);
            });
        }
    });
    url
}

fn answer(mut stream: TcpStream, mode: Mode, served: &AtomicUsize) -> std::io::Result<()> {
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut request_line = String::new();
    reader.read_line(&mut request_line)?;
    let mut length = 0;
    loop {
        let mut line = String::new();
        reader.read_line(&mut line)?;
        if line.trim().is_empty() {
            break;
        }
        if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
            length = v.trim().parse().unwrap_or(0);
        }
    }
    let mut body = vec![0; length];
    reader.read_exact(&mut body)?;
    if request_line.starts_with("GET /v1/models") {
        let list = r#"{"object":"list","data":[{"id":"fake","object":"model","owned_by":"fake-engine"}]}"#;
        return write!(
            stream,
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{list}",
            list.len()
        );
    }
    let body: serde_json::Value = serde_json::from_slice(&body).unwrap_or_default();
    let asked = body["max_tokens"].as_u64().unwrap_or(1) as usize;
    let prompt = body["prompt"].as_array().map_or(0, |p| p.len());
    let n = served.fetch_add(1, Ordering::Relaxed);
    if mode == Mode::Refuses && prompt > 40 {
        let said = r#"{"error":{"message":"the prompt is longer than the context"}}"#;
        return write!(
            stream,
            "HTTP/1.1 400 Bad Request\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{said}",
            said.len()
        );
    }
    write!(
        stream,
        "HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
    )?;
    let given = match mode {
        Mode::Short => asked.div_ceil(2),
        _ => asked,
    };
    let per_chunk = if mode == Mode::Coalesced { 2 } else { 1 };
    let mut sent = 0;
    while sent < given {
        std::thread::sleep(Duration::from_millis(per_chunk as u64));
        let k = per_chunk.min(given - sent);
        write!(
            stream,
            "data: {{\"choices\":[{{\"index\":0,\"text\":\"{}\",\"finish_reason\":null}}]}}\n\n",
            "ab".repeat(k)
        )?;
        stream.flush()?;
        sent += k;
        let unlucky = n % 3 == 2;
        if mode == Mode::Dies && unlucky && sent >= 2 {
            return Ok(());
        }
        if mode == Mode::Malformed && unlucky && sent >= 2 {
            write!(stream, "data: {{\"choices\":[{{\"te\n\n")?;
            break;
        }
    }
    let reason = if given < asked { "stop" } else { "length" };
    write!(
        stream,
        "data: {{\"choices\":[{{\"index\":0,\"text\":\"\",\"finish_reason\":\"{reason}\"}}],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{given}}}}}\n\ndata: [DONE]\n\n"
    )?;
    stream.flush()
}

fn load(out: &Path, args: &[&str]) -> Output {
    migprof()
        .args(["load", "--device", "cpu", "--protocol", "openai", "--out"])
        .arg(out)
        .args(args)
        .output()
        .expect("migprof runs")
}

/// A short step of requests of 16-token prompts and 8-token outputs.
const SHORT: [&str; 10] = [
    "--prompt-len",
    "16",
    "--output-len",
    "8",
    "--warmup",
    "0.3",
    "--duration",
    "1.5",
    "--drain",
    "5",
];

/// `load` of short steps with `args`, which must succeed.
fn short_steps(out: &Path, args: &[&str]) -> Output {
    let mut all = args.to_vec();
    all.extend(SHORT);
    let o = load(out, &all);
    assert!(o.status.success(), "{}", text(&o));
    o
}

fn rows(out: &Path, table: Table) -> polars::prelude::DataFrame {
    read_table(out, table).unwrap()
}

#[test]
fn a_server_s_steps_are_serving_rows_with_its_name_and_exact_counts() {
    let url = fake_server(Mode::Whole);
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let args = vec!["--endpoint", &url, "--concurrency", "1,3", "--qps", "20"];
    let o = short_steps(&out, &args);
    assert!(text(&o).contains("fake-engine model `fake`"), "{}", text(&o));
    let serve = rows(&out, Table::Serve);
    assert_eq!(serve.height(), 3);
    assert_eq!(strings(&serve, "engine"), vec!["fake-engine"; 3]);
    assert_eq!(strings(&serve, "family"), vec!["server"; 3]);
    assert_eq!(strings(&serve, "api"), vec!["completions"; 3]);
    assert_eq!(strings(&serve, "prompt_form"), vec!["ids"; 3]);
    assert_eq!(numbers(&serve, "concurrency"), vec![Some(1.0), Some(3.0), None]);
    assert_eq!(numbers(&serve, "offered_qps"), vec![None, None, Some(20.0)]);
    assert_eq!(f64s(&serve, "failed_requests"), vec![0.0; 3]);
    assert_eq!(f64s(&serve, "short_requests"), vec![0.0; 3]);
    assert_eq!(strings(&serve, "tokens_counted_by"), vec!["usage"; 3]);
    // What only migprof's batcher knows is null.
    assert!(numbers(&serve, "kv_blocks").iter().all(Option::is_none));
    assert!(numbers(&serve, "batch_mean").iter().all(Option::is_none));
    // The more in flight, the more served: each request takes about 8 ms here.
    let qps = f64s(&serve, "achieved_qps");
    assert!(qps[1] > 1.5 * qps[0], "{qps:?}");
    let tpot = f64s(&serve, "tpot_p50_ms");
    assert!(tpot.iter().all(|&t| (0.9..5.0).contains(&t)), "{tpot:?}");
    let requests = rows(&out, Table::ServeRequests);
    for name in ["prompt_tokens", "output_tokens", "tokens_out", "chunks"] {
        let want = if name == "prompt_tokens" { 16.0 } else { 8.0 };
        assert!(f64s(&requests, name).iter().all(|&v| v == want), "{name}");
    }
    assert!(numbers(&requests, "ttft_ms").iter().all(Option::is_some));
    // Every column is in the schema reference, and the folder checks clean.
    let schema = repo_file("docs/schema.md");
    for table in [Table::Serve, Table::ServeRequests] {
        let names = columns(&rows(&out, table));
        let missing = undocumented(&schema, names.iter().map(String::as_str));
        assert!(missing.is_empty(), "docs/schema.md lacks {missing:?}");
    }
    let check = migprof().arg("check").arg(&out).output().unwrap();
    assert!(
        check.status.success() && text(&check).contains("3 serving step(s)"),
        "{}",
        text(&check)
    );
}

#[test]
fn streams_that_break_off_or_are_not_json_are_failed_requests_that_miss_the_objectives() {
    for (mode, reason) in [
        (Mode::Dies, "ended without [DONE] after 2 chunk(s)"),
        (Mode::Malformed, "not JSON after 2 chunk(s)"),
    ] {
        let url = fake_server(mode);
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("D");
        let args = vec![
            "--endpoint",
            &url,
            "--concurrency",
            "2",
            "--slo-ttft-p99-ms",
            "1000",
            "--slo-tpot-p99-ms",
            "1000",
        ];
        short_steps(&out, &args);
        let serve = rows(&out, Table::Serve);
        let (failed, requests) = (f64s(&serve, "failed_requests")[0], f64s(&serve, "requests")[0]);
        // A third of the requests fail.
        assert!(failed >= 1.0 && failed < requests / 2.0, "{failed} of {requests}");
        let failures = strings(&serve, "failures")[0].clone();
        assert!(failures.contains(reason), "{failures}");
        assert_eq!(
            strings(&serve, "meets_slo"),
            vec!["false"],
            "a step with failures misses"
        );
        assert!(strings(&serve, "note")[0].contains("failed and did not finish"));
        let failure = strings(&rows(&out, Table::ServeRequests), "failure");
        assert!(failure.iter().any(|f| f.contains(reason)));
    }
}

#[test]
fn short_and_coalesced_answers_are_counted_and_said() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let url = fake_server(Mode::Short);
    let args = vec!["--endpoint", &url, "--concurrency", "1"];
    let o = short_steps(&out, &args);
    assert!(text(&o).contains("came back with 4 of the 8 tokens"), "{}", text(&o));
    let serve = rows(&out, Table::Serve);
    assert_eq!(f64s(&serve, "short_requests"), f64s(&serve, "requests"));
    assert!(strings(&serve, "note")[0].contains("does not honour them"));
    let requests = rows(&out, Table::ServeRequests);
    assert!(f64s(&requests, "tokens_out").iter().all(|&t| t == 4.0));
    assert!(strings(&requests, "finished").iter().all(|f| f == "true"));

    let out = dir.path().join("C");
    let url = fake_server(Mode::Coalesced);
    let args = vec!["--endpoint", &url, "--concurrency", "1"];
    short_steps(&out, &args);
    let serve = rows(&out, Table::Serve);
    assert!(strings(&serve, "note")[0].contains("ITL within a chunk is estimated"));
    let requests = rows(&out, Table::ServeRequests);
    assert!(f64s(&requests, "chunks").iter().all(|&c| c == 4.0));
    assert!(f64s(&requests, "tokens_out").iter().all(|&t| t == 8.0));
}

#[test]
fn a_refusal_and_settings_of_the_other_protocol_are_named_before_any_step() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let url = fake_server(Mode::Refuses);
    let o = load(&out, &["--endpoint", &url, "--concurrency", "1", "--prompt-len", "64"]);
    assert!(!o.status.success());
    let said = text(&o);
    assert!(
        said.contains("the first request to model `fake` (64 prompt tokens"),
        "{said}"
    );
    assert!(
        said.contains("HTTP 400") && said.contains("longer than the context"),
        "{said}"
    );
    assert!(read_table(&out, Table::Serve).unwrap().height() == 0);
    for (args, named) in [
        (vec!["--batch", "4"], "--batch applies to the kserve protocol"),
        (vec!["--max-seqs", "8"], "--max-seqs is migprof's continuous batcher's"),
        (vec!["--slo-p99-ms", "50"], "--slo-p99-ms is for models served one pass"),
        (vec!["--api", "chat", "--prompt-form", "ids"], "a chat message is text"),
        (vec!["--search"], "--slo-ttft-p99-ms and --slo-tpot-p99-ms"),
    ] {
        let mut all = vec!["--endpoint", &url];
        all.extend(args);
        let o = load(&out, &all);
        assert!(!o.status.success());
        assert!(text(&o).contains(named), "{named}: {}", text(&o));
    }
    let o = migprof()
        .args([
            "load",
            "--device",
            "cpu",
            "--endpoint",
            &url,
            "--prompt-len",
            "8",
            "--concurrency",
            "1",
        ])
        .output()
        .unwrap();
    assert!(
        text(&o).contains("--prompt-len is for language models (--protocol openai), not a KServe server"),
        "{}",
        text(&o)
    );
}

/// The llama.cpp server CI builds; fails, never passes, where there is none.
fn llama_server() -> (String, String) {
    let server = std::env::var("MIGPROF_LLAMA_SERVER").unwrap_or_default();
    let python = std::env::var("MIGPROF_OPENAI_PYTHON").unwrap_or_default();
    assert!(
        Path::new(&server).is_file() && Path::new(&python).is_file(),
        "MIGPROF_LLAMA_SERVER and MIGPROF_OPENAI_PYTHON name no llama.cpp server and python: make them with scripts/setup-llama-server.sh DIR and set them to what it prints"
    );
    (server, python)
}

/// The tiny model in `dir`, written by the repository's script with the `gguf` package.
fn tiny_model(python: &str, dir: &Path) -> PathBuf {
    let path = dir.join("tiny.gguf");
    let o = std::process::Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/write_tiny_gguf.py"))
        .arg(&path)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    path
}

/// Held by each test of the llama.cpp server: one at a time, on a machine of two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

/// The command that starts llama.cpp's server on `port` with four slots and one thread (two
/// threads wait on each other on a busy machine of two cores).
fn llama_cmd(server: &str, model: &Path, port: u16) -> String {
    format!(
        "{server} -m {} --alias tiny --host 127.0.0.1 --port {port} -c 4096 -np 4 -t 1",
        model.display()
    )
}

#[test]
#[ignore = "needs llama.cpp's server (.ci/run builds it: scripts/setup-llama-server.sh)"]
fn a_llama_cpp_server_migprof_starts_is_measured_on_completions_and_chat_and_stopped() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, python) = llama_server();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(&python, dir.path());
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let out = dir.path().join("D");
    let cmd = llama_cmd(&server, &model, port);
    let args = vec![
        "--endpoint",
        &url,
        "--server-cmd",
        &cmd,
        "--concurrency",
        "1,2",
        "--qps",
        "10",
    ];
    let o = short_steps(&out, &args);
    assert!(text(&o).contains("llamacpp model `tiny`"), "{}", text(&o));
    let serve = rows(&out, Table::Serve);
    assert_eq!(serve.height(), 3);
    assert_eq!(strings(&serve, "engine"), vec!["llamacpp"; 3]);
    assert_eq!(strings(&serve, "server_command"), vec![cmd.clone(); 3]);
    assert_eq!(f64s(&serve, "failed_requests"), vec![0.0; 3]);
    assert_eq!(f64s(&serve, "short_requests"), vec![0.0; 3]);
    // Token-id prompts are exactly as long as drawn (llama.cpp adds no BOS before ids), and each
    // token of the test tokenizer is a chunk of its own.
    let requests = rows(&out, Table::ServeRequests);
    assert!(f64s(&requests, "prompt_tokens").iter().all(|&p| p == 16.0));
    assert!(f64s(&requests, "tokens_out").iter().all(|&t| t == 8.0));
    assert!(f64s(&requests, "chunks").iter().all(|&c| c == 8.0));
    assert!(processes_of(&port.to_string()).is_empty(), "the server is stopped");

    // Chat: text prompts, which the server counts with its template's tokens.
    let out = dir.path().join("C");
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let cmd = llama_cmd(&server, &model, port);
    let args = vec![
        "--endpoint",
        &url,
        "--server-cmd",
        &cmd,
        "--api",
        "chat",
        "--concurrency",
        "2",
    ];
    short_steps(&out, &args);
    let serve = rows(&out, Table::Serve);
    assert_eq!(strings(&serve, "prompt_form"), vec!["text"]);
    let requests = rows(&out, Table::ServeRequests);
    assert!(
        f64s(&requests, "prompt_tokens").iter().all(|&p| p > 16.0),
        "the template's tokens counted"
    );
    assert!(f64s(&requests, "tokens_out").iter().all(|&t| t == 8.0));
    assert!(processes_of(&port.to_string()).is_empty(), "the server is stopped");
}

/// Processes whose command line holds `needle`, after a few seconds for them to end.
fn processes_of(needle: &str) -> Vec<u32> {
    for _ in 0..50 {
        let left: Vec<u32> = std::fs::read_dir("/proc")
            .unwrap()
            .flatten()
            .filter_map(|e| {
                let pid: u32 = e.file_name().to_string_lossy().parse().ok()?;
                let cmdline = std::fs::read(e.path().join("cmdline")).ok()?;
                let stat = std::fs::read_to_string(e.path().join("stat")).unwrap_or_default();
                let zombie = stat
                    .rsplit_once(')')
                    .is_some_and(|(_, r)| r.trim_start().starts_with('Z'));
                let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
                (cmdline.contains("llama-server") && cmdline.contains(needle) && !zombie).then_some(pid)
            })
            .collect();
        if left.is_empty() {
            return left;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    vec![0]
}

/// What one client measured at a concurrency: requests per second and TTFT's p50, ms.
type Measured = (f64, f64);

/// `migprof load` at `concurrency` against the server at `url`.
fn migprof_closed_loop(url: &str, concurrency: &str, out: &Path) -> Measured {
    let args = [
        "--endpoint",
        url,
        "--concurrency",
        concurrency,
        "--warmup",
        "1",
        "--duration",
        "6",
        "--prompt-len",
        "64",
        "--output-len",
        "48",
    ];
    let o = load(out, &args);
    assert!(o.status.success(), "{}", text(&o));
    let serve = rows(out, Table::Serve);
    (f64s(&serve, "achieved_qps")[0], f64s(&serve, "ttft_p50_ms")[0])
}

/// The reference client on the `openai` package at `concurrency`, its prompts of its own `seed`.
fn openai_closed_loop(python: &str, url: &str, concurrency: &str, seed: &str) -> Measured {
    let client = std::process::Command::new(python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../benches/openai/reference_client.py"))
        .args([
            "--base-url",
            &format!("{url}/v1"),
            "--concurrency",
            concurrency,
            "--seed",
            seed,
        ])
        .args([
            "--warmup",
            "1",
            "--duration",
            "5",
            "--vocab",
            "256",
            "--prompt-len",
            "64",
            "--output-len",
            "48",
        ])
        .output()
        .unwrap();
    assert!(client.status.success(), "{}", text(&client));
    let theirs: serde_json::Value = serde_json::from_slice(&client.stdout).unwrap();
    (
        theirs["requests_per_s"].as_f64().unwrap(),
        theirs["ttft_p50_ms"].as_f64().unwrap(),
    )
}

#[test]
#[ignore = "needs llama.cpp's server (.ci/run builds it: scripts/setup-llama-server.sh)"]
fn migprof_agrees_with_the_openai_client_on_ttft_and_throughput() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, python) = llama_server();
    let dir = tempfile::tempdir().unwrap();
    // Wide enough that a token takes the server milliseconds: the clients' own time is then small
    // beside it.
    let model = dir.path().join("wide.gguf");
    let o = std::process::Command::new(&python)
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/write_tiny_gguf.py"))
        .arg(&model)
        .args(["--n-embd", "512", "--n-layer", "4"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let port = free_port();
    let url = format!("http://127.0.0.1:{port}");
    let mut started = std::process::Command::new("sh")
        .args(["-c", &format!("exec {}", llama_cmd(&server, &model, port))])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let ready = (0..300).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        std::net::TcpStream::connect(("127.0.0.1", port)).is_ok()
    });
    assert!(ready, "llama.cpp's server did not start");
    std::thread::sleep(Duration::from_secs(1));
    let mut said = Vec::new();
    let mut agree = true;
    for concurrency in ["1", "2"] {
        // Two rounds of each, in turn: how far two runs of one client differ is the noise the two
        // clients are compared within, on a machine of two cores the server shares.
        let mut ours = Vec::new();
        let mut theirs = Vec::new();
        for round in 0..2 {
            theirs.push(openai_closed_loop(
                &python,
                &url,
                concurrency,
                &format!("{}", 10 + round),
            ));
            ours.push(migprof_closed_loop(
                &url,
                concurrency,
                &dir.path().join(format!("D{concurrency}-{round}")),
            ));
        }
        // TTFT at concurrency 1 only: at 2, requests of one length fall in step (arriving together,
        // prefilled together) or out of step by chance, in either client, and their TTFTs differ
        // by a prefill from run to run.
        let measures: &[(&str, usize)] = match concurrency {
            "1" => &[("requests/s", 0), ("TTFT p50 ms", 1)],
            _ => &[("requests/s", 0)],
        };
        for &(what, pick) in measures {
            let value = |m: &Measured| if pick == 0 { m.0 } else { m.1 };
            let (o, t) = (
                ours.iter().map(value).collect::<Vec<f64>>(),
                theirs.iter().map(value).collect::<Vec<f64>>(),
            );
            let (om, tm) = ((o[0] + o[1]) / 2.0, (t[0] + t[1]) / 2.0);
            let noise = ((o[0] - o[1]).abs() / om).max((t[0] - t[1]).abs() / tm).max(0.1);
            let apart = (om / tm - 1.0).abs();
            said.push(format!(
                "concurrency {concurrency} {what}: migprof {o:.2?}, openai {t:.2?}: apart {:.0}%, rounds' noise {:.0}%",
                apart * 100.0,
                noise * 100.0
            ));
            agree &= apart <= 2.0 * noise;
        }
    }
    let _ = started.kill();
    let _ = started.wait();
    assert!(agree, "{}", said.join("\n"));
    eprintln!("{}", said.join("\n"));
}

#[test]
#[ignore = "needs llama.cpp's server (.ci/run builds it: scripts/setup-llama-server.sh)"]
fn a_sweep_starts_a_language_model_s_server_on_its_target_and_finds_it_done_when_run_again() {
    let _alone = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    let (server, python) = llama_server();
    require_pyarrow();
    let dir = tempfile::tempdir().unwrap();
    let model = tiny_model(&python, dir.path());
    let out = dir.path().join("D");
    let port = free_port();
    let file = dir.path().join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            r#"
name = "llm"
[defaults]
timeout_secs = 300
[[targets]]
label = "host"
device = "cpu"
[[servers]]
endpoint = "http://127.0.0.1:{port}"
server_cmd = '{}'
served_model = "tiny"
protocol = "openai"
server_timeout = 60
concurrency = [1, 2]
prompt_len = 16
output_len = 8
warmup_secs = 0.3
duration_secs = 1.5
drain_secs = 5
"#,
            llama_cmd(&server, &model, port)
        ),
    )
    .unwrap();
    let sweep = || {
        migprof()
            .args(["sweep", file.to_str().unwrap(), "--out", out.to_str().unwrap()])
            .output()
            .unwrap()
    };
    let o = sweep();
    assert!(o.status.success(), "{}", text(&o));
    let serve = rows(&out, Table::Serve);
    assert_eq!(serve.height(), 2, "{}", text(&o));
    assert_eq!(strings(&serve, "sweep"), vec!["llm"; 2]);
    assert_eq!(strings(&serve, "target"), vec!["host"; 2]);
    let ids = strings(&serve, "cell_id");
    assert_eq!(ids[0], ids[1], "one cell, a row per step");
    assert!(processes_of(&port.to_string()).is_empty(), "the server is stopped");
    // Read as users read it: pyarrow, a duckdb glob and a polars scan.
    let script = r#"
import sys, duckdb, polars as pl, pyarrow.parquet as pq
d = sys.argv[1]
t = pq.read_table(f"{d}/serve").to_pylist()
assert sorted(r["concurrency"] for r in t) == [1, 2], t
assert all(r["engine"] == "llamacpp" and r["offered_qps"] is None and r["failed_requests"] == 0 for r in t), t
n, tokens = duckdb.sql(f"select count(*), sum(tokens_out) from '{d}/serve_requests/*.parquet'").fetchall()[0]
assert n > 0 and tokens == 8 * n, (n, tokens)
df = pl.scan_parquet(f"{d}/serve/*.parquet").collect()
assert df["protocol"].to_list() == ["openai", "openai"] and df["ttft_p99_ms"].null_count() == 0, df
print("read whole")
"#;
    let read = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&out)
        .output()
        .unwrap();
    assert!(read.status.success(), "{}", text(&read));
    let o = sweep();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("1 skipped (done already)"), "{}", text(&o));
    assert_eq!(rows(&out, Table::Serve).height(), 2);
}
