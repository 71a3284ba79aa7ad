//! The engine core: one thread running `schedule -> execute -> update`, and the handle that
//! HTTP handlers use to reach it.
//!
//! Requests enter through a channel; each request streams its [`RequestEvent`]s back through its
//! own channel. Dropping a [`RequestStream`] before it finished aborts the request, so a client
//! that disconnects frees its blocks at the next step boundary. If a step panics, every request
//! fails with an error and the engine reports itself dead (`/health` answers 503).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, TryRecvError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use parking_lot::Mutex;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use crate::error::EngineError;
use crate::metrics as m;
use crate::output::RequestEvent;
use crate::request::{FinishReason, NewRequest, Request};
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerStats};
use crate::worker::Worker;

enum Command {
    Add(Box<Request>),
    Abort(u64),
    /// A connector has something to report (see [`Worker::set_waker`]): run a step now.
    Wake,
    Shutdown,
}

/// How long the loop waits for commands while transfers are pending but nothing can run.
const TRANSFER_POLL_INTERVAL: Duration = Duration::from_millis(1);
/// The same while a finished request's answer waits for its KV checksums (they take well
/// under a millisecond for typical prompts; the answer should not wait for the poll).
const CHECKSUM_POLL_INTERVAL: Duration = Duration::from_micros(50);

/// A cloneable handle to the engine thread.
#[derive(Clone)]
pub struct EngineHandle {
    tx: Arc<mpsc::Sender<Command>>,
    alive: Arc<AtomicBool>,
    next_id: Arc<AtomicU64>,
    stats: Arc<Mutex<SchedulerStats>>,
    validator: Arc<RequestValidator>,
    /// The engine thread, until [`EngineHandle::shutdown_and_wait`] joins it.
    thread: Arc<Mutex<Option<std::thread::JoinHandle<()>>>>,
}

/// Checks requests against the engine's limits without a round trip to its thread.
#[derive(Debug, Clone)]
pub struct RequestValidator {
    pub config: SchedulerConfig,
    pub num_blocks: usize,
    pub block_size: usize,
    pub vocab_size: usize,
}

impl RequestValidator {
    pub fn validate(&self, new: &NewRequest) -> Result<(), EngineError> {
        new.params.validate(self.vocab_size)?;
        if let Some(&t) = new
            .prompt_token_ids
            .iter()
            .find(|&&t| t as usize >= self.vocab_size)
        {
            return Err(EngineError::InvalidParam {
                param: "prompt".into(),
                message: format!(
                    "token id {t} is out of the vocabulary (size {})",
                    self.vocab_size
                ),
            });
        }
        check_request_limits(&self.config, self.num_blocks, self.block_size, new)
    }
}

/// The limits every request must fit: a non-empty prompt, prompt + max_tokens within the model
/// length, and no more blocks than the cache holds (such a request could never be scheduled).
pub fn check_request_limits(
    config: &SchedulerConfig,
    num_blocks: usize,
    block_size: usize,
    new: &NewRequest,
) -> Result<(), EngineError> {
    let prompt = new.prompt_token_ids.len();
    if prompt == 0 {
        return Err(EngineError::InvalidParam {
            param: "prompt".into(),
            message: "the prompt must contain at least one token".into(),
        });
    }
    // Sizes come from the request: checked, so that a max_tokens near 2^64 cannot wrap.
    let Some(requested) = prompt.checked_add(new.params.max_tokens) else {
        return Err(EngineError::InvalidParam {
            param: "max_tokens".into(),
            message: format!(
                "max_tokens {} exceeds the model's maximum context length of {} tokens",
                new.params.max_tokens, config.max_model_len
            ),
        });
    };
    if requested > config.max_model_len {
        return Err(EngineError::ContextLengthExceeded {
            max_model_len: config.max_model_len,
            requested,
            prompt,
            max_tokens: new.params.max_tokens,
        });
    }
    let needed = requested.div_ceil(block_size);
    if needed > num_blocks {
        return Err(EngineError::TooLargeForCache {
            needed,
            available: num_blocks,
        });
    }
    Ok(())
}

