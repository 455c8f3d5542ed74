//! The memory-system neighbour of a memory-partitioned emulated slice (`mps-mem:`): a second client
//! of the same MPS daemon, on the SMs the slice does not have, streaming through memory so that the
//! slice's client reads only its profile's share of the GPU's bandwidth.
//!
//! It is this same migprof run as `migprof memory-neighbour`, started by the client it serves and
//! driven over its stdin and stdout, one line each way:
//!
//! | asked | answered |
//! |---|---|
//! | (at start) | `ready <blocks>`: the most blocks it streams with |
//! | `load <blocks> <ns>` | `ok`: from its next launch on it streams with that many blocks, each pausing that long between bursts |
//! | `avoid <id>,<id>,…` | `ok <blocks>`: from its next launch on, its blocks that land on those SMs end at once, and it streams with at most that many blocks (eight per SM left to it) |
//! | `sms` | `sms <id>,<id>,…`: the SMs its last launch ran on |
//! | `busy` | `busy <id>,<id>,…`: the SMs it cannot place blocks on now, in its own numbering (those the client fills while it asks) |
//! | `bandwidth` | `bandwidth <GB/s>`: a copy probe on its own SMs (the GPU's, when it holds them all) |
//! | `quit`, or its stdin closing | it exits |
//!
//! Its loads and stores are cache-streaming (`ld.global.cs`, `st.global.cs`: evict first), so that
//! it takes as little of the L2 as it can. It dies with the client (its stdin closes, and Linux sends
//! it SIGKILL when the client's thread that started it ends), so it never outlives the run.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};

use super::calibration::Load;

/// How long the neighbour may take to start (a CUDA context under MPS, NVRTC) and to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running neighbour, seen from the client.
pub struct NeighbourProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    max_blocks: u32,
}

