//! Scheduler lifecycle tests over a GPU-free mock worker.
//!
//! The mock worker keeps a "KV cache" of token ids by slot: it writes each scheduled token at its
//! slot and derives the next token from the whole context read back through the block table. A
//! wrong block table, slot, chunk boundary or a preemption that loses KV changes the output, so
//! "same output batched as alone" checks the scheduler's bookkeeping, not just its routing.
//! Every test ends with no request left and every block free.

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex};

use serde_json::{json, Value};
use tandem_engine::detokenizer::Detokenize;
use tandem_engine::request::NewRequest;
use tandem_engine::scheduler_output::{
    PromptLogprobs, SampledToken, SchedulerOutput, WorkerOutput,
};
use tandem_engine::{
    EngineError, EngineFault, EngineHandle, FaultyWorker, FinishReason, KvLoadFailurePolicy,
    RequestEvent, SamplingParams, Scheduler, SchedulerConfig, TokenLogprob, Worker,
};
use tandem_kv_cache::{BlockId, GroupPoolConfig, KvCacheManager, NULL_BLOCK};
use tandem_kv_connector::base::{
    ConnectorMetadata, ConnectorOutput, ConnectorRequest, FinishKind, FinishedAction,
    KvConnectorScheduler, MatchedTokens, NoopConnector,
};
use tandem_kv_connector::KvConnectorError;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use common::{add_request, greedy, step};

const BLOCK: usize = 4;
const EOS: u32 = 255;

struct Bytes;
impl Detokenize for Bytes {
    fn decode(&self, ids: &[u32], skip_special: bool) -> String {
        ids.iter()
            .filter(|&&i| !(skip_special && i == EOS))
            .map(|&i| char::from(b'a' + (i % 26) as u8))
            .collect()
    }
}

/// Next token from the whole context: order- and position-sensitive.
fn next_token(context: &[u32]) -> u32 {
    let mut h: u64 = 1469598103934665603;
    for (i, &t) in context.iter().enumerate() {
        h = (h ^ ((t as u64 + 1) * (i as u64 + 3))).wrapping_mul(1099511628211);
    }
    (h % 200) as u32
}

#[derive(Default)]
struct MockWorker {
    /// Token by (block table, slot).
    slots: HashMap<(usize, usize), u32>,
    /// With two block tables: the sliding window of table 1 (group 1). The worker reads the
    /// whole context through table 0 and checks that table 1 holds the same tokens over the
    /// window of every sampled position.
    window: Option<usize>,
    /// The most non-null table-1 blocks a request held, not counting the step's new tokens.
    max_window_blocks: usize,
    /// Tokens of the step, for chunking checks.
    step_tokens: Vec<usize>,
    /// Prompt-logprob targets of each step: (request, first position, targets).
    prompt_targets: Vec<(u64, usize, Vec<u32>)>,
}

impl Worker for MockWorker {
    fn execute(&mut self, step: &SchedulerOutput) -> Result<WorkerOutput, EngineError> {
        let mut out = WorkerOutput::default();
        self.step_tokens.push(step.num_tokens());
        for s in &step.scheduled {
            if !s.prompt_logprob_targets.is_empty() {
                let first = s.start_position + 1;
                self.prompt_targets
                    .push((s.request_id, first, s.prompt_logprob_targets.clone()));
                out.prompt_logprobs.push(PromptLogprobs {
                    request_id: s.request_id,
                    first_position: first,
                    logprobs: s
                        .prompt_logprob_targets
                        .iter()
                        .map(|&t| TokenLogprob {
                            token_id: t,
                            logprob: -1.0,
                            rank: 1,
                            top: Vec::new(),
                        })
                        .collect(),
                });
            }
            let slot =
                |t: usize, p: usize| s.block_tables[t][p / BLOCK] as usize * BLOCK + p % BLOCK;
            for (i, &tok) in s.token_ids.iter().enumerate() {
                let pos = s.start_position + i;
                for t in 0..s.block_tables.len() {
                    self.slots.insert((t, slot(t, pos)), tok);
                }
            }
            if let Some(table) = s.block_tables.get(1).filter(|_| self.window.is_some()) {
                // blocks before this step's: what the request held since the last step
                let held = table[..s.start_position / BLOCK]
                    .iter()
                    .filter(|&&b| b != NULL_BLOCK)
                    .count();
                self.max_window_blocks = self.max_window_blocks.max(held + 1);
            }
            if s.sample {
                let ctx_len = s.start_position + s.token_ids.len();
                let ctx: Vec<u32> = (0..ctx_len).map(|p| self.slots[&(0, slot(0, p))]).collect();
                if let (Some(w), true) = (self.window, s.block_tables.len() > 1) {
                    let first = ctx_len.saturating_sub(w);
                    for (p, tok) in ctx.iter().enumerate().skip(first) {
                        assert_ne!(s.block_tables[1][p / BLOCK], NULL_BLOCK, "position {p}");
                        assert_eq!(
                            self.slots.get(&(1, slot(1, p))),
                            Some(tok),
                            "request {} position {p}: the sliding group lost its KV",
                            s.request_id
                        );
                    }
                }
                out.sampled.push(SampledToken {
                    request_id: s.request_id,
                    token_id: next_token(&ctx),
                    logprob: None,
                });
            }
        }
        Ok(out)
    }
}

