//! The CPU inner loop: the slice checksums of every KV head of one layer over one block.
//!
//! Owns the arithmetic that turns bytes into `s = Σ x_j (2j + 1)`. Instead of one multiply per
//! piece it keeps, per head and per piece index `i` within a row, wrapping running sums over the
//! block's tokens (`u` counts them from 0, `W_u[i] = K_u[i] + V_u[i]`):
//! - `A[i] = Σ_u W_u[i]`, `V[i] = Σ_u V_u[i]`, `D[i] = Σ_u (n - u) W_u[i]` (D adds A after each
//!   token, so no multiply is needed),
//!
//! and applies the weights once per slice:
//! `s = (2 t0 P + 1) ΣA + 2P (n ΣA - ΣD) + 2R ΣV + 2 Σ i A[i]`
//! with `t0` the first token's position in the request, `P` pieces per token and `R = P / 2`
//! pieces per row. The loops are plain wrapping adds over `u64` lanes, which the compiler
//! vectorizes. Rows of 8, 16, 32 or 64 pieces (head_dim 64 or 128 in f32, bf16 or f16) keep the
//! sums in registers, one head at a time; other widths keep them in a scratch buffer and visit
//! rows in memory order. A row that is not whole pieces (`row_bytes % 8 == 4`) takes a slower
//! path that joins the token's K and V rows first, so a piece may straddle them as the
//! definition says.
//!
//! Invariants: callers have validated the job (block and slots in range, arrays long enough,
//! `2 * row_bytes` a multiple of 8), so indexing here cannot fail; tokens of each head are visited
//! in increasing position order, whatever the layout, which `D` relies on.

use tandem_kv_cache::{LayerKv, LayoutOrder};

use crate::definition::PIECE_BYTES;

/// Accumulators reused across blocks and layers, so the loop does not allocate.
#[derive(Debug, Default)]
pub(crate) struct Scratch {
    acc: Vec<u64>,
    row: Vec<u8>,
}

/// The slice checksum `s` of every head of `kv` over `n` tokens of cache block `block_id`,
/// starting at slot `first_slot`, the first of which is at position `t0` in the request.
/// Writes `s` of local head `h` to `out[h]`.
pub(crate) fn block_slice_sums(
    kv: &LayerKv<'_>,
    block_id: usize,
    first_slot: usize,
    n: usize,
    t0: u64,
    scratch: &mut Scratch,
    out: &mut [u64],
) {
    let heads = kv.layout.num_kv_heads;
    let rb = kv.layout.row_bytes();
    let pieces = (2 * rb / PIECE_BYTES) as u64;
    let whole_rows = rb.is_multiple_of(PIECE_BYTES);
    // Accumulator width per head: a row's pieces, or a token's when rows are joined.
    let width = if whole_rows {
        rb / PIECE_BYTES
    } else {
        2 * rb / PIECE_BYTES
    };
    if whole_rows {
        let fixed: Option<FixedWidth> = match width {
            8 => Some(head_sum_fixed::<8>),
            16 => Some(head_sum_fixed::<16>),
            32 => Some(head_sum_fixed::<32>),
            64 => Some(head_sum_fixed::<64>),
            _ => None,
        };
        if let Some(f) = fixed {
            for (h, s) in out.iter_mut().enumerate().take(heads) {
                *s = f(kv, block_id, first_slot, n, h, t0);
            }
            return;
        }
    }
    scratch.acc.clear();
    scratch.acc.resize(3 * heads * width, 0);
    let (a_all, rest) = scratch.acc.split_at_mut(heads * width);
    let (v_all, d_all) = rest.split_at_mut(heads * width);

    if whole_rows {
        walk_rows(kv, block_id, first_slot, n, |h, k, v| {
            let r = h * width..(h + 1) * width;
            accumulate_rows(
                k,
                v,
                &mut a_all[r.clone()],
                &mut v_all[r.clone()],
                &mut d_all[r],
            );
        });
    } else {
        let row = &mut scratch.row;
        row.clear();
        row.resize(2 * rb, 0);
        walk_rows(kv, block_id, first_slot, n, |h, k, v| {
            row[..rb].copy_from_slice(k);
            row[rb..].copy_from_slice(v);
            let r = h * width..(h + 1) * width;
            accumulate_token(row, &mut a_all[r.clone()], &mut d_all[r]);
        });
    }

    let n = n as u64;
    for (h, s) in out.iter_mut().enumerate().take(heads) {
        let r = h * width..(h + 1) * width;
        let v_term = if whole_rows {
            // V pieces of a token come R = width pieces after its K pieces.
            let v_tot = v_all[r.clone()]
                .iter()
                .fold(0u64, |acc, &x| acc.wrapping_add(x));
            2u64.wrapping_mul(width as u64).wrapping_mul(v_tot)
        } else {
            0
        };
        *s = finalize(&a_all[r.clone()], &d_all[r], t0, n, pieces).wrapping_add(v_term);
    }
}

