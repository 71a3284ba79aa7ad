//! Test helpers: a deliberately naive implementation of the definition, a logical model's KV,
//! and a simulated TP x PP cluster that lays it out in paged caches and runs the real worker,
//! merge and payload code over it.
//!
//! The naive implementation follows DESIGN.md word by word (join a token's K and V rows, cut
//! into pieces, multiply each by `2j + 1`); it shares no code with the crate but the
//! `BlockLayout::row_offset` used to place rows in a paged cache.

use tandem_kv_cache::{BlockLayout, CacheDtype, KvCacheSpec, LayerKv, LayoutOrder};
use tandem_kv_checksum::*;

/// splitmix64: deterministic test data from a seed.
#[derive(Debug, Clone)]
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    pub fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    pub fn fill(&mut self, buf: &mut [u8]) {
        for b in buf {
            *b = self.next() as u8;
        }
    }
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            let j = self.below(i + 1);
            v.swap(i, j);
        }
    }
}

/// One layer of the logical (unsharded) model: K and V as `[tokens][heads][row bytes]`.
#[derive(Debug, Clone)]
pub struct ModelLayer {
    pub name: String,
    pub number: u32,
    pub heads: usize,
    pub head_dim: usize,
    pub dtype: CacheDtype,
    pub k: Vec<u8>,
    pub v: Vec<u8>,
}

impl ModelLayer {
    pub fn row_bytes(&self) -> usize {
        self.head_dim * self.dtype.size()
    }
    fn at(&self, t: usize, h: usize) -> std::ops::Range<usize> {
        let rb = self.row_bytes();
        let o = (t * self.heads + h) * rb;
        o..o + rb
    }
    pub fn k_row(&self, t: usize, h: usize) -> &[u8] {
        &self.k[self.at(t, h)]
    }
    pub fn v_row(&self, t: usize, h: usize) -> &[u8] {
        &self.v[self.at(t, h)]
    }
}

/// The KV of a whole model for `tokens` tokens of one request.
#[derive(Debug, Clone)]
pub struct Model {
    pub layers: Vec<ModelLayer>,
    pub tokens: usize,
}

impl Model {
    pub fn random(
        rng: &mut Rng,
        names: &[&str],
        heads: usize,
        head_dim: usize,
        dtype: CacheDtype,
        tokens: usize,
    ) -> Model {
        let layers = names
            .iter()
            .map(|name| {
                let n = tokens * heads * head_dim * dtype.size();
                let mut k = vec![0u8; n];
                let mut v = vec![0u8; n];
                rng.fill(&mut k);
                rng.fill(&mut v);
                ModelLayer {
                    name: name.to_string(),
                    number: tandem_kv_cache::spec::layer_number(name).unwrap_or(0),
                    heads,
                    head_dim,
                    dtype,
                    k,
                    v,
                }
            })
            .collect();
        Model { layers, tokens }
    }

    pub fn names(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("model.layers.{i}.self_attn"))
            .collect()
    }
}

/// The definition, naively: block `pos` of `block_size` tokens, covering tokens in
/// `[first_token, num_tokens)`.
pub fn naive_block(
    model: &Model,
    pos: usize,
    block_size: usize,
    first_token: usize,
    num_tokens: usize,
) -> u64 {
    let lo = (pos * block_size).max(first_token);
    let hi = ((pos + 1) * block_size).min(num_tokens);
    let mut c = 0u64;
    for layer in &model.layers {
        for h in 0..layer.heads {
            let mut s = 0u64;
            for t in lo..hi {
                let mut token = layer.k_row(t, h).to_vec();
                token.extend_from_slice(layer.v_row(t, h));
                assert_eq!(token.len() % 8, 0, "test model must have whole pieces");
                let p_count = token.len() / 8;
                for p in 0..p_count {
                    let mut piece = [0u8; 8];
                    piece.copy_from_slice(&token[8 * p..8 * p + 8]);
                    let x = u64::from_le_bytes(piece);
                    let j = (t * p_count + p) as u64;
                    s = s.wrapping_add(x.wrapping_mul(2 * j + 1));
                }
            }
            let m = 2 * (layer.number as u64 * 65536 + h as u64) + 1;
            c = c.wrapping_add(m.wrapping_mul(s));
        }
    }
    c
}

/// Naive values of positions `start..start + n`.
pub fn naive_blocks(
    model: &Model,
    start: usize,
    n: usize,
    block_size: usize,
    first_token: usize,
    num_tokens: usize,
) -> Vec<u64> {
    (start..start + n)
        .map(|p| naive_block(model, p, block_size, first_token, num_tokens))
        .collect()
}

/// How a side lays out its cache.
#[derive(Debug, Clone, Copy)]
pub struct Physical {
    pub block_size: usize,
    pub kernel_block_size: usize,
    pub order: LayoutOrder,
}

