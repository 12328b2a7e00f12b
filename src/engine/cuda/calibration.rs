//! Per-device calibration of the `Auto` copy method: the table and how `Auto` reads it (measured by
//! `calibrate`).
//!
//! A short measurement on the device itself (about a second, once per device and driver, cached on disk)
//! of how fast each copy method moves scattered blocks in each direction: the kernel and batched DMA
//! by copy size, the staged pipeline by host-contiguous run length. `Auto` then picks, per job, the
//! method with the best estimate for the job's average copy size and run length (log-linear
//! interpolation between the measured sizes; staging only for jobs of at least two staging slots). When the other direction is active, kernel pairs are
//! known to share PCIe badly (docs/performance.md: 58–75 GB/s total against 82–100 for staged or DMA
//! pairs), so only DMA and staging are considered then, from 256 KiB runs.
//!
//! Cache: `$KVOFF_CACHE_DIR` or `$XDG_CACHE_HOME/kvoff` or `~/.cache/kvoff`, file
//! `calibration-<device uuid>-<driver version>[-debug].txt`, one `direction method bytes page gbps` line per
//! measurement. `KVOFF_CALIBRATION=off` disables calibration (the built-in thresholds are used),
//! `KVOFF_CALIBRATION=force` measures again.

use std::fmt::Write as _;
use std::path::PathBuf;

use crate::plan::Direction;

use super::config::CopyMethod;

/// One measurement: `method` moving copies (kernel, DMA) or host runs (staged) of `bytes` each.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CalRow {
    /// Direction measured.
    pub direction: Direction,
    /// `Kernel`, `Dma` or `Staged`.
    pub method: CopyMethod,
    /// Copy size (kernel, DMA) or host run length (staged), bytes.
    pub bytes: u64,
    /// Staged rows: the page (copy) size the runs were made of; 0 for kernel and DMA rows.
    pub page: u64,
    /// Measured throughput, GB/s.
    pub gbps: f64,
}

/// The measurements of one device.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Calibration {
    /// All rows.
    pub rows: Vec<CalRow>,
}

/// Copy sizes measured for the kernel and DMA.
pub(crate) const COPY_SIZES: [u64; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// Host run lengths measured for the staged method.
pub(crate) const RUN_SIZES: [u64; 4] = [64 << 10, 256 << 10, 1 << 20, 4 << 20];
/// Page sizes the staged runs are made of (its gather/scatter side depends on them).
pub(crate) const STAGED_PAGES: [u64; 2] = [4 << 10, 32 << 10];
/// Runs from which staging is considered when the other direction is active.
const CONCURRENT_MIN_RUN: u64 = 256 << 10;

fn dir_name(d: Direction) -> &'static str {
    match d {
        Direction::GpuToCpu => "d2h",
        Direction::CpuToGpu => "h2d",
    }
}

impl Calibration {
    /// Estimated GB/s of `method` in `direction` at `bytes` (log-linear between measurements,
    /// clamped at the ends); `None` when nothing was measured. Staged rows of every page size are
    /// pooled; see [`Calibration::estimate_staged`].
    #[must_use]
    pub fn estimate(&self, direction: Direction, method: CopyMethod, bytes: u64) -> Option<f64> {
        self.estimate_at(direction, method, bytes, None)
    }

    /// Staged estimate for runs of `run` bytes made of `page`-byte copies: interpolated over the
    /// run length for each measured page size, then (log-linearly, clamped) over the page size.
    #[must_use]
    #[allow(clippy::cast_precision_loss)] // sizes < 2^53
    pub fn estimate_staged(&self, direction: Direction, run: u64, page: u64) -> Option<f64> {
        let mut pages: Vec<u64> = self
            .rows
            .iter()
            .filter(|r| r.direction == direction && r.method == CopyMethod::Staged)
            .map(|r| r.page)
            .collect();
        pages.sort_unstable();
        pages.dedup();
        let pts: Vec<(f64, f64)> = pages
            .iter()
            .filter_map(|&p| {
                self.estimate_at(direction, CopyMethod::Staged, run, Some(p))
                    .map(|g| ((p.max(1) as f64).log2(), g))
            })
            .collect();
        interpolate(&pts, (page.max(1) as f64).log2())
    }

