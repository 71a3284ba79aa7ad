//! The GPU decoder against a plain f32 reference written here, on a GPU (run by
//! `scripts/gpu_run.sh` on the device machine; CI has no GPU and only builds this).
//!
//! The reference uses the same bf16 weights and rounds activations to bf16 where the GPU keeps
//! them in bf16 (normed inputs, products, rotated Q and K, the cache, attention and MLP outputs),
//! so the two differ only by summation order: the tolerance is tight. Cases: prefill of two
//! sequences in one step then batched decode, chunked prefill of a long sequence whose decode
//! splits its keys over thread blocks, both head sizes and group sizes, and steps that must be
//! refused.
#![cfg(feature = "cuda")]

use rand::{Rng, SeedableRng};
use tandem_kernels::cuda::{
    bf16_bits, bf16_to_f32, DecoderShape, Device, DeviceKvCache, GpuDecoder, KvArrangement,
    OwnedStep, Tensor, Weights,
};
use tandem_kv_cache::{BlockLayout, CacheDtype};

const BLOCK: usize = 16;
const THETA: f32 = 10_000.0;

fn device() -> Device {
    Device::open(0).unwrap_or_else(|e| panic!("these tests need a CUDA GPU: {e}"))
}

fn rb(x: f32) -> f32 {
    bf16_to_f32(bf16_bits(x))
}

/// The model's weights on the host (bf16-exact f32 values).
struct HostModel {
    shape: DecoderShape,
    embed: Vec<f32>,
    output: Vec<f32>,
    final_norm: Vec<f32>,
    layers: Vec<[Vec<f32>; 6]>, // attn_norm, ffn_norm, qkv, o, gate_up, down
}

impl HostModel {
    fn random(shape: DecoderShape, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut mat = |rows: usize, cols: usize| -> Vec<f32> {
            let a = (3.0 / cols as f32).sqrt();
            (0..rows * cols)
                .map(|_| rb(rng.random_range(-a..a)))
                .collect()
        };
        let (h, i, qd) = (
            shape.hidden,
            shape.intermediate,
            shape.heads * shape.head_dim,
        );
        let qkv = (shape.heads + 2 * shape.kv_heads) * shape.head_dim;
        let embed = mat(shape.vocab, h);
        let output = mat(shape.vocab, h).iter().map(|&x| rb(4.0 * x)).collect();
        let layers = (0..shape.layers)
            .map(|_| {
                [
                    mat(1, h).iter().map(|x| 1.0 + x).collect(),
                    mat(1, h).iter().map(|x| 1.0 + x).collect(),
                    mat(qkv, h),
                    mat(h, qd),
                    mat(2 * i, h),
                    mat(h, i),
                ]
            })
            .collect();
        let final_norm = vec![1.0; h];
        HostModel {
            shape,
            embed,
            output,
            final_norm,
            layers,
        }
    }

    fn tensor(&self, t: Tensor) -> Vec<f32> {
        match t {
            Tensor::Embedding => self.embed.clone(),
            Tensor::Output => self.output.clone(),
            Tensor::FinalNorm => self.final_norm.clone(),
            Tensor::AttnNorm(l) => self.layers[l][0].clone(),
            Tensor::FfnNorm(l) => self.layers[l][1].clone(),
            Tensor::Qkv(l) => self.layers[l][2].clone(),
            Tensor::AttnOutput(l) => self.layers[l][3].clone(),
            Tensor::GateUp(l) => self.layers[l][4].clone(),
            Tensor::Down(l) => self.layers[l][5].clone(),
        }
    }

    fn inv_freq(&self) -> Vec<f32> {
        let d = self.shape.head_dim;
        (0..d / 2)
            .map(|i| 1.0 / THETA.powf((2 * i) as f32 / d as f32))
            .collect()
    }

