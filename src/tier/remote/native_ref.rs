//! The native-client reference of `kvoff bench remote` (docs/tier.md "Remote tier"; issue 47's
//! measure): what a C++ connector such as LMCache's `resp://` one does with a Redis/Valkey
//! server — one `SET` or `GET` per key, one request in flight per connection, from `threads`
//! threads (one connection each, keys taken from a shared counter), values written from and read
//! straight into plain host memory, no header, no checksum. The remote tier's store and load are
//! measured against it on the same server in the same run.
//!
//! Each pass moves `n_blocks` values of `value_bytes` under keys `kvoff-bench-native:<i>`: a timed
//! `SET` of every value, then a timed `GET` of every value into a second buffer (pre-faulted, as a
//! host region is), then every byte compared. The keys are written once, untimed, before the first
//! pass, so that every timed `SET` replaces a value the server holds, as kvoff's timed stores and
//! redis-benchmark's SETs do (a first write of fresh keys costs the server far more per value:
//! BENCHMARKS.md "Remote tier"). The keys are deleted at the end
//! ([`NativeRef::cleanup`]). Standalone plain-TCP servers only (`redis://`): a Cluster's slot
//! routing or TLS would make it another client than the one it stands for.
#![forbid(unsafe_code)]

use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use super::config::parse_url;
use crate::error::{KvoffError, Result};

/// One pass's result.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct NativePass {
    /// Threads (connections) of the pass.
    pub threads: usize,
    /// GB/s of values stored (`SET`, each acknowledged).
    pub set_gb_s: f64,
    /// GB/s of values loaded (`GET`, each into its place in host memory).
    pub get_gb_s: f64,
    /// Every loaded byte equal to the stored one.
    pub verified: bool,
}

/// The reference client for one server and value size (see the module docs).
pub struct NativeRef {
    host: String,
    port: u16,
    /// `AUTH` arguments (user, password) and `SELECT` database, from the URL.
    auth: Option<(Option<String>, String)>,
    db: i64,
    value_bytes: usize,
    n_blocks: usize,
    io_timeout: Duration,
    /// The keys hold values (the untimed first write is done).
    written: bool,
    src: Vec<u8>,
    dst: Vec<u8>,
}

fn io(what: &str, e: &std::io::Error) -> KvoffError {
    KvoffError::state(format!("native reference: {what}: {e}"))
}

impl NativeRef {
    /// A reference over `n_blocks` values of `value_bytes` (random bytes, the value's index in
    /// its first 8) for the server at `url` (`redis://`, standalone).
    ///
    /// # Errors
    /// [`KvoffError::Config`] for a URL that is not a standalone plain-TCP one;
    /// [`KvoffError::InvalidArgument`] for zero or absurd sizes.
    pub fn new(url: &str, value_bytes: usize, n_blocks: usize) -> Result<Self> {
        if value_bytes < 8 || n_blocks == 0 {
            return Err(KvoffError::arg(
                "the native reference needs values of at least 8 bytes and one block",
            ));
        }
        let total = value_bytes
            .checked_mul(n_blocks)
            .filter(|&t| t <= 16 << 30)
            .ok_or_else(|| KvoffError::arg("the native reference moves at most 16 GiB"))?;
        let target = parse_url(url, "KVOFF_REMOTE_PASSWORD", None)?;
        if target.cluster {
            return Err(KvoffError::Config(
                "the native reference talks to a standalone server only".into(),
            ));
        }
        let info = &target.nodes[0];
        let redis::ConnectionAddr::Tcp(host, port) = info.addr() else {
            return Err(KvoffError::Config(
                "the native reference talks plain TCP (redis://) only".into(),
            ));
        };
        let s = info.redis_settings();
        let auth = s
            .password()
            .map(|p| (s.username().map(str::to_owned), p.to_owned()));
        let mut src = vec![0u8; total];
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        for (i, v) in src.chunks_exact_mut(value_bytes).enumerate() {
            for w in v.chunks_mut(8) {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                w.copy_from_slice(&x.to_le_bytes()[..w.len()]);
            }
            v[..8].copy_from_slice(&(i as u64).to_le_bytes());
        }
        Ok(Self {
            host: host.clone(),
            port: *port,
            auth,
            db: s.db(),
            value_bytes,
            n_blocks,
            io_timeout: Duration::from_secs(30),
            written: false,
            // Written once here, so that the timed loads land in mapped memory.
            dst: vec![1u8; total],
            src,
        })
    }

    fn key(i: usize) -> String {
        format!("kvoff-bench-native:{i}")
    }

