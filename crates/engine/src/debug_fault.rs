//! A deliberate engine fault, for tests only: `TANDEM_DEBUG_ENGINE_FAULT=panic_at_step:N` makes
//! the worker panic in the N-th step (1-based) that runs the model, so end-to-end tests can watch
//! the engine die for real: every request fails, `/health` answers 503, new requests get 503,
//! and the process keeps answering `/metrics`.
//!
//! Invariants: off unless the variable is set (an empty value is off too); a value that does not
//! parse is refused at startup, never ignored. The fault is a panic inside [`Worker::execute`],
//! the path a bug in the model or a kernel takes, so it exercises the engine's real recovery.

use crate::error::EngineError;
use crate::scheduler_output::{SchedulerOutput, WorkerOutput};
use crate::worker::Worker;

/// The environment variable that turns the fault on.
pub const ENGINE_FAULT_ENV: &str = "TANDEM_DEBUG_ENGINE_FAULT";

/// A fault the engine injects into itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EngineFault {
    /// Panic in the N-th step (1-based) that runs the model; steps that only poll transfers
    /// do not count.
    PanicAtStep(u64),
}

impl EngineFault {
    /// Parses `panic_at_step:N` with `N >= 1`.
    pub fn parse(s: &str) -> Result<EngineFault, EngineError> {
        let bad = || {
            EngineError::InvalidConfig(format!(
                "{ENGINE_FAULT_ENV}=`{s}`: expected `panic_at_step:N` with N >= 1"
            ))
        };
        let (kind, arg) = s.trim().split_once(':').ok_or_else(bad)?;
        match kind {
            "panic_at_step" => match arg.parse::<u64>() {
                Ok(n) if n >= 1 => Ok(EngineFault::PanicAtStep(n)),
                _ => Err(bad()),
            },
            _ => Err(bad()),
        }
    }

    /// The fault [`ENGINE_FAULT_ENV`] asks for, if any; read once, when the engine starts.
    pub fn from_env() -> Result<Option<EngineFault>, EngineError> {
        match std::env::var(ENGINE_FAULT_ENV) {
            Ok(v) if v.trim().is_empty() => Ok(None),
            Ok(v) => EngineFault::parse(&v).map(Some),
            Err(std::env::VarError::NotPresent) => Ok(None),
            Err(std::env::VarError::NotUnicode(_)) => Err(EngineError::InvalidConfig(format!(
                "{ENGINE_FAULT_ENV} is not valid UTF-8"
            ))),
        }
    }
}

impl std::fmt::Display for EngineFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            EngineFault::PanicAtStep(n) => write!(f, "panic_at_step:{n}"),
        }
    }
}

/// A worker that runs `inner` until its fault fires.
pub struct FaultyWorker {
    inner: Box<dyn Worker>,
    fault: EngineFault,
    model_steps: u64,
}

impl FaultyWorker {
    pub fn new(inner: Box<dyn Worker>, fault: EngineFault) -> Self {
        FaultyWorker {
            inner,
            fault,
            model_steps: 0,
        }
    }
}

impl Worker for FaultyWorker {
    fn set_waker(&mut self, waker: tandem_kv_connector::base::Waker) {
        self.inner.set_waker(waker);
    }

    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        if step.has_model_work() {
            self.model_steps += 1;
            let EngineFault::PanicAtStep(n) = self.fault;
            if self.model_steps == n {
                panic!(
                    "deliberate engine fault ({ENGINE_FAULT_ENV}={})",
                    self.fault
                );
            }
        }
        self.inner.execute(step)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_only_panic_at_step_with_a_positive_step() {
        assert_eq!(
            EngineFault::parse("panic_at_step:3"),
            Ok(EngineFault::PanicAtStep(3))
        );
        assert_eq!(
            EngineFault::parse(" panic_at_step:1 "),
            Ok(EngineFault::PanicAtStep(1))
        );
        for bad in [
            "",
            "panic_at_step",
            "panic_at_step:",
            "panic_at_step:0",
            "panic_at_step:-1",
            "panic_at_step:x",
            "crash:3",
        ] {
            let e = EngineFault::parse(bad).unwrap_err();
            assert!(
                matches!(&e, EngineError::InvalidConfig(m) if m.contains(ENGINE_FAULT_ENV)),
                "{bad}: {e}"
            );
        }
        assert_eq!(
            EngineFault::PanicAtStep(7).to_string(),
            "panic_at_step:7",
            "Display round-trips"
        );
    }
}
