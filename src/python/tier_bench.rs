//! Bindings of the tier benchmarks (docs/tier.md): `bench_disk` runs [`crate::tier::bench`] for
//! one layout (`kvoff bench disk`), `NativeRemoteRef` the native-client reference of `kvoff bench
//! remote` ([`crate::tier::remote::native_ref`]), each call with the GIL released.
#![forbid(unsafe_code)]

use std::sync::{Mutex, PoisonError};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::args::{Int, PathArg};
use super::enter::blocking;
use super::names::parse_direct_io;
use crate::error::KvoffError;
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

/// The native-client reference of `kvoff bench remote` ([`NativeRef`]): `n_blocks` values of
/// `value_bytes` for the standalone `redis://` server at `url`, stored (`set`) and loaded (`get`)
/// in timed passes from N connections, each call with the GIL released; `close` deletes its keys.
#[pyclass(name = "NativeRemoteRef", module = "kvoff._native", frozen)]
struct PyNativeRef {
    inner: Mutex<Option<NativeRef>>,
}

impl PyNativeRef {
    fn with<R: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&mut NativeRef) -> crate::error::Result<R> + Send,
    ) -> PyResult<R> {
        blocking(py, || {
            let mut g = self.inner.lock().unwrap_or_else(PoisonError::into_inner);
            let r = g
                .as_mut()
                .ok_or_else(|| KvoffError::state("the native reference is closed"))?;
            f(r)
        })
    }
}

#[pymethods]
impl PyNativeRef {
    #[new]
    fn new(py: Python<'_>, url: String, value_bytes: Int, n_blocks: Int) -> PyResult<Self> {
        let value_bytes: usize = value_bytes.get("value_bytes")?;
        let n_blocks: usize = n_blocks.get("n_blocks")?;
        let r = blocking(py, move || NativeRef::new(&url, value_bytes, n_blocks))?;
        Ok(Self {
            inner: Mutex::new(Some(r)),
        })
    }

    /// Stores every value from `threads` connections (timed; an untimed first write before the
    /// first call); GB/s of values.
    fn set(&self, py: Python<'_>, threads: Int) -> PyResult<f64> {
        let t: usize = threads.get("threads")?;
        self.with(py, move |r| r.set_pass(t))
    }

    /// Loads every value from `threads` connections into host memory (timed); (GB/s of values,
    /// every byte equal to the stored one).
    fn get(&self, py: Python<'_>, threads: Int) -> PyResult<(f64, bool)> {
        let t: usize = threads.get("threads")?;
        self.with(py, move |r| r.get_pass(t))
    }

    /// Deletes the reference's keys from the server and frees its memory (later calls raise
    /// `InvalidStateError`); a second call does nothing.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        blocking(py, || {
            let r = self
                .inner
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .take();
            r.map_or(Ok(()), |r| r.cleanup())
        })
    }
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(bench_disk, m)?)?;
    m.add_class::<PyNativeRef>()?;
    Ok(())
}
