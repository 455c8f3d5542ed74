//! The highest rate `migprof load --endpoint`'s client sustains: the same client (request made once,
//! sent on kept-alive connections, every answer checked) against a KServe v2 server in this process
//! that answers at once, so that whatever limits the rate is the client (and the loopback). At each
//! concurrency: the requests/s one closed loop per connection pushes through; at each open-loop rate:
//! whether the requests started when due (late: over 1 ms after) and the client's own time per
//! request. Run with `cargo bench -p migprof --bench client_ceiling` (`-- --quick`: shorter steps).

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Duration;

use migprof::load::arrival::Arrival;
use migprof::server::drive::{drive, Load};
use migprof::server::endpoint::Endpoint;
use migprof::server::kserve::{self, Encoding, Kserve, RequestOptions};

const METADATA: &str = r#"{"name":"instant","versions":["1"],"platform":"bench","inputs":[{"name":"x","datatype":"FP32","shape":[-1,16]}],"outputs":[{"name":"y","datatype":"FP32","shape":[-1,4]}]}"#;
const ANSWER: &str =
    r#"{"model_name":"instant","outputs":[{"name":"y","datatype":"FP32","shape":[1,4],"data":[0,0,0,0]}]}"#;

/// A KServe v2 server of one model that answers every request at once: a thread per connection,
/// HTTP/1.1 kept alive.
fn serve() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").expect("a port");
    let port = listener.local_addr().expect("bound").port();
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            std::thread::spawn(move || answer(stream));
        }
    });
    port
}

/// Answers the requests of one connection until it closes.
fn answer(stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    let mut writer = stream.try_clone().expect("a second handle");
    let mut reader = BufReader::new(stream);
    loop {
        let mut line = String::new();
        if reader.read_line(&mut line).unwrap_or(0) == 0 {
            return;
        }
        let path = line.split_whitespace().nth(1).unwrap_or("").to_string();
        let mut length = 0usize;
        loop {
            let mut header = String::new();
            if reader.read_line(&mut header).unwrap_or(0) == 0 {
                return;
            }
            if header == "\r\n" {
                break;
            }
            if let Some((name, value)) = header.split_once(':') {
                if name.eq_ignore_ascii_case("content-length") {
                    length = value.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; length];
        if reader.read_exact(&mut body).is_err() {
            return;
        }
        let reply = match path.as_str() {
            "/v2" => r#"{"name":"instant","version":"0"}"#,
            "/v2/models/instant" => METADATA,
            "/v2/models/instant/infer" => ANSWER,
            _ => "",
        };
        let head = format!(
            "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n",
            reply.len()
        );
        if writer.write_all(head.as_bytes()).is_err() || writer.write_all(reply.as_bytes()).is_err() {
            return;
        }
    }
}

fn main() -> anyhow::Result<()> {
    let quick = std::env::args().any(|a| a == "--quick");
    let (warmup, measured) = match quick {
        true => (Duration::from_millis(300), Duration::from_secs(1)),
        false => (Duration::from_secs(1), Duration::from_secs(3)),
    };
    let port = serve();
    let endpoint = Endpoint::new(&format!("http://127.0.0.1:{port}"), &[], Duration::from_secs(10))?;
    let (_, metadata) = kserve::discover(&endpoint, Some("instant"))?;
    let request = Kserve::new(
        &metadata,
        &RequestOptions {
            batch: 1,
            shapes: Default::default(),
            encoding: Encoding::Binary,
            seed: 0,
            input_data: None,
        },
    )?;
    println!(
        "client ceiling on {} ({} cores): a server that answers at once, requests of {}",
        migprof::provenance::cpu_model().unwrap_or_else(|| "this host".into()),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        request.described
    );
    println!("load                 requests/s   p50 ms  overhead p50/p99 ms   late   failed");
    let mut loads: Vec<Load> = [1, 2, 4, 8, 16].into_iter().map(Load::Concurrency).collect();
    loads.extend(
        [1000.0, 2000.0, 5000.0, 10000.0, 20000.0]
            .into_iter()
            .map(|qps| Load::Rate {
                qps,
                arrival: Arrival::Poisson,
                seed: 0,
                clients: 256,
            }),
    );
    for load in loads {
        let driven = drive(&request, &endpoint, load, warmup, measured);
        let client = driven.client_side();
        let served = driven.served();
        let mut latencies = served.latencies_ns.clone();
        latencies.sort_unstable();
        let p50 = latencies.get(latencies.len() / 2).copied().unwrap_or(0) as f64 / 1e6;
        let rate = served.latencies_ns.len() as f64 / served.window.as_secs_f64().max(1e-9);
        println!(
            "{:<20} {:>10.0} {:>8.3}  {:>8.3}/{:<8.3}  {:>5.1}%  {:>6}",
            load.describe(),
            rate,
            p50,
            client.overhead_p50_ms,
            client.overhead_p99_ms,
            100.0 * client.late as f64 / client.measured.max(1) as f64,
            client.failed
        );
    }
    Ok(())
}
