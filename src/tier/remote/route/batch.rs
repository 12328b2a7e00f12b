//! A batch's way through the router (docs/tier.md "Remote tier", "Faults", "Cluster routing"):
//! its commands split per node, each node's part one pipeline (written to every node first, then
//! the replies read node by node), `MOVED`/`ASK` followed once, and a failing node failing only
//! its own commands ([`Router::run`]).
#![forbid(unsafe_code)]

use super::{key_slot, lock, Conns, Pack, Router, RouterState, NO_NODE};

/// A pipeline is written to the socket whenever this much of it is packed.
const SEND_CHUNK_BYTES: usize = 1 << 20;

/// The replies of a batch: per command its value (server error replies other than redirects
/// included, as `redis::Value::ServerError`) or `None` when it was not answered (node down or
/// failing, slot unserved, redirected twice); and the last failure, for the tier's `last_error`.
pub(in crate::tier::remote) struct Outcome {
    pub replies: Vec<Option<redis::Value>>,
    pub error: Option<String>,
}

/// What to do with a reply that is a server error.
enum Redirect {
    Moved(String, u16),
    Ask(String, u16),
}

/// Where a command goes: its slot's master, or where a redirect sent it.
enum Dest {
    Slot,
    Redirect(Redirect),
}

/// What a round left to do: redirected commands, and commands whose node failed (with it).
struct Round {
    redirects: Vec<(usize, Redirect)>,
    failed: Vec<(usize, usize)>,
}

/// A batch's command routed to a node (`asking`: send `ASKING` first).
struct Routed {
    index: usize,
    asking: bool,
}

impl Router {
    /// Runs `cmds` (each with the key that routes it) and returns their replies; see the module
    /// docs for what fails which command, and [`Outcome`].
    pub(in crate::tier::remote) fn run<R: Pack>(
        &self,
        conns: &mut Conns,
        cmds: &[(String, R)],
    ) -> Outcome {
        let mut out = Outcome {
            replies: vec![None; cmds.len()],
            error: None,
        };
        if self.cfg.cluster {
            out.error = self.refresh(conns, false);
        }
        {
            let st = lock(&self.state);
            if st.epoch != conns.epoch {
                // Connections to nodes that left the map go (no fd kept for a dead master).
                conns
                    .map
                    .retain(|id, _| st.serving.binary_search(id).is_ok());
                conns.epoch = st.epoch;
            }
        }
        let first: Vec<(usize, Dest)> = (0..cmds.len()).map(|i| (i, Dest::Slot)).collect();
        let groups = self.route(cmds, first, &mut out);
        let round = self.exchange(conns, cmds, groups, &mut out);
        let mut next: Vec<(usize, Dest)> = round
            .redirects
            .into_iter()
            .map(|(i, r)| (i, Dest::Redirect(r)))
            .collect();
        if self.cfg.cluster && !round.failed.is_empty() {
            // A node failed under this call: read the map now (a replica may have taken over)
            // and send its commands once more where the map now puts them.
            if let Some(e) = self.refresh(conns, true) {
                out.error = Some(e);
            }
            let st = lock(&self.state);
            for (i, old) in round.failed {
                if Self::slot_node(&st, &cmds[i].0).is_some_and(|n| n != old) {
                    next.push((i, Dest::Slot));
                }
            }
        }
        if !next.is_empty() {
            let groups = self.route(cmds, next, &mut out);
            let again = self.exchange(conns, cmds, groups, &mut out);
            if !again.redirects.is_empty() {
                out.error = Some(format!("{}: redirected twice", self.label));
            }
        }
        out
    }

    fn slot_node(st: &RouterState, key: &str) -> Option<usize> {
        match st.slots.get(usize::from(key_slot(key.as_bytes()))) {
            Some(&n) if n != NO_NODE => Some(n as usize),
            _ => None,
        }
    }

