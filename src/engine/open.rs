//! Making the engine of one handler (docs/spec.md §6): [`open`] takes an [`EngineKind`], the
//! tensors of both sides and the [`EngineOptions`], resolves the kind against the tensors'
//! placement ([`EngineKind::resolve`]) and returns the engine that serves. The Python bindings
//! and Rust servers (`examples/server_loop.rs`, through [`crate::handlers::OffloadingHandlers`])
//! both make their engines here.
#![forbid(unsafe_code)]

use super::{EngineKind, HostEngine, TransferEngine};
use crate::error::{KvoffError, Result};
use crate::plan::{Direction, TensorDesc};

/// The default `compute_budget` of the handlers (docs/performance.md, "How `auto` chooses a copy
/// method"): 2% of a compute-bound kernel's time, in basis points. The one place this default is
/// written; Python reads it as `kvoff._native.DEFAULT_COMPUTE_BUDGET`.
pub const DEFAULT_COMPUTE_BUDGET_BP: u32 = 200;

/// A `compute_budget` fraction (e.g. 0.02) in basis points.
///
/// # Errors
/// [`KvoffError::InvalidArgument`] unless the fraction is finite and in `[0, 1]`.
pub fn budget_bp(fraction: f64) -> Result<u32> {
    if fraction.is_finite() && (0.0..=1.0).contains(&fraction) {
        // In 0..=1, so the product fits a u32.
        #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
        Ok((fraction * 10_000.0).round() as u32)
    } else {
        Err(KvoffError::arg(format!(
            "compute_budget must be a fraction in [0, 1] or None, got {fraction}"
        )))
    }
}

/// One tensor of a handler as [`open`] sees it: its layout and where it lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineTensor {
    /// Layout (`num_blocks` rows of `row_bytes`).
    pub desc: TensorDesc,
    /// CUDA device index of the memory, `None` for host memory.
    pub cuda_device: Option<i64>,
}

impl EngineTensor {
    /// A tensor in host memory.
    #[must_use]
    pub fn host(desc: TensorDesc) -> Self {
        Self {
            desc,
            cuda_device: None,
        }
    }

    /// A tensor in the memory of CUDA device `ordinal`.
    #[must_use]
    pub fn cuda(desc: TensorDesc, ordinal: i64) -> Self {
        Self {
            desc,
            cuda_device: Some(ordinal),
        }
    }
}

/// Settings of the engine [`open`] makes, beside its kind.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct EngineOptions {
    /// The serving policy's budget in basis points ([`DEFAULT_COMPUTE_BUDGET_BP`] in the handlers;
    /// `None`: the idle-GPU policy always). The host engine has no use for it.
    pub compute_budget_bp: Option<u32>,
    /// `KVOFF_CUDA_TUNE`-style overrides of the CUDA engine's settings (`key=value,…`, see
    /// `CudaEngineConfig::apply_tuning`); callers pass the environment's (see [`Self::from_env`]).
    pub cuda_tune: Option<String>,
}

impl EngineOptions {
    /// Options with `compute_budget_bp` and the environment's `KVOFF_CUDA_TUNE` (the override the
    /// bindings and the example server apply).
    #[must_use]
    pub fn from_env(compute_budget_bp: Option<u32>) -> Self {
        Self {
            compute_budget_bp,
            cuda_tune: std::env::var("KVOFF_CUDA_TUNE").ok(),
        }
    }
}

/// Whether CUDA is usable here (a driver and a device; always `false` without the `cuda` feature).
#[must_use]
pub fn cuda_usable() -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cuda::cuda_available()
    }
    #[cfg(not(feature = "cuda"))]
    {
        false
    }
}

