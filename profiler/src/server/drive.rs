//! One step of load on a server: a fixed number of requests always in flight (perf_analyzer's
//! `--concurrency-range`), or requests at scheduled arrivals whatever the server does (an open
//! loop, `--request-rate-range`). Each client is a thread with its own kept-alive connection. A
//! request's latency runs from when it was due — its scheduled arrival, or the moment its client
//! was free — to its answer's last byte, so that a client that falls behind makes latency worse,
//! never better; how far behind it fell is measured and said.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use super::endpoint::Endpoint;
use super::Exchange;
use crate::load::arrival::{arrivals, Arrival};
use crate::load::serve::{BatchRecord, Ending, Served};

/// How a step loads the server.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Load {
    /// This many requests always in flight: each client sends its next request once its last one
    /// is answered.
    Concurrency(usize),
    /// Requests at scheduled arrivals, `clients` of them in flight at most.
    Rate {
        qps: f64,
        arrival: Arrival,
        seed: u64,
        clients: usize,
    },
}

impl Load {
    /// Requests always in flight; `None` at a rate.
    pub fn concurrency(&self) -> Option<usize> {
        match *self {
            Load::Concurrency(n) => Some(n),
            Load::Rate { .. } => None,
        }
    }

    /// The rate offered; `None` at a fixed concurrency, which offers none.
    pub fn offered_qps(&self) -> Option<f64> {
        match *self {
            Load::Rate { qps, .. } => Some(qps),
            Load::Concurrency(_) => None,
        }
    }

    pub fn describe(&self) -> String {
        match self {
            Load::Concurrency(n) => format!("concurrency {n}"),
            Load::Rate { qps, arrival, .. } => format!("{qps:.1}/s {}", arrival.as_str()),
        }
    }
}

/// A request started this long after it was due counts as late: the client, not the server, held
/// it.
pub const LATE: Duration = Duration::from_millis(1);

/// One request as its client saw it, each time from the step's start.
#[derive(Debug, Clone, PartialEq)]
pub struct Sent {
    /// When it was due: its scheduled arrival, or when its client was free.
    pub due: Duration,
    pub started: Duration,
    /// When its answer had been read whole.
    pub read: Duration,
    /// When its answer had been checked.
    pub done: Duration,
    pub failure: Option<String>,
}

impl Sent {
    /// The client's own time on it: from due to sent, and checking the answer.
    pub fn overhead(&self) -> Duration {
        self.started.saturating_sub(self.due) + self.done.saturating_sub(self.read)
    }
}

/// What a step did: every request, warm-up ones included, in the order they were due.
#[derive(Debug, Clone)]
pub struct Driven {
    pub requests: Vec<Sent>,
    /// Requests due before this are warm-up.
    pub warmup: Duration,
    /// Requests due from this on were not sent.
    pub end: Duration,
}

/// One client's way of sending a step's requests: the `n`-th of the step (from 0, in the order
/// they were handed out), due `due` after the step's start `t0`, on the client's own connection.
pub trait Client: Sync {
    /// The request as its client saw it.
    type Sent: Send;
    fn send(&self, endpoint: &Endpoint, agent: &ureq::Agent, t0: Instant, n: usize, due: Duration) -> Self::Sent;
    /// When the request was done with, from `t0`: a client at a fixed concurrency sends its next
    /// one then.
    fn done(sent: &Self::Sent) -> Duration;
}

/// Runs one step of `load`: requests due until `end` from its start, then waits for those in
/// flight; every request as its client saw it, in no particular order.
pub fn run_clients<C: Client>(client: &C, endpoint: &Endpoint, load: Load, end: Duration) -> Vec<C::Sent> {
    let t0 = Instant::now();
    match load {
        Load::Concurrency(n) => closed_loop(client, endpoint, n, t0, end),
        Load::Rate {
            qps,
            arrival,
            seed,
            clients,
        } => open_loop(client, endpoint, arrivals(arrival, qps, seed), clients, t0, end),
    }
}

