//! What the GPU test binaries share.

use candle_core::{DType, Device, Tensor};

/// A tensor's elements on the host, in f32, in order.
pub fn host_values(t: &Tensor) -> Vec<f32> {
    t.to_device(&Device::Cpu)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap()
}
