//! The memory-system neighbour of a memory-partitioned emulated slice (`mps-mem:`): a second client
//! of the same MPS daemon, on the SMs the slice does not have, streaming through memory so that the
//! slice's client reads only its profile's share of the GPU's bandwidth.
//!
//! It is this same migprof run as `migprof memory-neighbour`, started by the client it serves and
//! driven over its stdin and stdout, one line each way:
//!
//! | asked | answered |
//! |---|---|
//! | (at start) | `ready` |
//! | `pause <ns>` | `ok`: from its next launch on it streams with that pause between bursts |
//! | `sms` | `sms <id>,<id>,…`: the SMs its last launch ran on |
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

/// How long the neighbour may take to start (a CUDA context under MPS, NVRTC) and to answer.
const START_TIMEOUT: Duration = Duration::from_secs(60);
const ANSWER_TIMEOUT: Duration = Duration::from_secs(30);

/// A running neighbour, seen from the client.
pub struct NeighbourProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
}

impl NeighbourProcess {
    /// Starts `exe memory-neighbour` as a client of the daemon at `pipe_dir` on `gpu_uuid`, with
    /// `percent` of the GPU's SMs (`sms` of them: its grid is sized by them), and waits until it is
    /// ready.
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
        };
        let first = neighbour.answer(START_TIMEOUT)?;
        if first != "ready" {
            bail!("the memory-system neighbour did not start: {first}")
        }
        Ok(neighbour)
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
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
        let list = self.ask("sms", "sms")?;
        list.split(',')
            .filter(|s| !s.is_empty())
            .map(|s| {
                s.parse::<u32>()
                    .map_err(|_| anyhow!("the neighbour's SM list `{list}`"))
            })
            .collect()
    }

    /// A copy probe on its SMs, GB/s.
    pub fn bandwidth_gbps(&mut self) -> Result<f64> {
        let v = self.ask("bandwidth", "bandwidth")?;
        v.parse().map_err(|_| anyhow!("the neighbour's bandwidth `{v}`"))
    }

    /// Asks it to quit and waits for it; killed when it does not go within a few seconds.
    pub fn stop(mut self) -> Result<()> {
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

impl super::calibration::Neighbour for NeighbourProcess {
    fn set_pause(&mut self, pause_ns: u32) -> Result<()> {
        self.ask(&format!("pause {pause_ns}"), "ok").map(|_| ())
    }
}

impl super::partition::PartitionNeighbour for NeighbourProcess {
    fn sms(&mut self) -> Result<std::collections::BTreeSet<u32>> {
        NeighbourProcess::sms(self)
    }
    fn pid(&self) -> Option<u32> {
        Some(NeighbourProcess::pid(self))
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

    fn start(&mut self, percent: u32) -> Result<NeighbourProcess> {
        let sms = self.gpu_sms * percent / 100;
        NeighbourProcess::start(&self.exe, &self.gpu_uuid, &self.pipe_dir, percent, sms)
    }

    fn gpu_bandwidth_gbps(&mut self) -> Result<f64> {
        let mut whole = self.start(100)?;
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
    Pause(u32),
    Sms,
    Bandwidth,
    Quit,
}

impl Request {
    fn parse(line: &str) -> Result<Request> {
        let mut words = line.split_whitespace();
        Ok(match (words.next(), words.next()) {
            (Some("pause"), Some(ns)) => Request::Pause(ns.parse().map_err(|_| anyhow!("`{line}`: pause in ns"))?),
            (Some("sms"), None) => Request::Sms,
            (Some("bandwidth"), None) => Request::Bandwidth,
            (Some("quit"), None) => Request::Quit,
            _ => bail!("`{line}`: expected pause <ns>, sms, bandwidth or quit"),
        })
    }
}

/// What the neighbour does on its GPU, behind a trait so that the protocol is tested without one.
pub trait Streamer {
    /// Launches one round of streaming with `pause_ns` between bursts and waits for it.
    fn stream(&mut self, pause_ns: u32) -> Result<()>;
    fn sms(&mut self) -> Result<Vec<u32>>;
    fn bandwidth_gbps(&mut self) -> Result<f64>;
}

/// `migprof memory-neighbour`: serves requests from `input` until it closes or says `quit`,
/// streaming between them once paused; answers on `out`.
pub fn serve(input: impl BufRead + Send + 'static, out: &mut dyn Write, streamer: &mut dyn Streamer) -> Result<()> {
    let requests = lines_of(input);
    writeln!(out, "ready")?;
    out.flush()?;
    let mut pause: Option<u32> = None;
    loop {
        let line = match pause {
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
                Ok(Request::Pause(ns)) => {
                    pause = Some(ns);
                    // One launch at the new setting has run when the client hears `ok`, and the
                    // next follows at once.
                    streamer.stream(ns).map(|_| "ok".to_string())
                }
                Ok(Request::Sms) => streamer
                    .sms()
                    .map(|ids| format!("sms {}", ids.iter().map(u32::to_string).collect::<Vec<_>>().join(","))),
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
        if let Some(ns) = pause {
            if let Err(e) = streamer.stream(ns) {
                writeln!(out, "error {e:#}")?;
                return Err(e);
            }
        }
    }
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
// Streams `passes` times through `src` into `dst` with evict-first loads and stores, eight loads in
// flight per thread, pausing `pause_ns` after each burst; each block first notes the SM it runs on.
extern "C" __global__ void migprof_neighbour(const float4* __restrict__ src, float4* __restrict__ dst,
                                             unsigned long long n, unsigned int passes, unsigned int pause_ns,
                                             unsigned int* sm_of_block) {
    if (threadIdx.x == 0) {
        unsigned int smid;
        asm volatile("mov.u32 %0, %%smid;" : "=r"(smid));
        sm_of_block[blockIdx.x] = smid;
    }
    unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned int p = 0; p < passes; p++) {
        unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x;
        for (; i + 7 * stride < n; i += 8 * stride) {
            float4 v[8];
            #pragma unroll
            for (int k = 0; k < 8; k++) v[k] = __ldcs(src + i + k * stride);
            #pragma unroll
            for (int k = 0; k < 8; k++) __stcs(dst + i + k * stride, v[k]);
            if (pause_ns) __nanosleep(pause_ns);
        }
    }
}
"#;

    const MIB: usize = 1 << 20;
    /// Each way: far past any L2.
    const BYTES: usize = 256 * MIB;
    /// Passes per launch: a couple of milliseconds at full rate, so that the gaps between launches
    /// (when requests are read) are a per cent of the time.
    const PASSES: u32 = 8;
    /// Eight blocks of 256 threads per SM of its share (every warp slot), eight loads in flight each:
    /// twice the loads per SM of the client's copy probe. Measured on an H100 with four blocks per SM
    /// and four loads: the client of a 2g kept 1.0–1.6 times its share beside a neighbour that never
    /// paused, a 1g up to 1.17 times; with eight blocks and four loads the 2g reached its share and
    /// the 1g still read up to 1.19 times it; fewer, larger blocks left the neighbour weaker still.
    const BLOCKS_PER_SM: u32 = 8;
    const THREADS: u32 = 256;

    pub struct GpuStreamer {
        device: candle_core::Device,
        func: CudaFunction,
        stream: std::sync::Arc<CudaStream>,
        src: CudaSlice<u8>,
        dst: CudaSlice<u8>,
        sm_of_block: CudaSlice<u32>,
        blocks: u32,
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
            let func = cuda
                .get_or_load_custom_func("migprof_neighbour", "migprof_neighbour", &ptx.to_src())?
                .into_cuda_function();
            // Sized by the client's count of the neighbour's SMs: what CUDA reports under an MPS share
            // is not the count to trust.
            let blocks = sms.max(1) * BLOCKS_PER_SM;
            Ok(GpuStreamer {
                src: cuda.alloc_zeros::<u8>(BYTES)?,
                dst: cuda.alloc_zeros::<u8>(BYTES)?,
                sm_of_block: cuda.alloc_zeros::<u32>(blocks as usize)?,
                blocks,
                func,
                stream: cuda.cuda_stream(),
                device,
            })
        }
    }

    impl super::Streamer for GpuStreamer {
        fn stream(&mut self, pause_ns: u32) -> Result<()> {
            let n = (BYTES / 16) as u64;
            let mut args = self.stream.launch_builder(&self.func);
            args.arg(&self.src)
                .arg(&mut self.dst)
                .arg(&n)
                .arg(&PASSES)
                .arg(&pause_ns)
                .arg(&mut self.sm_of_block);
            let cfg = LaunchConfig {
                grid_dim: (self.blocks, 1, 1),
                block_dim: (THREADS, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: (const float4*, float4*, n, passes, pause, unsigned int*): both buffers hold n
            // float4 and sm_of_block one entry per block.
            unsafe { args.launch(cfg) }.map_err(|e| anyhow!("launching the neighbour: {e:?}"))?;
            self.device.synchronize()?;
            Ok(())
        }

        fn sms(&mut self) -> Result<Vec<u32>> {
            let ids = self.device.as_cuda_device()?.clone_dtoh(&self.sm_of_block)?;
            let set: std::collections::BTreeSet<u32> = ids.into_iter().collect();
            Ok(set.into_iter().collect())
        }

        fn bandwidth_gbps(&mut self) -> Result<f64> {
            let mut probe = crate::gpu::memory_system::Probe::new(&self.device, self.blocks / BLOCKS_PER_SM)?;
            probe.bandwidth_gbps()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A streamer that records what it was asked.
    #[derive(Default)]
    struct Recording {
        streamed: Vec<u32>,
    }

    impl Streamer for Recording {
        fn stream(&mut self, pause_ns: u32) -> Result<()> {
            self.streamed.push(pause_ns);
            Ok(())
        }
        fn sms(&mut self) -> Result<Vec<u32>> {
            Ok(vec![16, 17, 131])
        }
        fn bandwidth_gbps(&mut self) -> Result<f64> {
            Ok(2983.04)
        }
    }

    #[test]
    fn serves_the_protocol_and_streams_only_once_paused() {
        let input = std::io::Cursor::new("bandwidth\npause 400\nsms\nnonsense\npause x\nquit\npause 1\n");
        let mut out = Vec::new();
        let mut s = Recording::default();
        serve(input, &mut out, &mut s).unwrap();
        let text = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..4], ["ready", "bandwidth 2983.0", "ok", "sms 16,17,131"]);
        assert!(lines[4].starts_with("error `nonsense`: expected pause"), "{}", lines[4]);
        assert!(lines[5].contains("pause in ns"), "{}", lines[5]);
        assert_eq!(lines.len(), 6, "nothing after quit: {text}");
        assert_eq!(s.streamed.first(), Some(&400));
        assert!(s.streamed.iter().all(|&p| p == 400), "never the request after quit");
    }

    #[test]
    fn a_closed_input_ends_it() {
        let mut out = Vec::new();
        serve(std::io::Cursor::new(""), &mut out, &mut Recording::default()).unwrap();
        assert_eq!(String::from_utf8(out).unwrap(), "ready\n");
    }
}