/// The engine of one handler moving `direction` between the GPU-side tensors `gpu` and the
/// CPU-side tensors `cpu`: a CUDA engine when [`EngineKind::resolve`] says so for `gpu`'s
/// placement, else the host engine. Returns it with its name (`"host"` or `"cuda:<method>"`).
/// Opening a device and calibrating make driver calls (the bindings release the GIL around this).
///
/// # Errors
/// [`KvoffError::InvalidArgument`] for CPU-side tensors in device memory, GPU-side tensors that do
/// not fit `kind` ([`EngineKind::resolve`]) or are not device memory of their device, `"kernel"`
/// over host memory that is not pinned, bad `cuda_tune`; [`KvoffError::CudaUnavailable`] where CUDA
/// is needed and unusable; [`KvoffError::Cuda`] from the driver.
pub fn open(
    kind: EngineKind,
    direction: Direction,
    gpu: &[EngineTensor],
    cpu: &[EngineTensor],
    options: &EngineOptions,
) -> Result<(Box<dyn TransferEngine>, String)> {
    if let Some(i) = cpu.iter().position(|t| t.cuda_device.is_some()) {
        return Err(KvoffError::arg(format!(
            "CPU-side tensor {i} is on cuda:{}; CPU-side tensors must be host memory",
            cpu[i].cuda_device.unwrap_or(0)
        )));
    }
    let placements: Vec<Option<i64>> = gpu.iter().map(|t| t.cuda_device).collect();
    if kind.resolve(&placements, &[], cuda_usable())? {
        open_cuda(kind, direction, gpu, cpu, options)
    } else {
        Ok((
            Box::new(HostEngine::new()?),
            EngineKind::Host.name().to_owned(),
        ))
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(
    kind: EngineKind,
    direction: Direction,
    gpu: &[EngineTensor],
    cpu: &[EngineTensor],
    options: &EngineOptions,
) -> Result<(Box<dyn TransferEngine>, String)> {
    use super::cuda::{CopyMethod, CudaDevice, CudaEngine, CudaEngineConfig};
    // `resolve` checked: CUDA is usable, every GPU-side tensor is a CUDA tensor, all on one device.
    let ordinal = gpu.first().and_then(|t| t.cuda_device).unwrap_or(0);
    let ordinal = i32::try_from(ordinal)
        .map_err(|_| KvoffError::arg(format!("bad CUDA device index {ordinal}")))?;
    let dev = CudaDevice::open(ordinal)?;
    for (i, t) in gpu.iter().enumerate() {
        if t.desc.num_blocks > 0 && !dev.is_device_ptr(t.desc.base_ptr)? {
            return Err(KvoffError::arg(format!(
                "GPU-side tensor {i} ({:#x}) is not device memory of cuda:{ordinal}",
                t.desc.base_ptr
            )));
        }
    }
    let mut host_mapped = true;
    for t in cpu.iter().filter(|t| t.desc.num_blocks > 0) {
        host_mapped &= dev.host_ptr_is_mapped(t.desc.base_ptr)?;
    }
    let method = CopyMethod::for_kind(kind).unwrap_or(CopyMethod::Auto);
    if method == CopyMethod::Kernel && !host_mapped {
        return Err(KvoffError::arg(
            "engine \"kernel\" needs pinned, device-mapped host memory (HostRegion.pin); the \
             CPU tensors are not pinned",
        ));
    }
    let mut cfg = CudaEngineConfig {
        method,
        host_mapped,
        compute_budget_bp: options.compute_budget_bp,
        ..CudaEngineConfig::default()
    };
    if let Some(spec) = &options.cuda_tune {
        cfg.apply_tuning(spec)?;
    }
    let e = CudaEngine::new(dev, direction, cfg)?;
    Ok((Box::new(e), format!("cuda:{}", method.name())))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(
    kind: EngineKind,
    _direction: Direction,
    _gpu: &[EngineTensor],
    _cpu: &[EngineTensor],
    _options: &EngineOptions,
) -> Result<(Box<dyn TransferEngine>, String)> {
    Err(KvoffError::CudaUnavailable(format!(
        "engine {:?} needs CUDA, but kvoff was built without the `cuda` feature",
        kind.name()
    )))
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    #[test]
    fn budget_fractions_and_host_engines() {
        assert_eq!(budget_bp(0.02).unwrap(), DEFAULT_COMPUTE_BUDGET_BP);
        assert!(budget_bp(1.5).is_err());
        assert!(budget_bp(f64::NAN).is_err());
        let d = TensorDesc::contiguous(0x1000, 4, 64);
        let (_, name) = open(
            EngineKind::Host,
            Direction::GpuToCpu,
            &[EngineTensor::host(d)],
            &[EngineTensor::host(d)],
            &EngineOptions::default(),
        )
        .unwrap();
        assert_eq!(name, "host");
        let e = open(
            EngineKind::Host,
            Direction::GpuToCpu,
            &[EngineTensor::host(d)],
            &[EngineTensor::cuda(d, 0)],
            &EngineOptions::default(),
        )
        .err()
        .unwrap();
        assert!(
            e.to_string().contains("CPU-side tensor 0 is on cuda:0"),
            "{e}"
        );
    }
}
