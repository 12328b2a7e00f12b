//! Payload checksum benchmark (harness-less): `kvoff::tier::payload_sum` (twox-hash's
//! XXH3-64, AVX2 chosen at run time) against xxhash-rust's `xxh3_64` of the same build (its SIMD
//! chosen at compile time: SSE2 in a portable build), one-shot and streamed in 64 KiB pieces as a
//! socket delivers them, in the same run; docs/performance.md "Tier tuning table".
//!
//! `cargo bench --bench checksum -- [ROUNDS]` (default 5).
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::hint::black_box;
use std::time::Instant;

use kvoff::tier::{payload_sum, PayloadSum};

/// Seconds per call of `f`, the best of `reps` batches.
fn best(reps: usize, calls: usize, mut f: impl FnMut() -> u64) -> f64 {
    let mut best = f64::INFINITY;
    for _ in 0..reps {
        let t = Instant::now();
        for _ in 0..calls {
            black_box(f());
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    best
}

fn main() {
    let rounds: usize = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .and_then(|s| s.parse().ok())
        .unwrap_or(5);
    println!(
        "{:>8} {:>10} {:>10} {:>8} {:>12} {:>12} {:>8}",
        "payload", "kvoff_us", "xxh_rs_us", "ratio", "kvoff_str_us", "xxh_str_us", "ratio"
    );
    for len in [32usize << 10, 2 << 20] {
        let v: Vec<u8> = (0..len).map(|i| (i * 131 + (i >> 9)) as u8).collect();
        assert_eq!(payload_sum(&v), xxhash_rust::xxh3::xxh3_64(&v));
        let calls = (256 << 20) / len;
        let a = best(rounds, calls, || payload_sum(black_box(&v)));
        let b = best(rounds, calls, || xxhash_rust::xxh3::xxh3_64(black_box(&v)));
        let c = best(rounds, calls, || {
            let mut h = PayloadSum::new();
            for p in v.chunks(64 << 10) {
                h.update(black_box(p));
            }
            h.digest()
        });
        let d = best(rounds, calls, || {
            let mut h = xxhash_rust::xxh3::Xxh3::new();
            for p in v.chunks(64 << 10) {
                h.update(black_box(p));
            }
            h.digest()
        });
        println!(
            "{:>7}K {:>10.1} {:>10.1} {:>8.2} {:>12.1} {:>12.1} {:>8.2}",
            len >> 10,
            a * 1e6,
            b * 1e6,
            b / a,
            c * 1e6,
            d * 1e6,
            d / c
        );
    }
}
