//! The memory pool.

use super::*;

#[test]
#[ignore = "needs a CUDA GPU"]
fn the_memory_pool_keeps_freed_memory_across_synchronisations_until_released() {
    use workloads::memory::{pool_allocations, pooled_bytes};
    let gpu = gpu();
    pool_allocations(&gpu).unwrap();
    // What earlier tests in this process left pooled would serve the allocation below.
    workloads::memory::release_pooled(&gpu).unwrap();
    let before = pooled_bytes(&gpu).unwrap().expect("CUDA allocations come from a pool");
    // 256 MiB allocated, used, freed; then a synchronisation, where a pool with the default
    // threshold would hand the memory back.
    let x = Tensor::ones(64 << 20, DType::F32, &gpu).unwrap();
    assert_eq!(x.max_all().unwrap().to_scalar::<f32>().unwrap(), 1.0);
    drop(x);
    gpu.synchronize().unwrap();
    let after = pooled_bytes(&gpu).unwrap().unwrap();
    // Between runs the pool is trimmed: the 256 MiB go back.
    workloads::memory::release_pooled(&gpu).unwrap();
    let released = pooled_bytes(&gpu).unwrap().unwrap();
    eprintln!("pooled: {before} bytes before, {after} after, {released} once released");
    assert!(
        after >= before + (256 << 20),
        "the pool kept {after} bytes (had {before})"
    );
    assert!(
        released + (256 << 20) <= after,
        "releasing left {released} of {after} bytes"
    );
}
