//! A [`Runtime`] over raw CUDA streams and events through cudarc (feature `cuda`), for users
//! that drive the lifetime manager without torch. cudarc is loaded dynamically, so the crate
//! builds with no CUDA present; [`CudaRuntime::new`] fails cleanly when no driver is found.
//! Without the feature, a stub with the same API returns [`Error::CudaUnavailable`].
//!
//! Streams are the callers' own (`StreamId::id` holds the raw `CUstream`); this module never
//! creates or destroys one. Payloads are release callbacks; the `record_stream` fallback keeps
//! the payload until an event recorded on the consumer completes (polled at later calls).

#[cfg(feature = "cuda")]
mod imp {
    use cudarc::driver::{result, sys};

    use crate::error::{Error, Result};
    use crate::runtime::{Action, Runtime, StreamId};

    /// What the caller does when the manager releases a tensor.
    pub type Release = Box<dyn FnOnce(Action) + Send>;

    /// CUDA events recorded and waited on through the driver API.
    pub struct CudaRuntime {
        deferred: Vec<(sys::CUevent, Release)>,
    }

    /// One driver event, destroyed on drop.
    pub struct CudaEvent(sys::CUevent);

    impl Drop for CudaEvent {
        fn drop(&mut self) {
            // SAFETY: created by `result::event::create` and owned by this value alone.
            let _ = unsafe { result::event::destroy(self.0) };
        }
    }

    fn driver(e: result::DriverError) -> Error {
        Error::Runtime(format!("CUDA driver: {e:?}"))
    }

    fn raw(stream: StreamId) -> sys::CUstream {
        stream.id as usize as sys::CUstream
    }

    impl CudaRuntime {
        /// Load the driver; fails with `CudaUnavailable` when libcuda cannot be found.
        pub fn new() -> Result<Self> {
            // SAFETY: only probes for the shared library.
            if !unsafe { sys::is_culib_present() } {
                return Err(Error::CudaUnavailable("libcuda could not be loaded".into()));
            }
            result::init().map_err(driver)?;
            Ok(CudaRuntime { deferred: Vec::new() })
        }

        /// Release deferred payloads whose consumer event has completed.
        pub fn poll(&mut self) -> Result<usize> {
            let mut done = 0;
            let mut i = 0;
            while i < self.deferred.len() {
                // SAFETY: the event is alive until destroyed below.
                match unsafe { result::event::query(self.deferred[i].0) } {
                    Ok(()) => {
                        let (ev, release) = self.deferred.swap_remove(i);
                        release(Action::DropReference);
                        // SAFETY: completed and no longer referenced.
                        unsafe { result::event::destroy(ev) }.map_err(driver)?;
                        done += 1;
                    }
                    Err(e) if e.0 == sys::CUresult::CUDA_ERROR_NOT_READY => i += 1,
                    Err(e) => return Err(driver(e)),
                }
            }
            Ok(done)
        }

        /// Payloads still waiting on their consumer.
        pub fn deferred(&self) -> usize {
            self.deferred.len()
        }
    }

    impl Drop for CudaRuntime {
        /// Deferred payloads wait for their consumer's event (a host sync, at teardown only),
        /// then are released and their events destroyed: nothing is reused early, nothing leaks.
        fn drop(&mut self) {
            for (ev, release) in self.deferred.drain(..) {
                // SAFETY: the event is alive and owned by this entry.
                let _ = unsafe { result::event::synchronize(ev) };
                release(Action::DropReference);
                // SAFETY: completed and no longer referenced.
                let _ = unsafe { result::event::destroy(ev) };
            }
        }
    }

    impl Runtime for CudaRuntime {
        type Payload = Release;
        type Event = CudaEvent;

        fn new_event(&mut self, _stream: StreamId) -> Result<CudaEvent> {
            result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING).map(CudaEvent).map_err(driver)
        }
        fn record(&mut self, event: &mut CudaEvent, stream: StreamId) -> Result<()> {
            // SAFETY: the event is alive; the stream is the caller's and outlives the call.
            unsafe { result::event::record(event.0, raw(stream)) }.map_err(driver)
        }
        fn wait(&mut self, event: &CudaEvent, stream: StreamId) -> Result<()> {
            // SAFETY: as above.
            unsafe { result::stream::wait_event(raw(stream), event.0, sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT) }
                .map_err(driver)
        }
        fn release(&mut self, payload: Release, action: Action) -> Result<()> {
            payload(action);
            self.poll().map(|_| ())
        }
        fn record_stream(&mut self, payload: Release, stream: StreamId) -> Result<()> {
            let mut ev = self.new_event(stream)?;
            self.record(&mut ev, stream)?;
            let raw_ev = ev.0;
            std::mem::forget(ev); // ownership moves to `deferred`
            self.deferred.push((raw_ev, payload));
            self.poll().map(|_| ())
        }
    }
}

#[cfg(not(feature = "cuda"))]
mod imp {
    use crate::error::{Error, Result};
    use crate::runtime::{Action, Runtime, StreamId};

    /// What the caller does when the manager releases a tensor.
    pub type Release = Box<dyn FnOnce(Action) + Send>;

    /// Stub event (never created: [`CudaRuntime::new`] fails first).
    pub struct CudaEvent(());

    /// Stub: the crate was built without the `cuda` feature. Same API as the real runtime;
    /// every call is [`Error::CudaUnavailable`].
    pub struct CudaRuntime(());

    fn unavailable<T>() -> Result<T> {
        Err(Error::CudaUnavailable("sched_lifetime was built without the `cuda` feature".into()))
    }

    impl CudaRuntime {
        /// Always `CudaUnavailable` without the `cuda` feature.
        pub fn new() -> Result<Self> {
            unavailable()
        }
        /// Always `CudaUnavailable` without the `cuda` feature.
        pub fn poll(&mut self) -> Result<usize> {
            unavailable()
        }
        /// No payload is ever deferred here.
        pub fn deferred(&self) -> usize {
            0
        }
    }

    impl Runtime for CudaRuntime {
        type Payload = Release;
        type Event = CudaEvent;

        fn new_event(&mut self, _stream: StreamId) -> Result<CudaEvent> {
            unavailable()
        }
        fn record(&mut self, _event: &mut CudaEvent, _stream: StreamId) -> Result<()> {
            unavailable()
        }
        fn wait(&mut self, _event: &CudaEvent, _stream: StreamId) -> Result<()> {
            unavailable()
        }
        fn release(&mut self, _payload: Release, _action: Action) -> Result<()> {
            unavailable()
        }
        fn record_stream(&mut self, _payload: Release, _stream: StreamId) -> Result<()> {
            unavailable()
        }
    }
}

pub use imp::*;
