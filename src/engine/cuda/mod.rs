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
//! Files by concern (as cudarc's `driver/safe`): `ffi` (every driver call, checked) and
//! `telemetry` (their timing), `handles` (owned primary context, module, streams, events, device
//! and pinned memory: released once, in `Drop` if not before), `memory` (public buffers), `device`
//! (context, kernels, registration), `config` (settings), `scores`, `choose`, `calibration` and
//! `calibrate` (which method a job gets), `pace` (the serving policy's cap on staged traffic),
//! `feed` + `dma` + `pitched`, `kernel` + `launch`, `staged` + `pipeline` (the three copy methods),
//! `engine` (the engine's state and the per-submit `JobCtx`), `submit` (submit, poll, wait,
//! shutdown).
//!
//! Loading: the driver library is opened at run time (cudarc `dynamic-loading`); where there is
//! none, [`CudaDevice::open`] returns [`KvoffError::CudaUnavailable`] and nothing else is touched.
#![allow(unsafe_code)]
#![deny(unsafe_op_in_unsafe_fn)]

// Layers, lowest first; a file imports only files of lower layers (checked by
// scripts/import_cycles.py): telemetry → ffi → handles, pace → config, pitched → calibration,
// kernel → staged, scores → device → memory, feed → engine (the state and `JobCtx`) → choose,
// dma, launch, pipeline (what a job does) → submit (`TransferEngine`), calibrate.
mod calibrate;
mod calibration;
mod choose;
mod config;
mod device;
mod dma;
mod engine;
mod feed;
mod ffi;
mod handles;
mod kernel;
mod launch;
mod marks;
mod memory;
mod pace;
mod pipeline;
mod pitched;
mod scores;
mod share;
mod staged;
mod submit;
mod telemetry;

pub use calibration::{CalRow, Calibration};
pub use config::{CopyMethod, CudaEngineConfig, Polite};
pub use device::{cuda_available, device_count, CudaDevice};
pub use engine::CudaEngine;
pub use feed::FeedStats;
pub use memory::{CudaStream, DeviceBuffer, PinnedBuffer};