impl Physical {
    pub fn plain(block_size: usize) -> Self {
        Physical {
            block_size,
            kernel_block_size: block_size,
            order: LayoutOrder::TokenMajor,
        }
    }
}

/// One worker's paged copy of some of the model's layers and heads.
#[derive(Debug, Clone)]
pub struct PagedWorker {
    /// (model layer index, K bytes, V bytes, layout)
    pub layers: Vec<(usize, Vec<u8>, Vec<u8>, BlockLayout)>,
}

impl PagedWorker {
    pub fn views(&self) -> Vec<LayerKv<'_>> {
        self.layers
            .iter()
            .map(|(_, k, v, l)| LayerKv::new(k, v, *l).unwrap())
            .collect()
    }

    /// Mutable K bytes of the row of (model token t, local head h) of worker layer `i`.
    pub fn k_row_mut(
        &mut self,
        i: usize,
        table: &[Option<usize>],
        t: usize,
        h: usize,
    ) -> &mut [u8] {
        let (_, k, _, lay) = &mut self.layers[i];
        let bs = lay.block_size;
        let off = lay.row_offset(table[t / bs].unwrap(), t % bs, h);
        let rb = lay.row_bytes();
        &mut k[off..off + rb]
    }
}

/// Lays out model layers `layer_ids`, global heads `[head_offset, head_offset + heads)`, in a
/// pool of `num_blocks` blocks; position `p` lives in `table[p]`; tokens `[from, to)` are
/// written, every other byte is random junk.
#[allow(clippy::too_many_arguments)]
pub fn paged(
    rng: &mut Rng,
    model: &Model,
    layer_ids: &[usize],
    head_offset: usize,
    heads: usize,
    phys: Physical,
    num_blocks: usize,
    table: &[Option<usize>],
    from: usize,
    to: usize,
) -> PagedWorker {
    let layers = layer_ids
        .iter()
        .map(|&li| {
            let ml = &model.layers[li];
            let layout = BlockLayout {
                num_blocks,
                block_size: phys.block_size,
                kernel_block_size: phys.kernel_block_size,
                num_kv_heads: heads,
                head_dim: ml.head_dim,
                dtype: ml.dtype,
                order: phys.order,
            };
            let mut k = vec![0u8; layout.total_bytes()];
            let mut v = vec![0u8; layout.total_bytes()];
            rng.fill(&mut k);
            rng.fill(&mut v);
            let rb = layout.row_bytes();
            for t in from..to {
                let Some(block) = table.get(t / phys.block_size).copied().flatten() else {
                    continue;
                };
                for h in 0..heads {
                    let off = layout.row_offset(block, t % phys.block_size, h);
                    k[off..off + rb].copy_from_slice(ml.k_row(t, head_offset + h));
                    v[off..off + rb].copy_from_slice(ml.v_row(t, head_offset + h));
                }
            }
            (li, k, v, layout)
        })
        .collect();
    PagedWorker { layers }
}

/// A random block table of `n` positions in a pool of `pool` blocks.
pub fn random_table(rng: &mut Rng, n: usize, pool: usize) -> Vec<Option<usize>> {
    let mut ids: Vec<usize> = (0..pool).collect();
    rng.shuffle(&mut ids);
    ids.into_iter().take(n).map(Some).collect()
}

/// How heads are spread over TP ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Heads {
    /// Split, replicated once TP exceeds the heads.
    Sharded,
    /// Every rank holds every head (MLA-like).
    Replicated,
}

/// A simulated instance: TP x PP workers holding a model's KV (one group) in paged caches.
#[derive(Debug, Clone)]
pub struct Cluster {
    pub tp: u32,
    pub pp: u32,
    pub spec: KvCacheSpec,
    pub table: Vec<Option<usize>>,
    pub group_id: usize,
    /// (worker id, setup, memory)
    pub workers: Vec<(WorkerId, WorkerChecksums, PagedWorker)>,
}

pub struct ClusterConfig {
    pub tp: u32,
    pub pp: u32,
    pub phys: Physical,
    pub window: Option<usize>,
    pub heads: Heads,
    /// Tokens `[from, to)` hold the model's KV (a consumer's load writes only these).
    pub from: usize,
    pub to: usize,
    pub table: Option<Vec<Option<usize>>>,
    pub group_id: usize,
}

impl ClusterConfig {
    pub fn new(tp: u32, pp: u32, block_size: usize, tokens: usize) -> Self {
        ClusterConfig {
            tp,
            pp,
            phys: Physical::plain(block_size),
            window: None,
            heads: Heads::Sharded,
            from: 0,
            to: tokens,
            table: None,
            group_id: GROUP,
        }
    }
}

pub const GROUP: usize = 0;

