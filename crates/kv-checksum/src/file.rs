//! The backend of `tandem kv-checksum`: the checksums of KV held in a safetensors file, so anyone
//! can check the definition from outside.
//!
//! Input: tensors `layers.{L}.k` and `layers.{L}.v`, each `[tokens, kv_heads, head_dim]` in f32,
//! f16 or bf16, holding the request's tokens `[T, T + tokens)`; `L` is the layer number and heads
//! are global (head `h` of the tensor is head `h` of the model). K and V of a layer share shape
//! and dtype; layers may differ. Any other tensor name is an error.
//!
//! Output: `{"block_size": B, "first_block": T / B, "checksums": ["0x…", …]}` with one value per
//! block position `T / B ..= (N - 1) / B` (`N`, the request's token count, defaults to
//! `T + tokens`; tokens at or after `N` are ignored). Each value is `0x` and 16 lower-case hex
//! digits. If `T` is not a multiple of `B`, the first block covers only its tokens from `T` (so
//! it is not the value of the whole block). Invariant: the values are exactly those a worker
//! holding the same KV in a paged cache computes for the same positions.

use std::path::Path;

use safetensors::{Dtype, SafeTensors};
use tandem_kv_cache::{BlockLayout, CacheDtype, LayerKv};

use crate::backend::{BlockJob, ChecksumBackend, CpuBackend, GroupJob, LayerJob};
use crate::error::KvChecksumError;

/// The checksums of a file's KV, by block position.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FileChecksums {
    pub block_size: usize,
    /// Position of `checksums[0]`: `T / B`.
    pub first_block: usize,
    pub checksums: Vec<u64>,
}

impl FileChecksums {
    /// The CLI's JSON: `{"block_size", "first_block", "checksums": ["0x%016x", …]}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "block_size": self.block_size,
            "first_block": self.first_block,
            "checksums": self
                .checksums
                .iter()
                .map(|c| format!("0x{c:016x}"))
                .collect::<Vec<_>>(),
        })
    }
}

/// Reads a safetensors file and returns the CLI's JSON (module docs).
pub fn checksum_safetensors_file(
    path: &Path,
    block_size: usize,
    start_token: usize,
    num_tokens: Option<usize>,
) -> Result<serde_json::Value, KvChecksumError> {
    let bytes = std::fs::read(path).map_err(|source| KvChecksumError::Io {
        path: path.to_owned(),
        source,
    })?;
    Ok(checksum_safetensors(&bytes, block_size, start_token, num_tokens)?.to_json())
}