type FixedWidth = fn(&LayerKv<'_>, usize, usize, usize, usize, u64) -> u64;

/// The slice checksum of one head whose rows are `W` whole pieces: the common head sizes, with
/// the accumulators in registers over the block's tokens.
fn head_sum_fixed<const W: usize>(
    kv: &LayerKv<'_>,
    block_id: usize,
    first_slot: usize,
    n: usize,
    h: usize,
    t0: u64,
) -> u64 {
    let mut a = [0u64; W];
    let mut vs = [0u64; W];
    let mut d = [0u64; W];
    walk_head(kv, block_id, first_slot, n, h, |k, v| {
        let k = &k[..W * PIECE_BYTES];
        let v = &v[..W * PIECE_BYTES];
        for i in 0..W {
            let xk = u64::from_le_bytes(k[8 * i..8 * i + 8].try_into().unwrap());
            let xv = u64::from_le_bytes(v[8 * i..8 * i + 8].try_into().unwrap());
            a[i] = a[i].wrapping_add(xk.wrapping_add(xv));
            vs[i] = vs[i].wrapping_add(xv);
            d[i] = d[i].wrapping_add(a[i]);
        }
    });
    let v_tot = vs.iter().fold(0u64, |acc, &x| acc.wrapping_add(x));
    finalize(&a, &d, t0, n as u64, 2 * W as u64)
        .wrapping_add(2u64.wrapping_mul(W as u64).wrapping_mul(v_tot))
}

/// `(2 t0 P + 1) ΣA + 2P (n ΣA - ΣD) + 2 Σ i A[i]`, all wrapping.
#[inline]
fn finalize(a: &[u64], d: &[u64], t0: u64, n: u64, pieces: u64) -> u64 {
    let mut a_tot = 0u64;
    let mut d_tot = 0u64;
    let mut ia = 0u64;
    for (i, (&ai, &di)) in a.iter().zip(d).enumerate() {
        a_tot = a_tot.wrapping_add(ai);
        d_tot = d_tot.wrapping_add(di);
        ia = ia.wrapping_add((i as u64).wrapping_mul(ai));
    }
    let first_weight = t0.wrapping_mul(2).wrapping_mul(pieces).wrapping_add(1);
    let local = n.wrapping_mul(a_tot).wrapping_sub(d_tot);
    first_weight
        .wrapping_mul(a_tot)
        .wrapping_add(pieces.wrapping_mul(2).wrapping_mul(local))
        .wrapping_add(ia.wrapping_mul(2))
}

/// One token of one head, K and V rows of whole pieces: `A += K + V`, `V += V`, `D += A`.
#[inline(always)]
fn accumulate_rows(k: &[u8], v: &[u8], a: &mut [u64], vs: &mut [u64], d: &mut [u64]) {
    let w = a.len();
    let k = &k[..w * PIECE_BYTES];
    let v = &v[..w * PIECE_BYTES];
    let vs = &mut vs[..w];
    let d = &mut d[..w];
    for ((((kc, vc), a), vs), d) in k
        .chunks_exact(PIECE_BYTES)
        .zip(v.chunks_exact(PIECE_BYTES))
        .zip(a.iter_mut())
        .zip(vs.iter_mut())
        .zip(d.iter_mut())
    {
        let xk = u64::from_le_bytes(kc.try_into().unwrap());
        let xv = u64::from_le_bytes(vc.try_into().unwrap());
        let na = a.wrapping_add(xk.wrapping_add(xv));
        *a = na;
        *vs = vs.wrapping_add(xv);
        *d = d.wrapping_add(na);
    }
}

/// One token of one head as one joined row of pieces: `A += x`, `D += A`.
#[inline(always)]
fn accumulate_token(row: &[u8], a: &mut [u64], d: &mut [u64]) {
    let w = a.len();
    let d = &mut d[..w];
    for ((c, a), d) in row
        .chunks_exact(PIECE_BYTES)
        .zip(a.iter_mut())
        .zip(d.iter_mut())
    {
        let na = a.wrapping_add(u64::from_le_bytes(c.try_into().unwrap()));
        *a = na;
        *d = d.wrapping_add(na);
    }
}

/// Calls `f(k_row, v_row)` for head `h` and every slot in `[first_slot, first_slot + n)` of
/// `block_id`, in increasing order.
#[inline(always)]
fn walk_head<'a>(
    kv: &LayerKv<'a>,
    block_id: usize,
    first_slot: usize,
    n: usize,
    h: usize,
    mut f: impl FnMut(&'a [u8], &'a [u8]),
) {
    let lay = &kv.layout;
    // Only this block's bytes are borrowed (the job's blocks are owned by its request).
    let (k, v) = kv
        .block(block_id)
        .expect("blocks were checked against the layout");
    let rb = lay.row_bytes();
    let heads = lay.num_kv_heads;
    let kbs = lay.kernel_block_size;
    let kernel_block_bytes = kbs * heads * rb;
    let (head_offset, stride) = match lay.order {
        LayoutOrder::TokenMajor => (h * rb, heads * rb),
        LayoutOrder::HeadMajor => (h * kbs * rb, rb),
    };
    let end = first_slot + n;
    let mut slot = first_slot;
    while slot < end {
        let kernel_block = slot / kbs;
        let t_first = slot % kbs;
        let seg = (end - slot).min(kbs - t_first);
        let first = kernel_block * kernel_block_bytes + head_offset + t_first * stride;
        for i in 0..seg {
            let o = first + i * stride;
            f(&k[o..o + rb], &v[o..o + rb]);
        }
        slot += seg;
    }
}