impl std::fmt::Debug for EngineHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineHandle")
            .field("alive", &self.is_alive())
            .finish()
    }
}

/// The events of one request. Dropping it before the final event aborts the request.
pub struct RequestStream {
    pub request_id: u64,
    rx: UnboundedReceiver<RequestEvent>,
    tx: Arc<mpsc::Sender<Command>>,
    finished: bool,
}

impl RequestStream {
    /// The next event; None after the final one. If the engine stopped without finishing the
    /// request (it died with the request still in its queue), the final event is a
    /// [`FinishReason::Error`] with [`EngineError::EngineDead`], so every stream ends with one.
    pub async fn next(&mut self) -> Option<RequestEvent> {
        if self.finished {
            return None;
        }
        match self.rx.recv().await {
            Some(ev) => {
                self.finished = ev.finish.is_some();
                Some(ev)
            }
            None => {
                self.finished = true;
                Some(RequestEvent {
                    finish: Some(FinishReason::Error),
                    error: Some(EngineError::EngineDead),
                    ..Default::default()
                })
            }
        }
    }
}

impl Drop for RequestStream {
    fn drop(&mut self) {
        if !self.finished {
            let _ = self.tx.send(Command::Abort(self.request_id));
        }
    }
}

impl EngineHandle {
    /// Starts the engine thread over a scheduler and a worker.
    pub fn spawn(
        scheduler: Scheduler,
        worker: Box<dyn Worker>,
        vocab_size: usize,
    ) -> Result<EngineHandle, EngineError> {
        let (tx, rx) = mpsc::channel();
        let tx = Arc::new(tx);
        // The waker must not keep the channel open: the loop ends when every handle is gone.
        let weak = Arc::downgrade(&tx);
        let mut worker = worker;
        worker.set_waker(Arc::new(move || {
            if let Some(tx) = weak.upgrade() {
                let _ = tx.send(Command::Wake);
            }
        }));
        let alive = Arc::new(AtomicBool::new(true));
        let stats = Arc::new(Mutex::new(scheduler.stats()));
        let validator = Arc::new(RequestValidator {
            config: scheduler.config().clone(),
            num_blocks: scheduler.kv().num_blocks(),
            block_size: scheduler.kv().block_size(),
            vocab_size,
        });
        let loop_alive = alive.clone();
        let loop_stats = stats.clone();
        let thread = std::thread::Builder::new()
            .name("tandem-engine".into())
            .spawn(move || run_loop(scheduler, worker, rx, loop_alive, loop_stats))
            .map_err(|e| EngineError::Execution(format!("cannot start the engine thread: {e}")))?;
        Ok(EngineHandle {
            tx,
            alive,
            next_id: Arc::new(AtomicU64::new(1)),
            stats,
            validator,
            thread: Arc::new(Mutex::new(Some(thread))),
        })
    }

    pub fn is_alive(&self) -> bool {
        self.alive.load(Ordering::Relaxed)
    }

    /// Request counts and free blocks, as of the last step.
    pub fn stats(&self) -> SchedulerStats {
        *self.stats.lock()
    }

    pub fn validator(&self) -> &RequestValidator {
        &self.validator
    }

    /// Validates and queues a request.
    pub fn submit(&self, new: NewRequest) -> Result<RequestStream, EngineError> {
        self.validator.validate(&new)?;
        if !self.is_alive() {
            return Err(EngineError::EngineDead);
        }
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        let (etx, erx) = unbounded_channel();
        let req = Request::new(id, new, etx);
        self.tx
            .send(Command::Add(Box::new(req)))
            .map_err(|_| EngineError::EngineDead)?;
        Ok(RequestStream {
            request_id: id,
            rx: erx,
            tx: self.tx.clone(),
            finished: false,
        })
    }

