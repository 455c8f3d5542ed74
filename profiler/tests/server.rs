//! `migprof load --endpoint` against a real Triton Inference Server (PyTriton's tritonserver, in the
//! environment scripts/setup-triton-venv.sh makes; .ci/run makes it and names its python in
//! MIGPROF_TRITON_PYTHON): the server started pinned and stopped with its whole tree, `kill -9`
//! included; concurrency and rate steps beside Triton's own client at the same concurrency; and the
//! ways a server can fail, each with a clear error.

use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use migprof::results::parts::{read_table, Table};

mod common;
use common::*;

/// Held by each test of a Triton server: they run one at a time, so that the timing of one is not
/// the load of another on a machine of two cores.
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

/// The Triton environment's python; fails, never passes, where there is none.
fn triton_python() -> String {
    let python = std::env::var("MIGPROF_TRITON_PYTHON").unwrap_or_default();
    assert!(
        !python.is_empty() && Path::new(&python).exists(),
        "MIGPROF_TRITON_PYTHON names no python: make the environment with scripts/setup-triton-venv.sh DIR and set it to what that prints"
    );
    python
}

/// Three ports nobody listens on now.
fn free_ports() -> [u16; 3] {
    let listeners: Vec<TcpListener> = (0..3).map(|_| TcpListener::bind("127.0.0.1:0").unwrap()).collect();
    let ports: Vec<u16> = listeners.iter().map(|l| l.local_addr().unwrap().port()).collect();
    [ports[0], ports[1], ports[2]]
}

/// The command line of the test server on `ports`.
fn server_cmd(python: &str, ports: [u16; 3], extra: &str) -> String {
    format!(
        "{python} {} --http-port {} --grpc-port {} --metrics-port {} {extra}",
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../scripts/triton_server.py")
            .display(),
        ports[0],
        ports[1],
        ports[2]
    )
}

fn load(out: &Path, args: &[&str]) -> Output {
    migprof()
        .args(["load", "--device", "cpu", "--out"])
        .arg(out)
        .args(args)
        .output()
        .expect("migprof runs")
}

/// Processes whose command line holds `needle` (this test's own ports tell its server apart).
fn processes_with(needle: &str) -> Vec<u32> {
    let mut pids = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<u32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        let state = std::fs::read_to_string(entry.path().join("stat")).unwrap_or_default();
        let zombie = state
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with('Z'));
        if cmdline.contains(needle) && !zombie && pid != std::process::id() {
            pids.push(pid);
        }
    }
    pids
}