/// Calls `f(head, k_row, v_row)` for every head and slot in `[first_slot, first_slot + n)` of
/// `block_id`, in memory order, each head's tokens in increasing order.
#[inline(always)]
fn walk_rows<'a>(
    kv: &LayerKv<'a>,
    block_id: usize,
    first_slot: usize,
    n: usize,
    mut f: impl FnMut(usize, &'a [u8], &'a [u8]),
) {
    let lay = &kv.layout;
    // Only this block's bytes are borrowed (the job's blocks are owned by its request).
    let (k, v) = kv
        .block(block_id)
        .expect("blocks were checked against the layout");
    let rb = lay.row_bytes();
    let heads = lay.num_kv_heads;
    let kbs = lay.kernel_block_size;
    let kernel_block_bytes = kbs * heads * rb;
    let end = first_slot + n;
    let mut slot = first_slot;
    while slot < end {
        let kernel_block = slot / kbs;
        let t_first = slot % kbs;
        let seg = (end - slot).min(kbs - t_first);
        let base = kernel_block * kernel_block_bytes;
        match lay.order {
            LayoutOrder::TokenMajor => {
                for t in t_first..t_first + seg {
                    let row0 = base + t * heads * rb;
                    for h in 0..heads {
                        let o = row0 + h * rb;
                        f(h, &k[o..o + rb], &v[o..o + rb]);
                    }
                }
            }
            LayoutOrder::HeadMajor => {
                for h in 0..heads {
                    let head0 = base + h * kbs * rb;
                    for t in t_first..t_first + seg {
                        let o = head0 + t * rb;
                        f(h, &k[o..o + rb], &v[o..o + rb]);
                    }
                }
            }
        }
        slot += seg;
    }
}