struct Harness {
    sched: Scheduler,
    worker: MockWorker,
    streams: HashMap<u64, UnboundedReceiver<RequestEvent>>,
    next_id: u64,
}

impl Harness {
    fn new(config: SchedulerConfig, num_blocks: usize) -> Self {
        Self::with_connector(config, num_blocks, Box::new(NoopConnector))
    }
    fn with_connector(
        config: SchedulerConfig,
        num_blocks: usize,
        connector: Box<dyn KvConnectorScheduler>,
    ) -> Self {
        let kv = KvCacheManager::new(num_blocks, BLOCK, true);
        Harness {
            sched: Scheduler::new(config, kv, connector, Arc::new(Bytes), vec![EOS]),
            worker: MockWorker::default(),
            streams: HashMap::new(),
            next_id: 1,
        }
    }
    /// Two KV cache groups: `full` blocks of full attention, `sliding` blocks of a window of
    /// `window` tokens.
    fn hybrid(config: SchedulerConfig, full: usize, sliding: usize, window: usize) -> Self {
        Self::hybrid_with_connector(config, full, sliding, window, Box::new(NoopConnector))
    }
    fn hybrid_with_connector(
        config: SchedulerConfig,
        full: usize,
        sliding: usize,
        window: usize,
        connector: Box<dyn KvConnectorScheduler>,
    ) -> Self {
        let kv = KvCacheManager::with_groups(
            &[
                GroupPoolConfig {
                    num_blocks: full,
                    window: None,
                },
                GroupPoolConfig {
                    num_blocks: sliding,
                    window: Some(window),
                },
            ],
            BLOCK,
            true,
        );
        Harness {
            sched: Scheduler::new(config, kv, connector, Arc::new(Bytes), vec![EOS]),
            worker: MockWorker {
                window: Some(window),
                ..Default::default()
            },
            streams: HashMap::new(),
            next_id: 1,
        }
    }
    fn add(&mut self, prompt: Vec<u32>, params: SamplingParams) -> u64 {
        self.add_with(prompt, params, None)
    }
    fn add_with(&mut self, prompt: Vec<u32>, params: SamplingParams, kvp: Option<Value>) -> u64 {
        let id = self.next_id;
        self.next_id += 1;
        let rx = add_request(
            &mut self.sched,
            id,
            format!("req-{id}"),
            prompt,
            params,
            kvp,
        );
        self.streams.insert(id, rx);
        id
    }
    fn step(&mut self) {
        step(&mut self.sched, &mut self.worker);
    }
    fn run(&mut self) {
        let mut guard = 0;
        while self.sched.has_work() {
            self.step();
            guard += 1;
            assert!(guard < 10_000, "scheduler does not make progress");
        }
    }
    /// All events of a request: (tokens, text, finish event).
    fn collect(&mut self, id: u64) -> (Vec<u32>, String, RequestEvent) {
        let rx = self.streams.get_mut(&id).unwrap();
        let mut toks = Vec::new();
        let mut text = String::new();
        while let Ok(ev) = rx.try_recv() {
            toks.extend(&ev.token_ids);
            text.push_str(&ev.text);
            if ev.finish.is_some() {
                return (toks, text, ev);
            }
        }
        panic!("request {id} did not finish");
    }
    fn assert_empty(&self) {
        assert_eq!(self.sched.num_unfinished(), 0, "requests left");
        assert_eq!(
            self.sched.kv().num_free_blocks(),
            self.sched.kv().num_blocks(),
            "blocks leaked"
        );
    }
}