    /// Groups commands by the node they go to; commands whose node is down (or that no node
    /// serves) fail here, without a network call.
    fn route<R>(
        &self,
        cmds: &[(String, R)],
        dests: Vec<(usize, Dest)>,
        out: &mut Outcome,
    ) -> Vec<(usize, Vec<Routed>)> {
        let mut st = lock(&self.state);
        let mut groups: Vec<(usize, Vec<Routed>)> = Vec::new();
        for (index, dest) in dests {
            let (node, asking) = match dest {
                Dest::Slot if !self.cfg.cluster => (0, false),
                Dest::Slot => {
                    let Some(n) = Self::slot_node(&st, &cmds[index].0) else {
                        st.stale = true;
                        out.error =
                            Some(format!("{}: no node serves the slot of a key", self.label));
                        continue;
                    };
                    (n, false)
                }
                Dest::Redirect(r) => {
                    let (Redirect::Moved(h, p) | Redirect::Ask(h, p), asking) =
                        (&r, matches!(r, Redirect::Ask(..)));
                    // Only to a node the Cluster announced (or a seed): a redirect to any other
                    // address fails the command and has the map read again (docs/tier.md
                    // "Cluster routing").
                    let Some(&n) = st.by_addr.get(&(h.clone(), *p)) else {
                        st.stale = true;
                        out.error = Some(format!(
                            "{}: redirected to {h}:{p}, a node the Cluster has not announced",
                            self.label
                        ));
                        continue;
                    };
                    (n, asking)
                }
            };
            if !Self::usable(&st, node) {
                // The map may be stale (a replica may have taken over the down master's slots).
                st.stale = true;
                out.error.get_or_insert_with(|| {
                    format!(
                        "{} {}: down (backoff)",
                        self.label,
                        Self::node_name(&st, node)
                    )
                });
                continue;
            }
            let routed = Routed { index, asking };
            match groups.iter_mut().find(|(n, _)| *n == node) {
                Some((_, g)) => g.push(routed),
                None => groups.push((node, vec![routed])),
            }
        }
        groups
    }

    /// One round: writes each node's pipeline, then reads the replies node by node.
    fn exchange<R: Pack>(
        &self,
        conns: &mut Conns,
        cmds: &[(String, R)],
        groups: Vec<(usize, Vec<Routed>)>,
        out: &mut Outcome,
    ) -> Round {
        let mut round = Round {
            redirects: Vec::new(),
            failed: Vec::new(),
        };
        let mut sent = Vec::with_capacity(groups.len());
        for (node, group) in groups {
            let (info, ups) = {
                let st = lock(&self.state);
                let downs = st.nodes[node].downs;
                // A connection opened before the node's last failure (seen by another thread) is
                // not used: the server may have restarted since, and this thread's first write on
                // it would fail the batch with a reset (docs/tier.md "Faults").
                if conns.opened.get(&node).is_some_and(|&d| d < downs) {
                    conns.map.remove(&node);
                }
                (
                    (!conns.map.contains_key(&node)).then(|| (st.nodes[node].info.clone(), downs)),
                    Self::ups(&st, node),
                )
            };
            let mut packed = std::mem::take(&mut conns.packed);
            // The pipeline goes out in chunks of SEND_CHUNK_BYTES as it is packed, so the server
            // works on the first commands while the rest are packed.
            let io_timeout = self.cfg.io_timeout;
            let res = self.conn(conns, node, info).and_then(|c| {
                // The node's whole pipeline is written within one I/O timeout (docs/tier.md
                // "Faults").
                c.set_deadline(std::time::Instant::now() + io_timeout);
                packed.clear();
                for r in &group {
                    if r.asking {
                        redis::cmd("ASKING").write_packed_command(&mut packed);
                    }
                    let (key, cmd) = &cmds[r.index];
                    cmd.pack(key, c, &mut packed)
                        .map_err(|e| format!("writing: {e}"))?;
                    if packed.len() >= SEND_CHUNK_BYTES {
                        c.send(&packed).map_err(|e| format!("writing: {e}"))?;
                        packed.clear();
                    }
                }
                if packed.is_empty() {
                    return Ok(());
                }
                c.send(&packed).map_err(|e| format!("writing: {e}"))
            });
            conns.packed = packed;
            match res {
                Ok(()) => sent.push((node, group, ups)),
                Err(e) => {
                    self.node_failed(conns, node, ups, &e, out);
                    round.failed.extend(group.iter().map(|r| (r.index, node)));
                }
            }
        }
        for (node, group, ups) in sent {
            let Some(c) = conns.map.get_mut(&node) else {
                continue;
            };
            // Every reply of the node's pipeline is read within one I/O timeout.
            c.set_deadline(std::time::Instant::now() + self.cfg.io_timeout);
            let mut failure = None;
            let mut answered = 0;
            for r in &group {
                if r.asking {
                    if let Err(e) = c.recv(None) {
                        failure = Some(format!("reading: {e}"));
                        break;
                    }
                }
                match cmds[r.index].1.recv(c, conns.pool.as_deref()) {
                    Ok(v) => {
                        answered += 1;
                        match self.classify(v, out) {
                            Ok(v) => out.replies[r.index] = Some(v),
                            Err(Some(redirect)) => round.redirects.push((r.index, redirect)),
                            Err(None) => {}
                        }
                    }
                    Err(e) => {
                        failure = Some(format!("reading: {e}"));
                        break;
                    }
                }
            }
            match failure {
                // The first failed read ends the node's part: the rest of its replies are not
                // waited for (the connection, with replies in flight, is dropped).
                Some(e) => {
                    self.node_failed(conns, node, ups, &e, out);
                    round
                        .failed
                        .extend(group[answered..].iter().map(|r| (r.index, node)));
                }
                None => self.mark_up(&mut lock(&self.state), node),
            }
        }
        round
    }

