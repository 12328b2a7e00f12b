//! CUDA transfer engine (docs/spec.md §6 on a GPU): moves a [`CopyPlan`](crate::plan::CopyPlan) between GPU memory and pinned host
//! memory on a pooled stream, choosing per job between batched DMA (`cuMemcpyBatchAsync`, one call
//! per job; a per-copy `cuMemcpyAsync` loop where the driver lacks it) and a gather/scatter copy
//! kernel over device-mapped host memory (`kernels/copy.cu`, shipped as PTX).
//!
//! Ordering: each job first waits on the caller's stream (an event recorded there at submission),
//! then runs on this engine's stream after the previous job, so jobs of one engine complete in
//! submission order. Loads use a higher-priority stream than stores. Each job is bracketed by two
//! pooled timing events; [`TransferEngine::poll`] queries them without blocking.
//!
//! Errors: a failing driver call during submission or execution never panics and never aborts the
//! process: the job is reported with `success = false` and the driver's error text. Errors while
//! releasing resources in `Drop` are recorded in [`CudaEngine::close_errors`].
//!
//! Files by concern (as cudarc's `driver/safe`): `ffi` (every driver call, checked), `handles`
//! (owned primary context, module, streams, events, device and pinned memory: released once, in `Drop` if not before),
//! `memory` (public buffers), `device` (context, kernels, registration), `config` (settings),
//! `choose` + `calibrate` (which method a job gets), `pace` (the serving policy's cap on staged traffic), `dma` + `pitched`, `kernel`, `staged` +
//! `pipeline` (the three copy methods), `engine` (submit, poll, wait, shutdown).
//!
//! Loading: the driver library is opened at run time (cudarc `dynamic-loading`); where there is
//! none, [`CudaDevice::open`] returns [`KvoffError::CudaUnavailable`] and nothing else is touched.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

mod calibrate;
mod choose;
mod config;
mod device;
mod dma;
mod engine;
mod ffi;
mod handles;
mod kernel;
mod memory;
mod pace;
mod pipeline;
mod pitched;
mod staged;

pub use calibrate::{CalRow, Calibration};
pub use config::{CopyMethod, CudaEngineConfig};
pub use device::{cuda_available, device_count, CudaDevice};
pub use dma::FeedStats;
pub use engine::CudaEngine;
pub use memory::{CudaStream, DeviceBuffer, PinnedBuffer};
pub(crate) use staged::{
    staged_chunk_count, staged_chunk_len, staged_desc_bound, StagedPacker, STAGED_MIN_JOB_BYTES,
};