    #[allow(clippy::cast_precision_loss)] // sizes < 2^53
    fn estimate_at(
        &self,
        direction: Direction,
        method: CopyMethod,
        bytes: u64,
        page: Option<u64>,
    ) -> Option<f64> {
        let mut pts: Vec<(f64, f64)> = self
            .rows
            .iter()
            .filter(|r| {
                r.direction == direction && r.method == method && page.is_none_or(|p| r.page == p)
            })
            .map(|r| ((r.bytes.max(1) as f64).log2(), r.gbps))
            .collect();
        pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        interpolate(&pts, (bytes.max(1) as f64).log2())
    }

    /// The method to use for a job with this average copy size and host run length (0 when the
    /// job cannot be staged usefully).
    #[must_use]
    pub fn choose(
        &self,
        direction: Direction,
        avg_copy_bytes: u64,
        avg_run_bytes: u64,
        host_mapped: bool,
        other_busy: bool,
    ) -> Option<CopyMethod> {
        let dma = self.estimate(direction, CopyMethod::Dma, avg_copy_bytes);
        let staged_ok =
            avg_run_bytes >= RUN_SIZES[0] && (!other_busy || avg_run_bytes >= CONCURRENT_MIN_RUN);
        let staged = staged_ok
            .then(|| self.estimate_staged(direction, avg_run_bytes, avg_copy_bytes))
            .flatten();
        let kernel = (host_mapped && !(other_busy && staged.is_some()))
            .then(|| self.estimate(direction, CopyMethod::Kernel, avg_copy_bytes))
            .flatten();
        [
            (CopyMethod::Dma, dma),
            (CopyMethod::Staged, staged),
            (CopyMethod::Kernel, kernel),
        ]
        .into_iter()
        .filter_map(|(m, g)| g.map(|g| (m, g)))
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map(|(m, _)| m)
    }

    /// The cache file's text.
    #[must_use]
    pub fn to_text(&self) -> String {
        let mut s = String::from("# kvoff calibration: direction method bytes page gbps\n");
        for r in &self.rows {
            let _ = writeln!(
                s,
                "{} {} {} {} {:.3}",
                dir_name(r.direction),
                r.method.name(),
                r.bytes,
                r.page,
                r.gbps
            );
        }
        s
    }

    /// Parses [`Calibration::to_text`]; `None` if any line is malformed.
    #[must_use]
    pub fn from_text(text: &str) -> Option<Self> {
        let mut rows = Vec::new();
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            let mut it = line.split_whitespace();
            let direction = match it.next()? {
                "d2h" => Direction::GpuToCpu,
                "h2d" => Direction::CpuToGpu,
                _ => return None,
            };
            let method = CopyMethod::parse(it.next()?).ok()?;
            let bytes = it.next()?.parse().ok()?;
            let page = it.next()?.parse().ok()?;
            let gbps: f64 = it.next()?.parse().ok()?;
            if it.next().is_some() || !gbps.is_finite() {
                return None;
            }
            rows.push(CalRow {
                direction,
                method,
                bytes,
                page,
                gbps,
            });
        }
        (!rows.is_empty()).then_some(Self { rows })
    }
}

/// Piecewise-linear interpolation through points sorted by x, clamped at the ends.
fn interpolate(pts: &[(f64, f64)], x: f64) -> Option<f64> {
    let (first, last) = (*pts.first()?, *pts.last()?);
    if x <= first.0 {
        return Some(first.1);
    }
    if x >= last.0 {
        return Some(last.1);
    }
    for w in pts.windows(2) {
        let ((x0, y0), (x1, y1)) = (w[0], w[1]);
        if x >= x0 && x <= x1 {
            let t = if x1 > x0 { (x - x0) / (x1 - x0) } else { 0.0 };
            return Some(y0 + t * (y1 - y0));
        }
    }
    Some(last.1)
}

/// Where the calibration of a device is cached.
pub(crate) fn cache_path(uuid: &str, driver: i32) -> Option<PathBuf> {
    let dir = std::env::var_os("KVOFF_CACHE_DIR")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("kvoff")))
        .or_else(|| {
            std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("kvoff"))
        })?;
    // Debug builds prepare jobs far slower on the CPU, which end-to-end timing sees: keep their
    // measurements apart.
    let profile = if cfg!(debug_assertions) { "-debug" } else { "" };
    Some(dir.join(format!("calibration-{uuid}-{driver}{profile}.txt")))
}

