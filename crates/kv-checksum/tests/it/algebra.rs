//! The algebra of the definition, by proptest over the real (fast) worker path: block sums,
//! sensitivity to swaps and single-piece changes, ignored slots, layout independence. (TP and PP
//! sums: `definition::every_split_sums_to_the_whole`.)
//!
//! Swaps change the value with probability about 1 - 2^-60 on random data (a swap of two tokens
//! whose pieces have equal sums is invisible by design); a single-piece change always does.

use proptest::prelude::*;
use tandem_kv_cache::{CacheDtype, LayoutOrder};
use tandem_kv_checksum::*;

use crate::common::*;

fn fast(model: &Model, phys: Physical, first: usize, num_tokens: usize, seed: u64) -> Vec<u64> {
    let mut cfg = ClusterConfig::new(1, 1, phys.block_size, model.tokens);
    cfg.phys = phys;
    let cluster = Cluster::new(&mut Rng(seed), model, cfg);
    let merged = cluster.merged(Role::Producer, &cluster.request(first, num_tokens));
    checks(&merged).checks[0].clone()
}

fn model(seed: u64, layers: usize, heads: usize, dtype: CacheDtype, tokens: usize) -> Model {
    let names = Model::names(layers);
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    Model::random(&mut Rng(seed), &refs, heads, 8, dtype, tokens)
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]

    #[test]
    fn small_blocks_sum_to_large_blocks(
        num_tokens in 1..100usize,
        small in prop::sample::select(vec![1usize, 2, 4, 8, 16]),
        ratio in prop::sample::select(vec![1usize, 2, 4]),
        seed in any::<u64>(),
    ) {
        let m = model(seed, 2, 2, CacheDtype::F16, num_tokens);
        let large = small * ratio;
        let a = fast(&m, Physical::plain(small), 0, num_tokens, seed);
        let b = fast(&m, Physical::plain(large), 0, num_tokens, seed ^ 1);
        prop_assert_eq!(b.len(), num_tokens.div_ceil(large));
        for (q, want) in b.iter().enumerate() {
            let got = a[q * ratio..((q + 1) * ratio).min(a.len())]
                .iter()
                .fold(0u64, |s, x| s.wrapping_add(*x));
            prop_assert_eq!(got, *want);
        }
    }

    #[test]
    fn swapping_two_tokens_changes_it(
        num_tokens in 2..40usize,
        a in 0..40usize,
        b in 0..40usize,
        seed in any::<u64>(),
    ) {
        let (a, b) = (a % num_tokens, b % num_tokens);
        prop_assume!(a != b);
        let m = model(seed, 2, 2, CacheDtype::Bf16, num_tokens);
        let before = fast(&m, Physical::plain(4), 0, num_tokens, seed);
        let mut swapped = m.clone();
        for l in &mut swapped.layers {
            let rb = l.row_bytes() * l.heads;
            for buf in [&mut l.k, &mut l.v] {
                let row_a = buf[a * rb..(a + 1) * rb].to_vec();
                let row_b = buf[b * rb..(b + 1) * rb].to_vec();
                buf[a * rb..(a + 1) * rb].copy_from_slice(&row_b);
                buf[b * rb..(b + 1) * rb].copy_from_slice(&row_a);
            }
        }
        prop_assert_ne!(before, fast(&swapped, Physical::plain(4), 0, num_tokens, seed));
    }

    #[test]
    fn swapping_two_heads_or_layers_changes_it(
        num_tokens in 1..30usize,
        swap_layers in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let m = model(seed, 3, 4, CacheDtype::F32, num_tokens);
        let before = fast(&m, Physical::plain(8), 0, num_tokens, seed);
        let mut swapped = m.clone();
        if swap_layers {
            let (k0, v0) = (m.layers[0].k.clone(), m.layers[0].v.clone());
            swapped.layers[0].k = m.layers[2].k.clone();
            swapped.layers[0].v = m.layers[2].v.clone();
            swapped.layers[2].k = k0;
            swapped.layers[2].v = v0;
        } else {
            let l = &mut swapped.layers[1];
            let rb = l.row_bytes();
            for t in 0..num_tokens {
                for buf in [&mut l.k, &mut l.v] {
                    let base = t * 4 * rb;
                    let h1 = buf[base + rb..base + 2 * rb].to_vec();
                    let h3 = buf[base + 3 * rb..base + 4 * rb].to_vec();
                    buf[base + rb..base + 2 * rb].copy_from_slice(&h3);
                    buf[base + 3 * rb..base + 4 * rb].copy_from_slice(&h1);
                }
            }
        }
        prop_assert_ne!(before, fast(&swapped, Physical::plain(8), 0, num_tokens, seed));
    }

    /// Odd weights and factors: any change to one piece changes its block's value, and only it.
    #[test]
    fn a_single_piece_change_always_changes_its_block(
        num_tokens in 1..40usize,
        t in 0..40usize,
        layer in 0..3usize,
        head in 0..2usize,
        piece in 0..2usize,
        delta in 1..u64::MAX,
        in_v in any::<bool>(),
        seed in any::<u64>(),
    ) {
        let t = t % num_tokens;
        let m = model(seed, 3, 2, CacheDtype::F32, num_tokens);
        let before = fast(&m, Physical::plain(4), 0, num_tokens, seed);
        let mut changed = m.clone();
        let l = &mut changed.layers[layer];
        let rb = l.row_bytes(); // 32 bytes: 4 pieces per row
        let off = (t * 2 + head) * rb + 8 * piece;
        let buf = if in_v { &mut l.v } else { &mut l.k };
        let x = u64::from_le_bytes(buf[off..off + 8].try_into().unwrap()).wrapping_add(delta);
        buf[off..off + 8].copy_from_slice(&x.to_le_bytes());
        let after = fast(&changed, Physical::plain(4), 0, num_tokens, seed);
        for (pos, (x, y)) in before.iter().zip(&after).enumerate() {
            prop_assert_eq!(x != y, pos == t / 4, "position {}", pos);
        }
    }

    #[test]
    fn slots_past_num_tokens_are_ignored(
        num_tokens in 1..40usize,
        seed in any::<u64>(),
    ) {
        let bs = 8;
        let m = model(seed, 2, 2, CacheDtype::Bf16, num_tokens.div_ceil(bs) * bs);
        let cluster = Cluster::new(&mut Rng(seed), &m, ClusterConfig::new(1, 1, bs, m.tokens));
        let req = cluster.request(0, num_tokens);
        let before = checks(&cluster.merged(Role::Consumer, &req)).checks.clone();
        let mut scribbled = cluster.clone();
        let table = scribbled.table.clone();
        let mem = &mut scribbled.workers[0].2;
        for t in num_tokens..m.tokens {
            for i in 0..2 {
                for h in 0..2 {
                    for b in mem.k_row_mut(i, &table, t, h) {
                        *b ^= 0x5a;
                    }
                }
            }
        }
        let after = checks(&scribbled.merged(Role::Consumer, &req)).checks.clone();
        prop_assert_eq!(before, after);
    }

    #[test]
    fn layout_does_not_matter(
        num_tokens in 1..70usize,
        first in 0..70usize,
        kbs_div in prop::sample::select(vec![1usize, 2, 4, 16]),
        head_major in any::<bool>(),
        head_dim in prop::sample::select(vec![8usize, 64]),
        seed in any::<u64>(),
    ) {
        let first = first % num_tokens;
        let names = Model::names(2);
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let m = Model::random(&mut Rng(seed), &refs, 3, head_dim, CacheDtype::F16, num_tokens);
        let plain = fast(&m, Physical::plain(16), first, num_tokens, seed);
        let other = Physical {
            block_size: 16,
            kernel_block_size: 16 / kbs_div,
            order: if head_major { LayoutOrder::HeadMajor } else { LayoutOrder::TokenMajor },
        };
        prop_assert_eq!(plain, fast(&m, other, first, num_tokens, seed ^ 7));
    }
}