impl NeighbourProcess {
    /// Starts `exe memory-neighbour` as a client of the daemon at `pipe_dir` on `gpu_uuid`, held by
    /// MPS to `percent` of the GPU's SMs (100: any of them), its grid sized for `sms` SMs, and waits
    /// until it is ready.
    pub fn start(exe: &Path, gpu_uuid: &str, pipe_dir: &Path, percent: u32, sms: u32) -> Result<NeighbourProcess> {
        let mut cmd = Command::new(exe);
        cmd.arg("memory-neighbour")
            .arg("--sms")
            .arg(sms.max(1).to_string())
            .env("CUDA_VISIBLE_DEVICES", gpu_uuid)
            .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
            .env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", percent.to_string())
            .env_remove("CUDA_MPS_PINNED_DEVICE_MEM_LIMIT")
            .env_remove(super::daemon::CLIENT_PIPE_ENV)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        // Its own process group: a Ctrl-C at the terminal reaches the migprof that started it,
        // which stops it, rather than killing it in the middle of a request.
        std::os::unix::process::CommandExt::process_group(&mut cmd, 0);
        // SAFETY: between fork and exec, only prctl and getppid: the neighbour is killed when the
        // thread that started it ends, so that a client that dies cannot leave it streaming; one
        // whose client died before the prctl took effect does not start.
        let client = std::process::id();
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                if libc::getppid() as u32 != client {
                    libc::_exit(1);
                }
                Ok(())
            });
        }
        let mut child = cmd
            .spawn()
            .with_context(|| format!("starting the memory-system neighbour ({})", exe.display()))?;
        let lines = lines_of(BufReader::new(child.stdout.take().expect("piped")));
        let mut neighbour = NeighbourProcess {
            stdin: child.stdin.take(),
            child,
            lines,
            max_blocks: 0,
        };
        let first = neighbour.answer(START_TIMEOUT)?;
        neighbour.max_blocks = first
            .strip_prefix("ready ")
            .and_then(|b| b.trim().parse().ok())
            .filter(|&b| b > 0)
            .ok_or_else(|| anyhow!("the memory-system neighbour did not start: {first}"))?;
        Ok(neighbour)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// How it ended, if it has.
    pub fn ended(&mut self) -> Result<Option<std::process::ExitStatus>> {
        Ok(self.child.try_wait()?)
    }

    fn answer(&mut self, timeout: Duration) -> Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(line) => match line.strip_prefix("error ") {
                Some(e) => bail!("the memory-system neighbour: {e}"),
                None => Ok(line),
            },
            Err(mpsc::RecvTimeoutError::Timeout) => {
                bail!("the memory-system neighbour did not answer within {timeout:?}")
            }
            Err(mpsc::RecvTimeoutError::Disconnected) => {
                // Its output closed: it ended, or is about to; one that lingers is killed.
                let status = self.wait_or_kill().map(|s| s.to_string()).unwrap_or_default();
                bail!("the memory-system neighbour ended ({status}); its error is above")
            }
        }
    }

    /// Sends `request` and returns what follows `expect` in the answer.
    fn ask(&mut self, request: &str, expect: &str) -> Result<String> {
        let stdin = self
            .stdin
            .as_mut()
            .ok_or_else(|| anyhow!("the neighbour was stopped"))?;
        writeln!(stdin, "{request}").context("writing to the memory-system neighbour")?;
        stdin.flush()?;
        let line = self.answer(ANSWER_TIMEOUT)?;
        line.strip_prefix(expect)
            .map(|rest| rest.trim().to_string())
            .ok_or_else(|| anyhow!("the memory-system neighbour answered `{line}` to `{request}`"))
    }

    /// The SMs its last launch ran on.
    pub fn sms(&mut self) -> Result<std::collections::BTreeSet<u32>> {
        self.ask_sms("sms")
    }

    /// The SMs, in its numbering, that it cannot place blocks on now: those another process fills.
    pub fn busy_sms(&mut self) -> Result<std::collections::BTreeSet<u32>> {
        self.ask_sms("busy")
    }

    /// The list of SM ids it answers to `request`, which its answer starts with.
    fn ask_sms(&mut self, request: &str) -> Result<std::collections::BTreeSet<u32>> {
        let list = self.ask(request, request)?;
        list.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>()
                    .map_err(|_| anyhow!("the neighbour's SM list `{list}`, answering {request}"))
            })
            .collect()
    }

    /// A copy probe on its SMs, GB/s.
    pub fn bandwidth_gbps(&mut self) -> Result<f64> {
        let v = self.ask("bandwidth", "bandwidth")?;
        v.parse().map_err(|_| anyhow!("the neighbour's bandwidth `{v}`"))
    }

    /// Asks it to quit and waits for it; killed when it does not go within a few seconds. One that
    /// had already ended is an error: the client measured beside no neighbour for some of its run.
    pub fn stop(mut self) -> Result<()> {
        if let Some(status) = self.ended()? {
            self.stdin = None;
            bail!("the memory-system neighbour had ended before it was stopped ({status}); its error is above")
        }
        self.quit()
    }

    fn quit(&mut self) -> Result<()> {
        if let Some(mut stdin) = self.stdin.take() {
            let _ = writeln!(stdin, "quit");
        }
        self.wait_or_kill()?;
        Ok(())
    }

    /// Its exit status, waiting up to five seconds before killing it.
    fn wait_or_kill(&mut self) -> std::io::Result<std::process::ExitStatus> {
        for _ in 0..50 {
            if let Some(status) = self.child.try_wait()? {
                return Ok(status);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        self.child.kill()?;
        self.child.wait()
    }
}

impl NeighbourProcess {
    /// Keeps its streaming off `sms`: the client's.
    pub fn avoid(&mut self, sms: &std::collections::BTreeSet<u32>) -> Result<()> {
        let list: Vec<String> = sms.iter().map(u32::to_string).collect();
        let blocks = self.ask(&format!("avoid {}", list.join(",")), "ok")?;
        self.max_blocks = blocks
            .parse()
            .ok()
            .filter(|&b| b > 0)
            .ok_or_else(|| anyhow!("the memory-system neighbour answered `ok {blocks}` to avoid"))?;
        Ok(())
    }
}

impl super::calibration::Neighbour for NeighbourProcess {
    fn max_blocks(&self) -> u32 {
        self.max_blocks
    }
    fn set_load(&mut self, load: Load) -> Result<()> {
        self.ask(&format!("load {} {}", load.blocks, load.pause_ns), "ok")
            .map(|_| ())
    }
}

impl super::partition::PartitionNeighbour for NeighbourProcess {
    fn sms(&mut self) -> Result<std::collections::BTreeSet<u32>> {
        NeighbourProcess::sms(self)
    }
    fn busy_sms(&mut self) -> Result<std::collections::BTreeSet<u32>> {
        NeighbourProcess::busy_sms(self)
    }
    fn pid(&self) -> Option<u32> {
        Some(NeighbourProcess::pid(self))
    }
    fn copy_gbps(&mut self) -> Result<f64> {
        self.bandwidth_gbps()
    }
    fn avoid(&mut self, sms: &std::collections::BTreeSet<u32>) -> Result<()> {
        NeighbourProcess::avoid(self, sms)
    }
    fn stop(self) -> Result<()> {
        NeighbourProcess::stop(self)
    }
}

/// Starts neighbours of one GPU under one daemon: this migprof again, as `memory-neighbour`.
pub struct Spawner {
    pub exe: std::path::PathBuf,
    pub gpu_uuid: String,
    /// The GPU's SMs, as NVML counts them.
    pub gpu_sms: u32,
    pub pipe_dir: std::path::PathBuf,
}

impl super::partition::Neighbours for Spawner {
    type Running = NeighbourProcess;

    fn start(&mut self) -> Result<NeighbourProcess> {
        // Under no MPS limit: a client held to a share of the SMs lands on SMs that overlap the
        // other client's, so a held neighbour that keeps off the client's is left few SMs to
        // stream on (benches/results/*-slice-fidelity.md). Its grid has blocks for every SM, so
        // that the SMs it keeps get their full count when those on the client's SMs end.
        NeighbourProcess::start(&self.exe, &self.gpu_uuid, &self.pipe_dir, 100, self.gpu_sms)
    }

    fn start_confined(&mut self, percent: u32) -> Result<NeighbourProcess> {
        let sms = self.gpu_sms * percent / 100;
        NeighbourProcess::start(&self.exe, &self.gpu_uuid, &self.pipe_dir, percent, sms)
    }

    fn gpu_bandwidth_gbps(&mut self) -> Result<f64> {
        let mut whole = self.start_confined(100)?;
        let gbps = whole.bandwidth_gbps()?;
        whole.stop()?;
        Ok(gbps)
    }
}

impl Drop for NeighbourProcess {
    fn drop(&mut self) {
        let _ = self.quit();
    }
}

/// The lines of `input`, read on a thread of their own so that neither end of the pipes blocks on
/// the other: the channel closes when the input does.
fn lines_of(input: impl BufRead + Send + 'static) -> mpsc::Receiver<String> {
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in input.lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    lines
}

/// A request to the neighbour.
#[derive(Debug, Clone, PartialEq)]
enum Request {
    Load(Load),
    Avoid(Vec<u32>),
    Sms,
    Busy,
    Bandwidth,
    Quit,
}

impl Request {
    fn parse(line: &str) -> Result<Request> {
        let mut words = line.split_whitespace();
        let number = |w: Option<&str>, what: &str| -> Result<u32> {
            w.and_then(|w| w.parse().ok())
                .ok_or_else(|| anyhow!("`{line}`: expected load <blocks> <pause ns>, {what} a whole number"))
        };
        Ok(match (words.next(), words.next(), words.next(), words.next()) {
            (Some("load"), blocks, ns, None) => Request::Load(Load {
                blocks: number(blocks, "blocks")?,
                pause_ns: number(ns, "pause")?,
            }),
            (Some("avoid"), ids, None, ..) => Request::Avoid(
                ids.unwrap_or("")
                    .split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse().map_err(|_| anyhow!("`{line}`: expected avoid <id>,<id>,…")))
                    .collect::<Result<_>>()?,
            ),
            (Some("sms"), None, ..) => Request::Sms,
            (Some("busy"), None, ..) => Request::Busy,
            (Some("bandwidth"), None, ..) => Request::Bandwidth,
            (Some("quit"), None, ..) => Request::Quit,
            _ => bail!("`{line}`: expected load <blocks> <pause ns>, avoid <id>,<id>,…, sms, busy, bandwidth or quit"),
        })
    }
}