fn solo(prompt: &[u32], params: SamplingParams) -> Vec<u32> {
    let mut h = Harness::new(SchedulerConfig::default(), 64);
    let id = h.add(prompt.to_vec(), params);
    h.run();
    let (toks, _, _) = h.collect(id);
    h.assert_empty();
    toks
}

fn prompt(seed: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| (i * 7 + seed * 13) % 200).collect()
}

#[test]
fn a_request_runs_to_max_tokens_and_frees_everything() {
    let mut h = Harness::new(SchedulerConfig::default(), 16);
    let id = h.add(prompt(1, 10), greedy(5));
    h.run();
    let (toks, text, fin) = h.collect(id);
    assert_eq!(toks.len(), 5);
    assert_eq!(fin.finish, Some(FinishReason::Length));
    assert_eq!(fin.num_prompt_tokens, 10);
    assert_eq!(fin.num_output_tokens, 5);
    assert_eq!(text.len(), 5);
    h.assert_empty();
}

#[test]
fn chunked_prefill_respects_the_token_budget_and_keeps_the_output() {
    let config = SchedulerConfig {
        max_num_batched_tokens: 8,
        ..Default::default()
    };
    let mut h = Harness::new(config, 32);
    let p = prompt(2, 21);
    let id = h.add(p.clone(), greedy(4));
    h.run();
    assert_eq!(
        &h.worker.step_tokens[..4],
        &[8, 8, 5, 1],
        "3 prefill chunks, then decode"
    );
    let (toks, _, _) = h.collect(id);
    assert_eq!(toks, solo(&p, greedy(4)));
    h.assert_empty();
}

#[test]
fn batched_requests_match_their_solo_output() {
    let mut h = Harness::new(SchedulerConfig::default(), 64);
    let prompts: Vec<Vec<u32>> = (0..8).map(|i| prompt(i, 3 + 5 * i as usize)).collect();
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| h.add(p.clone(), greedy(9)))
        .collect();
    h.run();
    for (id, p) in ids.into_iter().zip(&prompts) {
        assert_eq!(h.collect(id).0, solo(p, greedy(9)));
    }
    h.assert_empty();
}

#[test]
fn preemption_recomputes_without_changing_outputs() {
    // 12 blocks of 4 tokens: four requests of 10 + 14 tokens cannot all fit (6 blocks each).
    let config = SchedulerConfig {
        max_num_batched_tokens: 16,
        ..Default::default()
    };
    let mut h = Harness::new(config, 12);
    let prompts: Vec<Vec<u32>> = (0..4).map(|i| prompt(10 + i, 10)).collect();
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| h.add(p.clone(), greedy(14)))
        .collect();
    h.run();
    assert!(h.sched.stats().preemptions > 0, "the test must preempt");
    for (id, p) in ids.into_iter().zip(&prompts) {
        assert_eq!(h.collect(id).0, solo(p, greedy(14)));
    }
    h.assert_empty();
}

#[test]
fn a_sliding_window_group_holds_only_its_window_and_keeps_every_output() {
    // window 10, blocks of 4: at most cdiv(10, 4) + 1 = 4 sliding blocks between steps. Long
    // prompts in small chunks and long decodes, under pressure in both groups: 40 full blocks
    // (preemption), 20 sliding blocks (5 requests' windows).
    let config = SchedulerConfig {
        max_num_batched_tokens: 12,
        ..Default::default()
    };
    let mut h = Harness::hybrid(config, 40, 20, 10);
    let prompts: Vec<Vec<u32>> = (0..6).map(|i| prompt(20 + i, 9 + 7 * i as usize)).collect();
    let ids: Vec<u64> = prompts
        .iter()
        .map(|p| h.add(p.clone(), greedy(30)))
        .collect();
    h.run();
    assert!(
        h.worker.max_window_blocks <= 4,
        "{}",
        h.worker.max_window_blocks
    );
    assert!(h.sched.stats().preemptions > 0, "the test must preempt");
    for (id, p) in ids.into_iter().zip(&prompts) {
        assert_eq!(h.collect(id).0, solo(p, greedy(30)), "request {id}");
    }
    h.assert_empty();
    h.sched.check_invariants().unwrap();

    // a prefix hit in both groups gives the same output
    let p = prompt(40, 30);
    let first = h.add(p.clone(), greedy(5));
    h.run();
    let second = h.add(p.clone(), greedy(5));
    h.run();
    let (a, _, _) = h.collect(first);
    let (b, _, fin) = h.collect(second);
    assert_eq!(fin.num_cached_tokens, 28);
    assert_eq!(a, b);
    h.assert_empty();
}