    /// Logits of every position of `tokens` (one sequence, full causal attention).
    fn reference(&self, tokens: &[u32]) -> Vec<Vec<f32>> {
        let s = &self.shape;
        let (h, inter, d) = (s.hidden, s.intermediate, s.head_dim);
        let (nh, nkv) = (s.heads, s.kv_heads);
        let n = tokens.len();
        let matmul = |x: &[f32], w: &[f32], rows: usize, cols: usize| -> Vec<f32> {
            // x [n, cols] · w[rows, cols]ᵀ
            let mut y = vec![0f32; n * rows];
            for t in 0..n {
                for r in 0..rows {
                    let xr = &x[t * cols..(t + 1) * cols];
                    let wr = &w[r * cols..(r + 1) * cols];
                    y[t * rows + r] = xr.iter().zip(wr).map(|(a, b)| a * b).sum();
                }
            }
            y
        };
        let norm = |x: &[f32], w: &[f32]| -> Vec<f32> {
            x.chunks(h)
                .flat_map(|row| {
                    let ss: f32 = row.iter().map(|v| v * v).sum();
                    let r = 1.0 / (ss / h as f32 + s.rms_eps).sqrt();
                    row.iter().zip(w).map(move |(v, g)| rb(g * (v * r)))
                })
                .collect()
        };
        let inv = self.inv_freq();
        let mut x: Vec<f32> = tokens
            .iter()
            .flat_map(|&t| self.embed[t as usize * h..(t as usize + 1) * h].to_vec())
            .collect();
        for layer in &self.layers {
            let xn = norm(&x, &layer[0]);
            let width = (nh + 2 * nkv) * d;
            let mut qkv: Vec<f32> = matmul(&xn, &layer[2], width, h)
                .into_iter()
                .map(rb)
                .collect();
            for t in 0..n {
                for head in 0..nh + nkv {
                    let base = t * width + head * d;
                    for i in 0..d / 2 {
                        let a = t as f32 * inv[i];
                        let (c, sn) = (a.cos(), a.sin());
                        let (x1, x2) = (qkv[base + i], qkv[base + i + d / 2]);
                        qkv[base + i] = rb(x1 * c - x2 * sn);
                        qkv[base + i + d / 2] = rb(x2 * c + x1 * sn);
                    }
                }
            }
            let group = nh / nkv;
            let scale = 1.0 / (d as f32).sqrt();
            let mut attn = vec![0f32; n * nh * d];
            for t in 0..n {
                for head in 0..nh {
                    let kvh = head / group;
                    let q: Vec<f32> = (0..d)
                        .map(|i| rb(qkv[t * width + head * d + i]) * scale)
                        .collect();
                    let scores: Vec<f32> = (0..=t)
                        .map(|j| {
                            let k = &qkv[j * width + (nh + kvh) * d..][..d];
                            q.iter().zip(k).map(|(a, b)| a * b).sum()
                        })
                        .collect();
                    let m = scores.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                    let p: Vec<f32> = scores.iter().map(|s| (s - m).exp()).collect();
                    let l: f32 = p.iter().sum();
                    for i in 0..d {
                        let acc: f32 = (0..=t)
                            .map(|j| p[j] * qkv[j * width + (nh + nkv + kvh) * d + i])
                            .sum();
                        attn[t * nh * d + head * d + i] = rb(acc / l);
                    }
                }
            }
            let o = matmul(&attn, &layer[3], h, nh * d);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let xn = norm(&x, &layer[1]);
            let gu: Vec<f32> = matmul(&xn, &layer[4], 2 * inter, h)
                .into_iter()
                .map(rb)
                .collect();
            let act: Vec<f32> = (0..n * inter)
                .map(|k| {
                    let (t, j) = (k / inter, k % inter);
                    let g = gu[t * 2 * inter + j];
                    rb(g / (1.0 + (-g).exp()) * gu[t * 2 * inter + inter + j])
                })
                .collect();
            let down = matmul(&act, &layer[5], h, inter);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
        let xn = norm(&x, &self.final_norm);
        let logits = matmul(&xn, &self.output, s.vocab, h);
        logits.chunks(s.vocab).map(<[f32]>::to_vec).collect()
    }
}

fn shape(head_dim: usize, heads: usize, kv_heads: usize) -> DecoderShape {
    DecoderShape {
        hidden: 256,
        intermediate: 512,
        layers: 2,
        heads,
        kv_heads,
        head_dim,
        vocab: 301,
        max_positions: 4096,
        rms_eps: 1e-5,
        tie_embeddings: false,
    }
}

fn load(dev: &Device, model: &HostModel, num_blocks: usize, max_tokens: usize) -> GpuDecoder {
    let s = &model.shape;
    let layout =
        BlockLayout::token_major(num_blocks, BLOCK, s.kv_heads, s.head_dim, CacheDtype::Bf16);
    let cache = DeviceKvCache::new(dev, layout, s.layers, KvArrangement::BlockMajor).unwrap();
    let mut source = |t: Tensor| Ok(model.tensor(t));
    GpuDecoder::new(
        dev,
        s.clone(),
        &model.inv_freq(),
        cache,
        max_tokens,
        Weights::Host(&mut source),
    )
    .unwrap()
}

/// One sequence's state in a test: its tokens so far and its scrambled block table.
struct Seq {
    tokens: Vec<u32>,
    table: Vec<u32>,
    computed: usize,
}

/// Runs one step in which each listed sequence computes `count` more tokens (its tokens
/// `computed..computed + count`), returning the logits of each one's last row.
fn step(dec: &GpuDecoder, seqs: &mut [&mut Seq], counts: &[usize]) -> Vec<Vec<f32>> {
    let mut input = OwnedStep::default();
    for (seq, &count) in seqs.iter_mut().zip(counts) {
        let ids = &seq.tokens[seq.computed..seq.computed + count];
        input.push_sequence(&seq.table, BLOCK, seq.computed, ids);
        seq.computed += count;
    }
    let logits = dec.forward(&input.input()).unwrap();
    logits
        .chunks(dec.shape().vocab)
        .map(<[f32]>::to_vec)
        .collect()
}

fn assert_close(gpu: &[f32], cpu: &[f32], what: &str) {
    let scale = cpu.iter().map(|v| v.abs()).fold(0f32, f32::max);
    let worst = gpu
        .iter()
        .zip(cpu)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    assert!(
        worst <= 0.03 * scale.max(1.0),
        "{what}: logits differ by up to {worst} (largest |logit| {scale})"
    );
    let argmax = |v: &[f32]| {
        v.iter()
            .enumerate()
            .max_by(|a, b| a.1.total_cmp(b.1))
            .unwrap()
            .0
    };
    let mut sorted = cpu.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    if sorted[0] - sorted[1] > 0.1 {
        assert_eq!(argmax(gpu), argmax(cpu), "{what}: greedy choice");
    }
}

/// A table of `n` distinct blocks taken from a scrambled pool.
fn tables(num_blocks: usize, lens: &[usize], seed: u64) -> Vec<Vec<u32>> {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let mut pool: Vec<u32> = (0..num_blocks as u32).collect();
    for i in (1..pool.len()).rev() {
        pool.swap(i, rng.random_range(0..=i));
    }
    let mut it = pool.into_iter();
    lens.iter()
        .map(|&n| it.by_ref().take(n.div_ceil(BLOCK)).collect())
        .collect()
}

/// Two sequences prefilled in one step (`prefill` rows each), then three batched decode steps.
/// With 64 rows or more in a step of long runs the prefill takes the tensor-core kernel, and
/// [70, 50] puts the end of one sequence and all of the other in one thread block's 64 rows.
fn run_batch_case(head_dim: usize, heads: usize, kv_heads: usize, prefill: [usize; 2]) {
    let dev = device();
    let model = HostModel::random(shape(head_dim, heads, kv_heads), 7);
    let dec = load(&dev, &model, 64, 128);
    let mut rng = rand::rngs::StdRng::seed_from_u64(11);
    let lens = [prefill[0] + 3, prefill[1] + 3];
    let t = tables(64, &lens, 3);
    let mut seqs: Vec<Seq> = lens
        .iter()
        .zip(t)
        .map(|(&n, table)| Seq {
            tokens: (0..n).map(|_| rng.random_range(0..301)).collect(),
            table,
            computed: 0,
        })
        .collect();
    let refs: Vec<Vec<Vec<f32>>> = seqs.iter().map(|s| model.reference(&s.tokens)).collect();
    let (a, b) = seqs.split_at_mut(1);
    let mut both = [&mut a[0], &mut b[0]];
    let out = step(&dec, &mut both, &prefill);
    assert_close(&out[0], &refs[0][prefill[0] - 1], "prefill of sequence 0");
    assert_close(&out[1], &refs[1][prefill[1] - 1], "prefill of sequence 1");
    for k in 0..3 {
        let out = step(&dec, &mut both, &[1, 1]);
        assert_close(&out[0], &refs[0][prefill[0] + k], "decode of sequence 0");
        assert_close(&out[1], &refs[1][prefill[1] + k], "decode of sequence 1");
    }
}

#[test]
fn prefill_and_decode_of_two_sequences_match_the_reference_head_dim_64() {
    run_batch_case(64, 6, 2, [37, 20]);
    run_batch_case(64, 6, 2, [70, 50]);
}

#[test]
fn prefill_and_decode_of_two_sequences_match_the_reference_head_dim_128() {
    run_batch_case(128, 8, 2, [37, 20]);
    run_batch_case(128, 8, 2, [70, 50]);
}

#[test]
fn chunked_prefill_of_a_long_sequence_and_its_split_decode_match_the_reference() {
    let dev = device();
    let model = HostModel::random(shape(128, 4, 1), 5);
    let dec = load(&dev, &model, 128, 512);
    let mut rng = rand::rngs::StdRng::seed_from_u64(13);
    let n = 1300;
    let mut seq = Seq {
        tokens: (0..n + 2).map(|_| rng.random_range(0..301)).collect(),
        table: tables(128, &[n + 2], 9).remove(0),
        computed: 0,
    };
    let reference = model.reference(&seq.tokens);
    for chunk in [512, 512, 276] {
        let last = seq.computed + chunk - 1;
        let out = step(&dec, &mut [&mut seq], &[chunk]);
        assert_close(&out[0], &reference[last], "a prefill chunk");
    }
    // Decode with 1301 and 1302 keys: split over thread blocks of 512 keys and merged.
    for k in 0..2 {
        let out = step(&dec, &mut [&mut seq], &[1]);
        assert_close(&out[0], &reference[n + k], "split decode");
    }
}

#[test]
fn steps_outside_the_cache_the_vocabulary_or_the_scratch_are_refused() {
    let dev = device();
    let model = HostModel::random(shape(64, 2, 1), 1);
    let dec = load(&dev, &model, 8, 16);
    // Two rows of one sequence in block 1.
    let good = |f: &mut dyn FnMut(&mut OwnedStep)| {
        let mut s = OwnedStep::default();
        s.push_sequence(&[1], BLOCK, 0, &[1, 2]);
        f(&mut s);
        dec.forward(&s.input())
    };
    assert!(good(&mut |_| {}).is_ok());
    type Breaker = Box<dyn FnMut(&mut OwnedStep)>;
    let cases: Vec<(&str, Breaker)> = vec![
        ("token id", Box::new(|s| s.token_ids[0] = 301)),
        ("slot", Box::new(|s| s.slots[1] = 8 * 16)),
        ("block", Box::new(|s| s.tables[0] = 8)),
        ("table coverage", Box::new(|s| s.ctx_idx[1] = 16)),
        ("logits row", Box::new(|s| s.logits_rows[0] = 2)),
        ("position", Box::new(|s| s.positions[0] = 4096)),
        ("row count", Box::new(|s| s.positions.push(2))),
        (
            "too many rows",
            Box::new(|s| {
                s.token_ids = vec![1; 17];
                s.positions = vec![0; 17];
                s.slots = vec![16; 17];
                s.ctx_idx = vec![0; 17];
                s.table_off = vec![0; 17];
            }),
        ),
    ];
    for (what, mut f) in cases {
        assert!(good(&mut *f).is_err(), "a bad {what} was accepted");
    }
}