/// Runs one step: warm-up, then `duration` of measured requests, then waits for those in flight.
pub fn drive(exchange: &dyn Exchange, endpoint: &Endpoint, load: Load, warmup: Duration, duration: Duration) -> Driven {
    let end = warmup + duration;
    let mut requests = run_clients(&Checked(exchange), endpoint, load, end);
    requests.sort_by_key(|r| r.due);
    Driven { requests, warmup, end }
}

fn closed_loop<C: Client>(client: &C, endpoint: &Endpoint, clients: usize, t0: Instant, end: Duration) -> Vec<C::Sent> {
    let next = AtomicUsize::new(0);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|_| {
                let next = &next;
                scope.spawn(move || {
                    let agent = endpoint.agent();
                    let mut sent = Vec::new();
                    let mut due = t0.elapsed();
                    while due < end {
                        let r = client.send(endpoint, &agent, t0, next.fetch_add(1, Ordering::Relaxed), due);
                        due = C::done(&r);
                        sent.push(r);
                    }
                    sent
                })
            })
            .collect();
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    })
}

fn open_loop<C: Client>(
    client: &C,
    endpoint: &Endpoint,
    schedule: impl Iterator<Item = Duration>,
    clients: usize,
    t0: Instant,
    end: Duration,
) -> Vec<C::Sent> {
    let (tx, rx) = mpsc::channel::<(usize, Duration)>();
    let rx = Arc::new(Mutex::new(rx));
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..clients)
            .map(|_| {
                let rx = Arc::clone(&rx);
                scope.spawn(move || {
                    let agent = endpoint.agent();
                    let mut sent = Vec::new();
                    loop {
                        let next = rx.lock().map(|r| r.recv());
                        let Ok(Ok((n, due))) = next else { break };
                        sent.push(client.send(endpoint, &agent, t0, n, due));
                    }
                    sent
                })
            })
            .collect();
        for (n, due) in schedule.take_while(|&d| d < end).enumerate() {
            let now = t0.elapsed();
            if due > now {
                std::thread::sleep(due - now);
            }
            if tx.send((n, due)).is_err() {
                break;
            }
        }
        drop(tx);
        workers.into_iter().flat_map(|w| w.join().unwrap_or_default()).collect()
    })
}

/// A request of one exchange, checked: what a KServe step sends.
struct Checked<'a>(&'a dyn Exchange);

impl Client for Checked<'_> {
    type Sent = Sent;

    fn send(&self, endpoint: &Endpoint, agent: &ureq::Agent, t0: Instant, _n: usize, due: Duration) -> Sent {
        let started = t0.elapsed();
        let answered = self.0.exchange(endpoint, agent);
        let done = t0.elapsed();
        match answered {
            Ok(read_at) => Sent {
                due,
                started,
                read: read_at.saturating_duration_since(t0),
                done,
                failure: None,
            },
            Err(why) => Sent {
                due,
                started,
                read: done,
                done,
                failure: Some(why),
            },
        }
    }

    fn done(sent: &Sent) -> Duration {
        sent.done
    }
}

/// How many requests failed and the three most frequent reasons with their counts.
pub fn tally<'a>(failures: impl Iterator<Item = &'a str>) -> (usize, Vec<(String, usize)>) {
    let mut reasons: BTreeMap<&str, usize> = BTreeMap::new();
    for why in failures {
        *reasons.entry(why).or_default() += 1;
    }
    let failed = reasons.values().sum();
    let mut most: Vec<(String, usize)> = reasons.into_iter().map(|(why, n)| (why.to_string(), n)).collect();
    most.sort_by_key(|f| std::cmp::Reverse(f.1));
    most.truncate(3);
    (failed, most)
}

/// The reasons of [`tally`] in words (`N× reason; …`); `None` when none failed.
pub fn reasons(failures: &[(String, usize)]) -> Option<String> {
    let reasons: Vec<String> = failures.iter().map(|(why, n)| format!("{n}× {why}")).collect();
    (!reasons.is_empty()).then(|| reasons.join("; "))
}

