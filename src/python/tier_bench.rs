//! Bindings of the tier benchmarks (docs/tier.md): `bench_disk` runs [`crate::tier::bench`] for
//! one layout (`kvoff bench disk`), `bench_remote_native` the native-client reference of `kvoff
//! bench remote` ([`crate::tier::remote::native_ref`]), each with the GIL released.
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{Int, PathArg};
use super::enter::blocking;
use super::names::parse_direct_io;
use crate::tier::bench::{run as run_bench, DiskBenchConfig};
use crate::tier::remote::native_ref::NativeRef;

/// Runs the disk benchmark for one layout (GIL released) and returns its row as a dict.
#[pyfunction]
#[pyo3(signature = (dir, label, page_sizes, num_blocks = Int::of(256), reps = Int::of(5), io_threads = Int::of(8), direct_io = "auto"))]
#[allow(clippy::too_many_arguments)]
fn bench_disk<'py>(
    py: Python<'py>,
    dir: PathArg,
    label: String,
    page_sizes: Vec<Int>,
    num_blocks: Int,
    reps: Int,
    io_threads: Int,
    direct_io: &str,
) -> PyResult<Bound<'py, PyDict>> {
    let cfg = DiskBenchConfig {
        dir: dir.0,
        label,
        page_sizes_bytes: page_sizes
            .into_iter()
            .map(|p| p.get::<u64>("page_sizes[i]"))
            .collect::<PyResult<_>>()?,
        num_blocks: num_blocks.get("num_blocks")?,
        reps: reps.get("reps")?,
        io_threads: io_threads.get("io_threads")?,
        direct_io: parse_direct_io(direct_io)?,
    };
    let r = blocking(py, || run_bench(&cfg))?;
    let d = PyDict::new(py);
    d.set_item("label", r.label)?;
    d.set_item("block_bytes", r.block_bytes)?;
    d.set_item("num_blocks", r.num_blocks)?;
    d.set_item("io_threads", r.io_threads)?;
    d.set_item("direct_io", r.direct_io)?;
    d.set_item("baseline_direct_io", r.baseline_direct_io)?;
    d.set_item("fill_write_gbps", r.fill_write_gbps)?;
    d.set_item("tier_write_gbps", r.tier_write_gbps)?;
    d.set_item("tier_read_gbps", r.tier_read_gbps)?;
    d.set_item("seq_write_gbps", r.seq_write_gbps)?;
    d.set_item("seq_read_gbps", r.seq_read_gbps)?;
    d.set_item("seq_write_block_req_gbps", r.seq_write_block_req_gbps)?;
    d.set_item("seq_read_block_req_gbps", r.seq_read_block_req_gbps)?;
    d.set_item("scattered_write_gbps", r.scattered_write_gbps)?;
    d.set_item("scattered_read_gbps", r.scattered_read_gbps)?;
    d.set_item("write_ratio", r.write_ratio)?;
    d.set_item("read_ratio", r.read_ratio)?;
    d.set_item("promotion_p50_us", r.promotion_p50_us)?;
    d.set_item("promotion_p90_us", r.promotion_p90_us)?;
    d.set_item("write_cpu_us_per_block", r.write_cpu_us_per_block)?;
    d.set_item("read_cpu_us_per_block", r.read_cpu_us_per_block)?;
    d.set_item("seq_cpu_us_per_block", r.seq_cpu_us_per_block)?;
    d.set_item("lookup_hit_ns_per_key", r.lookup_hit_ns_per_key)?;
    Ok(d)
}

/// The native-client reference of `kvoff bench remote`: `n_blocks` values of `value_bytes` stored
/// and loaded once per entry of `threads` (GIL released), the keys deleted at the end. Returns a
/// list of dicts `{threads, set_gb_s, get_gb_s, verified}`, one per pass in order.
#[pyfunction]
#[pyo3(signature = (url, value_bytes, n_blocks, threads))]
fn bench_remote_native(
    py: Python<'_>,
    url: String,
    value_bytes: Int,
    n_blocks: Int,
    threads: Vec<Int>,
) -> PyResult<Vec<Bound<'_, PyDict>>> {
    let value_bytes: usize = value_bytes.get("value_bytes")?;
    let n_blocks: usize = n_blocks.get("n_blocks")?;
    let threads = threads
        .into_iter()
        .map(|t| t.get::<usize>("threads[i]"))
        .collect::<PyResult<Vec<_>>>()?;
    let passes = blocking(py, move || {
        let mut r = NativeRef::new(&url, value_bytes, n_blocks)?;
        let out = threads
            .iter()
            .map(|&t| r.pass(t))
            .collect::<crate::error::Result<Vec<_>>>();
        let cleaned = r.cleanup();
        let out = out?;
        cleaned.map(|()| out)
    })?;
    passes
        .into_iter()
        .map(|p| {
            let d = PyDict::new(py);
            d.set_item("threads", p.threads)?;
            d.set_item("set_gb_s", p.set_gb_s)?;
            d.set_item("get_gb_s", p.get_gb_s)?;
            d.set_item("verified", p.verified)?;
            Ok(d)
        })
        .collect()
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bench_disk, m)?)?;
    m.add_function(wrap_pyfunction!(bench_remote_native, m)?)?;
    Ok(())
}
