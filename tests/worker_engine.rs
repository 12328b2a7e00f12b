//! Host engine contract: ordering, polling, waiting, id reuse, shutdown with jobs in flight.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use kvoff::engine::{HostEngine, Job, TransferEngine};
use kvoff::plan::{CopyOp, CopyPlan, Direction};
use kvoff::KvoffError;

/// A plan copying all of `src` into `dst` in `pieces` equal copies.
fn plan(src: &[u8], dst: &mut [u8], pieces: usize, dir: Direction) -> CopyPlan {
    assert_eq!(src.len(), dst.len());
    assert_eq!(src.len() % pieces, 0);
    let n = src.len() / pieces;
    let copies = (0..pieces)
        .map(|k| CopyOp {
            src_ptr: src.as_ptr() as u64 + (k * n) as u64,
            dst_ptr: dst.as_mut_ptr() as u64 + (k * n) as u64,
            bytes: n as u64,
        })
        .collect();
    CopyPlan::from_copies(dir, copies).unwrap()
}

#[test]
fn results_in_submission_order_and_wait() {
    let src: Vec<Vec<u8>> = (0..10).map(|k| vec![k as u8 + 1; 1 << 20]).collect();
    let mut dst: Vec<Vec<u8>> = (0..10).map(|_| vec![0u8; 1 << 20]).collect();
    let mut e = HostEngine::new().unwrap();
    for (k, (s, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
        let dir = if k % 2 == 0 {
            Direction::GpuToCpu
        } else {
            Direction::CpuToGpu
        };
        // SAFETY: src/dst buffers are distinct, alive and untouched until `wait` below.
        unsafe {
            e.submit(Job::new(100 + k as i64, plan(s, d, 16, dir)))
                .unwrap()
        };
    }
    e.wait(&[109, 12345]).unwrap(); // unknown id ignored
    let r = e.poll();
    assert_eq!(
        r.iter().map(|r| r.job_id).collect::<Vec<_>>(),
        (100..110).collect::<Vec<_>>()
    );
    for (k, res) in r.iter().enumerate() {
        assert!(res.success);
        assert_eq!(res.bytes, 1 << 20);
        assert!(res.seconds >= 0.0);
        let want = if k % 2 == 0 {
            Direction::GpuToCpu
        } else {
            Direction::CpuToGpu
        };
        assert_eq!(res.direction, want);
        assert_eq!(
            want.transfer_type().0,
            if k % 2 == 0 { "GPU" } else { "CPU" }
        );
    }
    assert!(dst == src, "bytes differ");
    assert!(e.poll().is_empty(), "each result is returned once");
    e.wait(&[100]).unwrap(); // already polled: returns at once
}

#[test]
fn busy_job_id_is_rejected_and_nothing_written() {
    let big = vec![7u8; 32 << 20];
    let mut big_dst = vec![0u8; 32 << 20];
    let small = vec![9u8; 4096];
    let mut sentinel = vec![0u8; 4096];
    let mut e = HostEngine::new().unwrap();
    // SAFETY: buffers alive and untouched until waited.
    unsafe {
        e.submit(Job::new(
            1,
            plan(&big, &mut big_dst, 4, Direction::GpuToCpu),
        ))
        .unwrap()
    };
    // SAFETY: as above (the job is rejected anyway).
    let again = unsafe {
        e.submit(Job::new(
            1,
            plan(&small, &mut sentinel, 1, Direction::GpuToCpu),
        ))
    };
    assert!(
        matches!(again, Err(KvoffError::InvalidArgument(_))),
        "{again:?}"
    );
    e.wait(&[1]).unwrap();
    // Finished but not polled: still busy.
    // SAFETY: as above.
    let again = unsafe {
        e.submit(Job::new(
            1,
            plan(&small, &mut sentinel, 1, Direction::GpuToCpu),
        ))
    };
    assert!(again.is_err());
    assert_eq!(e.poll().len(), 1);
    assert!(
        sentinel.iter().all(|&b| b == 0),
        "a rejected job wrote bytes"
    );
    // After polling, the id can be used again.
    // SAFETY: as above.
    unsafe {
        e.submit(Job::new(
            1,
            plan(&small, &mut sentinel, 1, Direction::GpuToCpu),
        ))
        .unwrap()
    };
    e.wait(&[1]).unwrap();
    assert!(e.poll()[0].success);
    assert!(sentinel == small);
}

#[test]
fn shutdown_drains_jobs_in_flight_and_is_idempotent() {
    let src: Vec<Vec<u8>> = (0..16).map(|k| vec![k as u8 + 1; 4 << 20]).collect();
    let mut dst: Vec<Vec<u8>> = (0..16).map(|_| vec![0u8; 4 << 20]).collect();
    let mut e = HostEngine::with_threads(2).unwrap();
    for (k, (s, d)) in src.iter().zip(dst.iter_mut()).enumerate() {
        // SAFETY: buffers alive and untouched until shutdown returns.
        unsafe {
            e.submit(Job::new(k as i64, plan(s, d, 4, Direction::CpuToGpu)))
                .unwrap()
        };
    }
    e.shutdown();
    let r = e.poll();
    assert_eq!(r.len(), 16, "every submitted job is reported");
    assert!(r.iter().all(|r| r.success));
    assert!(dst == src, "bytes differ");
    e.shutdown();
    // SAFETY: rejected before touching anything.
    let late = unsafe { e.submit(Job::new(99, CopyPlan::new(Direction::GpuToCpu))) };
    assert!(matches!(late, Err(KvoffError::InvalidState(_))), "{late:?}");
    e.wait(&[0, 99]).unwrap();
}

#[test]
fn drop_with_jobs_in_flight_does_not_hang() {
    let src = vec![1u8; 16 << 20];
    let mut dst = vec![0u8; 16 << 20];
    {
        let mut e = HostEngine::new().unwrap();
        for k in 0..4 {
            let n = 4 << 20;
            let (s, d) = (&src[k * n..(k + 1) * n], &mut dst[k * n..(k + 1) * n]);
            // SAFETY: buffers outlive the engine, whose drop drains the queue.
            unsafe {
                e.submit(Job::new(k as i64, plan(s, d, 1, Direction::GpuToCpu)))
                    .unwrap()
            };
        }
    }
    assert!(dst == src, "bytes differ");
}

#[test]
fn empty_job_succeeds() {
    let mut e = HostEngine::with_threads(1).unwrap();
    // SAFETY: no copies.
    unsafe {
        e.submit(Job::new(-5, CopyPlan::new(Direction::GpuToCpu)))
            .unwrap()
    };
    e.wait(&[-5]).unwrap();
    let r = e.poll();
    assert!(r[0].success && r[0].bytes == 0 && r[0].error.is_none());
    assert!(HostEngine::with_threads(0).is_err());
}