#[cfg(test)]
#[allow(clippy::pedantic)] // tests: style lints are for the library
mod tests {
    use super::*;

    fn table() -> Calibration {
        let mut rows = Vec::new();
        for (dir, k4, kbig, d4, dbig, s64, sbig) in [
            (Direction::GpuToCpu, 50.0, 52.0, 12.0, 55.0, 40.0, 54.0),
            (Direction::CpuToGpu, 49.0, 51.0, 3.5, 55.0, 45.0, 54.5),
        ] {
            let row = |method, bytes, page, gbps| CalRow {
                direction: dir,
                method,
                bytes,
                page,
                gbps,
            };
            rows.push(row(CopyMethod::Kernel, 4 << 10, 0, k4));
            rows.push(row(CopyMethod::Kernel, 4 << 20, 0, kbig));
            rows.push(row(CopyMethod::Dma, 4 << 10, 0, d4));
            rows.push(row(CopyMethod::Dma, 4 << 20, 0, dbig));
            // Staged from 32 KiB pages as given; from 4 KiB pages 5 GB/s slower.
            rows.push(row(CopyMethod::Staged, 64 << 10, 32 << 10, s64));
            rows.push(row(CopyMethod::Staged, 4 << 20, 32 << 10, sbig));
            rows.push(row(CopyMethod::Staged, 64 << 10, 4 << 10, s64 - 5.0));
            rows.push(row(CopyMethod::Staged, 4 << 20, 4 << 10, sbig - 5.0));
        }
        Calibration { rows }
    }

    #[test]
    fn estimate_interpolates_and_clamps() {
        let c = table();
        let d = Direction::GpuToCpu;
        assert_eq!(c.estimate(d, CopyMethod::Kernel, 1), Some(50.0));
        assert_eq!(c.estimate(d, CopyMethod::Kernel, 1 << 30), Some(52.0));
        let mid = c.estimate(d, CopyMethod::Dma, 128 << 10).unwrap(); // halfway in log2
        assert!((mid - 33.5).abs() < 1e-9, "{mid}");
        assert_eq!(c.estimate(d, CopyMethod::Loop, 4096), None);
    }

    #[test]
    fn choose_picks_the_fastest_estimate() {
        let c = table();
        let d = Direction::GpuToCpu;
        // Small pages, short runs: kernel.
        assert_eq!(
            c.choose(d, 4 << 10, 4 << 10, true, false),
            Some(CopyMethod::Kernel)
        );
        // Unpinned host memory: never the kernel.
        assert_eq!(
            c.choose(d, 4 << 10, 4 << 10, false, false),
            Some(CopyMethod::Dma)
        );
        // Staged estimates depend on the page size too.
        assert_eq!(c.estimate_staged(d, 4 << 20, 32 << 10), Some(54.0));
        assert_eq!(c.estimate_staged(d, 4 << 20, 4 << 10), Some(49.0));
        // Long runs: staged; huge copies: DMA.
        assert_eq!(
            c.choose(d, 32 << 10, 4 << 20, true, false),
            Some(CopyMethod::Staged)
        );
        assert_eq!(
            c.choose(d, 8 << 20, 8 << 20, true, false),
            Some(CopyMethod::Dma)
        );
        // Other direction busy with 256 KiB runs: staged even where the kernel is faster alone.
        assert_eq!(
            c.choose(d, 4 << 10, 256 << 10, true, false),
            Some(CopyMethod::Kernel)
        );
        assert_eq!(
            c.choose(d, 4 << 10, 256 << 10, true, true),
            Some(CopyMethod::Staged)
        );
        // ... but not from short runs.
        assert_eq!(
            c.choose(d, 4 << 10, 64 << 10, true, true),
            Some(CopyMethod::Kernel)
        );
        assert_eq!(
            Calibration::default().choose(d, 4096, 4096, true, false),
            None
        );
    }

    #[test]
    fn text_round_trip() {
        let c = table();
        assert_eq!(Calibration::from_text(&c.to_text()), Some(c));
        assert_eq!(Calibration::from_text("d2h kernel 4096 0"), None);
        assert_eq!(Calibration::from_text("x kernel 1 2"), None);
        assert_eq!(Calibration::from_text("# only a comment\n"), None);
    }
}
