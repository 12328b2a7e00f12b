//! Host regions across processes: the test binary re-invokes itself (`child_entry`, selected by the
//! `KVOFF_REGION_CHILD` environment variable) to play the other ranks.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]
// Unsafe: submitting plans to engines over memory this file allocates and keeps alive.
#![allow(unsafe_code)]

use std::ffi::CString;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvoff::region::{os_page_size, HostRegion, RegionOptions};
use kvoff::KvoffError;

const CHILD: &str = "KVOFF_REGION_CHILD";

/// A fresh directory for one test (in /dev/shm when available, like production).
fn test_dir(tag: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let d = base.join(format!("kvoff-test-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("sync")).unwrap();
    d
}

fn opts(dir: &Path, timeout: Duration) -> RegionOptions {
    RegionOptions {
        dir: dir.to_path_buf(),
        timeout,
        ..RegionOptions::default()
    }
}

/// Files left in `dir` besides the `sync` folder.
fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n != "sync")
        .collect()
}

fn spawn_child(mode: &str, env: &[(&str, String)]) -> Child {
    let exe = std::env::current_exe().unwrap();
    let mut c = Command::new(exe);
    c.args(["child_entry", "--exact", "--nocapture", "--test-threads=1"]);
    c.env(CHILD, mode);
    for (k, v) in env {
        c.env(k, v);
    }
    c.stdout(std::process::Stdio::null());
    c.spawn().unwrap()
}