#[test]
fn max_num_seqs_limits_the_batch() {
    let config = SchedulerConfig {
        max_num_seqs: 2,
        ..Default::default()
    };
    let mut h = Harness::new(config, 64);
    for i in 0..5 {
        h.add(prompt(i, 4), greedy(3));
    }
    h.step();
    assert_eq!(h.sched.stats().running, 2);
    assert_eq!(h.sched.stats().waiting, 3);
    h.run();
    for id in 1..=5 {
        h.collect(id);
    }
    h.assert_empty();
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut h = Harness::new(SchedulerConfig::default(), 16);
    let a = h.add(prompt(3, 9), greedy(50));
    let b = h.add(prompt(4, 9), greedy(50));
    h.step();
    h.step();
    assert!(h.sched.kv().num_free_blocks() < 16);
    h.sched.abort_request(a);
    h.sched.abort_request(b);
    h.sched.check_invariants().unwrap();
    assert_eq!(h.collect(a).2.finish, Some(FinishReason::Abort));
    assert_eq!(h.collect(b).2.finish, Some(FinishReason::Abort));
    h.assert_empty();
    // aborting twice or an unknown id is harmless
    h.sched.abort_request(a);
    h.sched.abort_request(999);
}

#[test]
fn prefix_cache_hit_gives_the_same_output() {
    let mut h = Harness::new(SchedulerConfig::default(), 32);
    let p = prompt(5, 13);
    let first = h.add(p.clone(), greedy(6));
    h.run();
    let second = h.add(p.clone(), greedy(6));
    h.run();
    let (a, _, _) = h.collect(first);
    let (b, _, fin) = h.collect(second);
    assert_eq!(fin.num_cached_tokens, 12, "three full blocks hit");
    assert_eq!(a, b);
    h.assert_empty();
}

#[test]
fn stop_conditions() {
    let p = prompt(6, 5);
    let free = solo(&p, greedy(10));
    // stop token id: finishes on its first occurrence, included in the token ids
    let stop_tok = free[3];
    let first = free.iter().position(|&t| t == stop_tok).unwrap();
    let got = solo(
        &p,
        SamplingParams {
            stop_token_ids: vec![stop_tok],
            ..greedy(10)
        },
    );
    assert_eq!(got, free[..=first].to_vec());
    // min_tokens defers a stop token
    let got = solo(
        &p,
        SamplingParams {
            stop_token_ids: vec![free[0]],
            min_tokens: 2,
            ..greedy(10)
        },
    );
    assert!(got.len() > 1);
    // stop strings end the request and are not emitted
    let text = Bytes.decode(&free, true);
    let stop = text[4..6].to_string();
    let mut h = Harness::new(SchedulerConfig::default(), 16);
    let id = h.add(
        p.clone(),
        SamplingParams {
            stop: vec![stop.clone()],
            ..greedy(10)
        },
    );
    h.run();
    let (_, out, fin) = h.collect(id);
    assert_eq!(fin.finish, Some(FinishReason::Stop));
    assert_eq!(fin.stop_reason.as_deref(), Some(stop.as_str()));
    assert_eq!(out, text[..text.find(&stop).unwrap()]);
    h.assert_empty();
}

