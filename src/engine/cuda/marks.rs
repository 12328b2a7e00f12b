//! Points of callers' streams recorded when a job is asked for and waited on when it is submitted
//! later, from another thread ([`crate::engine::StreamMarks`]; docs/performance.md, "The cost of a
//! submit"): the caller pays one event record instead of the whole submit.
// Unsafe: driver calls on events this marker owns, after binding the device's context.
#![allow(unsafe_code)]

use std::sync::{Arc, Mutex, PoisonError};

use super::device::CudaDevice;
use super::ffi;
use super::handles::Event;
use crate::engine::{StreamMark, StreamMarks};
use crate::error::Result;

/// Events idle between marks. Destroyed by [`CallerMarks::release`] (the engine's shutdown, the
/// context bound) or, failing that, when the last mark and the engine are gone.
#[derive(Default)]
struct Pool(Mutex<Vec<Event>>);

impl Pool {
    fn take(&self) -> Option<Event> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).pop()
    }

    fn give(&self, e: Event) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(e);
    }
}

/// The CUDA engine's marker: one ordering-only event per mark, reused through a pool.
pub(super) struct CallerMarks {
    device: Arc<CudaDevice>,
    pool: Arc<Pool>,
}

impl CallerMarks {
    pub(super) fn new(device: Arc<CudaDevice>) -> Self {
        Self {
            device,
            pool: Arc::default(),
        }
    }

    /// Destroys the idle events (the caller bound the device's context); marks still held give
    /// theirs back to the emptied pool, destroyed with it.
    pub(super) fn release(&self) -> Vec<Result<()>> {
        let idle = std::mem::take(&mut *self.pool.0.lock().unwrap_or_else(PoisonError::into_inner));
        idle.into_iter().map(Event::release).collect()
    }
}

impl StreamMarks for CallerMarks {
    unsafe fn mark(&self, stream: u64) -> Result<Arc<dyn StreamMark>> {
        self.device.bind()?;
        let ev = match self.pool.take() {
            Some(e) => e,
            // SAFETY: the context is current (bound above).
            None => unsafe { Event::new(false) }?,
        };
        // SAFETY: a live event of this context; `stream` is a live stream of the device (the
        // caller's obligation).
        if let Err(e) = unsafe { ffi::event_record(ev.raw(), stream as ffi::CUstream) } {
            self.pool.give(ev);
            return Err(e);
        }
        Ok(Arc::new(Mark {
            ev: Some(ev),
            pool: Arc::clone(&self.pool),
        }))
    }
}

/// One recorded point; its event returns to the pool on drop (a later record replaces the point,
/// which does not affect a `cuStreamWaitEvent` already enqueued on it).
struct Mark {
    ev: Option<Event>,
    pool: Arc<Pool>,
}

impl std::fmt::Debug for Mark {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Mark")
            .field("event", &self.raw_event())
            .finish()
    }
}

impl StreamMark for Mark {
    fn raw_event(&self) -> u64 {
        self.ev.as_ref().map_or(0, |e| e.raw() as u64)
    }
}

impl Drop for Mark {
    fn drop(&mut self) {
        if let Some(e) = self.ev.take() {
            self.pool.give(e);
        }
    }
}