impl Cluster {
    pub fn new(rng: &mut Rng, model: &Model, cfg: ClusterConfig) -> Cluster {
        let first = &model.layers[0];
        let global_heads = first.heads as u32;
        let bs = cfg.phys.block_size;
        let positions = model.tokens.div_ceil(bs).max(1);
        let pool = positions + 3;
        let table = cfg
            .table
            .clone()
            .unwrap_or_else(|| random_table(rng, positions, pool));
        let n_layers = model.layers.len();
        let mut workers = Vec::new();
        for pp_rank in 0..cfg.pp {
            let lo = n_layers * pp_rank as usize / cfg.pp as usize;
            let hi = n_layers * (pp_rank as usize + 1) / cfg.pp as usize;
            let layer_ids: Vec<usize> = (lo..hi).collect();
            for tp_rank in 0..cfg.tp {
                let placement = match cfg.heads {
                    Heads::Sharded => HeadPlacement::tp_sharded(tp_rank, cfg.tp, global_heads),
                    Heads::Replicated => HeadPlacement::replicated(tp_rank, cfg.tp, global_heads),
                }
                .unwrap();
                let local_heads = match cfg.heads {
                    Heads::Sharded => (global_heads / cfg.tp).max(1) as usize,
                    Heads::Replicated => global_heads as usize,
                };
                let mem = paged(
                    rng,
                    model,
                    &layer_ids,
                    placement.head_offset as usize,
                    local_heads,
                    cfg.phys,
                    pool,
                    &table,
                    cfg.from,
                    cfg.to,
                );
                let spec = spec_of(first, cfg.phys.block_size, local_heads, cfg.window);
                let group = WorkerGroup {
                    group_id: cfg.group_id,
                    spec,
                    layers: mem
                        .layers
                        .iter()
                        .enumerate()
                        .map(|(i, (li, _, _, layout))| CacheLayer {
                            source_index: i,
                            name: model.layers[*li].name.clone(),
                            layout: *layout,
                        })
                        .collect(),
                    heads: placement,
                };
                let id = WorkerId { tp_rank, pp_rank };
                workers.push((id, WorkerChecksums::new(id, vec![group]), mem));
            }
        }
        let spec = spec_of(first, bs, first.heads, cfg.window);
        Cluster {
            tp: cfg.tp,
            pp: cfg.pp,
            spec,
            table,
            group_id: cfg.group_id,
            workers,
        }
    }

    /// The scheduler's selection of tokens `[first_token, num_tokens)`.
    pub fn request(&self, first_token: usize, num_tokens: usize) -> ChecksumRequest {
        let g = GroupBlocks {
            group_id: self.group_id,
            spec: &self.spec,
            first_position: 0,
            blocks: &self.table,
        };
        ChecksumRequest::for_load(first_token, num_tokens, &[g])
    }

    /// Every worker's record of `request`.
    pub fn records(&self, role: Role, request: &ChecksumRequest) -> Vec<RequestRecord> {
        self.workers
            .iter()
            .map(|(_, setup, mem)| {
                let views = mem.views();
                setup.checksum(&CpuBackend::new(&views), role, request)
            })
            .collect()
    }

    /// The merged checksums of `request`.
    pub fn merged(&self, role: Role, request: &ChecksumRequest) -> MergedChecksums {
        let mut m = RecordMerger::new(self.tp, self.pp, request.clone());
        for r in self.records(role, request) {
            m.add(r).unwrap();
        }
        m.finish().unwrap()
    }

    /// The producer's payload for the prompt's `num_tokens` tokens.
    pub fn payload(&self, num_tokens: usize) -> Payload {
        let req = self.request(0, num_tokens);
        Payload::from_merged(&self.merged(Role::Producer, &req)).unwrap()
    }

    /// The consumer's verdict for a load of tokens `[first_token, num_tokens)`.
    pub fn verdict(&self, payload: &str, first_token: usize, num_tokens: usize) -> Verdict {
        let req = self.request(first_token, num_tokens);
        verify(Some(payload), Ok(&self.merged(Role::Consumer, &req)))
    }
}

pub fn spec_of(
    layer: &ModelLayer,
    block_size: usize,
    heads: usize,
    window: Option<usize>,
) -> KvCacheSpec {
    match window {
        None => KvCacheSpec::FullAttention {
            block_size,
            num_kv_heads: heads,
            head_dim: layer.head_dim,
            dtype: layer.dtype,
        },
        Some(window) => KvCacheSpec::SlidingWindow {
            block_size,
            num_kv_heads: heads,
            head_dim: layer.head_dim,
            dtype: layer.dtype,
            window,
        },
    }
}

/// The only group's computed checks.
pub fn checks(m: &MergedChecksums) -> &GroupChecks {
    match m.group(GROUP) {
        Some(MergedState::Computed(c)) => c,
        other => panic!("group not computed: {other:?}"),
    }
}