#[test]
fn eos_stops_unless_ignored() {
    // Find a prompt whose first greedy token is EOS-like by making EOS the token the mock emits.
    let p = prompt(7, 6);
    let first = solo(&p, greedy(1))[0];
    let mut h = Harness::new(SchedulerConfig::default(), 16);
    h.sched = Scheduler::new(
        SchedulerConfig::default(),
        KvCacheManager::new(16, BLOCK, true),
        Box::new(NoopConnector),
        Arc::new(Bytes),
        vec![first],
    );
    let a = h.add(p.clone(), greedy(5));
    let b = h.add(
        p.clone(),
        SamplingParams {
            ignore_eos: true,
            ..greedy(5)
        },
    );
    h.run();
    let (ta, _, fa) = h.collect(a);
    assert_eq!((ta.len(), fa.finish), (1, Some(FinishReason::Stop)));
    let (tb, _, fb) = h.collect(b);
    assert_eq!((tb.len(), fb.finish), (5, Some(FinishReason::Length)));
    h.assert_empty();
}

#[test]
fn context_length_is_enforced_with_a_clear_error() {
    let h = Harness::new(
        SchedulerConfig {
            max_model_len: 32,
            ..Default::default()
        },
        64,
    );
    let (tx, _rx) = unbounded_channel::<RequestEvent>();
    drop(tx);
    let new = NewRequest {
        external_id: "x".into(),
        prompt_token_ids: vec![1; 30],
        params: greedy(5),
        kv_transfer_params: None,
    };
    let err = h.sched.validate(&new).unwrap_err();
    assert!(matches!(
        err,
        EngineError::ContextLengthExceeded {
            requested: 35,
            prompt: 30,
            ..
        }
    ));
    assert!(err.to_string().contains("maximum context length is 32"));
}

// ---- connector hooks ----

/// A connector that pretends every prompt with `{"remote": n}` has n tokens remotely, loads them
/// by writing the expected tokens into the worker's mock cache, and holds finished requests'
/// blocks when asked to.
#[derive(Clone, Default)]
struct TestConnector {
    state: Arc<Mutex<TestConnectorState>>,
}

#[derive(Default)]
struct TestConnectorState {
    /// (request, its block tables, external tokens)
    loads: Vec<(u64, Vec<Vec<BlockId>>, usize)>,
    finished: Vec<(u64, FinishKind)>,
    hold: bool,
}

impl KvConnectorScheduler for TestConnector {
    fn get_num_new_matched_tokens(
        &mut self,
        req: &ConnectorRequest<'_>,
        computed: usize,
    ) -> Result<MatchedTokens, KvConnectorError> {
        match req.kv_transfer_params.and_then(|p| p.get("remote")) {
            None => Ok(MatchedTokens::default()),
            Some(Value::Number(n)) => {
                let ext = (n.as_u64().unwrap() as usize).saturating_sub(computed);
                Ok(MatchedTokens {
                    num_external_tokens: ext,
                    load_async: ext > 0,
                })
            }
            Some(_) => Err(KvConnectorError::InvalidTransferParams(
                "remote must be a number".into(),
            )),
        }
    }
    fn update_state_after_alloc(
        &mut self,
        req: &ConnectorRequest<'_>,
        tables: &[Vec<BlockId>],
        n: usize,
    ) {
        if n > 0 {
            self.state
                .lock()
                .unwrap()
                .loads
                .push((req.request_id, tables.to_vec(), n));
        }
    }
    fn build_connector_meta(&mut self) -> ConnectorMetadata {
        ConnectorMetadata(None)
    }
    fn request_finished(
        &mut self,
        req: &ConnectorRequest<'_>,
        _tables: &[Vec<BlockId>],
        finish: FinishKind,
    ) -> FinishedAction {
        let mut s = self.state.lock().unwrap();
        s.finished.push((req.request_id, finish));
        FinishedAction {
            delay_free: s.hold,
            kv_transfer_params: s.hold.then(|| json!({"held": true})),
        }
    }
}

/// Completes the pending loads the test connector recorded: writes the prompt's tokens into the
/// mock cache (or not, for a failure) and reports them finished.
fn complete_loads(
    h: &mut Harness,
    c: &TestConnector,
    prompts: &HashMap<u64, Vec<u32>>,
    fail: &HashSet<u64>,
) {
    complete_loads_naming_invalid(h, c, prompts, fail, &HashSet::new());
}