/// What the neighbour does on its GPU, behind a trait so that the protocol is tested without one.
pub trait Streamer {
    /// The most blocks it streams with.
    fn max_blocks(&self) -> u32;
    /// Launches one round of streaming at `load` and waits for it.
    fn stream(&mut self, load: Load) -> Result<()>;
    /// Keeps its streaming off the SMs `ids` from its next launch on; [`Streamer::max_blocks`] then
    /// counts only the SMs left to it.
    fn avoid(&mut self, ids: &[u32]) -> Result<()>;
    fn sms(&mut self) -> Result<Vec<u32>>;
    /// The SMs it cannot place blocks on now, in its numbering.
    fn busy_sms(&mut self) -> Result<Vec<u32>>;
    fn bandwidth_gbps(&mut self) -> Result<f64>;
}

/// `migprof memory-neighbour`: serves requests from `input` until it closes or says `quit`,
/// streaming between them once paused; answers on `out`.
pub fn serve(input: impl BufRead + Send + 'static, out: &mut dyn Write, streamer: &mut dyn Streamer) -> Result<()> {
    let requests = lines_of(input);
    writeln!(out, "ready {}", streamer.max_blocks())?;
    out.flush()?;
    let mut load: Option<Load> = None;
    loop {
        let line = match load {
            Some(_) => match requests.try_recv() {
                Ok(line) => Some(line),
                Err(mpsc::TryRecvError::Empty) => None,
                Err(mpsc::TryRecvError::Disconnected) => return Ok(()),
            },
            None => match requests.recv() {
                Ok(line) => Some(line),
                Err(_) => return Ok(()),
            },
        };
        if let Some(line) = line {
            let answer = match Request::parse(&line) {
                Ok(Request::Quit) => return Ok(()),
                Ok(Request::Load(l)) if !(1..=streamer.max_blocks()).contains(&l.blocks) => Err(anyhow!(
                    "`{line}`: {} blocks, where it streams with 1 to {}",
                    l.blocks,
                    streamer.max_blocks()
                )),
                Ok(Request::Load(l)) => {
                    load = Some(l);
                    // One launch at the new setting has run when the client hears `ok`, and the
                    // next follows at once.
                    streamer.stream(l).map(|_| "ok".to_string())
                }
                Ok(Request::Avoid(ids)) => streamer.avoid(&ids).map(|_| format!("ok {}", streamer.max_blocks())),
                Ok(Request::Sms) => streamer.sms().map(|ids| format!("sms {}", id_list(&ids))),
                Ok(Request::Busy) => streamer.busy_sms().map(|ids| format!("busy {}", id_list(&ids))),
                Ok(Request::Bandwidth) => streamer.bandwidth_gbps().map(|g| format!("bandwidth {g:.1}")),
                Err(e) => Err(e),
            };
            match answer {
                Ok(a) => writeln!(out, "{a}")?,
                Err(e) => writeln!(out, "error {e:#}")?,
            }
            out.flush()?;
            continue;
        }
        if let Some(l) = load {
            if let Err(e) = streamer.stream(l) {
                writeln!(out, "error {e:#}")?;
                return Err(e);
            }
        }
    }
}