    fn connect(&self) -> Result<TcpStream> {
        let addr = (self.host.as_str(), self.port)
            .to_socket_addrs()
            .map_err(|e| io("resolving", &e))?
            .next()
            .ok_or_else(|| KvoffError::Config("native reference: no address".into()))?;
        let mut s =
            TcpStream::connect_timeout(&addr, self.io_timeout).map_err(|e| io("connecting", &e))?;
        s.set_nodelay(true).map_err(|e| io("connecting", &e))?;
        s.set_read_timeout(Some(self.io_timeout))
            .map_err(|e| io("connecting", &e))?;
        s.set_write_timeout(Some(self.io_timeout))
            .map_err(|e| io("connecting", &e))?;
        if let Some((user, pw)) = &self.auth {
            let mut args: Vec<&[u8]> = vec![b"AUTH"];
            if let Some(u) = user {
                args.push(u.as_bytes());
            }
            args.push(pw.as_bytes());
            simple(&mut s, &args, b"+OK\r\n")?;
        }
        if self.db != 0 {
            let db = self.db.to_string();
            simple(&mut s, &[b"SELECT", db.as_bytes()], b"+OK\r\n")?;
        }
        Ok(s)
    }

    /// Runs `work(connection, key index)` over every key from `threads` threads (keys taken from a
    /// shared counter); returns the seconds from the first request to the last reply.
    fn run(
        &self,
        threads: usize,
        work: &(dyn Fn(&mut TcpStream, usize) -> Result<()> + Sync),
    ) -> Result<f64> {
        let conns = (0..threads)
            .map(|_| self.connect())
            .collect::<Result<Vec<_>>>()?;
        let next = AtomicUsize::new(0);
        let n = self.n_blocks;
        let t0 = Instant::now();
        std::thread::scope(|sc| {
            let handles: Vec<_> = conns
                .into_iter()
                .map(|mut c| {
                    let next = &next;
                    sc.spawn(move || -> Result<()> {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= n {
                                return Ok(());
                            }
                            work(&mut c, i)?;
                        }
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join()
                        .map_err(|_| KvoffError::state("native reference: a thread panicked"))?
                })
                .collect::<Result<Vec<()>>>()
        })?;
        Ok(t0.elapsed().as_secs_f64())
    }

    fn gb_s(&self, secs: f64) -> f64 {
        #[allow(clippy::cast_precision_loss)] // at most 16 GiB: exact in an f64
        let bytes = (self.value_bytes * self.n_blocks) as f64;
        bytes / secs / 1e9
    }

    /// The timed `SET` of every value from `threads` connections (before the first, an untimed
    /// one: see the module docs); GB/s of values.
    ///
    /// # Errors
    /// The first I/O error or unexpected reply.
    pub fn set_pass(&mut self, threads: usize) -> Result<f64> {
        let threads = threads.clamp(1, 256);
        let vb = self.value_bytes;
        let src = &self.src;
        let set = |c: &mut TcpStream, i: usize| -> Result<()> {
            let key = Self::key(i);
            let head = format!("*3\r\n$3\r\nSET\r\n${}\r\n{key}\r\n${vb}\r\n", key.len());
            write_all_vectored(c, &[head.as_bytes(), &src[i * vb..(i + 1) * vb], b"\r\n"])?;
            expect(c, b"+OK\r\n")
        };
        if !self.written {
            self.run(threads, &set)?;
            self.written = true;
        }
        let secs = self.run(threads, &set)?;
        Ok(self.gb_s(secs))
    }

    /// The timed `GET` of every value from `threads` connections, each into its row of host
    /// memory; GB/s of values, and whether every byte equals the stored one (the rows are
    /// overwritten after the check, so that the next pass is checked afresh).
    ///
    /// # Errors
    /// [`KvoffError::InvalidState`] before any [`NativeRef::set_pass`]; the first I/O error or
    /// unexpected reply.
    pub fn get_pass(&mut self, threads: usize) -> Result<(f64, bool)> {
        if !self.written {
            return Err(KvoffError::state(
                "native reference: no values stored yet (set_pass first)",
            ));
        }
        let threads = threads.clamp(1, 256);
        let vb = self.value_bytes;
        // Each key's row of the destination, handed to whichever thread takes the key.
        let mut dst = std::mem::take(&mut self.dst);
        let secs = {
            let rows: Vec<std::sync::Mutex<&mut [u8]>> = dst
                .chunks_exact_mut(vb)
                .map(std::sync::Mutex::new)
                .collect();
            let get = |c: &mut TcpStream, i: usize| -> Result<()> {
                let key = Self::key(i);
                let req = format!("*2\r\n$3\r\nGET\r\n${}\r\n{key}\r\n", key.len());
                c.write_all(req.as_bytes()).map_err(|e| io("GET", &e))?;
                let mut row = rows[i]
                    .lock()
                    .map_err(|_| KvoffError::state("native reference: a row's lock"))?;
                read_bulk_into(c, &mut row)
            };
            self.run(threads, &get)
        };
        let verified = dst == self.src;
        dst.fill(1);
        self.dst = dst;
        Ok((self.gb_s(secs?), verified))
    }

    /// One pass: [`NativeRef::set_pass`] then [`NativeRef::get_pass`] with `threads`
    /// connections.
    ///
    /// # Errors
    /// The first I/O error or unexpected reply.
    pub fn pass(&mut self, threads: usize) -> Result<NativePass> {
        let set_gb_s = self.set_pass(threads)?;
        let (get_gb_s, verified) = self.get_pass(threads)?;
        Ok(NativePass {
            threads: threads.clamp(1, 256),
            set_gb_s,
            get_gb_s,
            verified,
        })
    }

    /// Deletes the reference's keys (pipelined `DEL`s on one connection).
    ///
    /// # Errors
    /// The first I/O error.
    pub fn cleanup(&self) -> Result<()> {
        let mut c = self.connect()?;
        for chunk in (0..self.n_blocks).collect::<Vec<_>>().chunks(512) {
            let mut out = String::new();
            for &i in chunk {
                let key = Self::key(i);
                let _ = write!(out, "*2\r\n$3\r\nDEL\r\n${}\r\n{key}\r\n", key.len());
            }
            c.write_all(out.as_bytes()).map_err(|e| io("DEL", &e))?;
            for _ in chunk {
                let mut line = Vec::new();
                read_line(&mut c, &mut line)?;
                if line.first() != Some(&b':') {
                    return Err(bad_reply("DEL", &line));
                }
            }
        }
        Ok(())
    }
}

fn bad_reply(what: &str, got: &[u8]) -> KvoffError {
    let shown = String::from_utf8_lossy(&got[..got.len().min(80)]).into_owned();
    KvoffError::InvalidState(format!("native reference: {what} answered {shown:?}"))
}

/// Sends one command and expects exactly `want` back.
fn simple(c: &mut TcpStream, args: &[&[u8]], want: &[u8]) -> Result<()> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    c.write_all(&out).map_err(|e| io("setup", &e))?;
    let mut line = Vec::new();
    read_line(c, &mut line)?;
    if line != want {
        // Never the command's arguments: AUTH's is a password.
        return Err(KvoffError::Config(
            "native reference: the server refused AUTH or SELECT".into(),
        ));
    }
    Ok(())
}