/// [`complete_loads`], writing garbage into the blocks `invalid` and naming them invalid.
fn complete_loads_naming_invalid(
    h: &mut Harness,
    c: &TestConnector,
    prompts: &HashMap<u64, Vec<u32>>,
    fail: &HashSet<u64>,
    invalid: &HashSet<BlockId>,
) {
    let loads = std::mem::take(&mut c.state.lock().unwrap().loads);
    let mut out = ConnectorOutput::default();
    for (id, tables, _n) in loads {
        if fail.contains(&id) {
            out.failed_recving.insert(id, "peer went away".into());
        } else {
            // Every table's blocks (a sliding group's window), as a connector moves them.
            for (g, blocks) in tables.iter().enumerate() {
                for (pos, &t) in prompts[&id].iter().enumerate() {
                    let block = blocks[pos / BLOCK];
                    if block == NULL_BLOCK {
                        continue;
                    }
                    let t = if g == 0 && invalid.contains(&block) {
                        7
                    } else {
                        t
                    };
                    h.worker
                        .slots
                        .insert((g, block as usize * BLOCK + pos % BLOCK), t);
                }
            }
        }
        out.finished_recving.insert(id);
    }
    out.invalid_block_ids = invalid.iter().map(|&b| (0, b)).collect();
    let step = h.sched.schedule();
    let mut w = h.worker.execute(&step).unwrap();
    w.connector_output = out;
    h.sched.update_from_output(&step, w);
    h.sched.check_invariants().unwrap();
}

#[test]
fn remote_kv_load_waits_then_decodes_like_a_local_prefill() {
    let c = TestConnector::default();
    let mut h = Harness::with_connector(SchedulerConfig::default(), 32, Box::new(c.clone()));
    let p = prompt(8, 11);
    // 10 of 11 tokens come from "remote"; the last is computed locally (its logits are needed).
    let id = h.add_with(p.clone(), greedy(6), Some(json!({"remote": 10})));
    h.step();
    assert_eq!(h.sched.stats().waiting_for_remote_kv, 1);
    assert_eq!(
        h.worker.step_tokens.last(),
        Some(&0),
        "nothing runs while loading"
    );
    complete_loads(
        &mut h,
        &c,
        &HashMap::from([(id, p.clone())]),
        &HashSet::new(),
    );
    h.run();
    assert_eq!(h.collect(id).0, solo(&p, greedy(6)));
    h.assert_empty();
}

/// With a sliding-window group, a load holds the window of the last prompt token too: that token
/// is computed again after the load and attends `window` tokens back, one more than the first
/// output token's window before it. Prompt lengths where that extra token starts a block (13,
/// 17) and where it does not (15, 22).
#[test]
fn a_load_into_a_sliding_group_holds_the_window_the_recomputed_last_token_reads() {
    for len in [13, 15, 17, 22] {
        let c = TestConnector::default();
        let mut h = Harness::hybrid_with_connector(
            SchedulerConfig::default(),
            40,
            20,
            10,
            Box::new(c.clone()),
        );
        let p = prompt(40 + len as u32, len);
        let id = h.add_with(p.clone(), greedy(6), Some(json!({"remote": len})));
        h.step();
        let tables = c.state.lock().unwrap().loads[0].1.clone();
        let held = tables[1].iter().filter(|&&b| b != NULL_BLOCK).count();
        assert!(held <= 4, "len {len}: {tables:?}");
        complete_loads(
            &mut h,
            &c,
            &HashMap::from([(id, p.clone())]),
            &HashSet::new(),
        );
        h.run();
        assert_eq!(h.collect(id).0, solo(&p, greedy(6)), "len {len}");
        h.assert_empty();
    }
}

#[test]
fn a_load_of_the_whole_prompt_recomputes_only_its_last_token() {
    let c = TestConnector::default();
    let mut h = Harness::with_connector(SchedulerConfig::default(), 32, Box::new(c.clone()));
    let p = prompt(11, 12);
    let id = h.add_with(p.clone(), greedy(5), Some(json!({"remote": 12})));
    h.step();
    complete_loads(
        &mut h,
        &c,
        &HashMap::from([(id, p.clone())]),
        &HashSet::new(),
    );
    h.step();
    assert_eq!(
        h.worker.step_tokens.last(),
        Some(&1),
        "only the last prompt token runs"
    );
    h.run();
    assert_eq!(h.collect(id).0, solo(&p, greedy(5)));
    h.assert_empty();
}