fn id_list(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// The SMs another process fills, from how many of a grid's blocks landed on each SM (`hits`, by
/// id) while it did: among the ids the neighbour can run on (`ids`), those that took fewer than half
/// the median's blocks. A full SM takes none; one its client left partly free (MPS rounds a share
/// up, and a grid's last blocks leave an SM short) takes a few, where a free SM takes them all.
pub fn busy_from_hits(ids: &[u32], hits: &[u32]) -> Vec<u32> {
    let count = |id: u32| hits.get(id as usize).copied().unwrap_or(0);
    let mut counts: Vec<u32> = ids.iter().map(|&id| count(id)).collect();
    counts.sort_unstable();
    let Some(&median) = counts.get(counts.len() / 2) else {
        return Vec::new();
    };
    ids.iter().copied().filter(|&id| 2 * count(id) < median).collect()
}

/// The neighbour on this process's GPU, on `sms` SMs (CUDA_VISIBLE_DEVICES and the MPS share are
/// set by the client that started it).
#[cfg(feature = "cuda")]
pub fn gpu_streamer(sms: u32) -> Result<Box<dyn Streamer>> {
    Ok(Box::new(gpu::GpuStreamer::new(sms)?))
}

#[cfg(not(feature = "cuda"))]
pub fn gpu_streamer(_sms: u32) -> Result<Box<dyn Streamer>> {
    bail!("this migprof was built without CUDA support: it has no memory-system neighbour")
}

#[cfg(feature = "cuda")]
mod gpu {
    use anyhow::{anyhow, Result};
    use candle_core::cuda_backend::cudarc;
    use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};

    const SOURCE: &str = r#"
// Streams chunks of 8 x 256 float4 (32 KiB) from `src` into `dst` with evict-first loads and
// stores, eight loads in flight per thread, pausing `pause_ns` after each chunk. The grid has
// blocks for every SM, and the block scheduler deals them out over all of them: a block that lands
// on an SM `avoid` marks (the client's) ends at once, and of the others the first `active` stream.
// They take chunks from a shared count until `quota` are done, so that however they were dealt
// out the launch's work is done by the streaming blocks together, none left to a weak second wave.
// Chunks follow on from `first` round the buffer of `chunks`, so that a launch moves on rather
// than reading what an earlier one left in the L2. `counters` (blocks ranked, chunks taken) start
// at zero; each streaming block notes its SM.
extern "C" __global__ void migprof_neighbour(const float4* __restrict__ src, float4* __restrict__ dst,
                                             unsigned long long chunks, unsigned long long first,
                                             unsigned int active, unsigned long long quota,
                                             unsigned int pause_ns, unsigned int* sm_of_block,
                                             const unsigned char* __restrict__ avoid,
                                             unsigned long long* counters) {
    __shared__ int go;
    __shared__ unsigned long long taken;
    if (threadIdx.x == 0) {
        unsigned int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        go = !avoid[smid & 255] && atomicAdd(&counters[0], 1ull) < active;
        sm_of_block[blockIdx.x] = go ? smid : 0xffffffffu;
    }
    __syncthreads();
    if (!go) return;
    for (;;) {
        if (threadIdx.x == 0) taken = atomicAdd(&counters[1], 4ull);
        __syncthreads();
        unsigned long long c0 = taken;
        __syncthreads();
        if (c0 >= quota) return;
        for (unsigned long long c = c0; c < c0 + 4 && c < quota; c++) {
            unsigned long long chunk = (first + c) % chunks;
            const float4* from = src + chunk * 2048 + threadIdx.x;
            float4* to = dst + chunk * 2048 + threadIdx.x;
            float4 v[8];
            #pragma unroll
            for (int k = 0; k < 8; k++) v[k] = __ldcs(from + k * 256);
            #pragma unroll
            for (int k = 0; k < 8; k++) __stcs(to + k * 256, v[k]);
            if (pause_ns) __nanosleep(pause_ns);
        }
    }
}

// Each block counts itself on the SM it landed on, then holds the SM a few microseconds so that
// the grid's blocks spread over every SM with room rather than reuse the first ones.
extern "C" __global__ void migprof_where(unsigned int* hits) {
    if (threadIdx.x == 0) {
        unsigned int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        atomicAdd(&hits[smid & 255], 1u);
        unsigned long long t0, t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
        do { asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); } while (t - t0 < 5000);
    }
}
"#;

    const MIB: usize = 1 << 20;
    /// Each way: far past any L2.
    const BYTES: usize = 256 * MIB;
    /// A chunk: eight float4 for each of a block's threads.
    const CHUNK_BYTES: usize = 8 * THREADS as usize * 16;
    /// Chunks per streaming block per launch: about 3 ms with every block at full rate on an H100,
    /// 8 ms for one block at the longest pause, so that the gaps between launches (when requests
    /// are read) are a per cent of the time and a request waits a few milliseconds at most.
    const BURSTS: u32 = 128;
    /// Eight blocks of 256 threads per SM (every warp slot), eight loads in flight each: twice the
    /// loads per SM of the client's copy probe. Fewer blocks or loads per SM left the neighbour too
    /// weak for the small slices (benches/results/*-slice-fidelity.md); the calibration streams with
    /// fewer blocks where the share asks for less.
    const BLOCKS_PER_SM: u32 = 8;
    const THREADS: u32 = 256;
    /// The placement grid: small blocks, many per SM, so that an SM with room for a few takes a few.
    const WHERE_BLOCKS_PER_SM: u32 = 16;
    const WHERE_THREADS: u32 = 32;

    pub struct GpuStreamer {
        device: candle_core::Device,
        func: CudaFunction,
        place: CudaFunction,
        /// The SMs its blocks land on with the GPU to itself, in its numbering.
        all_sms: Vec<u32>,
        stream: std::sync::Arc<CudaStream>,
        src: CudaSlice<u8>,
        dst: CudaSlice<u8>,
        sm_of_block: CudaSlice<u32>,
        /// Blocks ranked and chunks taken in the current launch.
        counters: CudaSlice<u64>,
        /// One byte per SM id: 1 where its blocks end at once.
        avoid: CudaSlice<u8>,
        /// The SMs it was sized for, and how many of them it keeps off.
        sms: u32,
        avoided: u32,
        /// Blocks of the last launch: the SMs noted by the first that many.
        launched: u32,
        /// The chunk the next launch starts at.
        next_chunk: u64,
    }

    impl GpuStreamer {
        pub fn new(sms: u32) -> Result<GpuStreamer> {
            let device = candle_core::Device::new_cuda(0)?;
            let cuda = device.as_cuda_device()?;
            let opts = cudarc::nvrtc::CompileOptions {
                // __nanosleep needs compute capability 7.0; CUDA 13's NVRTC starts at 7.5.
                options: vec!["--gpu-architecture=compute_75".into()],
                ..Default::default()
            };
            let ptx = cudarc::nvrtc::compile_ptx_with_opts(SOURCE, opts)
                .map_err(|e| anyhow!("compiling the neighbour's kernel with NVRTC: {e:?}"))?;
            let ptx = ptx.to_src();
            let func = cuda
                .get_or_load_custom_func("migprof_neighbour", "migprof_neighbour", &ptx)?
                .into_cuda_function();
            let place = cuda
                .get_or_load_custom_func("migprof_where", "migprof_neighbour", &ptx)?
                .into_cuda_function();
            // Sized by the client's count of the neighbour's SMs: what CUDA reports under an MPS share
            // is not the count to trust.
            let max_blocks = sms.max(1) * BLOCKS_PER_SM;
            let mut streamer = GpuStreamer {
                src: cuda.alloc_zeros::<u8>(BYTES)?,
                dst: cuda.alloc_zeros::<u8>(BYTES)?,
                sm_of_block: cuda.alloc_zeros::<u32>(max_blocks as usize)?,
                counters: cuda.alloc_zeros::<u64>(2)?,
                avoid: cuda.alloc_zeros::<u8>(256)?,
                sms: sms.max(1),
                avoided: 0,
                launched: 0,
                next_chunk: 0,
                func,
                place,
                all_sms: Vec::new(),
                stream: cuda.cuda_stream(),
                device,
            };
            // Started before its client streams, it has the GPU to itself.
            let hits = streamer.placement()?;
            streamer.all_sms = (0..hits.len() as u32).filter(|&id| hits[id as usize] > 0).collect();
            Ok(streamer)
        }

        /// Blocks of the placement grid that landed on each SM id (0..256).
        fn placement(&mut self) -> Result<Vec<u32>> {
            let cuda = self.device.as_cuda_device()?;
            let mut hits = cuda.alloc_zeros::<u32>(256)?;
            let mut args = self.stream.launch_builder(&self.place);
            args.arg(&mut hits);
            let cfg = LaunchConfig {
                grid_dim: (self.sms * WHERE_BLOCKS_PER_SM, 1, 1),
                block_dim: (WHERE_THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (unsigned int*): 256 counters, indexed by an SM id masked to 0..255.
            unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the neighbour's placement grid: {e:?}"))?;
            self.device.synchronize()?;
            Ok(cuda.clone_dtoh(&hits)?)
        }
    }

    impl super::Streamer for GpuStreamer {
        /// Eight per SM left to it: a grid larger than fits at once on those SMs runs a second
        /// wave of a few blocks, streaming weakly for as long as the first.
        fn max_blocks(&self) -> u32 {
            self.sms.saturating_sub(self.avoided).max(1) * BLOCKS_PER_SM
        }

        fn stream(&mut self, load: super::Load) -> Result<()> {
            let active = load.blocks.clamp(1, self.max_blocks());
            let grid = self.sms * BLOCKS_PER_SM;
            let chunks = (BYTES / CHUNK_BYTES) as u64;
            let first = self.next_chunk;
            let quota = u64::from(active) * u64::from(BURSTS);
            self.stream
                .memset_zeros(&mut self.counters)
                .map_err(|e| anyhow!("clearing the neighbour's counters: {e:?}"))?;
            let mut args = self.stream.launch_builder(&self.func);
            args.arg(&self.src)
                .arg(&mut self.dst)
                .arg(&chunks)
                .arg(&first)
                .arg(&active)
                .arg(&quota)
                .arg(&load.pause_ns)
                .arg(&mut self.sm_of_block)
                .arg(&self.avoid)
                .arg(&mut self.counters);
            let cfg = LaunchConfig {
                grid_dim: (grid, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (const float4*, float4*, chunks, first, active, quota, pause, unsigned int*,
            // const unsigned char*, unsigned long long*): both buffers hold `chunks` chunks of 2,048
            // float4 (indices are taken modulo `chunks`), sm_of_block one entry for each of the
            // grid's blocks, avoid 256 bytes (read at an SM id masked to 0..255), counters two.
            unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the neighbour: {e:?}"))?;
            self.device.synchronize()?;
            self.launched = grid;
            self.next_chunk = (first + quota) % chunks;
            Ok(())
        }

        fn avoid(&mut self, ids: &[u32]) -> Result<()> {
            let mut mask = vec![0u8; 256];
            for &id in ids {
                mask[(id & 255) as usize] = 1;
            }
            self.device.as_cuda_device()?.memcpy_htod(&mask, &mut self.avoid)?;
            self.avoided = mask.iter().map(|&m| u32::from(m)).sum();
            Ok(())
        }

        fn sms(&mut self) -> Result<Vec<u32>> {
            let ids = self.device.as_cuda_device()?.clone_dtoh(&self.sm_of_block)?;
            let set: std::collections::BTreeSet<u32> = ids
                .into_iter()
                .take(self.launched as usize)
                .filter(|&id| id != u32::MAX)
                .collect();
            Ok(set.into_iter().collect())
        }

        fn busy_sms(&mut self) -> Result<Vec<u32>> {
            let hits = self.placement()?;
            Ok(super::busy_from_hits(&self.all_sms, &hits))
        }

        fn bandwidth_gbps(&mut self) -> Result<f64> {
            let mut probe = crate::gpu::memory_system::Probe::new(&self.device, self.sms)?;
            probe.bandwidth_over_gbps(crate::mps::partition::PROBE_WINDOW_MS)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamer of 912 blocks that records what it was asked.
    #[derive(Default)]
    struct Recording {
        streamed: Vec<Load>,
        avoided: Vec<u32>,
    }

    impl Streamer for Recording {
        fn max_blocks(&self) -> u32 {
            912
        }
        fn stream(&mut self, load: Load) -> Result<()> {
            self.streamed.push(load);
            Ok(())
        }
        fn avoid(&mut self, ids: &[u32]) -> Result<()> {
            self.avoided = ids.to_vec();
            Ok(())
        }
        fn sms(&mut self) -> Result<Vec<u32>> {
            Ok(vec![16, 17, 131])
        }
        fn busy_sms(&mut self) -> Result<Vec<u32>> {
            Ok(vec![116, 117])
        }
        fn bandwidth_gbps(&mut self) -> Result<f64> {
            Ok(2983.04)
        }
    }

    #[test]
    fn serves_the_protocol_and_streams_only_once_set() {
        let input = std::io::Cursor::new(
            "bandwidth\nload 40 400\nsms\nbusy\nnonsense\nload 40 x\nload 913 0\nload 0 0\navoid 0,1,17\navoid x\nquit\nload 1 1\n",
        );
        let mut out = Vec::new();
        let mut s = Recording::default();
        serve(input, &mut out, &mut s).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[..5],
            ["ready 912", "bandwidth 2983.0", "ok", "sms 16,17,131", "busy 116,117"]
        );
        let lines = [&lines[..4], &lines[5..]].concat();
        assert!(
            lines[4].starts_with("error `nonsense`: expected load <blocks> <pause ns>"),
            "{}",
            lines[4]
        );
        assert!(lines[5].contains("pause a whole number"), "{}", lines[5]);
        assert!(
            lines[6].contains("913 blocks, where it streams with 1 to 912"),
            "{}",
            lines[6]
        );
        assert!(lines[7].contains("0 blocks"), "{}", lines[7]);
        assert_eq!(lines[8], "ok 912");
        assert!(lines[9].contains("expected avoid <id>,<id>"), "{}", lines[9]);
        assert_eq!(lines.len(), 10, "nothing after quit: {text}");
        assert_eq!(s.avoided, [0, 1, 17]);
        let asked = Load {
            blocks: 40,
            pause_ns: 400,
        };
        assert_eq!(s.streamed.first(), Some(&asked));
        assert!(
            s.streamed.iter().all(|&l| l == asked),
            "never a refused load, nor one after quit"
        );
    }

    #[test]
    fn busy_sms_are_those_that_took_under_half_the_median_s_blocks() {
        // 132 SMs: a client filling 60 of them (three left a little room), and ids the neighbour
        // never ran on (beyond 132) are not counted.
        let ids: Vec<u32> = (0..132).collect();
        let mut hits: Vec<u32> = (0..256u32).map(|id| if id < 72 { 26 + id % 3 } else { 0 }).collect();
        hits[80] = 3;
        hits[90] = 12;
        hits[200] = 40;
        assert_eq!(busy_from_hits(&ids, &hits), (72..132).collect::<Vec<u32>>());
        // With the GPU to itself nothing is busy; with nothing to read, nothing either.
        assert!(busy_from_hits(&ids, &vec![17; 256]).is_empty());
        assert!(busy_from_hits(&[], &hits).is_empty());
    }

    #[test]
    fn a_closed_input_ends_it() {
        let mut out = Vec::new();
        serve(std::io::Cursor::new(""), &mut out, &mut Recording::default()).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "ready 912\n");
    }
}
