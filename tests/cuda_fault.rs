//! A device error must fail the job, not the process (a kernel that touches an unmapped device
//! address raises a sticky CUDA error: the job and later ones report `success = false`). In its own test binary: a fault can poison
//! the CUDA context of the whole process.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]
#![cfg(feature = "cuda")]

use std::sync::Arc;

use kvoff::engine::cuda::{
    cuda_available, CopyMethod, CudaDevice, CudaEngine, CudaEngineConfig, DeviceBuffer,
};
use kvoff::engine::{Job, TransferEngine};
use kvoff::plan::{CopyOp, CopyPlan, Direction};

fn run_job(
    engine: &mut CudaEngine,
    job_id: i64,
    plan: CopyPlan,
    _stream: Option<u64>,
) -> kvoff::engine::JobResult {
    // SAFETY: the plan names an unmapped device address on purpose: the device faults, the host
    // memory is untouched.
    unsafe { engine.submit(Job::new(job_id, plan)) }.expect("submit");
    engine.wait(&[job_id]).unwrap();
    let mut res = engine.poll();
    assert_eq!(res.len(), 1);
    res.pop().unwrap()
}

/// A device error (a copy from an address that is not mapped) yields `success = false` with the
/// driver's text, never a crash.
#[test]
#[ignore = "needs a CUDA GPU"]
fn bad_address_fails_the_job_not_the_process() {
    assert!(
        cuda_available(),
        "no CUDA driver or device on this machine (this test needs a GPU)"
    );
    let dev = CudaDevice::open(0).unwrap();
    let gpu = DeviceBuffer::new(&dev, 4096).unwrap();
    let cfg = CudaEngineConfig {
        method: CopyMethod::Kernel,
        ..CudaEngineConfig::default()
    };
    let mut load = CudaEngine::new(Arc::clone(&dev), Direction::CpuToGpu, cfg).unwrap();
    let plan = CopyPlan::from_copies(
        Direction::CpuToGpu,
        vec![CopyOp {
            src_ptr: gpu.ptr() + (1 << 44),
            dst_ptr: gpu.ptr(),
            bytes: 4096,
        }],
    )
    .unwrap();
    let r = run_job(&mut load, 5, plan, None);
    assert!(!r.success);
    assert!(r.error.as_deref().is_some_and(|e| !e.is_empty()));
}