#[test]
fn failed_load_follows_the_policy() {
    for policy in [KvLoadFailurePolicy::Fail, KvLoadFailurePolicy::Recompute] {
        let c = TestConnector::default();
        let config = SchedulerConfig {
            kv_load_failure_policy: policy,
            ..Default::default()
        };
        let mut h = Harness::with_connector(config, 32, Box::new(c.clone()));
        let p = prompt(9, 9);
        let id = h.add_with(p.clone(), greedy(4), Some(json!({"remote": 8})));
        h.step();
        complete_loads(
            &mut h,
            &c,
            &HashMap::from([(id, p.clone())]),
            &HashSet::from([id]),
        );
        h.run();
        let (toks, _, fin) = h.collect(id);
        match policy {
            KvLoadFailurePolicy::Fail => {
                assert_eq!(fin.finish, Some(FinishReason::Error));
                assert!(matches!(fin.error, Some(EngineError::KvLoadFailed(_))));
                assert_eq!(
                    h.sched.kv().group_pool(0).num_cached(),
                    0,
                    "failed load was cached"
                );
            }
            KvLoadFailurePolicy::Recompute => {
                assert_eq!(fin.finish, Some(FinishReason::Length));
                assert_eq!(toks, solo(&p, greedy(4)), "recomputed locally");
            }
        }
        h.assert_empty();
    }
}

/// A load whose connector names invalid blocks (and reports no failure): under recompute the
/// request keeps the blocks before the first invalid one and computes only from there; the
/// invalid block's garbage never reaches the output; with partial recompute off it computes all.
#[test]
fn invalid_blocks_resume_the_request_at_the_first_of_them() {
    let n = 21;
    for (partial, bad_position, want_step) in [
        (true, 2usize, n - 2 * BLOCK),
        (true, 0, n),
        (true, 5, n - 5 * BLOCK),
        (false, 2, n),
    ] {
        let c = TestConnector::default();
        let config = SchedulerConfig {
            kv_partial_recompute: partial,
            ..Default::default()
        };
        let mut h = Harness::with_connector(config, 32, Box::new(c.clone()));
        let p = prompt(13, n);
        let id = h.add_with(p.clone(), greedy(4), Some(json!({"remote": n})));
        h.step();
        let bad = c.state.lock().unwrap().loads[0].1[0][bad_position];
        complete_loads_naming_invalid(
            &mut h,
            &c,
            &HashMap::from([(id, p.clone())]),
            &HashSet::new(),
            &HashSet::from([bad]),
        );
        h.step();
        let case = format!("partial {partial}, invalid block at position {bad_position}");
        assert_eq!(h.worker.step_tokens.last(), Some(&want_step), "{case}");
        h.run();
        let (toks, _, fin) = h.collect(id);
        assert_eq!(fin.finish, Some(FinishReason::Length), "{case}");
        assert_eq!(toks, solo(&p, greedy(4)), "{case}");
        h.assert_empty();
    }
}

#[test]
fn malformed_transfer_params_fail_only_that_request() {
    let c = TestConnector::default();
    let mut h = Harness::with_connector(SchedulerConfig::default(), 32, Box::new(c.clone()));
    let bad = h.add_with(prompt(1, 5), greedy(3), Some(json!({"remote": "lots"})));
    let good = h.add(prompt(2, 5), greedy(3));
    h.run();
    let (_, _, fin) = h.collect(bad);
    assert!(matches!(
        fin.error,
        Some(EngineError::InvalidTransferParams(_))
    ));
    assert_eq!(h.collect(good).0.len(), 3);
    h.assert_empty();
}

#[test]
fn producer_holds_blocks_until_the_connector_releases_them() {
    let c = TestConnector::default();
    c.state.lock().unwrap().hold = true;
    let mut h = Harness::with_connector(SchedulerConfig::default(), 16, Box::new(c.clone()));
    let id = h.add(prompt(3, 9), greedy(1));
    h.run();
    let (_, _, fin) = h.collect(id);
    assert_eq!(fin.kv_transfer_params, Some(json!({"held": true})));
    assert_eq!(
        h.sched.kv().num_free_blocks(),
        16 - 3,
        "blocks held after finish"
    );
    assert!(h.sched.has_pending_transfers());
    let step = h.sched.schedule();
    let mut w = h.worker.execute(&step).unwrap();
    w.connector_output.finished_sending.insert(id);
    h.sched.update_from_output(&step, w);
    assert_eq!(
        c.state.lock().unwrap().finished,
        vec![(id, FinishKind::Normal)]
    );
    h.assert_empty();
}

