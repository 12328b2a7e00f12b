//! `ChainManagerCore.get_stats()`'s dict: the host gauges (docs/spec.md §2.2) plus each tier's
//! counters and gauges under `<kind>_<name>` (the Python names and Prometheus names of each tier's
//! keys: `kvoff.tiers.METRICS`).
#![forbid(unsafe_code)]

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::tier::chain::ChainTierStats;

/// Stats keys of one tier: `<kind>_<name>`, with the file tier's historical names
/// (`disk_files_written`, `disk_corrupt_files`) and the remote tier's `remote_rejected_values`.
fn tier_stats(d: &Bound<'_, PyDict>, s: &ChainTierStats) -> PyResult<()> {
    let p = s.kind;
    let t = &s.tier;
    let c = &s.chain;
    let (writes, rejected) = if p == "disk" {
        ("files_written", "corrupt_files")
    } else {
        ("writes", "rejected_values")
    };
    let put = |name: &str, v: u64| d.set_item(format!("{p}_{name}"), v);
    put(writes, t.writes)?;
    put("bytes_written", t.bytes_written)?;
    d.set_item(format!("{p}_write_seconds"), t.write_seconds)?;
    put("write_errors", t.write_errors)?;
    put("writes_dropped", t.writes_dropped)?;
    put("promotions", t.promotions)?;
    put("bytes_read", t.bytes_read)?;
    d.set_item(format!("{p}_read_seconds"), t.read_seconds)?;
    put("read_errors", t.read_errors)?;
    put(rejected, t.rejected)?;
    put("queued_reads", t.queued_reads)?;
    put("queued_writes", t.queued_writes)?;
    d.set_item(format!("{p}_last_error"), t.last_error.clone())?;
    put("hits", c.hits)?;
    put("misses", c.misses)?;
    put("promotions_started", c.promotions_started)?;
    put("promotions_failed", c.promotions_failed)?;
    put("promotions_no_room", c.promotions_no_room)?;
    put("writes_started", c.writes_started)?;
    put("writes_refused", c.writes_refused)?;
    put("writes_below_threshold", c.writes_below_threshold)?;
    if p != "disk" {
        put("fetches", c.fetches)?;
        put("fetch_keys", c.fetch_keys)?;
        put("fetch_hits", t.fetch_hits)?;
        put("fetch_misses", t.fetch_misses)?;
        put("fetch_errors", t.fetch_errors)?;
        put("reconnects", t.reconnects)?;
    }
    Ok(())
}

/// Host gauges (docs/spec.md §2.2) plus every tier's counters and gauges.
pub(super) fn stats_dict<'py>(
    py: Python<'py>,
    h: &crate::manager::ManagerStats,
    tiers: &[ChainTierStats],
    extra: Vec<(&'static str, Vec<(&'static str, u64)>)>,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("usage", h.usage)?;
    d.set_item("write_usage", h.write_usage)?;
    d.set_item("read_usage", h.read_usage)?;
    d.set_item("num_blocks", h.num_blocks)?;
    d.set_item("num_present", h.num_present)?;
    d.set_item("num_free", h.num_free)?;
    d.set_item("num_evictable", h.num_evictable)?;
    d.set_item("stores_skipped", h.stores_skipped)?;
    for s in tiers {
        tier_stats(&d, s)?;
    }
    for (kind, kv) in extra {
        for (name, v) in kv {
            if kind == "disk" && name == "direct_io" {
                d.set_item("disk_direct_io", v != 0)?;
            } else {
                d.set_item(format!("{kind}_{name}"), v)?;
            }
        }
    }
    Ok(d)
}