struct FileLayer<'a> {
    number: u32,
    k: Option<(CacheDtype, [usize; 3], &'a [u8])>,
    v: Option<(CacheDtype, [usize; 3], &'a [u8])>,
}

/// The checksums of a serialized safetensors buffer (module docs).
pub fn checksum_safetensors(
    bytes: &[u8],
    block_size: usize,
    start_token: usize,
    num_tokens: Option<usize>,
) -> Result<FileChecksums, KvChecksumError> {
    let invalid = |m: String| KvChecksumError::InvalidInput(m);
    if block_size == 0 {
        return Err(invalid("block size must be positive".into()));
    }
    let st = SafeTensors::deserialize(bytes).map_err(|e| invalid(e.to_string()))?;
    let mut layers: Vec<FileLayer<'_>> = Vec::new();
    for (name, view) in st.tensors() {
        let (number, part) = parse_name(&name).ok_or_else(|| {
            invalid(format!(
                "unexpected tensor {name:?}; expected layers.{{L}}.k or .v"
            ))
        })?;
        let dtype = match view.dtype() {
            Dtype::F32 => CacheDtype::F32,
            Dtype::F16 => CacheDtype::F16,
            Dtype::BF16 => CacheDtype::Bf16,
            other => {
                return Err(invalid(format!(
                    "{name}: dtype {other:?} is not f32, f16 or bf16"
                )))
            }
        };
        let shape: [usize; 3] = view.shape().try_into().map_err(|_| {
            invalid(format!(
                "{name}: shape {:?} is not [tokens, kv_heads, head_dim]",
                view.shape()
            ))
        })?;
        let idx = match layers.iter().position(|l| l.number == number) {
            Some(i) => i,
            None => {
                layers.push(FileLayer {
                    number,
                    k: None,
                    v: None,
                });
                layers.len() - 1
            }
        };
        let slot = if part == 'k' {
            &mut layers[idx].k
        } else {
            &mut layers[idx].v
        };
        *slot = Some((dtype, shape, view.data()));
    }
    layers.sort_by_key(|l| l.number);

    let mut tokens_given: Option<usize> = None;
    let mut views = Vec::with_capacity(layers.len());
    let mut jobs = Vec::with_capacity(layers.len());
    for l in &layers {
        let (Some(k), Some(v)) = (l.k, l.v) else {
            return Err(invalid(format!(
                "layer {} lacks its k or v tensor",
                l.number
            )));
        };
        if k.0 != v.0 || k.1 != v.1 {
            return Err(invalid(format!(
                "layer {}: k and v differ in dtype or shape",
                l.number
            )));
        }
        let (dtype, [tokens, heads, head_dim]) = (k.0, k.1);
        if *tokens_given.get_or_insert(tokens) != tokens {
            return Err(invalid(format!(
                "layer {} holds {tokens} tokens, another layer {}",
                l.number,
                tokens_given.unwrap_or(0)
            )));
        }
        if heads as u64 > crate::MAX_KV_HEADS_PER_LAYER {
            return Err(invalid(format!(
                "layer {}: more than 2^16 KV heads",
                l.number
            )));
        }
        if crate::definition::pieces_per_token(head_dim, dtype).is_none() {
            return Err(invalid(format!(
                "layer {}: a token's K and V rows of one head ({} bytes) are not whole 8-byte pieces",
                l.number,
                2 * head_dim * dtype.size()
            )));
        }
        if tokens == 0 || heads == 0 {
            continue; // nothing to checksum in this layer
        }
        // The whole tensor as one token-major cache block of `tokens` tokens.
        let layout = BlockLayout::token_major(1, tokens, heads, head_dim, dtype);
        let view = LayerKv::new(k.2, v.2, layout)
            .map_err(|e| invalid(format!("layer {}: {e}", l.number)))?;
        jobs.push(LayerJob {
            source_index: views.len(),
            layout,
            layer_number: l.number,
            head_base: 0,
            column: 0,
        });
        views.push(view);
    }

    let given = tokens_given.unwrap_or(0);
    let available = start_token
        .checked_add(given)
        .ok_or_else(|| invalid("start token + tokens overflows".into()))?;
    let n = num_tokens.unwrap_or(available);
    if n > available {
        return Err(invalid(format!(
            "num_tokens {n} exceeds the {given} tokens given from token {start_token}"
        )));
    }
    let first_block = start_token / block_size;
    let blocks: Vec<BlockJob> = if n > start_token {
        (first_block..n.div_ceil(block_size))
            .map(|pos| {
                let token_begin = pos.saturating_mul(block_size).max(start_token);
                BlockJob {
                    block_id: 0,
                    first_slot: token_begin - start_token,
                    token_begin,
                    token_end: (pos + 1).saturating_mul(block_size).min(n),
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let mut checksums = vec![0u64; blocks.len()];
    CpuBackend::new(&views).checksum(
        &GroupJob {
            layers: &jobs,
            blocks: &blocks,
            columns: 1,
        },
        &mut checksums,
    )?;
    Ok(FileChecksums {
        block_size,
        first_block,
        checksums,
    })
}

/// `layers.{L}.k` -> `(L, 'k')`, with `L` in canonical decimal.
fn parse_name(name: &str) -> Option<(u32, char)> {
    let rest = name.strip_prefix("layers.")?;
    let (num, part) = rest.split_once('.')?;
    let number: u32 = num.parse().ok()?;
    if number.to_string() != num {
        return None;
    }
    match part {
        "k" => Some((number, 'k')),
        "v" => Some((number, 'v')),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::parse_name;

    #[test]
    fn tensor_names() {
        assert_eq!(parse_name("layers.12.k"), Some((12, 'k')));
        assert_eq!(parse_name("layers.0.v"), Some((0, 'v')));
        assert_eq!(parse_name("layers.01.v"), None);
        assert_eq!(parse_name("layers.1.q"), None);
        assert_eq!(parse_name("model.layers.1.k"), None);
    }
}