/// A step that panics kills the engine for real: the running request ends with an error event,
/// the engine reports itself dead before that event arrives, new requests are refused, and the
/// failed request's blocks are free again.
#[test]
fn a_panicking_step_fails_every_request_and_marks_the_engine_dead() {
    let sched = Scheduler::new(
        SchedulerConfig::default(),
        KvCacheManager::new(16, BLOCK, true),
        Box::new(NoopConnector),
        Arc::new(Bytes),
        vec![EOS],
    );
    let worker = FaultyWorker::new(Box::new(MockWorker::default()), EngineFault::PanicAtStep(3));
    let engine = EngineHandle::spawn(sched, Box::new(worker), 256).unwrap();
    assert!(engine.is_alive());
    let new = || NewRequest {
        external_id: "dies".into(),
        prompt_token_ids: prompt(1, 10),
        params: greedy(20),
        kv_transfer_params: None,
    };
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let (tokens, fin) = rt.block_on(async {
        let mut stream = engine.submit(new()).unwrap();
        let (mut tokens, mut last) = (0, None);
        while let Some(ev) = tokio::time::timeout(std::time::Duration::from_secs(10), stream.next())
            .await
            .expect("the stream ends when the engine dies")
        {
            tokens += ev.token_ids.len();
            last = Some(ev);
        }
        (tokens, last.unwrap())
    });
    assert_eq!(tokens, 2, "steps 1 and 2 ran, step 3 panicked");
    assert_eq!(fin.finish, Some(FinishReason::Error));
    assert!(
        matches!(&fin.error, Some(EngineError::Execution(m)) if m.contains("deliberate engine fault")),
        "{:?}",
        fin.error
    );
    assert!(
        !engine.is_alive(),
        "dead before the error reached the client"
    );
    assert_eq!(engine.submit(new()).err(), Some(EngineError::EngineDead));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    loop {
        let s = engine.stats();
        if s.running == 0 && s.waiting == 0 && s.free_blocks == s.total_blocks {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "after death: {s:?}");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
}

#[test]
fn prompt_logprobs_cover_every_prompt_position_in_bounded_steps_without_the_prefix_cache() {
    let mut h = Harness::new(SchedulerConfig::default(), 512);
    let p = prompt(5, 600);
    let params = SamplingParams {
        prompt_logprobs: Some(2),
        ..greedy(3)
    };
    // The same prompt twice, one after the other: the second must not take the first's blocks
    // from the prefix cache (their positions have no logits to give).
    for round in 0..2 {
        h.worker.prompt_targets.clear();
        let id = h.add(p.clone(), params.clone());
        h.run();
        let chunks = &h.worker.prompt_targets;
        assert!(
            chunks.len() >= 3,
            "600 tokens in steps of at most 256: {}",
            chunks.len()
        );
        let mut next = 1;
        for (req, first, targets) in chunks {
            assert_eq!((*req, *first), (id, next), "round {round}");
            assert!(targets.len() <= tandem_engine::scheduler::PROMPT_LOGPROBS_CHUNK);
            assert_eq!(targets[..], p[next..next + targets.len()]);
            next += targets.len();
        }
        assert_eq!(next, p.len(), "every prompt token after the first, once");
        let rx = h.streams.get_mut(&id).unwrap();
        let first = rx.try_recv().unwrap();
        let lps = first.prompt_logprobs.expect("with the first token");
        assert_eq!(lps.len(), p.len());
        assert!(lps[0].is_none());
        for (i, lp) in lps.iter().enumerate().skip(1) {
            assert_eq!(lp.as_ref().unwrap().token_id, p[i]);
        }
        while let Ok(ev) = rx.try_recv() {
            assert!(ev.prompt_logprobs.is_none(), "sent once");
        }
        h.assert_empty();
    }
}
