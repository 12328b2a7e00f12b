//! The object tier's real-server harness for Rust tests (tests/support/seaweed.rs): SeaweedFS's
//! `weed mini` comes up on loopback with S3 auth on and its buckets, keeps its data across SIGKILL
//! and restart, loses it with `restart_empty`, answers nothing while stopped, and leaves nothing
//! behind. Without `weed` (the test command installs it) the test prints why it skips, unless
//! `KVOFF_REQUIRE_SEAWEED` is set.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

#[path = "support/seaweed.rs"]
mod seaweed;

use std::time::Instant;

use seaweed::Seaweed;

fn alive(pid: u32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|s| {
        s.rsplit(')')
            .next()
            .and_then(|r| r.split_whitespace().next())
            != Some("Z")
    })
}

#[test]
fn seaweed_starts_restarts_and_cleans_up() {
    if !seaweed::have_weed() {
        return;
    }
    let t0 = Instant::now();
    let mut s = Seaweed::start(&["kvoff"]);
    eprintln!("weed mini up with a bucket in {:?}", t0.elapsed());
    assert_eq!(s.endpoint(), format!("http://127.0.0.1:{}", s.port()));
    assert!(s.env().contains(&("AWS_ALLOW_HTTP", "true".to_owned())));

    // Auth is on: unsigned requests are refused, with S3's XML error.
    let (status, body) = s.http("GET", s.port(), "/kvoff", None).unwrap();
    assert_eq!(status, 403, "{}", String::from_utf8_lossy(&body));
    assert!(String::from_utf8_lossy(&body).contains("<Code>AccessDenied</Code>"));

    // Objects through the filer (past the S3 gateway), in the buckets made by weed shell.
    let t1 = Instant::now();
    s.create_bucket("kvoff-two");
    eprintln!("create_bucket (weed shell): {:?}", t1.elapsed());
    s.filer_put("kvoff", "a/b", b"kept");
    s.filer_put("kvoff-two", "c", b"two");
    assert_eq!(s.filer_get("kvoff", "a/b").as_deref(), Some(&b"kept"[..]));
    assert_eq!(s.filer_get("kvoff", "missing"), None);
    // Two of the filer's 4 MiB chunks: a file the filer splits, and the HTTP bodies' framing.
    let big: Vec<u8> = (0..5_000_000u32).map(|i| (i % 251) as u8).collect();
    s.filer_put("kvoff", "big", &big);
    assert_eq!(s.filer_get("kvoff", "big"), Some(big));

    // SIGKILL: nothing answers; restart: same port, data kept.
    let (port, pid) = (s.port(), s.pid().unwrap());
    s.kill();
    assert!(!alive(pid));
    assert!(s.http("GET", port, "/", None).is_none());
    let t2 = Instant::now();
    s.restart();
    eprintln!("restart: {:?}", t2.elapsed());
    assert_eq!(s.port(), port);
    assert_eq!(s.filer_get("kvoff", "a/b").as_deref(), Some(&b"kept"[..]));

    // SIGSTOP: the port accepts, nothing answers (2 s timeout); SIGCONT: answers again.
    s.stop();
    assert!(s.http("GET", s.port(), "/", None).is_none());
    s.cont();
    assert_eq!(s.http("GET", s.port(), "/", None).unwrap().0, 403);

    // restart_empty: objects gone, both buckets there again.
    s.restart_empty();
    assert_eq!(s.filer_get("kvoff", "a/b"), None);
    assert_eq!(s.filer_get("kvoff-two", "c"), None);
    let (status, _) = s
        .http("GET", s.ports.filer, "/buckets/kvoff-two/", None)
        .unwrap();
    assert_eq!(status, 200, "bucket kvoff-two not made again");

    // Drop: the process, its directory and its gRPC sockets are gone.
    let (pid, dir, sockets) = (s.pid().unwrap(), s.dir.clone(), s.grpc_sockets());
    assert!(sockets[0].exists());
    s.stop();
    drop(s);
    assert!(!alive(pid) && !dir.exists());
    assert!(sockets.iter().all(|p| !p.exists()));
}
