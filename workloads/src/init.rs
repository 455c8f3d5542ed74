//! Seeded, device-independent parameter initialisation.
//!
//! candle cannot seed its CPU generator, and a CUDA generator draws different numbers from a CPU one,
//! so every initial value is drawn here, on the host, from a generator keyed by (seed, parameter name):
//! the same seed gives the same weights on every device and in every construction order.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Device, Result, Shape, Tensor, Var};
use candle_nn::init::{FanInOut, NormalOrUniform};
use candle_nn::var_builder::SimpleBackend;
use candle_nn::{Init, VarBuilder, VarMap};

/// SplitMix64: tiny, fast and good enough for initial weights and synthetic inputs; chosen because its
/// output is fixed by its definition, not by a crate version.
#[derive(Debug, Clone)]
pub struct Rng(u64);

/// SplitMix64's increment of the state per draw.
const GAMMA: u64 = 0x9e37_79b9_7f4a_7c15;

impl Rng {
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// A generator for one named stream, independent of the order in which streams are created.
    pub fn for_name(seed: u64, name: &str) -> Self {
        // FNV-1a over the name, mixed with the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in name.bytes() {
            h ^= b as u64;
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        let mut rng = Self(seed ^ h);
        rng.next_u64();
        rng
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(GAMMA);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform integer in [0, n).
    pub fn below(&mut self, n: u32) -> u32 {
        (((self.next_u64() >> 32) * n as u64) >> 32) as u32
    }

    /// Standard normal (Box-Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = 1.0 - self.uniform(); // (0, 1]: ln stays finite
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }

    /// `n` draws of [`Rng::normal`], scaled: the same values, in the same order, as `n` calls would
    /// give. SplitMix64's state only advances by a constant, so a chunk of the stream can start
    /// anywhere: large tensors (a language model's 100-million-element embeddings) are drawn on
    /// every core, which keeps seeded weights for billions of parameters to seconds.
    pub fn normal_vec(&mut self, n: usize, mean: f64, std: f64) -> Vec<f32> {
        const SERIAL_BELOW: usize = 1 << 20;
        let threads = std::thread::available_parallelism().map_or(1, |t| t.get());
        if n < SERIAL_BELOW || threads == 1 {
            return (0..n).map(|_| (mean + std * self.normal()) as f32).collect();
        }
        let mut out = vec![0f32; n];
        let chunk = n.div_ceil(threads);
        let start = self.0;
        std::thread::scope(|scope| {
            for (c, slice) in out.chunks_mut(chunk).enumerate() {
                // Each normal takes two steps of the state.
                let mut rng = Rng(start.wrapping_add(GAMMA.wrapping_mul(2 * (c * chunk) as u64)));
                scope.spawn(move || {
                    for v in slice {
                        *v = (mean + std * rng.normal()) as f32;
                    }
                });
            }
        });
        self.0 = start.wrapping_add(GAMMA.wrapping_mul(2 * n as u64));
        out
    }

    pub fn uniform_vec(&mut self, n: usize, lo: f64, up: f64) -> Vec<f32> {
        (0..n).map(|_| (lo + (up - lo) * self.uniform()) as f32).collect()
    }
}

/// Draws the values `init` asks for, on the host, as f32.
fn sample(init: Init, shape: &Shape, rng: &mut Rng) -> Vec<f32> {
    let n = shape.elem_count();
    match init {
        Init::Const(v) => vec![v as f32; n],
        Init::Randn { mean, stdev } => rng.normal_vec(n, mean, stdev),
        Init::Uniform { lo, up } => rng.uniform_vec(n, lo, up),
        Init::Kaiming {
            dist,
            fan,
            non_linearity,
        } => {
            let fan = fan.for_shape(shape) as f64;
            let std = non_linearity.gain() / fan.sqrt();
            match dist {
                NormalOrUniform::Normal => rng.normal_vec(n, 0.0, std),
                NormalOrUniform::Uniform => {
                    let bound = 3f64.sqrt() * std;
                    rng.uniform_vec(n, -bound, bound)
                }
            }
        }
    }
}

/// Kaiming-normal with fan-out, as torchvision initialises convolutions.
pub const KAIMING_NORMAL_FAN_OUT: Init = Init::Kaiming {
    dist: NormalOrUniform::Normal,
    fan: FanInOut::FanOut,
    non_linearity: candle_nn::init::NonLinearity::ReLU,
};

/// Where a model's tensors live: trainable variables in a [`VarMap`] (the optimizer updates them), or
/// plain tensors for inference, so that no gradient graph is recorded.
///
/// A frozen model's tensors are kept here as built, on the host; the model holds its device copies
/// alone, so that it can let go of one it has replaced (ResNet's folded convolutions,
/// `models::layers::ConvBn`) instead of the device holding both.
#[derive(Clone)]
pub enum Params {
    Trainable(VarMap),
    Frozen(Arc<Mutex<HashMap<String, Tensor>>>),
}

