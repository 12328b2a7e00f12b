//! Results in submission order when some jobs fail before an engine takes them (a handler that
//! submits from its own thread: docs/performance.md "The cost of a submit"). The engine reports
//! the jobs it accepted in their order; a job refused on the way is reported after the jobs
//! accepted before it and before those accepted after it.
#![forbid(unsafe_code)]

use std::collections::VecDeque;

use super::JobResult;

/// Merges an engine's results with those of jobs that never reached it.
#[derive(Debug, Default)]
pub struct ResultOrder {
    accepted: u64,
    reported: u64,
    failed: VecDeque<(u64, JobResult)>,
}

impl ResultOrder {
    /// The engine accepted the next job.
    pub fn accepted(&mut self) {
        self.accepted += 1;
    }

    /// The next job failed before the engine took it.
    pub fn failed(&mut self, r: JobResult) {
        self.failed.push_back((self.accepted, r));
    }

    /// `engine`'s results (the next ones it reported, in its order) with the failures that
    /// belong before, between and after them.
    pub fn merge(&mut self, engine: Vec<JobResult>) -> Vec<JobResult> {
        let mut out = Vec::with_capacity(engine.len() + self.failed.len());
        for r in engine {
            self.release(&mut out);
            out.push(r);
            self.reported += 1;
        }
        self.release(&mut out);
        out
    }

    fn release(&mut self, out: &mut Vec<JobResult>) {
        while self
            .failed
            .front()
            .is_some_and(|(n, _)| *n <= self.reported)
        {
            if let Some((_, r)) = self.failed.pop_front() {
                out.push(r);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::Direction;

    fn r(id: i64, ok: bool) -> JobResult {
        JobResult {
            job_id: id,
            success: ok,
            bytes: 0,
            seconds: 0.0,
            direction: Direction::GpuToCpu,
            error: (!ok).then(|| "refused".to_owned()),
        }
    }

    /// Jobs 1..=6 asked in order; 2 and 5 fail on the way, 6 right after 5. However the
    /// engine's results arrive (one poll, one at a time, none then all), the merged order is
    /// the submission order.
    #[test]
    fn failures_take_their_place_in_submission_order() {
        let fails = [2, 5, 6];
        for split in [
            vec![4],
            vec![1, 1, 1, 1],
            vec![0, 0, 4],
            vec![2, 0, 2],
            vec![3, 1],
        ] {
            let mut o = ResultOrder::default();
            let mut engine_ids = Vec::new();
            for id in 1..=6 {
                if fails.contains(&id) {
                    o.failed(r(id, false));
                } else {
                    o.accepted();
                    engine_ids.push(id);
                }
            }
            let mut got = Vec::new();
            let mut next = engine_ids.into_iter();
            for n in &split {
                let batch: Vec<JobResult> = next.by_ref().take(*n).map(|id| r(id, true)).collect();
                got.extend(o.merge(batch).into_iter().map(|x| (x.job_id, x.success)));
            }
            let want: Vec<(i64, bool)> = (1..=6).map(|id| (id, !fails.contains(&id))).collect();
            assert_eq!(got, want, "engine results in batches of {split:?}");
        }
        // A failure before anything was accepted comes out at once.
        let mut o = ResultOrder::default();
        o.failed(r(9, false));
        assert_eq!(o.merge(Vec::new()).len(), 1);
    }
}
