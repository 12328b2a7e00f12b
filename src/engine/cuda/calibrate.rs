//! Measuring the calibration of one device (see `calibration` for the table and how `Auto`
//! reads it): about a second of copies by each method, once per device and driver, cached on disk.
// Unsafe: none here beyond the engine's `submit` contract (each block says why it is sound).
#![allow(unsafe_code)]

use std::sync::Arc;

use super::calibration::{cache_path, CalRow, Calibration, COPY_SIZES, RUN_SIZES, STAGED_PAGES};
use super::config::{CopyMethod, CudaEngineConfig};
use super::device::CudaDevice;
use super::engine::CudaEngine;
use super::ffi;
use super::memory::{DeviceBuffer, PinnedBuffer};
use crate::engine::TransferEngine;
use crate::error::{KvoffError, Result};
use crate::plan::{CopyOp, CopyPlan, Direction};

impl CudaDevice {
    /// The calibration `Auto` uses on this device: loaded from the on-disk cache, or measured now
    /// (about a second, see the `calibrate` module) and cached. `None` when `KVOFF_CALIBRATION=off` or
    /// the measurement failed (then `Auto` uses its built-in thresholds).
    pub fn calibration(self: &Arc<Self>) -> Option<Arc<Calibration>> {
        self.calibration
            .get_or_init(|| {
                let mode = std::env::var("KVOFF_CALIBRATION").unwrap_or_default();
                if mode == "off" {
                    return None;
                }
                self.bind().ok()?;
                // SAFETY: the device was opened by `open`.
                let path = unsafe { ffi::device_identity(self.dev) }
                    .ok()
                    .and_then(|(uuid, driver)| cache_path(&uuid, driver));
                if mode != "force" {
                    if let Some(c) = path
                        .as_ref()
                        .and_then(|p| std::fs::read_to_string(p).ok())
                        .and_then(|t| Calibration::from_text(&t))
                    {
                        return Some(Arc::new(c));
                    }
                }
                let c = measure(self).ok()?;
                if let Some(p) = path {
                    if let Some(dir) = p.parent() {
                        let _ = std::fs::create_dir_all(dir);
                    }
                    // Write then rename, so a concurrent reader never sees half a file.
                    let tmp = p.with_extension(format!("tmp{}", std::process::id()));
                    if std::fs::write(&tmp, c.to_text()).is_ok() {
                        let _ = std::fs::rename(&tmp, &p);
                    }
                }
                Some(Arc::new(c))
            })
            .clone()
    }
}

/// Measures the copy methods on `dev` for [`Calibration`], end to end (host clock from submission to
/// completion): 128 MiB jobs of scattered copies (kernel,
/// DMA) or of scattered 32 KiB pages grouped into host-contiguous runs (staged), each direction,
/// median of three after a warm-up.
fn measure(dev: &Arc<CudaDevice>) -> Result<Calibration> {
    // Jobs large enough that launch and pipeline ramp-up do not dominate (16 MiB jobs measured
    // the staged pipeline at 44 GB/s where 512 MiB jobs reach 54).
    const BUF: u64 = 256 << 20;
    const JOB: u64 = 128 << 20;
    let gpu = DeviceBuffer::new(dev, crate::usize_from(BUF))?;
    let host = PinnedBuffer::new(dev, crate::usize_from(BUF))?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    // `k` distinct slots of `unit` bytes in the buffer, shuffled.
    let mut slots = |unit: u64, k: usize| -> Vec<u64> {
        let n = crate::usize_from(BUF / unit);
        let mut v: Vec<u64> = (0..n as u64).collect();
        for i in 0..k.min(n) {
            let j = i + crate::usize_from(next() % (n - i) as u64);
            v.swap(i, j);
        }
        v.truncate(k);
        v
    };
    let mut rows = Vec::new();
    for dir in [Direction::GpuToCpu, Direction::CpuToGpu] {
        // (method, copy size or run length, page size of staged runs)
        let mut points: Vec<(CopyMethod, u64, u64)> = Vec::new();
        for m in [CopyMethod::Kernel, CopyMethod::Dma] {
            points.extend(COPY_SIZES.iter().map(|&b| (m, b, 0)));
        }
        for &p in &STAGED_PAGES {
            points.extend(RUN_SIZES.iter().map(|&b| (CopyMethod::Staged, b, p)));
        }
        for method in [CopyMethod::Kernel, CopyMethod::Dma, CopyMethod::Staged] {
            let mut cfg = CudaEngineConfig {
                method,
                calibrate: false,
                // Per-copy DMA: the calibrated rate must hold for any job, pitched or not.
                dma_pitched: false,
                ..CudaEngineConfig::default()
            };
            cfg.apply_env_tuning()?;
            let mut eng = CudaEngine::new(Arc::clone(dev), dir, cfg)?;
            for &(_, size, staged_page) in points.iter().filter(|p| p.0 == method) {
                // Kernel/DMA: copies of `size`; staged: `staged_page` pages in host runs of `size`.
                let page = if method == CopyMethod::Staged {
                    size.min(staged_page)
                } else {
                    size
                };
                let n = crate::usize_from(JOB / page);
                let gslots = slots(page, n);
                let per_run = crate::usize_from(size / page);
                let hruns = slots(size, n.div_ceil(per_run));
                let copies: Vec<CopyOp> = (0..n)
                    .map(|i| {
                        let g = gpu.ptr() + gslots[i] * page;
                        let h =
                            host.ptr() + hruns[i / per_run] * size + (i % per_run) as u64 * page;
                        match dir {
                            Direction::GpuToCpu => CopyOp {
                                src_ptr: g,
                                dst_ptr: h,
                                bytes: page,
                            },
                            Direction::CpuToGpu => CopyOp {
                                src_ptr: h,
                                dst_ptr: g,
                                bytes: page,
                            },
                        }
                    })
                    .collect();
                let mut secs = Vec::new();
                for rep in 0..4i64 {
                    let plan = CopyPlan::from_copies(dir, copies.clone())?;
                    // End to end, from submission to completion: the CPU work of a method (the
                    // batch call spends milliseconds in the driver for thousands of copies) is
                    // part of what a waiting request pays.
                    let t0 = std::time::Instant::now();
                    // SAFETY: the buffers outlive the engine's jobs (waited for below).
                    unsafe { eng.submit(crate::engine::Job::new(rep, plan)) }?;
                    eng.wait(&[rep])?;
                    let wall = t0.elapsed().as_secs_f64();
                    for r in eng.poll() {
                        if !r.success {
                            return Err(KvoffError::cuda(r.error.unwrap_or_default()));
                        }
                        if rep > 0 {
                            secs.push(wall);
                        }
                    }
                }
                secs.sort_by(f64::total_cmp);
                let s = secs.get(secs.len() / 2).copied().unwrap_or(0.0);
                if s > 0.0 {
                    #[allow(clippy::cast_precision_loss)]
                    rows.push(CalRow {
                        direction: dir,
                        method,
                        bytes: size,
                        page: if method == CopyMethod::Staged {
                            staged_page
                        } else {
                            0
                        },
                        gbps: JOB as f64 / s / 1e9,
                    });
                }
            }
            eng.shutdown();
        }
    }
    Ok(Calibration { rows })
}