/// Waits up to `within` for no process to hold `needle`; the ones left.
fn gone(needle: &str, within: Duration) -> Vec<u32> {
    let started = Instant::now();
    loop {
        let left = processes_with(needle);
        if left.is_empty() || started.elapsed() > within {
            return left;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

/// A server started by the test itself, ready, stopped when dropped.
struct Server {
    child: Child,
    port: u16,
}

impl Server {
    /// Starts the test server with `models`, and waits until each is ready; fails with its last
    /// lines if it ends or is not ready within 4 minutes. PyTriton's model proxies meet their
    /// backend through a socket handshake that a machine of two cores busy with other tests can
    /// miss (`load failed for model …: Connection refused`): a server that ended so is started
    /// again, three times at most, what it left stopped first.
    fn start(python: &str, models: &str, extra: &str) -> Server {
        for attempt in 1..=3 {
            match Server::try_start(python, models, extra) {
                Ok(server) => return server,
                Err(why) if attempt < 3 && why.contains("load failed for model") => {
                    eprintln!("the test's Triton server did not load its models (attempt {attempt}); starting it again")
                }
                Err(why) => panic!("{why}"),
            }
        }
        unreachable!("the third attempt returns or panics")
    }

    fn try_start(python: &str, models: &str, extra: &str) -> Result<Server, String> {
        let ports = free_ports();
        let log = std::env::temp_dir().join(format!("migprof-test-triton-{}.log", ports[0]));
        let file = std::fs::File::create(&log).unwrap();
        let mut child = Command::new("sh")
            .args([
                "-c",
                &format!("exec {} --models {models} {extra}", server_cmd(python, ports, "")),
            ])
            .stdout(file.try_clone().unwrap())
            .stderr(file)
            .spawn()
            .unwrap();
        let started = Instant::now();
        let ready = |port: u16| {
            models
                .split(',')
                .all(|m| answers(port, &format!("/v2/models/{m}/ready")))
        };
        while !ready(ports[0]) {
            let ended = child.try_wait().unwrap();
            if ended.is_some() || started.elapsed() > Duration::from_secs(240) {
                let text = std::fs::read_to_string(&log).unwrap_or_default();
                let tail: Vec<&str> = text.lines().rev().take(30).collect();
                let _ = child.kill();
                let _ = child.wait();
                for pid in gone(&format!("--http-port {}", ports[0]), Duration::from_secs(10)) {
                    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
                }
                return Err(format!(
                    "the test's Triton server {} ({ended:?}); its last lines:\n{}",
                    if ended.is_some() {
                        "ended"
                    } else {
                        "was not ready in 240 s"
                    },
                    tail.into_iter().rev().collect::<Vec<_>>().join("\n")
                ));
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(Server { child, port: ports[0] })
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }
}

/// Whether GET `path` on the local `port` answers 200.
fn answers(port: u16, path: &str) -> bool {
    let address = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    std::net::TcpStream::connect_timeout(&address, Duration::from_secs(2))
        .and_then(|mut s| {
            use std::io::{Read, Write};
            // A server that keeps the connection open must not hold the wait forever.
            s.set_read_timeout(Some(Duration::from_secs(2)))?;
            s.write_all(format!("GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n").as_bytes())?;
            let mut answer = String::new();
            s.read_to_string(&mut answer)?;
            Ok(answer.starts_with("HTTP/1.1 200"))
        })
        .unwrap_or(false)
}

impl Drop for Server {
    fn drop(&mut self) {
        // SIGTERM, which the test server takes as a Ctrl-C (a SIGINT may be ignored where the test
        // was started in the background): PyTriton stops tritonserver on its way out; what is left
        // after 20 s is killed.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGTERM) };
        let needle = format!("--http-port {}", self.port);
        for pid in gone(&needle, Duration::from_secs(20)) {
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
        }
        let _ = self.child.wait();
    }
}

#[test]
#[ignore = "needs the Triton environment (.ci/run makes it: scripts/setup-triton-venv.sh)"]
fn a_server_migprof_starts_is_measured_at_each_concurrency_and_rate_and_stopped_whole() {
    let _alone = one_at_a_time();
    let python = triton_python();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let ports = free_ports();
    let cmd = server_cmd(&python, ports, "--delay-ms 5 --models dense");
    let o = load(
        &out,
        &[
            "--endpoint",
            &format!("http://127.0.0.1:{}", ports[0]),
            "--server-cmd",
            &cmd,
            "--served-model",
            "dense",
            "--concurrency",
            "1,2,3",
            "--qps",
            "50",
            "--warmup",
            "0.5",
            "--duration",
            "2",
            "--batch",
            "4",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let log = text(&o);
    assert!(
        log.contains("server: ready after") && log.contains("server: stopped"),
        "{log}"
    );
    let rows = read_table(&out, Table::Load).unwrap();
    assert_eq!(rows.height(), 4, "{log}");
    let concurrency: Vec<Option<i64>> = rows.column("concurrency").unwrap().i64().unwrap().iter().collect();
    let mut got = concurrency.clone();
    got.sort();
    assert_eq!(got, vec![None, Some(1), Some(2), Some(3)]);
    assert!(
        strings(&rows, "engine").iter().all(|e| e.starts_with("triton ")),
        "{:?}",
        strings(&rows, "engine")
    );
    assert!(strings(&rows, "model").iter().all(|m| m == "dense"));
    assert!(strings(&rows, "family").iter().all(|f| f == "server"));
    assert!(strings(&rows, "protocol").iter().all(|p| p == "kserve"));
    assert!(strings(&rows, "request_inputs").iter().all(|i| i == "x [4, 16] FP32"));
    assert!(strings(&rows, "server_command").iter().all(|c| c == &cmd));
    let failed: Vec<Option<i64>> = rows.column("failed_requests").unwrap().i64().unwrap().iter().collect();
    assert!(failed.iter().all(|f| *f == Some(0)), "{failed:?}");
    // Every request sleeps 5 ms in the server.
    assert!(
        f64s(&rows, "p50_ms").iter().all(|&p| p >= 5.0),
        "{:?}",
        f64s(&rows, "p50_ms")
    );
    let offered = numbers(&rows, "offered_qps");
    for (c, q) in concurrency.iter().zip(&offered) {
        assert_eq!(
            c.is_none(),
            q.is_some(),
            "a rate step offers its rate, a concurrency step none"
        );
    }
    // Nothing of the server is left: not the Python parent, not tritonserver.
    assert_eq!(
        gone(&format!("{}", ports[0]), Duration::from_secs(15)),
        Vec::<u32>::new()
    );
    let kept = std::fs::read_dir(out.join("servers")).unwrap().count();
    assert_eq!(kept, 1, "the server's output is kept beside the results");
}

/// Triton's own client in a closed loop at `concurrency`, one process per request in flight (as
/// perf_analyzer's threads: Python threads would share one interpreter lock on a machine whose
/// cores the server also uses): requests per second and p50 in ms.
fn tritonclient_loop(python: &str, url: &str, concurrency: usize, seconds: f64) -> (f64, f64) {
    let script = r#"
import sys, time
import numpy as np
import tritonclient.http as http
url, start, seconds = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
x = np.random.default_rng(0).random((4, 16), dtype=np.float32)
client = http.InferenceServerClient(url)
inp = http.InferInput("x", list(x.shape), "FP32")
inp.set_data_from_numpy(x, binary_data=True)
out = [http.InferRequestedOutput("y", binary_data=True)]
latencies = []
while time.time() < start + seconds:
    t = time.perf_counter()
    client.infer("dense", [inp], outputs=out).as_numpy("y")
    if time.time() >= start:
        latencies.append(time.perf_counter() - t)
print(" ".join(str(l) for l in latencies))
"#;
    let host = url.trim_start_matches("http://");
    // Every client starts measuring at once, after a second of warm-up.
    let start = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
        + 1.0;
    let clients: Vec<Child> = (0..concurrency)
        .map(|_| {
            Command::new(python)
                .args(["-c", script, host, &start.to_string(), &seconds.to_string()])
                .stdout(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let mut latencies: Vec<f64> = Vec::new();
    for c in clients {
        let o = c.wait_with_output().unwrap();
        assert!(o.status.success(), "{}", text(&o));
        latencies.extend(
            String::from_utf8_lossy(&o.stdout)
                .split_whitespace()
                .map(|x| x.parse::<f64>().unwrap()),
        );
    }
    latencies.sort_by(f64::total_cmp);
    (latencies.len() as f64 / seconds, latencies[latencies.len() / 2] * 1e3)
}

#[test]
#[ignore = "needs the Triton environment (.ci/run makes it: scripts/setup-triton-venv.sh)"]
fn migprof_agrees_with_triton_s_own_client_at_each_concurrency() {
    let _alone = one_at_a_time();
    let python = triton_python();
    // 20 ms a request: a client's own microseconds, ours or Python's, are within the noise.
    let server = Server::start(&python, "dense", "--delay-ms 20");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let o = load(
        &out,
        &[
            "--endpoint",
            &server.url(),
            "--served-model",
            "dense",
            "--concurrency",
            "1,2,3",
            "--warmup",
            "0.5",
            "--duration",
            "4",
            "--batch",
            "4",
        ],
    );
    assert!(o.status.success(), "{}", text(&o));
    let rows = read_table(&out, Table::Load).unwrap();
    let ours: Vec<(i64, f64, f64)> = rows
        .column("concurrency")
        .unwrap()
        .i64()
        .unwrap()
        .iter()
        .zip(f64s(&rows, "achieved_qps"))
        .zip(f64s(&rows, "p50_ms"))
        .map(|((c, q), p)| (c.unwrap(), q, p))
        .collect();
    let mut said = Vec::new();
    for (c, qps, p50) in ours {
        let (their_qps, their_p50) = tritonclient_loop(&python, &server.url(), c as usize, 4.0);
        said.push(format!(
            "concurrency {c}: migprof {qps:.1}/s p50 {p50:.2} ms, tritonclient {their_qps:.1}/s p50 {their_p50:.2} ms"
        ));
        // Run-to-run noise of a 4 s window on a 2-core machine: ±15%.
        assert!((qps / their_qps - 1.0).abs() < 0.15, "{}", said.join("\n"));
        assert!((p50 / their_p50 - 1.0).abs() < 0.15, "{}", said.join("\n"));
    }
    eprintln!("{}", said.join("\n"));
}

#[test]
#[ignore = "needs the Triton environment (.ci/run makes it: scripts/setup-triton-venv.sh)"]
fn kill_9_of_migprof_leaves_no_process_of_the_server() {
    let _alone = one_at_a_time();
    let python = triton_python();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let ports = free_ports();
    let cmd = server_cmd(&python, ports, "--models dense");
    let mut child = migprof()
        .args(["load", "--device", "cpu", "--out"])
        .arg(&out)
        .args([
            "--endpoint",
            &format!("http://127.0.0.1:{}", ports[0]),
            "--server-cmd",
            &cmd,
        ])
        .args(["--concurrency", "1", "--duration", "600"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Until the server answers: tritonserver has started under the Python parent.
    let started = Instant::now();
    while processes_with("tritonserver").iter().all(|&p| {
        !String::from_utf8_lossy(&std::fs::read(format!("/proc/{p}/cmdline")).unwrap_or_default())
            .contains(&ports[0].to_string())
    }) {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "tritonserver never started"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    std::thread::sleep(Duration::from_secs(2));
    child.kill().unwrap();
    child.wait().unwrap();
    let left = gone(&ports[0].to_string(), Duration::from_secs(20));
    assert!(left.is_empty(), "left running after kill -9 of migprof: {left:?}");
}

#[test]
#[ignore = "needs the Triton environment (.ci/run makes it: scripts/setup-triton-venv.sh)"]
fn wrong_answers_shapes_and_encodings_are_named() {
    let _alone = one_at_a_time();
    let python = triton_python();
    let server = Server::start(&python, "dense,tokens,half,broken", "");
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let url = server.url();
    // One short step at concurrency 1 against the test server, with `args`.
    let step = |args: &[&str]| {
        let mut all = vec![
            "--endpoint",
            &url,
            "--concurrency",
            "1",
            "--duration",
            "0.5",
            "--warmup",
            "0",
        ];
        all.extend_from_slice(args);
        load(&out, &all)
    };
    let fails = |args: &[&str], expected: &str| {
        let o = step(args);
        assert!(!o.status.success(), "{args:?} ran");
        assert!(text(&o).contains(expected), "{args:?}: {}", text(&o));
    };
    // PyTriton keeps its repository index behind a token: the model must be named.
    fails(&[], "name the model with --served-model");
    fails(&["--served-model", "broken"], "output `y` has shape [1, 3], not [1, 4]");
    fails(&["--served-model", "nope"], "GET /v2/models/nope");
    fails(&["--served-model", "tokens"], "--shape input_ids:N");
    fails(
        &["--served-model", "tokens", "--shape", "input_ids:16"],
        "--shape attention_mask:N",
    );
    fails(&["--served-model", "half", "--encoding", "json"], "--encoding binary");
    fails(&["--served-model", "dense", "--shape", "z:3"], "has no input `z`");
    // The user's tensors: one sample of 16 values for a request of 2, and one that fits no shape.
    let data = dir.path().join("data.json");
    let sample: Vec<String> = (0..16).map(|i| format!("{}", i as f64 / 16.0)).collect();
    std::fs::write(&data, format!("{{\"data\": [{{\"x\": [{}]}}]}}", sample.join(","))).unwrap();
    let wrong = dir.path().join("wrong.json");
    std::fs::write(&wrong, "{\"data\": [{\"x\": [1, 2, 3]}]}").unwrap();
    fails(
        &["--served-model", "dense", "--input-data", wrong.to_str().unwrap()],
        "--input-data data[0].x: 3 values",
    );
    // What works: the sequence length given, half types over the binary extension, JSON.
    for args in [
        &[
            "--served-model",
            "tokens",
            "--shape",
            "input_ids:16",
            "--shape",
            "attention_mask:16",
        ][..],
        &["--served-model", "half"][..],
        &["--served-model", "dense", "--encoding", "json", "--batch", "2"][..],
        &[
            "--served-model",
            "dense",
            "--batch",
            "2",
            "--input-data",
            data.to_str().unwrap(),
        ][..],
    ] {
        let o = step(args);
        assert!(o.status.success(), "{args:?}: {}", text(&o));
    }
    let rows = read_table(&out, Table::Load).unwrap();
    assert_eq!(rows.height(), 4);
    assert!(
        strings(&rows, "request_inputs").contains(&"x [2, 16] FP32".to_string()),
        "{:?}",
        strings(&rows, "request_inputs")
    );
}

/// A sweep's `[[servers]]`: the server started for its cell, a row per step with the sweep's
/// identity, stopped whole; a rerun finds the cell done.
#[test]
#[ignore = "needs the Triton environment (.ci/run makes it: scripts/setup-triton-venv.sh)"]
fn a_sweep_starts_its_server_on_each_target_and_finds_it_done_when_run_again() {
    let _alone = one_at_a_time();
    let python = triton_python();
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let ports = free_ports();
    let cmd = server_cmd(&python, ports, "--models dense");
    let file = dir.path().join("sweep.toml");
    std::fs::write(
        &file,
        format!(
            r#"
name = "served"
[defaults]
timeout_secs = 300
[[targets]]
label = "host"
device = "cpu"
[[servers]]
endpoint = "http://127.0.0.1:{}"
server_cmd = '{cmd}'
served_model = "dense"
server_timeout = 120
concurrency = [1, 2]
batch = 2
warmup_secs = 0.5
duration_secs = 1
"#,
            ports[0]
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
    let rows = read_table(&out, Table::Load).unwrap();
    assert_eq!(rows.height(), 2, "{}", text(&o));
    assert_eq!(strings(&rows, "sweep"), vec!["served"; 2]);
    assert_eq!(strings(&rows, "target"), vec!["host"; 2]);
    assert_eq!(strings(&rows, "model"), vec!["dense"; 2]);
    let ids = strings(&rows, "cell_id");
    assert_eq!(ids[0], ids[1], "one cell, a row per step");
    assert_eq!(strings(&rows, "request_inputs"), vec!["x [2, 16] FP32"; 2]);
    assert_eq!(
        gone(&format!("{}", ports[0]), Duration::from_secs(15)),
        Vec::<u32>::new()
    );
    // Read as users read it: pyarrow, a duckdb glob and a polars scan see both rows and the server.
    let script = r#"
import sys, duckdb, polars as pl, pyarrow.parquet as pq
d = sys.argv[1]
t = pq.read_table(f"{d}/load").to_pylist()
assert sorted(r["concurrency"] for r in t) == [1, 2], t
assert all(r["engine"].startswith("triton ") and r["offered_qps"] is None and r["failed_requests"] == 0 for r in t), t
n, c, answered = duckdb.sql(f"select count(*), sum(concurrency), min(achieved_qps) from '{d}/load/*.parquet'").fetchall()[0]
assert (n, c) == (2, 3) and answered > 0, (n, c, answered)
df = pl.scan_parquet(f"{d}/load/*.parquet").collect()
assert df["protocol"].to_list() == ["kserve", "kserve"] and df["client_overhead_p50_ms"].null_count() == 0, df
print("read whole")
"#;
    let read = std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        read.status.success(),
        "pyarrow, duckdb and polars (.ci/run installs them): {}",
        text(&read)
    );
    let o = sweep();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("1 skipped (done already)"), "{}", text(&o));
    assert_eq!(read_table(&out, Table::Load).unwrap().height(), 2);
}

/// No Triton needed: a server that cannot start, never gets ready, or is not there.
#[test]
fn a_server_that_ends_never_answers_or_is_not_there_is_named_and_nothing_is_left() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("D");
    let port = free_ports()[0];
    let url = format!("http://127.0.0.1:{port}");
    let o = load(
        &out,
        &[
            "--endpoint",
            &url,
            "--server-cmd",
            "echo no model here >&2; exit 3",
            "--concurrency",
            "1",
        ],
    );
    assert!(!o.status.success());
    let e = text(&o);
    assert!(
        e.contains("the server ended before it was ready") && e.contains("no model here"),
        "{e}"
    );
    let marker = format!("sleep 3{port}");
    let o = load(
        &out,
        &[
            "--endpoint",
            &url,
            "--server-cmd",
            &format!("{marker} & {marker}"),
            "--server-timeout",
            "1",
            "--concurrency",
            "1",
        ],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("was not ready within 1 s"), "{}", text(&o));
    assert_eq!(
        gone(&marker, Duration::from_secs(15)),
        Vec::<u32>::new(),
        "the server's tree is stopped"
    );
    let o = load(&out, &["--endpoint", &url, "--concurrency", "1"]);
    assert!(!o.status.success());
    assert!(text(&o).contains("GET /v2"), "{}", text(&o));
    let o = load(&out, &["--endpoint", &url]);
    assert!(text(&o).contains("say how to load the server"), "{}", text(&o));
    // Something already answers at the endpoint: the command is not started, lest that be measured.
    let squatter = TcpListener::bind(("127.0.0.1", port)).unwrap();
    let marker = format!("sleep 4{port}");
    let o = load(
        &out,
        &["--endpoint", &url, "--server-cmd", &marker, "--concurrency", "1"],
    );
    assert!(!o.status.success());
    assert!(text(&o).contains("something already answers at"), "{}", text(&o));
    assert!(processes_with(&marker).is_empty(), "the command was not started");
    drop(squatter);
    let o = load(
        &out,
        &["--endpoint", &url, "--model", "resnet_tiny", "--concurrency", "1"],
    );
    assert!(text(&o).contains("cannot be used with"), "{}", text(&o));
    let o = load(&out, &["--endpoint", &url, "--max-batch", "8", "--concurrency", "1"]);
    assert!(
        text(&o).contains("a server batches as it is configured"),
        "{}",
        text(&o)
    );
    let o = load(
        &out,
        &["--endpoint", &url, "--weights", "w.safetensors", "--concurrency", "1"],
    );
    assert!(text(&o).contains("not to a server of your own"), "{}", text(&o));
    let o = migprof()
        .args([
            "load",
            "--device",
            "mps:3g.71gb",
            "--endpoint",
            &url,
            "--concurrency",
            "1",
            "--out",
        ])
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        text(&o).contains("give the command that starts it (--server-cmd"),
        "{}",
        text(&o)
    );
}