impl Params {
    pub fn new(trainable: bool) -> Self {
        if trainable {
            Self::Trainable(VarMap::new())
        } else {
            Self::Frozen(Arc::default())
        }
    }

    /// Every tensor the model holds (parameters and buffers such as batch-norm running statistics),
    /// sorted by name: a trainable model's as they are now, a frozen one's as built, on the host.
    pub fn tensors(&self) -> Vec<(String, Tensor)> {
        let mut all: Vec<(String, Tensor)> = match self {
            Self::Trainable(vm) => {
                let data = vm.data().lock().unwrap();
                data.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect()
            }
            Self::Frozen(map) => {
                let data = map.lock().unwrap();
                data.iter().map(|(k, v)| (k.clone(), v.clone())).collect()
            }
        };
        all.sort_by(|a, b| a.0.cmp(&b.0));
        all
    }
}

/// Tensors from a checkpoint, and what a model asked for that they could not give.
pub struct Checkpoint {
    tensors: HashMap<String, Tensor>,
    problems: Mutex<Vec<String>>,
}

impl Checkpoint {
    pub fn new(tensors: HashMap<String, Tensor>) -> Arc<Self> {
        Arc::new(Self {
            tensors,
            problems: Mutex::default(),
        })
    }

    /// Every tensor the model needed that was missing or of another shape, one line each, sorted.
    pub fn problems(&self) -> Vec<String> {
        let mut p = self.problems.lock().unwrap().clone();
        p.sort();
        p
    }
}

/// A [`SimpleBackend`] that gives every tensor a model asks for once and keeps it in `params`: from the
/// checkpoint when there is one, else drawn from the seeded generator.
pub struct SeededInit {
    params: Params,
    seed: u64,
    checkpoint: Option<Arc<Checkpoint>>,
    originals: Option<Originals>,
}

/// Every trainable parameter's value as drawn or read, in f32 on the host, before it was rounded to
/// the model's dtype: what f32 master weights start from, as PyTorch's start from the f32 weights
/// that autocast rounds for each step.
pub type Originals = Arc<Mutex<HashMap<String, Tensor>>>;

impl SeededInit {
    pub fn var_builder(params: Params, seed: u64, dtype: DType, device: &Device) -> VarBuilder<'static> {
        Self::with_checkpoint(params, seed, None, None, dtype, device)
    }

    /// As [`SeededInit::var_builder`], taking tensors from `checkpoint`. A tensor the checkpoint lacks or
    /// holds in another shape is recorded in [`Checkpoint::problems`] and initialised from the seed, so
    /// that building goes on and every problem can be reported at once. With `originals`, every
    /// trainable parameter's value before rounding to `dtype` is kept there too.
    pub fn with_checkpoint(
        params: Params,
        seed: u64,
        checkpoint: Option<Arc<Checkpoint>>,
        originals: Option<Originals>,
        dtype: DType,
        device: &Device,
    ) -> VarBuilder<'static> {
        VarBuilder::from_backend(
            Box::new(Self {
                params,
                seed,
                checkpoint,
                originals,
            }),
            dtype,
            device.clone(),
        )
    }

    fn initial_value(&self, shape: &Shape, name: &str, init: Init) -> Result<Tensor> {
        if let Some(ckpt) = &self.checkpoint {
            match ckpt.tensors.get(name) {
                Some(t) if t.shape() == shape => return Ok(t.clone()),
                Some(t) => ckpt.problems.lock().unwrap().push(format!(
                    "{name}: {:?} in the file, {:?} in the model",
                    t.dims(),
                    shape.dims()
                )),
                None => ckpt.problems.lock().unwrap().push(format!(
                    "{name}: missing from the file ({:?} in the model)",
                    shape.dims()
                )),
            }
        }
        Tensor::from_vec(
            sample(init, shape, &mut Rng::for_name(self.seed, name)),
            shape,
            &Device::Cpu,
        )
    }
}