    /// Asks the engine thread to stop after its current step.
    pub fn shutdown(&self) {
        let _ = self.tx.send(Command::Shutdown);
    }

    /// Stops the engine thread and waits, at most `timeout`, until it has ended: its worker and
    /// connector (NIXL agent, transfer threads) are dropped in order on that thread. A process
    /// must not exit while they are torn down (its exit handlers would unload the libraries
    /// under them). True when the thread ended in time.
    pub fn shutdown_and_wait(&self, timeout: Duration) -> bool {
        self.shutdown();
        let Some(thread) = self.thread.lock().take() else {
            return true;
        };
        let deadline = Instant::now() + timeout;
        while !thread.is_finished() {
            if Instant::now() >= deadline {
                tracing::warn!(?timeout, "the engine thread did not stop in time");
                return false;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = thread.join();
        true
    }
}

fn apply(scheduler: &mut Scheduler, cmd: Command) -> bool {
    match cmd {
        Command::Add(req) => scheduler.add_request(*req),
        Command::Abort(id) => scheduler.abort_request(id),
        Command::Wake => {}
        Command::Shutdown => return false,
    }
    true
}

fn run_loop(
    mut scheduler: Scheduler,
    mut worker: Box<dyn Worker>,
    rx: mpsc::Receiver<Command>,
    alive: Arc<AtomicBool>,
    stats: Arc<Mutex<SchedulerStats>>,
) {
    'outer: loop {
        // Take every queued command without waiting.
        loop {
            match rx.try_recv() {
                Ok(cmd) => {
                    if !apply(&mut scheduler, cmd) {
                        break 'outer;
                    }
                }
                Err(TryRecvError::Empty) => break,
                Err(TryRecvError::Disconnected) => break 'outer,
            }
        }
        if !scheduler.has_work() && !scheduler.has_pending_transfers() {
            // Aborts may have freed blocks since the last step: publish before idling.
            scheduler.publish_gauges();
            *stats.lock() = scheduler.stats();
            match rx.recv() {
                Ok(cmd) => {
                    if !apply(&mut scheduler, cmd) {
                        break;
                    }
                    continue;
                }
                Err(_) => break,
            }
        }
        let started = Instant::now();
        let step = scheduler.schedule();
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| worker.execute(&step)));
        match result {
            Ok(Ok(out)) => {
                let had_work = step.has_model_work();
                scheduler.update_from_output(&step, out);
                if had_work {
                    metrics::histogram!(m::ENGINE_STEP_SECONDS)
                        .record(started.elapsed().as_secs_f64());
                }
                *stats.lock() = scheduler.stats();
                if !had_work {
                    // Only transfers are pending: wait a little for them or for a command.
                    let wait = if scheduler.is_awaiting_checksums() {
                        CHECKSUM_POLL_INTERVAL
                    } else {
                        TRANSFER_POLL_INTERVAL
                    };
                    match rx.recv_timeout(wait) {
                        Ok(cmd) => {
                            if !apply(&mut scheduler, cmd) {
                                break;
                            }
                        }
                        Err(RecvTimeoutError::Timeout) => {}
                        Err(RecvTimeoutError::Disconnected) => break,
                    }
                }
            }
            Ok(Err(e)) => {
                tracing::error!("step {} failed: {e}", step.step);
                scheduler.fail_all(e);
                *stats.lock() = scheduler.stats();
            }
            Err(panic) => {
                let msg = panic
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_else(|| "unknown panic".into());
                tracing::error!("engine step panicked: {msg}; the engine stops");
                alive.store(false, Ordering::Relaxed);
                scheduler.fail_all(EngineError::Execution(msg));
                break;
            }
        }
    }
    alive.store(false, Ordering::Relaxed);
    scheduler.fail_all(EngineError::EngineDead);
    // The gauges and stats say what is left: nothing runs, the failed requests' blocks are free.
    scheduler.publish_gauges();
    *stats.lock() = scheduler.stats();
}
