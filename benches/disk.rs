//! Disk tier benchmark (harness-less): tier write/read GB/s against a sequential `O_DIRECT` write
//! and read of the same bytes on the same filesystem in the same run, promotion latency, CPU time
//! per block, and the scheduler-side cost of a lookup that hits a file. See `kvoff::tier::file::bench`.
//!
//! `cargo bench --bench disk -- [DIR] [BLOCKS] [REPS] [IO_THREADS] [LAYOUT]` (defaults: `$TMPDIR` or
//! /tmp, 256 blocks, 5 repetitions, 8 threads, every layout).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use kvoff::tier::file::bench::{run, DiskBenchConfig};
use kvoff::tier::DirectIo;

fn main() {
    let args: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with("--"))
        .collect();
    let dir = args
        .first()
        .cloned()
        .unwrap_or_else(|| std::env::temp_dir().display().to_string());
    let blocks: usize = args.get(1).and_then(|s| s.parse().ok()).unwrap_or(256);
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(5);
    let threads: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(8);
    let only: Option<&str> = args.get(4).map(String::as_str);
    println!("disk tier on {dir}: {blocks} blocks per repetition, {reps} repetitions, {threads} I/O threads");
    println!(
        "{:<16} {:>9} {:>6} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>9} {:>6} {:>6} {:>9} {:>9} {:>8} {:>8} {:>8} {:>8}",
        "layout", "block", "direct", "fill_w", "tier_w", "seq_w", "seq_w_b", "scat_w", "tier_r", "seq_r", "seq_r_b", "scat_r", "w%", "r%",
        "prom_p50", "prom_p90", "cpu_w", "cpu_r", "cpu_seq", "lookup"
    );
    let layouts: [(&str, Vec<u64>); 3] = [
        ("2MiB", vec![2 << 20]),
        ("llama3-8b", vec![32 << 10; 64]),
        ("64x4KiB", vec![4 << 10; 64]),
    ];
    for (label, pages) in layouts {
        if only.is_some_and(|o| o != label) {
            continue;
        }
        let nb = if label == "64x4KiB" {
            blocks * 8
        } else {
            blocks
        };
        let cfg = DiskBenchConfig {
            dir: dir.clone().into(),
            label: label.into(),
            page_sizes_bytes: pages,
            num_blocks: nb,
            reps,
            io_threads: threads,
            direct_io: DirectIo::Auto,
        };
        match run(&cfg) {
            Ok(r) => println!(
                "{:<16} {:>9} {:>6} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>9.2} {:>6.0} {:>6.0} {:>8.0}us {:>8.0}us {:>6.0}us {:>6.0}us {:>6.0}us {:>6.0}ns",
                r.label, r.block_bytes, r.direct_io, r.fill_write_gbps, r.tier_write_gbps, r.seq_write_gbps,
                r.seq_write_block_req_gbps, r.scattered_write_gbps, r.tier_read_gbps, r.seq_read_gbps,
                r.seq_read_block_req_gbps, r.scattered_read_gbps, r.write_ratio * 100.0, r.read_ratio * 100.0,
                r.promotion_p50_us, r.promotion_p90_us, r.write_cpu_us_per_block,
                r.read_cpu_us_per_block, r.seq_cpu_us_per_block, r.lookup_hit_ns_per_key
            ),
            Err(e) => println!("{label:<16} failed: {e}"),
        }
    }
}