    /// A call to `node` that began at its `ups` failed: its connection goes, and the node is
    /// marked down unless it came back since (`Router::mark_down_since`); the error is the
    /// batch's either way.
    fn node_failed(&self, conns: &mut Conns, node: usize, ups: u64, e: &str, out: &mut Outcome) {
        conns.map.remove(&node);
        let mut st = lock(&self.state);
        self.mark_down_since(&mut st, node, ups);
        out.error = Some(format!(
            "{} {}: {e}",
            self.label,
            Self::node_name(&st, node)
        ));
    }

    /// A reply as the caller sees it: `Ok` (values, and server errors the caller handles),
    /// `Err(Some)` a redirect to follow, `Err(None)` a Cluster condition that fails the command.
    fn classify(
        &self,
        v: redis::Value,
        out: &mut Outcome,
    ) -> Result<redis::Value, Option<Redirect>> {
        let redis::Value::ServerError(e) = &v else {
            return Ok(v);
        };
        let kind = e.code();
        let target = || {
            let addr = e.details()?.split_whitespace().nth(1)?;
            let (host, port) = addr.rsplit_once(':')?;
            Some((
                host.trim_matches(['[', ']']).to_owned(),
                port.parse::<u16>().ok()?,
            ))
        };
        let stale = |out: &mut Outcome| {
            lock(&self.state).stale = true;
            out.error = Some(format!(
                "{}: {kind} {}",
                self.label,
                e.details().unwrap_or("")
            ));
        };
        match kind {
            "MOVED" | "ASK" if !self.cfg.cluster => {
                // A standalone server never redirects: a MOVED there is a misconfiguration or an
                // attack, and neither the password nor the data follows it (docs/tier.md
                // "Faults"). The command fails; nothing is sent to the named host.
                out.error = Some(format!(
                    "{}: the server answered {kind}; redirects are followed only in Cluster mode \
                     (redis+cluster://), the command failed",
                    self.label
                ));
                Err(None)
            }
            "MOVED" | "ASK" => {
                stale(out);
                match target() {
                    Some((h, p)) if !h.is_empty() && kind == "MOVED" => {
                        Err(Some(Redirect::Moved(h, p)))
                    }
                    Some((h, p)) if !h.is_empty() => Err(Some(Redirect::Ask(h, p))),
                    _ => Err(None),
                }
            }
            "TRYAGAIN" | "CLUSTERDOWN" | "MASTERDOWN" | "LOADING" | "READONLY" => {
                stale(out);
                Err(None)
            }
            _ => Ok(v),
        }
    }
}