impl SimpleBackend for SeededInit {
    fn get(&self, shape: Shape, name: &str, init: Init, dtype: DType, dev: &Device) -> Result<Tensor> {
        let existing = match &self.params {
            Params::Trainable(vm) => vm.data().lock().unwrap().get(name).map(|v| v.as_tensor().clone()),
            // A tensor asked for again: frozen, an equal copy serves as well as the same one.
            Params::Frozen(map) => map.lock().unwrap().get(name).map(|t| t.to_device(dev)).transpose()?,
        };
        if let Some(t) = existing {
            if t.shape() != &shape {
                candle_core::bail!("parameter {name} requested as {shape:?} but exists as {:?}", t.shape())
            }
            return Ok(t);
        }
        let original = self.initial_value(&shape, name, init)?;
        let tensor = original.to_dtype(dtype)?;
        match &self.params {
            Params::Trainable(vm) => {
                if let Some(originals) = &self.originals {
                    let f32 = original.to_dtype(DType::F32)?;
                    originals.lock().unwrap().insert(name.to_string(), f32);
                }
                let var = uploaded_var(&tensor, dev)?;
                let t = var.as_tensor().clone();
                vm.data().lock().unwrap().insert(name.to_string(), var);
                Ok(t)
            }
            Params::Frozen(map) => {
                map.lock().unwrap().insert(name.to_string(), tensor.clone());
                tensor.to_device(dev)
            }
        }
    }

    fn get_unchecked(&self, name: &str, _dtype: DType, _dev: &Device) -> Result<Tensor> {
        candle_core::bail!("parameter {name} requested without a shape; seeded initialisation needs one")
    }

    fn contains_tensor(&self, name: &str) -> bool {
        match &self.params {
            Params::Trainable(vm) => vm.data().lock().unwrap().contains_key(name),
            Params::Frozen(map) => map.lock().unwrap().contains_key(name),
        }
    }
}

/// A host tensor uploaded into a new variable on `dev`: one device buffer, written once. (Making a
/// device tensor a variable copies it into a second buffer and frees the first, which leaves a hole
/// of each parameter's size among the parameters, which a trim cannot return: docs/kernels.md#memory.)
fn uploaded_var(t: &Tensor, dev: &Device) -> Result<Var> {
    let shape = t.shape().clone();
    let t = t.flatten_all()?;
    match t.dtype() {
        DType::F32 => Var::from_vec(t.to_vec1::<f32>()?, shape, dev),
        DType::F64 => Var::from_vec(t.to_vec1::<f64>()?, shape, dev),
        DType::BF16 => Var::from_vec(t.to_vec1::<half::bf16>()?, shape, dev),
        DType::F16 => Var::from_vec(t.to_vec1::<half::f16>()?, shape, dev),
        other => candle_core::bail!("parameters are f32, f64, bf16 or f16, not {other:?}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_and_name_give_same_values_whatever_the_order() {
        let a = Rng::for_name(7, "layer1.0.conv1.weight").normal_vec(4, 0.0, 1.0);
        let _ = Rng::for_name(7, "other").normal_vec(4, 0.0, 1.0);
        let b = Rng::for_name(7, "layer1.0.conv1.weight").normal_vec(4, 0.0, 1.0);
        assert_eq!(a, b);
        assert_ne!(a, Rng::for_name(8, "layer1.0.conv1.weight").normal_vec(4, 0.0, 1.0));
    }

    #[test]
    fn large_draws_on_every_core_are_the_serial_stream() {
        // Above the serial threshold, with an odd length so the last chunk is short.
        let n = (1 << 20) + 12_345;
        let mut parallel = Rng::new(3);
        let mut serial = Rng::new(3);
        let a = parallel.normal_vec(n, 0.0, 0.02);
        let b: Vec<f32> = (0..n).map(|_| (0.02 * serial.normal()) as f32).collect();
        assert!(a == b, "the chunks drew other values than the serial stream");
        // And the generator continues where the serial one does.
        assert_eq!(parallel.next_u64(), serial.next_u64());
    }

    #[test]
    fn normal_samples_have_the_asked_moments() {
        let v = Rng::new(1).normal_vec(100_000, 0.5, 2.0);
        let mean = v.iter().map(|&x| x as f64).sum::<f64>() / v.len() as f64;
        let var = v.iter().map(|&x| (x as f64 - mean).powi(2)).sum::<f64>() / v.len() as f64;
        assert!((mean - 0.5).abs() < 0.03, "mean {mean}");
        assert!((var.sqrt() - 2.0).abs() < 0.03, "std {}", var.sqrt());
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut rng = Rng::new(3);
        let mut seen = [false; 10];
        for _ in 0..1000 {
            let k = rng.below(10) as usize;
            assert!(k < 10);
            seen[k] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn kaiming_fan_out_has_torchvision_std() {
        // conv 64->128, 3x3: fan_out = 128*9, std = sqrt(2/fan_out).
        let shape = Shape::from((128, 64, 3, 3));
        let v = sample(KAIMING_NORMAL_FAN_OUT, &shape, &mut Rng::new(5));
        let std = (v.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / v.len() as f64).sqrt();
        let want = (2.0f64 / (128.0 * 9.0)).sqrt();
        assert!((std / want - 1.0).abs() < 0.02, "std {std} want {want}");
    }
}
