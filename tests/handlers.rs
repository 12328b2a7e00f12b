//! `OffloadingHandlers` (the Rust counterpart of `CpuGpuOffloadingHandlers`, docs/spec.md §6): one
//! call sets up the region, planner and engines; blocks round-trip byte-exact through it.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting jobs over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use kvoff::engine::{EngineKind, EngineTensor};
use kvoff::handlers::{HandlersConfig, OffloadingHandlers};
use kvoff::plan::{Direction, GpuSpec, PlanRef, TensorDesc};

#[test]
fn host_handlers_round_trip_blocks() {
    let (blocks, page, tensors) = (8usize, 256usize, 3usize);
    let mut gpu: Vec<Vec<u8>> = (0..tensors)
        .map(|t| (0..blocks * page).map(|i| (i * 7 + t) as u8).collect())
        .collect();
    let descs: Vec<EngineTensor> = gpu
        .iter_mut()
        .map(|v| {
            EngineTensor::host(TensorDesc::contiguous(
                v.as_mut_ptr() as u64,
                blocks as u64,
                page as u64,
            ))
        })
        .collect();
    let refs = vec![(0..tensors).map(|t| PlanRef::new(t, page as u64)).collect()];
    let cfg = HandlersConfig {
        num_cpu_blocks: 4,
        ..HandlersConfig::default()
    };
    let mut h = OffloadingHandlers::new(&descs, refs, &cfg).unwrap();
    assert_eq!(h.engine_name(), "host");
    assert_eq!(h.pin_error(), None);
    let want: Vec<Vec<u8>> = gpu.iter().map(|v| v[2 * page..3 * page].to_vec()).collect();
    // SAFETY: `gpu` outlives the jobs (waited for below) and nothing else touches it meanwhile.
    unsafe { h.submit(1, Direction::GpuToCpu, &GpuSpec::new(&[2]), &[3], None) }.unwrap();
    h.wait(Direction::GpuToCpu, &[1]).unwrap();
    assert!(h.poll(Direction::GpuToCpu).iter().all(|r| r.success));
    for v in &mut gpu {
        v[5 * page..6 * page].fill(0);
    }
    // SAFETY: as above.
    unsafe { h.submit(2, Direction::CpuToGpu, &GpuSpec::new(&[5]), &[3], None) }.unwrap();
    h.wait(Direction::CpuToGpu, &[2]).unwrap();
    let r = h.poll(Direction::CpuToGpu);
    assert_eq!(r.len(), 1);
    assert!(r[0].success, "{:?}", r[0].error);
    for (t, v) in gpu.iter().enumerate() {
        assert_eq!(&v[5 * page..6 * page], &want[t][..], "tensor {t}");
    }
    h.shutdown();
}

#[test]
fn handlers_refuse_bad_settings() {
    let mut v = vec![0u8; 1024];
    let d = EngineTensor::host(TensorDesc::contiguous(v.as_mut_ptr() as u64, 4, 256));
    let refs = || vec![vec![PlanRef::new(0, 256)]];
    let bad = HandlersConfig {
        block_size_factor: 0,
        ..HandlersConfig::default()
    };
    assert!(OffloadingHandlers::new(&[d], refs(), &bad).is_err());
    assert!(OffloadingHandlers::new(&[], vec![], &HandlersConfig::default()).is_err());
    // Overlapping GPU-side tensors.
    assert!(OffloadingHandlers::new(
        &[d, d],
        vec![vec![PlanRef::new(0, 256), PlanRef::new(1, 256)]],
        &HandlersConfig::default()
    )
    .is_err());
    // A CUDA engine for host tensors is refused (CudaUnavailable here, or InvalidArgument on a GPU).
    let cuda = HandlersConfig {
        engine: EngineKind::Dma,
        ..HandlersConfig::default()
    };
    assert!(OffloadingHandlers::new(&[d], refs(), &cuda).is_err());
}
