//! Helpers shared by the engine's scheduler-level tests: queue a request on a real `Scheduler`
//! and run one `schedule -> execute -> update` step with its bookkeeping invariants checked.

use serde_json::Value;
use tandem_engine::request::{NewRequest, Request};
use tandem_engine::scheduler_output::SchedulerOutput;
use tandem_engine::{RequestEvent, SamplingParams, Scheduler, Worker};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

/// Greedy sampling of `max_tokens` tokens.
pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        temperature: 0.0,
        max_tokens,
        ..Default::default()
    }
}

/// Validates and queues request `id`; returns the receiving end of its events.
pub fn add_request(
    sched: &mut Scheduler,
    id: u64,
    external_id: String,
    prompt: Vec<u32>,
    params: SamplingParams,
    kv_transfer_params: Option<Value>,
) -> UnboundedReceiver<RequestEvent> {
    let (tx, rx) = unbounded_channel();
    let new = NewRequest {
        external_id,
        prompt_token_ids: prompt,
        params,
        kv_transfer_params,
    };
    sched.validate(&new).unwrap();
    sched.add_request(Request::new(id, new, tx));
    rx
}

/// One engine step on `worker`; the scheduler's invariants hold after it.
pub fn step(sched: &mut Scheduler, worker: &mut dyn Worker) -> SchedulerOutput {
    let out = sched.schedule();
    let w = worker.execute(&out).unwrap();
    sched.update_from_output(&out, w);
    sched.check_invariants().unwrap();
    out
}