/// What a step says of `late` requests: the client, not the server, held them.
pub fn late_note(load: &Load, late: usize) -> Option<String> {
    (late > 0).then(|| match load {
        Load::Rate { clients, .. } => format!(
            "{late} request(s) started over {} ms after their arrival: the client fell behind its schedule (its CPU busy, or all {clients} of --max-in-flight in flight); their times count from their arrival",
            LATE.as_millis()
        ),
        Load::Concurrency(_) => format!(
            "{late} request(s) started over {} ms after their client was free: the client fell behind its concurrency",
            LATE.as_millis()
        ),
    })
}

/// What the client says of a step beside the server's numbers.
#[derive(Debug, Clone, PartialEq)]
pub struct ClientSide {
    /// Measured requests that failed, and the most frequent reasons with their counts.
    pub failed: usize,
    pub failures: Vec<(String, usize)>,
    /// The client's own time per measured request (see [`Sent::overhead`]), p50 and p99, ms.
    pub overhead_p50_ms: f64,
    pub overhead_p99_ms: f64,
    /// Measured requests started over [`LATE`] after they were due.
    pub late: usize,
    pub measured: usize,
}

impl ClientSide {
    /// The most frequent reasons of the failures with their counts (`N× reason; …`); `None` when
    /// none failed.
    pub fn reasons(&self) -> Option<String> {
        reasons(&self.failures)
    }

    /// What needs saying about the client: failures, and a client that fell behind.
    pub fn notes(&self, load: &Load) -> Vec<String> {
        let mut notes = Vec::new();
        if let Some(reasons) = self.reasons() {
            notes.push(format!(
                "{} of {} measured request(s) failed, left out of the latencies: {reasons}",
                self.failed, self.measured
            ));
        }
        notes.extend(late_note(load, self.late));
        notes
    }
}

impl Driven {
    /// The measured requests: those due after the warm-up.
    fn measured(&self) -> impl Iterator<Item = &Sent> {
        self.requests.iter().filter(|r| r.due >= self.warmup)
    }

    /// The client's side of the step.
    pub fn client_side(&self) -> ClientSide {
        let mut overheads: Vec<f64> = self.measured().map(|r| r.overhead().as_secs_f64() * 1e3).collect();
        overheads.sort_by(f64::total_cmp);
        let at = |q: f64| match overheads.len() {
            0 => 0.0,
            n => overheads[((n - 1) as f64 * q).round() as usize],
        };
        let (failed, failures) = tally(self.measured().filter_map(|r| r.failure.as_deref()));
        ClientSide {
            failed,
            failures,
            overhead_p50_ms: at(0.5),
            overhead_p99_ms: at(0.99),
            late: self
                .measured()
                .filter(|r| r.started.saturating_sub(r.due) > LATE)
                .count(),
            measured: self.measured().count(),
        }
    }

    /// The step as the load tables keep one: the measured answered requests' latencies from when
    /// they were due, each request a batch of one from sent to read (its round trip), the window
    /// from the warm-up's end to the last answer.
    pub fn served(&self) -> Served {
        let ok: Vec<&Sent> = self.measured().filter(|r| r.failure.is_none()).collect();
        let last_read = ok.iter().map(|r| r.read).max().unwrap_or(self.warmup);
        let last_due = self.measured().map(|r| r.due).max().unwrap_or(self.warmup);
        let mut batches: Vec<BatchRecord> = self
            .requests
            .iter()
            .filter(|r| r.failure.is_none())
            .map(|r| BatchRecord {
                dispatched: r.started,
                done: r.read,
                size: 1,
                queued: 1,
            })
            .collect();
        batches.sort_by_key(|b| b.done);
        Served {
            latencies_ns: ok
                .iter()
                .map(|r| r.read.saturating_sub(r.due).as_nanos() as u64)
                .collect(),
            arrivals: ok.iter().map(|r| r.due).collect(),
            unfinished_ns: Vec::new(),
            offered: self.measured().count(),
            offered_span: last_due.saturating_sub(self.warmup),
            window: last_read.saturating_sub(self.warmup),
            batches,
            ending: Ending::Schedule,
            round_trips: true,
        }
    }
}