/// Writes every slice in order (`writev`, as a C++ client sends a command around a value).
fn write_all_vectored(c: &mut TcpStream, parts: &[&[u8]]) -> Result<()> {
    let mut idx = 0;
    let mut off = 0;
    while idx < parts.len() {
        let mut iov = Vec::with_capacity(parts.len() - idx);
        iov.push(std::io::IoSlice::new(&parts[idx][off..]));
        for p in &parts[idx + 1..] {
            iov.push(std::io::IoSlice::new(p));
        }
        let mut n = c.write_vectored(&iov).map_err(|e| io("SET", &e))?;
        if n == 0 {
            return Err(KvoffError::InvalidState(
                "native reference: connection closed".into(),
            ));
        }
        while idx < parts.len() && n >= parts[idx].len() - off {
            n -= parts[idx].len() - off;
            idx += 1;
            off = 0;
        }
        off += n;
    }
    Ok(())
}

/// Reads exactly `want` (a short status reply).
fn expect(c: &mut TcpStream, want: &[u8]) -> Result<()> {
    let mut got = vec![0u8; want.len()];
    c.read_exact(&mut got).map_err(|e| io("reply", &e))?;
    if got != want {
        return Err(bad_reply("SET", &got));
    }
    Ok(())
}

/// Reads one line (up to and with its CRLF) a byte at a time (short replies only).
fn read_line(c: &mut TcpStream, line: &mut Vec<u8>) -> Result<()> {
    let mut b = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        if line.len() > 4096 {
            return Err(bad_reply("a command", line));
        }
        c.read_exact(&mut b).map_err(|e| io("reply", &e))?;
        line.push(b[0]);
    }
    Ok(())
}

/// Reads a bulk string reply of exactly `row.len()` bytes straight into `row`: its header in one
/// small read (the bytes of the body it took are copied), the body with `read_exact`, the CRLF.
fn read_bulk_into(c: &mut TcpStream, row: &mut [u8]) -> Result<()> {
    let mut head = [0u8; 32];
    let mut have = 0;
    let end = loop {
        let n = c.read(&mut head[have..]).map_err(|e| io("GET", &e))?;
        if n == 0 {
            return Err(KvoffError::InvalidState(
                "native reference: connection closed".into(),
            ));
        }
        have += n;
        if let Some(p) = head[..have].windows(2).position(|w| w == b"\r\n") {
            break p;
        }
        if have == head.len() {
            return Err(bad_reply("GET", &head));
        }
    };
    let len = std::str::from_utf8(&head[1..end])
        .ok()
        .and_then(|s| s.parse::<usize>().ok());
    if head[0] != b'$' || len != Some(row.len()) {
        return Err(bad_reply("GET", &head[..have]));
    }
    let body = &head[end + 2..have];
    let total = row.len() + 2;
    if body.len() > total {
        return Err(bad_reply("GET", &head[..have]));
    }
    let mut tail = [0u8; 2];
    // The body and CRLF bytes that came with the header.
    let take = body.len().min(row.len());
    row[..take].copy_from_slice(&body[..take]);
    let crlf_have = body.len() - take;
    tail[..crlf_have].copy_from_slice(&body[take..]);
    if take < row.len() {
        c.read_exact(&mut row[take..]).map_err(|e| io("GET", &e))?;
    }
    if body.len() < total {
        c.read_exact(&mut tail[crlf_have..])
            .map_err(|e| io("GET", &e))?;
    }
    if &tail != b"\r\n" {
        return Err(bad_reply("GET", &tail));
    }
    Ok(())
}
