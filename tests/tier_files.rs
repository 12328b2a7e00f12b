//! File tier (docs/spec.md §9): format, restart, corruption, capacity, sharing, crash safety, full disk and
//! permission errors. Processes are this test binary run again with `KVOFF_TIER_CHILD` set.
// Tests and benchmarks: an unwrap that fails is the failure report; pedantic style is for the library.
#![allow(
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kvoff::key::{make_offload_key, ByteKey};
use kvoff::tier::{Completion, DirectIo, FileTier, Layout, TierConfig, VecMemory};
use kvoff::KvoffError;

const BLOCK: usize = 64 * 1024 + 100; // not a multiple of 4 KiB: exercises the padding

fn tmpdir(tag: &str) -> PathBuf {
    static N: AtomicU64 = AtomicU64::new(0);
    let d = std::env::temp_dir().join(format!(
        "kvoff-tier-{tag}-{}-{}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    ));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Every file under `dir` (one level of shard directories).
fn files_in(dir: &Path) -> Vec<PathBuf> {
    let mut v = Vec::new();
    for shard in std::fs::read_dir(dir).unwrap().flatten() {
        if shard.path().is_dir() {
            v.extend(
                std::fs::read_dir(shard.path())
                    .unwrap()
                    .flatten()
                    .map(|e| e.path()),
            );
        }
    }
    v
}

fn layout(rank: u32) -> Layout {
    Layout {
        namespace: "test-model".into(),
        page_sizes_bytes: vec![BLOCK as u64],
        block_size_factor: 1,
        dtype: "bfloat16".into(),
        world_size: 2,
        rank,
    }
}

fn key(i: u64) -> ByteKey {
    ByteKey::new(&make_offload_key(&i.to_le_bytes().repeat(4), 0))
}

/// Deterministic block content for key `i` (never all zeros).
fn content(i: u64, len: usize) -> Vec<u8> {
    let mut x = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

fn cfg(dir: &Path, cap: u64) -> TierConfig {
    let mut c = TierConfig::new(dir, cap, layout(0));
    c.rescan_interval = None;
    c
}

fn open(dir: &Path, cap: u64, blocks: usize) -> (FileTier, Arc<VecMemory>) {
    let mem = Arc::new(VecMemory::new(blocks, BLOCK));
    let t = FileTier::open(cfg(dir, cap), mem.clone()).unwrap();
    (t, mem)
}

/// Writes keys `ids` from blocks `0..` and waits.
fn write_keys(t: &FileTier, mem: &VecMemory, ids: &[u64]) {
    for (b, &i) in ids.iter().enumerate() {
        mem.set_block(b as u32, &content(i, BLOCK)).unwrap();
        assert!(t.submit_write(&key(i), b as u32), "write of {i} refused");
    }
    t.flush();
    let released = t
        .poll()
        .into_iter()
        .filter(|c| matches!(c, Completion::Released { .. }))
        .count();
    assert_eq!(released, ids.len());
}

/// Promotes key `i` into block 0 and returns whether it came back with the right bytes.
fn read_key(t: &FileTier, mem: &VecMemory, i: u64) -> Option<bool> {
    mem.set_block(0, &vec![0; BLOCK]).unwrap();
    if !t.submit_read(&key(i), 0) {
        return None;
    }
    t.flush();
    let done = t.poll();
    let ok = done
        .iter()
        .any(|c| matches!(c, Completion::Promoted { ok: true, key, .. } if *key == self::key(i)));
    if ok {
        assert_eq!(
            mem.block(0).unwrap(),
            content(i, BLOCK),
            "promoted bytes of {i} differ"
        );
    }
    Some(ok)
}

#[test]
fn write_restart_read_same_process() {
    let dir = tmpdir("restart");
    let ids: Vec<u64> = (0..20).collect();
    {
        let (t, mem) = open(&dir, 1 << 30, 20);
        write_keys(&t, &mem, &ids);
        let s = t.stats();
        assert_eq!(s.files_written, 20);
        assert_eq!(s.bytes_written, 20 * BLOCK as u64);
        assert_eq!(s.own_files, 20);
        assert_eq!(s.write_errors, 0);
        // A key that already has a file is not written again.
        assert!(!t.submit_write(&key(0), 0));
    }
    let (t, mem) = open(&dir, 1 << 30, 1);
    let s = t.stats();
    assert_eq!(s.indexed_files, 20, "restart indexes every file");
    assert_eq!(s.own_files, 20, "restart adopts own files");
    for &i in &ids {
        assert!(t.contains(&key(i)));
        assert_eq!(read_key(&t, &mem, i), Some(true));
    }
    assert!(!t.contains(&key(99)));
    assert_eq!(read_key(&t, &mem, 99), None);
    let s = t.stats();
    assert_eq!(s.promotions, 20);
    assert_eq!(s.bytes_read, 20 * BLOCK as u64);
    // Other ranks' files are not indexed by this rank.
    let mut c1 = cfg(&dir, 1 << 30);
    c1.layout = layout(1);
    let t1 = FileTier::open(c1, Arc::new(VecMemory::new(1, BLOCK))).unwrap();
    assert_eq!(t1.stats().indexed_files, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn other_layouts_use_other_directories() {
    let dir = tmpdir("layout");
    let (t, mem) = open(&dir, 1 << 30, 2);
    write_keys(&t, &mem, &[1]);
    let mut c = cfg(&dir, 1 << 30);
    c.layout.namespace = "other-model".into();
    let t2 = FileTier::open(c, Arc::new(VecMemory::new(1, BLOCK))).unwrap();
    assert!(!t2.contains(&key(1)));
    assert_ne!(t.dir(), t2.dir());
    let _ = std::fs::remove_dir_all(&dir);
}

fn flip_byte(path: &Path, at: u64) {
    use std::os::unix::fs::FileExt;
    let f = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .unwrap();
    let mut b = [0u8; 1];
    f.read_exact_at(&mut b, at).unwrap();
    b[0] ^= 0x01;
    f.write_all_at(&b, at).unwrap();
}

#[test]
fn flipped_or_truncated_files_are_never_served() {
    let dir = tmpdir("flip");
    let (t, mem) = open(&dir, 1 << 30, 8);
    write_keys(&t, &mem, &[1, 2, 3, 4, 5]);
    // Payload byte, header byte (the key), last payload byte, a truncated file, an appended byte.
    flip_byte(&t.path_of(&key(1)), 4096 + 12345);
    flip_byte(&t.path_of(&key(2)), 70);
    flip_byte(&t.path_of(&key(3)), 4096 + BLOCK as u64 - 1);
    let p4 = t.path_of(&key(4));
    let f = std::fs::OpenOptions::new().write(true).open(&p4).unwrap();
    f.set_len(4096 + 8192).unwrap();
    drop(f);
    let p5 = t.path_of(&key(5));
    let len5 = std::fs::metadata(&p5).unwrap().len();
    let f = std::fs::OpenOptions::new().write(true).open(&p5).unwrap();
    f.set_len(len5 + 4096).unwrap();
    drop(f);
    for i in 1..=5 {
        assert_eq!(
            read_key(&t, &mem, i),
            Some(false),
            "corrupt file of key {i} served"
        );
        assert!(!t.contains(&key(i)));
        assert!(
            !t.path_of(&key(i)).exists(),
            "corrupt file of key {i} not removed"
        );
    }
    let s = t.stats();
    assert_eq!(s.corrupt_files, 5);
    assert_eq!(s.promotions, 0);
    assert_eq!(s.own_files, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_file_renamed_to_another_key_is_rejected() {
    let dir = tmpdir("rename");
    let (t, mem) = open(&dir, 1 << 30, 8);
    write_keys(&t, &mem, &[1]);
    let p1 = t.path_of(&key(1));
    let p2 = t.path_of(&key(2));
    std::fs::rename(&p1, &p2).unwrap();
    t.rescan();
    drop(t);
    let (t, mem) = open(&dir, 1 << 30, 1);
    assert!(t.contains(&key(2)));
    assert_eq!(read_key(&t, &mem, 2), Some(false));
    assert_eq!(t.stats().corrupt_files, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn capacity_evicts_own_lru_files() {
    let dir = tmpdir("cap");
    let flen = kvoff::tier::file_len(BLOCK as u64);
    let (t, mem) = open(&dir, 3 * flen, 8);
    write_keys(&t, &mem, &[1, 2, 3]);
    // Promoting 1 makes it the most recently used.
    assert_eq!(read_key(&t, &mem, 1), Some(true));
    write_keys(&t, &mem, &[4, 5]);
    let s = t.stats();
    assert_eq!(s.own_files, 3);
    assert_eq!(s.own_bytes, 3 * flen);
    assert_eq!(s.evicted_files, 2);
    for (i, present) in [(1, true), (2, false), (3, false), (4, true), (5, true)] {
        assert_eq!(t.contains(&key(i)), present, "key {i}");
        assert_eq!(t.path_of(&key(i)).exists(), present, "file of key {i}");
    }
    // 4 and 5 overwrote the evicted files of 2 and 3 in place: their bytes are exact.
    assert_eq!(files_in(t.dir()).len(), 3);
    for i in [1, 4, 5] {
        assert_eq!(read_key(&t, &mem, i), Some(true), "key {i}");
    }
    // A capacity below one file drops every write.
    let (t2, mem2) = open(&tmpdir("cap0"), flen - 1, 1);
    mem2.set_block(0, &content(1, BLOCK)).unwrap();
    assert!(!t2.submit_write(&key(1), 0));
    assert_eq!(t2.stats().writes_dropped, 1);
    // Restart with a smaller capacity trims the adopted files.
    drop(t);
    let (t, _) = open(&dir, flen, 1);
    assert_eq!(t.stats().own_files, 1);
    t.flush();
    assert_eq!(
        files_in(t.dir()).len(),
        1,
        "files beyond the capacity removed at start"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn two_instances_share_a_directory() {
    let dir = tmpdir("share");
    let (a, mem_a) = open(&dir, 1 << 30, 8);
    let mut cb = cfg(&dir, 1 << 30);
    cb.owner = Some("engine-b".into());
    cb.rescan_interval = Some(Duration::from_millis(20));
    let mem_b = Arc::new(VecMemory::new(8, BLOCK));
    let b = FileTier::open(cb, mem_b.clone()).unwrap();
    write_keys(&a, &mem_a, &[1, 2, 3]);
    // B sees A's files after its periodic rescan.
    let t0 = Instant::now();
    while !(1..=3).all(|i| b.contains(&key(i))) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "B never saw A's files"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    for i in 1..=3 {
        assert_eq!(read_key(&b, &mem_b, i), Some(true));
    }
    assert_eq!(b.stats().own_files, 0, "A's files are not B's");
    // B does not write a key A already has; its own writes do not evict A's files.
    assert!(!b.submit_write(&key(1), 0));
    // A removes a file: B forgets it after a rescan; a read racing the removal is a miss, not an error.
    assert!(a.remove_own(&key(3)));
    a.flush();
    b.rescan();
    assert!(!b.contains(&key(3)));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn flush_waits_for_removals_and_wakes_every_waiter() {
    let dir = tmpdir("flushwait");
    let (t, mem) = open(&dir, 1 << 30, 16);
    let ids: Vec<u64> = (0..16).collect();
    write_keys(&t, &mem, &ids);
    let paths: Vec<PathBuf> = ids.iter().map(|&i| t.path_of(&key(i))).collect();
    assert!(paths.iter().all(|p| p.exists()));
    for &i in &ids {
        assert!(t.remove_own(&key(i)));
    }
    // Four threads wait at once: each returns, and only once every removal has run.
    let t = Arc::new(t);
    let waiters: Vec<_> = (0..4)
        .map(|_| {
            let w = t.idle_waiter();
            std::thread::spawn(move || w.wait())
        })
        .collect();
    within(10, "flush after removals", {
        let t = Arc::clone(&t);
        move || t.flush()
    });
    for w in waiters {
        within(10, "a second waiter", move || w.join().unwrap());
    }
    for p in &paths {
        assert!(!p.exists(), "{} still there after flush", p.display());
    }
    // An idle tier's flush returns at once.
    within(10, "flush of an idle tier", move || t.flush());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn same_owner_in_two_live_instances_still_shares() {
    let dir = tmpdir("sameowner");
    let (a, mem_a) = open(&dir, 1 << 30, 4);
    let (b, mem_b) = open(&dir, 1 << 30, 4); // same default owner tag
    write_keys(&a, &mem_a, &[1, 2]);
    assert!(!b.contains(&key(1)));
    b.rescan();
    assert!(b.contains(&key(1)) && b.contains(&key(2)));
    assert_eq!(read_key(&b, &mem_b, 1), Some(true));
    assert_eq!(
        b.stats().own_files,
        0,
        "found after the start: not counted as its own"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------- child processes ----------

fn child(mode: &str, dir: &Path) -> Command {
    let mut c = Command::new(std::env::current_exe().unwrap());
    c.args(["--exact", "child_entry", "--nocapture", "--test-threads=1"])
        .env("KVOFF_TIER_CHILD", mode)
        .env("KVOFF_TIER_DIR", dir)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit());
    c
}

/// Not a test of its own: the body of the child processes.
#[test]
fn child_entry() {
    let (Ok(mode), Ok(dir)) = (
        std::env::var("KVOFF_TIER_CHILD"),
        std::env::var("KVOFF_TIER_DIR"),
    ) else {
        return;
    };
    let dir = PathBuf::from(dir);
    let mem = Arc::new(VecMemory::new(16, BLOCK));
    let mut c = cfg(&dir, 1 << 40);
    c.owner = Some(format!("child-{mode}"));
    c.io_threads = 4;
    let t = FileTier::open(c, mem.clone()).unwrap();
    match mode.as_str() {
        "write64" => {
            for i in 0..64u64 {
                let b = (i % 16) as u32;
                // Wait for the block to be released before reusing it.
                while t.stats().queued_writes >= 12 {
                    std::thread::sleep(Duration::from_millis(1));
                }
                t.flush();
                let _ = t.poll();
                mem.set_block(b, &content(i, BLOCK)).unwrap();
                assert!(t.submit_write(&key(i), b));
            }
            t.flush();
        }
        "forever" => {
            // Writes until killed, 16 in flight; prints nothing.
            let mut i = 1000u64;
            loop {
                t.flush();
                let _ = t.poll();
                for b in 0..16u32 {
                    mem.set_block(b, &content(i, BLOCK)).unwrap();
                    let _ = t.submit_write(&key(i), b);
                    i += 1;
                }
            }
        }
        _ => panic!("unknown child mode {mode}"),
    }
}

#[test]
fn restart_in_another_process_serves_the_files() {
    let dir = tmpdir("proc");
    let st = child("write64", &dir).status().unwrap();
    assert!(st.success());
    let (t, mem) = open(&dir, 1 << 30, 1);
    let mut served = 0;
    for i in 0..64 {
        if read_key(&t, &mem, i) == Some(true) {
            served += 1;
        }
    }
    assert_eq!(
        served, 64,
        "restart serves every block the other process wrote"
    );
    assert_eq!(t.stats().corrupt_files, 0);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_running_engine_sees_another_process_files() {
    let dir = tmpdir("proc2");
    let (t, mem) = open(&dir, 1 << 30, 1);
    assert!(!t.contains(&key(5)));
    assert!(child("write64", &dir).status().unwrap().success());
    t.rescan();
    for i in 0..64 {
        assert_eq!(read_key(&t, &mem, i), Some(true), "key {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigkill_during_writes_never_serves_a_torn_block() {
    let dir = tmpdir("kill");
    for round in 0..3 {
        let mut ch = child("forever", &dir).spawn().unwrap();
        std::thread::sleep(Duration::from_millis(300 + 150 * round));
        ch.kill().unwrap(); // SIGKILL
        ch.wait().unwrap();
    }
    // Tear one published file by hand as a crash of the filesystem would (truncate mid-payload).
    let (t, mem) = open(&dir, 1 << 40, 1);
    let n = t.stats().indexed_files;
    assert!(n > 16, "the children wrote only {n} files");
    let mut any = None;
    for p in files_in(t.dir()) {
        let name = p.file_name().unwrap().to_str().unwrap().to_owned();
        assert!(
            !name.starts_with(".tmp."),
            "stale temporary file {name} left after restart"
        );
        any.get_or_insert(p);
    }
    let torn = any.unwrap();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&torn)
        .unwrap()
        .set_len(4096 + 1000)
        .unwrap();
    let (mut ok, mut bad) = (0, 0);
    for i in 1000..1000 + 16 * 4000u64 {
        match read_key(&t, &mem, i) {
            Some(true) => ok += 1, // read_key checked the bytes
            Some(false) => bad += 1,
            None => {}
        }
    }
    assert_eq!(ok + bad, n, "every indexed file was tried");
    assert_eq!(bad, 1, "only the hand-torn file is rejected");
    assert_eq!(t.stats().corrupt_files, 1);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------- errors ----------

#[test]
fn bad_directories_are_config_errors() {
    let base = tmpdir("bad");
    let file = base.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let mem = Arc::new(VecMemory::new(1, BLOCK));
    for d in [file.clone(), file.join("sub")] {
        let e = FileTier::open(cfg(&d, 1 << 20), mem.clone()).unwrap_err();
        assert!(
            matches!(e, KvoffError::Config(ref m) if m.contains("disk_path")),
            "{e:?}"
        );
    }
    // O_DIRECT demanded where it may be refused: an error only where it is.
    let shm = PathBuf::from("/dev/shm").join(format!("kvoff-tier-shm-{}", std::process::id()));
    let mut c = cfg(&shm, 1 << 20);
    c.direct_io = DirectIo::On;
    if let Err(e) = FileTier::open(c, mem.clone()) {
        assert!(
            matches!(e, KvoffError::Config(ref m) if m.contains("O_DIRECT")),
            "{e:?}"
        );
    }
    let t = FileTier::open(cfg(&shm, 1 << 20), mem.clone()).unwrap();
    assert!(!t.direct_io() || t.dir().exists());
    drop(t);
    let _ = std::fs::remove_dir_all(&shm);
    let mut c = cfg(&base, 1 << 20);
    c.io_threads = 0;
    assert!(matches!(
        FileTier::open(c, mem),
        Err(KvoffError::InvalidArgument(_))
    ));
    let _ = std::fs::remove_dir_all(&base);
}

fn is_root() -> bool {
    std::fs::read_to_string("/proc/self/status")
        .map(|s| {
            s.lines()
                .any(|l| l.starts_with("Uid:") && l.split_whitespace().nth(1) == Some("0"))
        })
        .unwrap_or(false)
}

struct Mount(PathBuf);
impl Mount {
    fn tmpfs(tag: &str, opts: &str) -> Option<Self> {
        if !is_root() {
            return None;
        }
        let d = tmpdir(tag);
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", opts, "tmpfs"])
            .arg(&d)
            .status()
            .is_ok_and(|s| s.success());
        ok.then_some(Self(d))
    }
    fn remount(&self, opts: &str) -> bool {
        Command::new("mount")
            .args(["-o", &format!("remount,{opts}")])
            .arg(&self.0)
            .status()
            .is_ok_and(|s| s.success())
    }
}
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[test]
fn full_disk_skips_stores_and_keeps_serving() {
    let Some(m) = Mount::tmpfs("enospc", "size=1m") else {
        eprintln!("SKIPPED: mounting a 1 MiB tmpfs needs root (run as root to cover ENOSPC)");
        return;
    };
    let (t, mem) = open(&m.0, 1 << 30, 16);
    for i in 0..16u64 {
        mem.set_block(i as u32, &content(i, BLOCK)).unwrap();
        assert!(t.submit_write(&key(i), i as u32));
    }
    t.flush();
    let released = t.poll().len();
    assert_eq!(released, 16, "every block is released, written or not");
    let s = t.stats();
    assert!(
        s.write_errors > 0,
        "a 1 MiB filesystem cannot hold 16 files of 68 KiB: {s:?}"
    );
    assert_eq!(s.files_written + s.write_errors, 16);
    assert!(
        s.last_error.as_deref().unwrap_or("").contains("No space"),
        "{s:?}"
    );
    assert_eq!(
        s.own_files, s.files_written,
        "failed writes are not indexed"
    );
    // What was written is still served; nothing half-written stays behind.
    let mut served = 0;
    for i in 0..16 {
        if read_key(&t, &mem, i) == Some(true) {
            served += 1;
        }
    }
    assert_eq!(served, s.files_written);
    for p in files_in(t.dir()) {
        assert!(!p
            .file_name()
            .unwrap()
            .to_string_lossy()
            .starts_with(".tmp."));
    }
}

#[test]
fn read_only_filesystem_at_start_and_at_run_time() {
    let Some(m) = Mount::tmpfs("rofs", "size=16m") else {
        eprintln!(
            "SKIPPED: mounting a tmpfs needs root (run as root to cover read-only filesystems)"
        );
        return;
    };
    let (t, mem) = open(&m.0, 1 << 30, 4);
    write_keys(&t, &mem, &[1]);
    assert!(m.remount("ro"));
    // At run time: the write fails, is counted, the tier keeps serving.
    mem.set_block(1, &content(2, BLOCK)).unwrap();
    assert!(t.submit_write(&key(2), 1));
    t.flush();
    assert_eq!(t.poll().len(), 1);
    let s = t.stats();
    assert_eq!(s.write_errors, 1);
    assert_eq!(read_key(&t, &mem, 1), Some(true));
    // At start: a clear configuration error naming the directory.
    let e = FileTier::open(cfg(&m.0, 1 << 30), Arc::new(VecMemory::new(1, BLOCK))).unwrap_err();
    match e {
        KvoffError::Config(msg) => assert!(
            msg.contains("Read-only") && msg.contains("disk_path"),
            "{msg}"
        ),
        other => panic!("{other:?}"),
    }
    drop(t);
    assert!(m.remount("rw"));
}

#[test]
fn buffered_io_roundtrip() {
    let dir = tmpdir("buffered");
    let mem = Arc::new(VecMemory::new(4, BLOCK));
    let mut c = cfg(&dir, 1 << 30);
    c.direct_io = DirectIo::Off;
    c.fsync = true;
    let t = FileTier::open(c, mem.clone()).unwrap();
    assert!(!t.direct_io());
    write_keys(&t, &mem, &[7, 8]);
    assert_eq!(read_key(&t, &mem, 7), Some(true));
    assert_eq!(read_key(&t, &mem, 8), Some(true));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn at_capacity_restart_reuse() {
    let dir = tmpdir("atcap");
    let flen = kvoff::tier::file_len(BLOCK as u64);
    let ids: Vec<u64> = (100..108).collect();
    {
        let (t, mem) = open(&dir, 8 * flen, 8);
        write_keys(&t, &mem, &ids);
    }
    let ids2: Vec<u64> = (0..8).collect();
    {
        let (t, mem) = open(&dir, 8 * flen, 8);
        assert_eq!(t.stats().own_files, 8);
        write_keys(&t, &mem, &ids2);
        let s = t.stats();
        assert_eq!(
            (s.own_files, s.evicted_files, s.write_errors),
            (8, 8, 0),
            "{s:?}"
        );
    }
    let (t, mem) = open(&dir, 8 * flen, 1);
    assert_eq!(files_in(t.dir()).len(), 8);
    for &i in &ids2 {
        assert_eq!(read_key(&t, &mem, i), Some(true), "key {i}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// Promotions read straight into 4 KiB-aligned host rows (the `HostRegion` case) and check the
/// bytes there; corrupt and short files are still rejected.
#[test]
fn direct_reads_into_aligned_rows() {
    use kvoff::tier::{AlignedRows, BlockMemory};
    const B: usize = 64 * 1024;
    let dir = tmpdir("direct");
    let mut c = TierConfig::new(&dir, 1 << 30, layout(0));
    c.rescan_interval = None;
    let src = Arc::new(AlignedRows::new(4, B).unwrap());
    let t = FileTier::open(c.clone(), src.clone()).unwrap();
    for i in 0..4u64 {
        src.copy_in(i as u32, &content(i, B)).unwrap();
        assert!(t.submit_write(&key(i), i as u32));
    }
    t.flush();
    let direct = t.direct_io();
    let p1 = t.path_of(&key(1));
    let p2 = t.path_of(&key(2));
    drop(t);
    flip_byte(&p1, 4096 + 5000);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p2)
        .unwrap()
        .set_len(4096 + B as u64 / 2)
        .unwrap();
    let dst = Arc::new(AlignedRows::new(4, B).unwrap());
    let t = FileTier::open(c, dst.clone()).unwrap();
    for i in 0..4u64 {
        assert!(t.submit_read(&key(i), i as u32));
    }
    t.flush();
    let mut done = t.poll();
    done.sort_by_key(|c| match c {
        Completion::Promoted { block, .. } | Completion::Released { block, .. } => *block,
    });
    let oks: Vec<bool> = done
        .iter()
        .map(|c| matches!(c, Completion::Promoted { ok: true, .. }))
        .collect();
    assert_eq!(oks, vec![true, false, false, true], "direct_io = {direct}");
    let mut got = vec![0u8; B];
    for i in [0u64, 3] {
        dst.copy_out(i as u32, &mut got).unwrap();
        assert_eq!(got, content(i, B));
    }
    assert_eq!(t.stats().corrupt_files, 2);
    let _ = std::fs::remove_dir_all(&dir);
}

// ---------- hostile directories (docs/tier.md "Trust") ----------

/// Runs `f` on another thread and fails the test if it has not returned within `secs` (a hang
/// must fail fast, not wedge the suite; the stuck thread is left behind).
fn within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(Duration::from_secs(secs)) {
        Ok(v) => v,
        Err(_) => panic!("{what} did not return within {secs} s (hung)"),
    }
}

fn mkfifo(p: &Path) {
    let _ = std::fs::remove_file(p);
    let ok = Command::new("mkfifo").arg(p).status().unwrap().success();
    assert!(ok, "mkfifo {}", p.display());
}

/// Key `i`'s file as a fresh tier would name it (the owner tag is the default one).
fn name_of(dir: &Path, i: u64) -> PathBuf {
    let (t, _) = open(dir, 1 << 30, 1);
    t.path_of(&key(i))
}

#[test]
fn a_fifo_at_a_key_file_name_is_skipped_never_waited_on() {
    let dir = tmpdir("fifo");
    let d = dir.clone();
    within(30, "the FIFO cases", move || {
        // Start-up scan: a FIFO at key 1's name and one at a hashed (long-key) name, which the
        // scan would open to read the key.
        let p1 = name_of(&d, 1);
        mkfifo(&p1);
        let hashed =
            p1.parent()
                .unwrap()
                .join(format!("h{}.r0.{}.kvb", "ab".repeat(16), "00".repeat(8)));
        mkfifo(&hashed);
        let (t, mem) = open(&d, 1 << 30, 4);
        assert!(!t.contains(&key(1)));
        assert_eq!(t.stats().rejected_files, 2, "{:?}", t.stats());
        // A FIFO that replaces an indexed file after the start: the promotion fails at once.
        write_keys(&t, &mem, &[2]);
        let p2 = t.path_of(&key(2));
        mkfifo(&p2);
        assert_eq!(read_key(&t, &mem, 2), Some(false));
        assert!(!t.contains(&key(2)));
        assert_eq!(t.stats().rejected_files, 3);
        // The rescan skips them (counted once per entry).
        t.rescan();
        t.rescan();
        assert_eq!(t.stats().rejected_files, 3);
        assert!(!t.contains(&key(2)));
        // Writing key 1 replaces the FIFO with its file.
        write_keys(&t, &mem, &[1]);
        assert_eq!(read_key(&t, &mem, 1), Some(true));
        drop(t);
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_fifo_replacing_an_evicted_own_file_does_not_block_the_write() {
    let dir = tmpdir("fifo-reuse");
    let d = dir.clone();
    within(30, "the write reusing a FIFO", move || {
        let flen = kvoff::tier::file_len(BLOCK as u64);
        // Room for one file: writing key 2 evicts key 1 and reuses its file.
        let (t, mem) = open(&d, flen, 2);
        write_keys(&t, &mem, &[1]);
        mkfifo(&t.path_of(&key(1)));
        write_keys(&t, &mem, &[2]);
        assert_eq!(read_key(&t, &mem, 2), Some(true));
        let s = t.stats();
        assert_eq!(s.rejected_files, 1, "{s:?}");
        assert_eq!(s.write_errors, 0, "{s:?}");
    });
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_hard_linked_evicted_file_is_not_written_through() {
    let dir = tmpdir("hardlink");
    let outside = tmpdir("hardlink-outside").join("victim");
    let flen = kvoff::tier::file_len(BLOCK as u64);
    let (t, mem) = open(&dir, flen, 2);
    write_keys(&t, &mem, &[1]);
    std::fs::hard_link(t.path_of(&key(1)), &outside).unwrap();
    let before = std::fs::read(&outside).unwrap();
    write_keys(&t, &mem, &[2]);
    assert_eq!(
        std::fs::read(&outside).unwrap(),
        before,
        "the linked file was rewritten"
    );
    assert_eq!(read_key(&t, &mem, 2), Some(true));
    assert_eq!(t.stats().rejected_files, 1);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(outside.parent().unwrap());
}

#[test]
fn symlinked_directories_are_never_followed() {
    let dir = tmpdir("symlink");
    let outside = tmpdir("symlink-outside");
    let ns = {
        let (t, _) = open(&dir, 1 << 30, 1);
        t.dir().to_path_buf()
    };
    // The namespace directory replaced by a link: refused at open, nothing created there.
    std::fs::rename(&ns, dir.join("moved")).unwrap();
    std::os::unix::fs::symlink(&outside, &ns).unwrap();
    let mem = Arc::new(VecMemory::new(2, BLOCK));
    let e = FileTier::open(cfg(&dir, 1 << 30), mem.clone()).unwrap_err();
    assert!(
        matches!(e, KvoffError::Config(ref m) if m.contains("refusing")),
        "{e:?}"
    );
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    std::fs::remove_file(&ns).unwrap();
    std::fs::rename(dir.join("moved"), &ns).unwrap();
    // A shard directory replaced by a link: refused at open.
    let shard = ns.join("00");
    std::fs::remove_dir(&shard).unwrap();
    std::os::unix::fs::symlink(&outside, &shard).unwrap();
    let e = FileTier::open(cfg(&dir, 1 << 30), mem.clone()).unwrap_err();
    assert!(
        matches!(e, KvoffError::Config(ref m) if m.contains("refusing")),
        "{e:?}"
    );
    std::fs::remove_file(&shard).unwrap();
    // ... and after the start: writes to that shard fail, nothing lands outside.
    let t = FileTier::open(cfg(&dir, 1 << 30), mem.clone()).unwrap();
    let ks: Vec<u64> = (0..2000)
        .filter(|&i| t.path_of(&key(i)).parent() == Some(shard.as_path()))
        .take(2)
        .collect();
    std::fs::remove_dir(&shard).unwrap();
    std::os::unix::fs::symlink(&outside, &shard).unwrap();
    for (b, &i) in ks.iter().enumerate() {
        mem.set_block(b as u32, &content(i, BLOCK)).unwrap();
        assert!(t.submit_write(&key(i), b as u32));
    }
    t.flush();
    assert_eq!(t.stats().write_errors, 2);
    assert_eq!(std::fs::read_dir(&outside).unwrap().count(), 0);
    t.rescan();
    assert_eq!(t.stats().rejected_files, 1, "{:?}", t.stats());
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&outside);
}

fn chown(p: &Path, uid: u32, gid: u32) {
    std::os::unix::fs::chown(p, Some(uid), Some(gid)).unwrap();
}

fn set_mode(p: &Path, mode: u32) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).unwrap();
}

#[test]
fn files_of_untrusted_users_or_modes_are_not_served() {
    if !is_root() {
        eprintln!("skipped: needs root to chown files to another user");
        return;
    }
    let dir = tmpdir("owners");
    {
        let (t, mem) = open(&dir, 1 << 30, 4);
        write_keys(&t, &mem, &[1, 2, 3]);
        chown(&t.path_of(&key(1)), 65534, 65534);
        set_mode(&t.path_of(&key(2)), 0o666);
        chown(&t.path_of(&key(3)), 65534, 4242);
    }
    let (t, mem) = open(&dir, 1 << 30, 4);
    assert!(!t.contains(&key(1)) && !t.contains(&key(2)) && !t.contains(&key(3)));
    assert_eq!(t.stats().rejected_files, 3);
    drop(t);
    // Trusted by setting: uid 65534's file, and group 4242's file.
    let mut c = cfg(&dir, 1 << 30);
    c.trusted_uids = vec![65534];
    c.trusted_gid = Some(4242);
    let t = FileTier::open(c, mem.clone()).unwrap();
    assert_eq!(read_key(&t, &mem, 1), Some(true));
    assert_eq!(read_key(&t, &mem, 3), Some(true));
    assert!(
        !t.contains(&key(2)),
        "a world-writable file is never trusted"
    );
    drop(t);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn writable_directories_need_the_sticky_bit_or_a_setting() {
    let base = tmpdir("writable");
    let mem = Arc::new(VecMemory::new(1, BLOCK));
    set_mode(&base, 0o777);
    let e = FileTier::open(cfg(&base, 1 << 20), mem.clone()).unwrap_err();
    assert!(
        matches!(e, KvoffError::Config(ref m) if m.contains("sticky")),
        "{e:?}"
    );
    let mut c = cfg(&base, 1 << 20);
    c.allow_writable_dir = true;
    drop(FileTier::open(c, mem.clone()).unwrap());
    set_mode(&base, 0o1777);
    let t = FileTier::open(cfg(&base, 1 << 20), mem.clone()).unwrap();
    // The namespace directory itself writable by others: refused.
    set_mode(t.dir(), 0o777);
    drop(t);
    let e = FileTier::open(cfg(&base, 1 << 20), mem.clone()).unwrap_err();
    assert!(
        matches!(e, KvoffError::Config(ref m) if m.contains("sticky")),
        "{e:?}"
    );
    let _ = std::fs::remove_dir_all(&base);
}