fn wait_child(c: &mut Child, limit: Duration) -> bool {
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return st.success();
        }
        if Instant::now() > end {
            let _ = c.kill();
            let _ = c.wait();
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn wait_for(path: &Path, limit: Duration) {
    let end = Instant::now() + limit;
    while !path.exists() {
        assert!(
            Instant::now() < end,
            "timed out waiting for {}",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

const WS: u64 = 4;
const ROWS: u64 = 40;
const SLOT: u64 = 1000; // 4 x 1000 = 4000 bytes: rows padded to the page

fn pattern(rank: u64, row: u64, i: u64) -> u8 {
    ((rank * 37 + row * 11 + i) % 255 + 1) as u8 // never 0
}

/// Entry point of child processes; a no-op in a normal test run.
#[test]
fn child_entry() {
    let Ok(mode) = std::env::var(CHILD) else {
        return;
    };
    let var = |k: &str| std::env::var(k).unwrap();
    let dir = PathBuf::from(var("DIR"));
    let name = var("NAME");
    match mode.as_str() {
        "join" => {
            let rank: u64 = var("RANK").parse().unwrap();
            let mut r = HostRegion::create_or_join_with(
                &name,
                ROWS,
                SLOT,
                WS,
                rank,
                &opts(&dir, Duration::from_secs(30)),
            )
            .unwrap();
            for row in 0..ROWS {
                let bytes: Vec<u8> = (0..SLOT).map(|i| pattern(rank, row, i)).collect();
                r.copy_to_slot(rank, row, 0, &bytes).unwrap();
            }
            // Other ranks' slots cannot be written from here.
            assert!(r.copy_to_slot((rank + 1) % WS, 0, 0, &[1]).is_err());
            std::fs::write(dir.join("sync").join(format!("done.{rank}")), b"").unwrap();
            for k in 0..WS {
                wait_for(
                    &dir.join("sync").join(format!("done.{k}")),
                    Duration::from_secs(30),
                );
            }
            // Every slot holds exactly its rank's bytes; row padding is untouched (zero).
            let mut buf = vec![0u8; SLOT as usize];
            for row in 0..ROWS {
                for k in 0..WS {
                    r.copy_from_slot(k, row, 0, &mut buf).unwrap();
                    for (i, &b) in buf.iter().enumerate() {
                        assert_eq!(b, pattern(k, row, i as u64), "rank {k} row {row} byte {i}");
                    }
                }
            }
            // SAFETY: the mapping is live for `len_bytes` bytes and every rank finished writing.
            let all = unsafe {
                std::slice::from_raw_parts(r.as_ptr() as *const u8, r.len_bytes() as usize)
            };
            for row in 0..ROWS as usize {
                let s = row * r.row_stride_bytes() as usize;
                let pad = &all[s + (WS * SLOT) as usize..s + r.row_stride_bytes() as usize];
                assert!(
                    pad.iter().all(|&b| b == 0),
                    "padding of row {row} was written"
                );
            }
            r.close().unwrap();
        }
        "create" => {
            // A creator (rank 0) of a region of ROWS rows of SLOT bytes for WS ranks, not
            // prefaulted; once it exists, it is held until the process is killed.
            let n = |k: &str| var(k).parse::<u64>().unwrap();
            let o = RegionOptions {
                prefault: false,
                ..opts(&dir, Duration::from_secs(30))
            };
            let r = HostRegion::create_or_join_with(&name, n("ROWS"), n("SLOT"), n("WS"), 0, &o)
                .unwrap();
            std::fs::write(dir.join("sync").join("created"), b"").unwrap();
            std::thread::sleep(Duration::from_secs(120));
            drop(r);
        }
        "hold_lock" => {
            // Play a creator that takes the creation lock and dies before publishing the region
            // (created as kvoff creates it: this user's, mode 0600).
            let lock = dir.join(format!("{name}.lock"));
            use std::os::unix::fs::OpenOptionsExt;
            let f = std::fs::OpenOptions::new()
                .mode(0o600)
                .create(true)
                .truncate(false)
                .read(true)
                .write(true)
                .open(&lock)
                .unwrap();
            use std::os::fd::AsRawFd;
            // SAFETY: `f` is an open file.
            assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
            std::fs::write(dir.join("sync").join("locked"), b"").unwrap();
            std::thread::sleep(Duration::from_millis(var("HOLD_MS").parse().unwrap()));
            // SAFETY: terminates the process at once, like a crash (no destructors, no cleanup).
            unsafe { libc::_exit(0) };
        }
        other => panic!("unknown child mode {other}"),
    }
}

#[test]
fn four_processes_share_one_region() {
    let dir = test_dir("share");
    let name = "kv-share";
    let mut kids: Vec<Child> = (0..WS)
        .map(|rank| {
            spawn_child(
                "join",
                &[
                    ("DIR", dir.display().to_string()),
                    ("NAME", name.to_string()),
                    ("RANK", rank.to_string()),
                ],
            )
        })
        .collect();
    let ok: Vec<bool> = kids
        .iter_mut()
        .map(|c| wait_child(c, Duration::from_secs(60)))
        .collect();
    assert!(ok.iter().all(|&b| b), "child results {ok:?}");
    // The last rank to join unlinked the file; no lock file either.
    assert!(
        leftovers(&dir).is_empty(),
        "left behind: {:?}",
        leftovers(&dir)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn creator_death_leaves_no_file_and_joiners_fail() {
    let dir = test_dir("death");
    let name = "kv-death";
    let mut kid = spawn_child(
        "hold_lock",
        &[
            ("DIR", dir.display().to_string()),
            ("NAME", name.to_string()),
            ("HOLD_MS", "300".into()),
        ],
    );
    wait_for(&dir.join("sync").join("locked"), Duration::from_secs(30));
    let t0 = Instant::now();
    let joiners: Vec<_> = (1..3)
        .map(|rank| {
            let o = opts(&dir, Duration::from_secs(20));
            std::thread::spawn(move || HostRegion::create_or_join_with(name, 8, 4096, 4, rank, &o))
        })
        .collect();
    for j in joiners {
        match j.join().unwrap() {
            Err(KvoffError::Region { message: msg, .. }) => {
                assert!(msg.contains("failed or died"), "{msg}");
                assert!(msg.contains(name), "{msg}");
            }
            other => panic!("expected RegionError, got {other:?}"),
        }
    }
    assert!(
        t0.elapsed() < Duration::from_secs(10),
        "joiners should not wait for the timeout"
    );
    assert!(wait_child(&mut kid, Duration::from_secs(30)));
    assert!(
        leftovers(&dir).is_empty(),
        "left behind: {:?}",
        leftovers(&dir)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn join_timeout_then_recovery_from_stale_lock() {
    let dir = test_dir("timeout");
    let name = "kv-timeout";
    let mut kid = spawn_child(
        "hold_lock",
        &[
            ("DIR", dir.display().to_string()),
            ("NAME", name.to_string()),
            ("HOLD_MS", "30000".into()),
        ],
    );
    wait_for(&dir.join("sync").join("locked"), Duration::from_secs(30));
    let t0 = Instant::now();
    let r = HostRegion::create_or_join_with(
        name,
        8,
        4096,
        2,
        1,
        &opts(&dir, Duration::from_millis(300)),
    );
    let elapsed = t0.elapsed();
    match r {
        Err(KvoffError::Region { message: msg, .. }) => {
            assert!(msg.contains("timed out"), "{msg}");
            assert!(msg.contains(&dir.join(name).display().to_string()), "{msg}");
            let total = os_page_size() + 8 * 2 * 4096u64.next_multiple_of(os_page_size());
            assert!(msg.contains(&format!("{total} bytes")), "{msg}");
        }
        other => panic!("expected RegionError, got {other:?}"),
    }
    assert!(elapsed >= Duration::from_millis(300) && elapsed < Duration::from_secs(5));
    // The lock holder crashes; its lock file stays behind but is not held: the next process
    // takes it over and creates the region.
    kid.kill().unwrap();
    kid.wait().unwrap();
    let mut r =
        HostRegion::create_or_join_with(name, 8, 4096, 1, 0, &opts(&dir, Duration::from_secs(5)))
            .unwrap();
    assert_eq!(r.len_bytes(), 8 * 4096u64.next_multiple_of(os_page_size()));
    // world_size 1: unlinked as soon as it is created, lock removed.
    assert!(
        leftovers(&dir).is_empty(),
        "left behind: {:?}",
        leftovers(&dir)
    );
    r.close().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn too_little_space_names_size_and_path() {
    let dir = test_dir("nospace");
    // 2^38 rows x 4 KiB = 1 PiB.
    let rows = 1u64 << 38;
    let r = HostRegion::create_or_join_with(
        "kv-huge",
        rows,
        4096,
        1,
        0,
        &opts(&dir, Duration::from_secs(5)),
    );
    match r {
        Err(KvoffError::Region { message: msg, .. }) => {
            let total = os_page_size() + rows * 4096u64.next_multiple_of(os_page_size());
            assert!(msg.contains(&format!("{total} bytes")), "{msg}");
            assert!(
                msg.contains(&dir.join("kv-huge").display().to_string()),
                "{msg}"
            );
        }
        other => panic!("expected RegionError, got {other:?}"),
    }
    assert!(
        leftovers(&dir).is_empty(),
        "left behind: {:?}",
        leftovers(&dir)
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn join_checks_geometry_and_rank_and_unlink_by_hand() {
    let dir = test_dir("geom");
    let name = "kv-geom";
    let o = RegionOptions {
        unlink_when_all_joined: false,
        ..opts(&dir, Duration::from_secs(5))
    };
    let mut r0 = HostRegion::create_or_join_with(name, 6, 512, 2, 0, &o).unwrap();
    assert_eq!(r0.path(), Some(dir.join(name).as_path()));
    let again = HostRegion::create_or_join_with(name, 6, 512, 2, 0, &o);
    assert!(
        matches!(&again, Err(KvoffError::Region { message: m, .. }) if m.contains("already joined")),
        "{again:?}"
    );
    let other = HostRegion::create_or_join_with(name, 7, 512, 2, 1, &o);
    assert!(
        matches!(&other, Err(KvoffError::Region { .. })),
        "{other:?}"
    );
    assert!(matches!(
        HostRegion::create_or_join_with(name, 6, 512, 2, 2, &o),
        Err(KvoffError::InvalidArgument(_))
    ));
    assert!(matches!(
        HostRegion::create_or_join_with("a/b", 6, 512, 2, 0, &o),
        Err(KvoffError::InvalidArgument(_))
    ));
    let r1 = HostRegion::create_or_join_with(name, 6, 512, 2, 1, &o).unwrap();
    // Both handles map the same bytes.
    r0.copy_to_slot(0, 5, 10, b"hello").unwrap();
    let mut buf = [0u8; 5];
    r1.copy_from_slot(0, 5, 10, &mut buf).unwrap();
    assert_eq!(&buf, b"hello");
    // Views: inside the rank's slot only.
    let v = r1.view(1, 12, 500).unwrap();
    assert_eq!(v.ptr, r1.as_ptr() + 512 + 12);
    assert_eq!((v.rows, v.row_stride_bytes), (6, r1.row_stride_bytes()));
    assert!(matches!(
        r1.view(1, 13, 500),
        Err(KvoffError::InvalidArgument(_))
    ));
    assert_eq!(v.tensor_desc().row_bytes, 500);
    // Not unlinked automatically with this option; by hand it is.
    assert_eq!(leftovers(&dir), vec![name.to_string()]);
    assert!(r0.unlink().unwrap());
    assert!(!r0.unlink().unwrap());
    assert!(leftovers(&dir).is_empty());
    drop(r1);
    r0.close().unwrap();
    r0.close().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

// --- hostile files on a shared host (docs/spec.md §5, issue #11) ------------------------------------

/// Makes a complete region file `name` with rank 0 joined, then drops its handle (as a crashed
/// engine would leave it: the file stays, nobody holds it).
fn leave_region_behind(dir: &Path, name: &str) {
    let o = RegionOptions {
        unlink_when_all_joined: false,
        ..opts(dir, Duration::from_secs(5))
    };
    let r = HostRegion::create_or_join_with(name, 4, 4096, 2, 0, &o).unwrap();
    // SAFETY: the region's own slot of row 0 (rank 0): inside the mapping, nobody else uses it.
    unsafe { (r.as_ptr() as *mut u8).write_bytes(0xAB, 4096) };
    drop(r);
    assert!(dir.join(name).exists());
    // Stale only once no process holds it: a child another test is spawning right now holds
    // copies of this process's descriptors until it execs (they are close-on-exec).
    drop(lock_exclusively(&dir.join(name)));
}

/// Opens `path` and takes its exclusive flock, waiting (up to 10 s) while other processes hold it
/// (see `leave_region_behind`).
fn lock_exclusively(path: &Path) -> std::fs::File {
    use std::os::fd::AsRawFd;
    let end = Instant::now() + Duration::from_secs(10);
    loop {
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .unwrap();
        // SAFETY: flock on a descriptor we own.
        if unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
            return f;
        }
        assert!(Instant::now() < end, "{} stays locked", path.display());
        drop(f);
        std::thread::sleep(Duration::from_millis(2));
    }
}

#[test]
fn stale_region_of_a_dead_engine_is_replaced_not_joined() {
    let dir = test_dir("stale");
    leave_region_behind(&dir, "kv-stale");
    // Restarting as rank 0 works (it used to fail with "rank 0 already joined"), and rank 1 joins
    // the new region, not the dead one: the old bytes are gone.
    let o = opts(&dir, Duration::from_secs(5));
    let r0 = HostRegion::create_or_join_with("kv-stale", 4, 4096, 2, 0, &o).unwrap();
    // SAFETY: reading rank 0's first slot byte inside the mapping.
    let first = unsafe { *(r0.as_ptr() as *const u8) };
    assert_eq!(first, 0, "the stale region's bytes were reused");
    let r1 = HostRegion::create_or_join_with("kv-stale", 4, 4096, 2, 1, &o).unwrap();
    drop((r0, r1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_live_region_is_joined() {
    let dir = test_dir("live");
    let o = RegionOptions {
        unlink_when_all_joined: false,
        ..opts(&dir, Duration::from_secs(5))
    };
    let r0 = HostRegion::create_or_join_with("kv-live", 4, 4096, 2, 0, &o).unwrap();
    // SAFETY: rank 0's own slot of row 0.
    unsafe { (r0.as_ptr() as *mut u8).write_bytes(0x5A, 1) };
    let r1 = HostRegion::create_or_join_with("kv-live", 4, 4096, 2, 1, &o).unwrap();
    // SAFETY: row 0 of the shared mapping, written by rank 0 above.
    let seen = unsafe { *(r1.as_ptr() as *const u8) };
    assert_eq!(seen, 0x5A, "rank 1 did not join rank 0's region");
    drop((r0, r1));
    std::fs::remove_dir_all(&dir).unwrap();
}

fn expect_refused(dir: &Path, name: &str, what: &str) {
    let o = opts(dir, Duration::from_secs(2));
    match HostRegion::create_or_join_with(name, 4, 4096, 2, 1, &o) {
        Err(KvoffError::Region { message: msg, .. }) => assert!(msg.contains(what), "{msg}"),
        other => panic!("expected RegionError ({what}), got {other:?}"),
    }
}

#[test]
fn files_of_another_user_or_readable_by_others_are_refused() {
    use std::os::unix::fs::PermissionsExt;
    let dir = test_dir("hostile");
    // A valid region file, made readable by everybody.
    leave_region_behind(&dir, "kv-mode");
    std::fs::set_permissions(dir.join("kv-mode"), std::fs::Permissions::from_mode(0o666)).unwrap();
    expect_refused(&dir, "kv-mode", "no group or other access");
    // A valid region file owned by another user (the test runs as root where it can chown).
    leave_region_behind(&dir, "kv-owner");
    let p = CString::new(dir.join("kv-owner").as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: `p` is a valid NUL-terminated path.
    if unsafe { libc::chown(p.as_ptr(), 12345, 12345) } == 0 {
        expect_refused(&dir, "kv-owner", "owned by uid 12345");
    }
    // A lock file of another user's mode.
    std::fs::write(dir.join("kv-lock.lock"), b"").unwrap();
    std::fs::set_permissions(
        dir.join("kv-lock.lock"),
        std::fs::Permissions::from_mode(0o644),
    )
    .unwrap();
    expect_refused(&dir, "kv-lock", "kv-lock.lock");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn symlinks_are_never_followed() {
    let dir = test_dir("symlink");
    let target = dir.join("elsewhere");
    std::fs::write(&target, vec![0u8; 1 << 16]).unwrap();
    std::os::unix::fs::symlink(&target, dir.join("kv-link")).unwrap();
    expect_refused(&dir, "kv-link", "kv-link");
    std::os::unix::fs::symlink(&target, dir.join("kv-link2.lock")).unwrap();
    expect_refused(&dir, "kv-link2", "kv-link2.lock");
    assert_eq!(
        std::fs::read(&target).unwrap().len(),
        1 << 16,
        "the target was touched"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn region_errors_keep_the_os_error() {
    // The OS error stays reachable as the error's source: a missing directory is ENOENT, not
    // just a message.
    let o = opts(
        Path::new("/nonexistent-kvoff-test-dir"),
        Duration::from_millis(100),
    );
    let e = HostRegion::create_or_join_with("kv-noent", 1, 4096, 1, 0, &o).unwrap_err();
    assert!(matches!(e, KvoffError::Region { .. }), "{e}");
    assert_eq!(
        e.io_error().and_then(std::io::Error::raw_os_error),
        Some(libc::ENOENT),
        "{e}"
    );
    assert!(std::error::Error::source(&e).is_some());
}

#[test]
fn an_observer_attaches_to_the_ranks_region() {
    let dir = test_dir("observer");
    let o = RegionOptions {
        unlink_when_all_joined: false,
        ..opts(&dir, Duration::from_secs(5))
    };
    let mut r0 = HostRegion::create_or_join_with("kv-obs", 3, 4096, 2, 0, &o).unwrap();
    let r1 = HostRegion::create_or_join_with("kv-obs", 3, 4096, 2, 1, &o).unwrap();
    let mut obs = HostRegion::attach("kv-obs", &o).unwrap();
    // The geometry comes from the header.
    assert_eq!(
        (
            obs.num_cpu_blocks(),
            obs.slot_bytes(),
            obs.world_size(),
            obs.rank()
        ),
        (3, 4096, 2, None)
    );
    assert_eq!(obs.row_stride_bytes(), r0.row_stride_bytes());
    // The observer writes any rank's slot; the ranks see it, and the other way round.
    obs.copy_to_slot(1, 2, 10, b"from the scheduler").unwrap();
    let mut got = [0u8; 18];
    r1.copy_from_slot(1, 2, 10, &mut got).unwrap();
    assert_eq!(&got, b"from the scheduler");
    r0.copy_to_slot(0, 1, 0, b"rank0").unwrap();
    let mut got = [0u8; 5];
    obs.copy_from_slot(0, 1, 0, &mut got).unwrap();
    assert_eq!(&got, b"rank0");
    // Attaching took no rank: nobody's flag was set twice, and the observer unlinks the name.
    assert!(obs.unlink().unwrap());
    assert!(HostRegion::attach("kv-obs", &opts(&dir, Duration::from_millis(50))).is_err());
    drop((r0, r1, obs));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn attach_refuses_what_is_not_a_complete_region() {
    let dir = test_dir("observer-bad");
    let o = opts(&dir, Duration::from_millis(100));
    // Missing: a timeout naming the path.
    let e = HostRegion::attach("kv-none", &o).unwrap_err();
    assert!(e.to_string().contains("timed out"), "{e}");
    // A private file of this user that is not a region (held open, so it is not stale).
    let path = dir.join("kv-junk");
    std::fs::write(&path, vec![7u8; 8192]).unwrap();
    std::fs::set_permissions(&path, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    let f = std::fs::File::open(&path).unwrap();
    // SAFETY: flock on a descriptor we own.
    let rc = unsafe { libc::flock(std::os::fd::AsRawFd::as_raw_fd(&f), libc::LOCK_SH) };
    assert_eq!(rc, 0);
    let e = HostRegion::attach("kv-junk", &o).unwrap_err();
    assert!(
        e.to_string().contains("not a complete kvoff shared region"),
        "{e}"
    );
    drop(f);
    std::fs::remove_dir_all(&dir).unwrap();
}

// --- creator crashes and stale regions (issue #11) -------------------------------------------

/// A child process, SIGKILLed when dropped (a failing test leaves no process behind).
struct Kid(Child);

impl Drop for Kid {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(kid: &Kid, sig: libc::c_int) {
    // SAFETY: kill has no memory preconditions; the pid is our own child's, not yet reaped.
    assert_eq!(unsafe { libc::kill(kid.0.id() as libc::pid_t, sig) }, 0);
}

fn kill_and_reap(kid: &mut Kid) {
    signal(kid, libc::SIGKILL);
    let st = kid.0.wait().unwrap();
    assert_eq!(
        std::os::unix::process::ExitStatusExt::signal(&st),
        Some(libc::SIGKILL)
    );
}

fn free_bytes(dir: &Path) -> u64 {
    let c = CString::new(dir.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: an all-zero `statvfs` is a valid value of this plain C struct.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: `c` is NUL-terminated and `st` writable.
    assert_eq!(unsafe { libc::statvfs(c.as_ptr(), &raw mut st) }, 0);
    st.f_bavail as u64 * st.f_frsize as u64
}

/// The region file a creator is building (unnamed: `O_TMPFILE` shows as `<dir>/#ino (deleted)`,
/// or the fallback's temporary name), found among the process's descriptors.
fn file_being_created(pid: u32, dir: &Path) -> Option<PathBuf> {
    let prefix = format!("{}/", dir.display());
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.flatten() {
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        let t = target.to_string_lossy();
        if t.starts_with(&prefix) && (t.ends_with("(deleted)") || t.ends_with(".tmp")) {
            return Some(e.path());
        }
    }
    None
}

/// Whether some process holds a flock on the file at `path`.
fn is_locked(path: &Path) -> bool {
    use std::os::fd::AsRawFd;
    let f = std::fs::File::open(path).unwrap();
    // SAFETY: flock on a descriptor we own (closing it releases a lock we took).
    unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) != 0 }
}

/// Waits until a process is blocked waiting for a flock on the file `f` (`/proc/locks` lists
/// waiters as `-> FLOCK ... <major>:<minor>:<inode> ...`, device numbers in hex).
fn wait_for_blocked_flock(f: &std::fs::File, limit: Duration) {
    use std::os::unix::fs::MetadataExt;
    let m = f.metadata().unwrap();
    let end = Instant::now() + limit;
    let needle = format!(
        " {:02x}:{:02x}:{} ",
        libc::major(m.dev()),
        libc::minor(m.dev()),
        m.ino()
    );
    loop {
        let locks = std::fs::read_to_string("/proc/locks").unwrap();
        if locks
            .lines()
            .any(|l| l.contains("-> FLOCK") && l.contains(&needle))
        {
            return;
        }
        assert!(Instant::now() < end, "nobody waited for{needle}");
        std::thread::sleep(Duration::from_millis(2));
    }
}

fn first_byte(r: &HostRegion, rank: u64) -> u8 {
    let mut b = [0u8; 1];
    r.copy_from_slot(rank, 0, 0, &mut b).unwrap();
    b[0]
}

/// Issue #11: the creator is SIGKILLed in the middle of creating a region (it holds the creation
/// lock and is sizing its unnamed file with `posix_fallocate`; the test freezes it there, checks
/// that state, then kills it). (b) A rank that was waiting for it fails at once with a clear
/// error, never a region of the dead creator; (a) a restarted rank 0 creates the region cleanly
/// (the stale lock is taken over and removed, nothing of the dead creator is left or reused) and
/// the other rank joins that one.
#[test]
fn creator_killed_mid_creation_then_a_restart_creates_cleanly() {
    let dir = test_dir("midcreate");
    let name = "kv-mid";
    let lock = dir.join(format!("{name}.lock"));
    let (ws, slot) = (2u64, 4096u64);
    // Sizing a tmpfs file takes ~0.3 s per GiB: a window the test catches reliably.
    if free_bytes(&dir) < 6 << 30 {
        eprintln!("skipped: less than 6 GiB free in {}", dir.display());
        return;
    }
    let mut frozen = None;
    for rows in [1u64 << 17, 1 << 18] {
        // 1 GiB, then 2 GiB
        let _ = std::fs::remove_file(dir.join("sync").join("created"));
        let mut kid = Kid(spawn_child(
            "create",
            &[
                ("DIR", dir.display().to_string()),
                ("NAME", name.to_string()),
                ("ROWS", rows.to_string()),
                ("SLOT", slot.to_string()),
                ("WS", ws.to_string()),
            ],
        ));
        let end = Instant::now() + Duration::from_secs(30);
        let file = loop {
            if let Some(f) = file_being_created(kid.0.id(), &dir) {
                signal(&kid, libc::SIGSTOP);
                break Some(f);
            }
            if kid.0.try_wait().unwrap().is_some() || dir.join("sync/created").exists() {
                break None;
            }
            assert!(Instant::now() < end, "the creator never started");
            std::thread::sleep(Duration::from_micros(200));
        };
        // Frozen before publishing: the name does not exist and the creation lock is held.
        if let Some(file) = file.filter(|_| !dir.join(name).exists()) {
            assert!(
                is_locked(&lock),
                "the frozen creator should hold {}",
                lock.display()
            );
            let allocated = std::fs::metadata(&file)
                .map_or(0, |m| std::os::unix::fs::MetadataExt::blocks(&m) * 512);
            eprintln!(
                "creator frozen with {allocated} of {} bytes allocated",
                rows * 8192
            );
            frozen = Some((kid, rows));
            break;
        }
        // Too fast to catch: clean up and try a bigger region.
        drop(kid);
        let _ = std::fs::remove_file(dir.join(name));
        let _ = std::fs::remove_file(&lock);
    }
    let (mut kid, rows) = frozen.expect("could not catch the creator in the middle of creating");
    let o = RegionOptions {
        prefault: false,
        ..opts(&dir, Duration::from_secs(30))
    };
    // (b) rank 1 arrives while the creation is under way: it waits for the creator.
    let o1 = o.clone();
    let rank1 =
        std::thread::spawn(move || HostRegion::create_or_join_with(name, rows, slot, ws, 1, &o1));
    std::thread::sleep(Duration::from_millis(500));
    let t0 = Instant::now();
    kill_and_reap(&mut kid);
    let first = rank1.join().unwrap();
    // The dead creator left no region file (it was never named) and no temporary file; its stale
    // lock file is left, unless rank 1 already took it over and removed it.
    let left = leftovers(&dir);
    assert!(
        left.is_empty() || left == [format!("{name}.lock")] || first.is_ok(),
        "{left:?}"
    );
    let mut r1 = match first {
        // Expected: it saw the creator's lock, which died with it: a clear error, at once.
        Err(KvoffError::Region { message: m, .. }) => {
            assert!(m.contains("failed or died"), "{m}");
            assert!(m.contains(&dir.join(name).display().to_string()), "{m}");
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "rank 1 waited too long"
            );
            None
        }
        // Only if it had not reached the lock before the kill: it then took the stale lock and
        // created a new region itself (never the dead creator's).
        Ok(r) => {
            eprintln!("rank 1 reached the lock only after the kill and created the region");
            Some(r)
        }
        Err(e) => panic!("rank 1: unexpected {e}"),
    };
    // (a) The restarted rank 0 creates the region (or joins rank 1's new one).
    let mut r0 = HostRegion::create_or_join_with(name, rows, slot, ws, 0, &o).unwrap();
    assert_eq!(r0.len_bytes(), rows * 8192);
    if r1.is_none() {
        // Created anew: only its name exists (no lock, no temporary file), its bytes are fresh.
        assert_eq!(leftovers(&dir), vec![name.to_string()]);
        for row in [0, rows / 2, rows - 1] {
            let mut b = [1u8; 16];
            r0.copy_from_slot(0, row, 0, &mut b).unwrap();
            assert_eq!(b, [0u8; 16]);
        }
        r1 = Some(HostRegion::create_or_join_with(name, rows, slot, ws, 1, &o).unwrap());
    }
    let r1 = r1.unwrap();
    // Both ranks map one region; all joined, so the name is gone too.
    r0.copy_to_slot(0, rows - 1, 7, b"restarted").unwrap();
    let mut got = [0u8; 9];
    r1.copy_from_slot(0, rows - 1, 7, &mut got).unwrap();
    assert_eq!(&got, b"restarted");
    assert!(leftovers(&dir).is_empty(), "{:?}", leftovers(&dir));
    drop((r0, r1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue #11: a rank that joined keeps the region alive after its creator died. A restarted
/// creator then gets a clear error (its rank already joined that region) instead of a second
/// region beside the live one or a silent join; once the last member is gone, the region is
/// stale and the next creator replaces it (fresh bytes).
#[test]
fn a_rank_that_joined_keeps_the_region_alive_after_its_creator_died() {
    let dir = test_dir("joined");
    let name = "kv-joined";
    let (rows, slot, ws) = (4u64, 4096u64, 3u64);
    let mut kid = Kid(spawn_child(
        "create",
        &[
            ("DIR", dir.display().to_string()),
            ("NAME", name.to_string()),
            ("ROWS", rows.to_string()),
            ("SLOT", slot.to_string()),
            ("WS", ws.to_string()),
        ],
    ));
    wait_for(&dir.join("sync").join("created"), Duration::from_secs(30));
    let o = opts(&dir, Duration::from_secs(2));
    let mut r1 = HostRegion::create_or_join_with(name, rows, slot, ws, 1, &o).unwrap();
    r1.copy_to_slot(1, 0, 0, &[0x11]).unwrap();
    kill_and_reap(&mut kid);
    // The creator is dead but rank 1 holds the region: it is alive, so it is neither replaced nor
    // joined again by a new rank 0.
    match HostRegion::create_or_join_with(name, rows, slot, ws, 0, &o) {
        Err(KvoffError::Region { message: m, .. }) => assert!(m.contains("already joined"), "{m}"),
        other => panic!("expected a RegionError, got {other:?}"),
    }
    assert_eq!(leftovers(&dir), vec![name.to_string()]);
    assert_eq!(first_byte(&r1, 1), 0x11);
    // The last member leaves: the region is stale (once no spawning child still holds a copy of
    // the descriptor, see `leave_region_behind`), and a new rank 0 creates a fresh one.
    drop(r1);
    drop(lock_exclusively(&dir.join(name)));
    let r0 = HostRegion::create_or_join_with(name, rows, slot, ws, 0, &o).unwrap();
    assert_eq!(first_byte(&r0, 1), 0, "the dead region's bytes were reused");
    let r1 = HostRegion::create_or_join_with(name, rows, slot, ws, 1, &o).unwrap();
    assert_eq!(first_byte(&r1, 1), 0);
    drop((r0, r1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Opens the stale region `<dir>/<name>` and takes its exclusive lock, as a rank that found it
/// stale does just before it unlinks it.
fn hold_as_cleaner(dir: &Path, name: &str) -> std::fs::File {
    lock_exclusively(&dir.join(name))
}

/// Regression (issue #11): a rank that opens a stale region while another rank holds it
/// exclusively to remove it finds it "busy", so it waited for its shared lock and got it once the
/// remover was done: on the removed file, whose bytes are the dead engine's. It now checks that
/// the name still refers to the file it locked, and starts over (here: it creates the region,
/// and rank 0 joins it).
#[test]
fn a_rank_blocked_behind_a_stale_region_s_removal_does_not_join_it() {
    let dir = test_dir("cleaner");
    let name = "kv-cleaner";
    leave_region_behind(&dir, name); // rank 0's first slot holds 0xAB
    let cleaner = hold_as_cleaner(&dir, name);
    let o = opts(&dir, Duration::from_secs(10));
    let o1 = o.clone();
    let rank1 =
        std::thread::spawn(move || HostRegion::create_or_join_with(name, 4, 4096, 2, 1, &o1));
    wait_for_blocked_flock(&cleaner, Duration::from_secs(20));
    // The remover unlinks the stale file, then releases it.
    std::fs::remove_file(dir.join(name)).unwrap();
    drop(cleaner);
    let r1 = rank1.join().unwrap().unwrap();
    assert_eq!(
        first_byte(&r1, 0),
        0,
        "rank 1 joined the dead engine's region"
    );
    let mut r0 = HostRegion::create_or_join_with(name, 4, 4096, 2, 0, &o).unwrap();
    r0.copy_to_slot(0, 0, 0, &[0x42]).unwrap();
    assert_eq!(
        first_byte(&r1, 0),
        0x42,
        "rank 0 and rank 1 map different regions"
    );
    drop((r0, r1));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The same for an observer ([`HostRegion::attach`]): it attaches to the region the new ranks
/// create, not to the stale one it was blocked on.
#[test]
fn an_observer_blocked_behind_a_stale_region_s_removal_does_not_attach_to_it() {
    let dir = test_dir("cleaner-obs");
    let name = "kv-cleaner-obs";
    leave_region_behind(&dir, name);
    let cleaner = hold_as_cleaner(&dir, name);
    let o = RegionOptions {
        unlink_when_all_joined: false,
        ..opts(&dir, Duration::from_secs(10))
    };
    let o1 = o.clone();
    let observer = std::thread::spawn(move || HostRegion::attach(name, &o1));
    wait_for_blocked_flock(&cleaner, Duration::from_secs(20));
    std::fs::remove_file(dir.join(name)).unwrap();
    drop(cleaner);
    let mut r0 = HostRegion::create_or_join_with(name, 4, 4096, 2, 0, &o).unwrap();
    let r1 = HostRegion::create_or_join_with(name, 4, 4096, 2, 1, &o).unwrap();
    r0.copy_to_slot(0, 0, 0, &[0x42]).unwrap();
    let obs = observer.join().unwrap().unwrap();
    assert_eq!(
        first_byte(&obs, 0),
        0x42,
        "the observer attached to the dead region"
    );
    drop((r0, r1, obs));
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Issue #11: region and lock files owned by another user (uid 65534, mode 0600: only the owner
/// check can refuse them) are refused with an error that names the file, its owner and what to
/// do, for ranks and observers alike, and are left untouched. Needs root (to chown).
#[test]
fn region_and_lock_files_of_another_uid_are_refused_and_left_alone() {
    use std::os::unix::fs::MetadataExt;
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipped: needs root to chown files to another user");
        return;
    }
    let dir = test_dir("uid");
    let chown = |p: &Path| {
        let c = CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a valid NUL-terminated path.
        assert_eq!(unsafe { libc::chown(c.as_ptr(), 65534, 65534) }, 0);
    };
    let refused = |r: kvoff::Result<HostRegion>, path: &Path| match r {
        Err(KvoffError::Region { message: m, .. }) => {
            assert!(m.contains(&path.display().to_string()), "{m}");
            assert!(m.contains("owned by uid 65534"), "{m}");
            assert!(m.contains("remove it"), "{m}");
        }
        other => panic!(
            "expected a RegionError for {}, got {other:?}",
            path.display()
        ),
    };
    // A complete region file of uid 65534.
    let o = opts(&dir, Duration::from_secs(2));
    leave_region_behind(&dir, "kv-nobody");
    let path = dir.join("kv-nobody");
    chown(&path);
    let before = std::fs::metadata(&path).unwrap();
    for rank in [0, 1] {
        refused(
            HostRegion::create_or_join_with("kv-nobody", 4, 4096, 2, rank, &o),
            &path,
        );
    }
    refused(HostRegion::attach("kv-nobody", &o), &path);
    let after = std::fs::metadata(&path).unwrap();
    assert_eq!(
        (after.ino(), after.len(), after.uid(), after.mode()),
        (before.ino(), before.len(), 65534, before.mode())
    );
    // A lock file of uid 65534 (no region yet): no rank creates the region under it.
    let lock = dir.join("kv-nobody2.lock");
    std::fs::write(&lock, b"").unwrap();
    std::fs::set_permissions(&lock, std::os::unix::fs::PermissionsExt::from_mode(0o600)).unwrap();
    chown(&lock);
    for rank in [0, 1] {
        refused(
            HostRegion::create_or_join_with("kv-nobody2", 4, 4096, 2, rank, &o),
            &lock,
        );
    }
    assert!(!dir.join("kv-nobody2").exists());
    assert_eq!(std::fs::metadata(&lock).unwrap().uid(), 65534);
    std::fs::remove_dir_all(&dir).unwrap();
}
