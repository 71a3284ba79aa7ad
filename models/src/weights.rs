//! Weight matrices as the forward pass holds them, and how they are built at load time.
//!
//! A `HostMatrix` is a loaded `[rows, cols]` matrix (rows = output features) in the file's
//! storage type; row operations (permute, concatenate) work on it before it becomes a `Linear`
//! in the chosen [`WeightMode`]:
//! - `F32`: dequantized to f32 (the accuracy mode);
//! - `Q8_0` (what `--dtype auto` picks on AVX512-VNNI CPUs): re-quantized to Q8_0 for candle's
//!   AVX512-VNNI tiled kernels, which need `cols % 256 == 0` (SmolLM2's 576 is not): the matrix is
//!   zero-padded to the next multiple of 256 (~10x faster than candle's untiled Q8_0 kernel for
//!   batched rows, see BENCHMARKS.md). Those kernels quantize activations per 256 values, which
//!   outlier channels make coarse; so the input dimension is rotated by a fixed orthogonal `R`
//!   (random signs, then a Hadamard transform, per 256-block: [`crate::ops::rotate_blocks`]): the
//!   weights are stored as `W R`, inputs are rotated likewise, `(x R)(W R)ᵀ = x Wᵀ`. The rotation
//!   spreads outliers over the block. Teacher-forced over the reference prompts
//!   (models/tests/weight_modes.rs) it cut the mean KL divergence from the f32 logits from 0.020 to
//!   0.003 and raised top-1 agreement from 354 to 370 of 384 steps. Free-running greedy text still
//!   differs from f32 wherever a near-tie flips: on "What is the capital of France?" the
//!   reference's first token wins by 0.08 logits ("The" over "L"), and rotated Q8_0 picks "L" (as
//!   native Q4_1 did through candle's kernel, which quantized activations to 8 bits; unrotated Q8_0
//!   happened to keep "The"); prefill plus step-by-step decode equals one teacher-forced forward
//!   exactly, so that is a flip, not a decode bug;
//! - `Native`: kept in the file's quantized type: the smallest. Q4_1 (the default file's type)
//!   is multiplied by our own batched kernel (`q4_1.rs`): f32 activations, each block
//!   dequantized once per pass and applied to up to 8 input rows, so rows share the weight
//!   reads and the dequantization. Without activation quantization it is closer to f32 than
//!   Q8_0 (mean KL 0.0005, 376–380/384 top-1, same test). Q8_0 matrices (SmolLM2's tied
//!   embedding, its lm_head) take the `Q8_0` mode's padded, rotated form: as stored, 576 wide,
//!   candle runs them untiled, and the lm_head alone held native's batch 16 ÷ batch 1 at 3.1x
//!   (4.1x with it padded, BENCHMARKS.md). Other quantized types go through candle's `QMatMul`: candle 0.11.1 has tiled x86 kernels
//!   only for Q4_K, Q6_K and Q8_0 and only for `cols % 256 == 0`; everything else runs a per-row
//!   dot-product kernel that does not batch (measured for Q4_1 before our kernel: batch 16 ÷
//!   batch 1 ≈ 1.1x). Whether a Q4_K/Q8_0 file with 256-multiple widths batches in this mode
//!   has not been measured.
//! - `NativeI8`: the file's Q4_1 and Q8_0 blocks regrouped 16 rows at a time
//!   (`quant/grouped`), each matmul's inputs quantized to 8 bits per 32 values
//!   (`quant/q8_rows.rs`), as llama.cpp multiplies Q4_1: integer dot products of four values
//!   for 16 (AVX-512) or 8 (AVX2) weight rows per instruction, AMX tiles where the CPU has
//!   them; the same bits on every CPU and kernel (each output sums its blocks in one fixed
//!   order). The activation rounding moves it a little further from f32 than `Native`
//!   (models/tests/weight_modes.rs prints its KL).
//! - `NativeAmx`: `NativeI8`, refused at load where the AMX kernels do not run (Sapphire
//!   Rapids and later, with Linux's grant of the tile state): for a user who wants to know
//!   that the tiles run.
//!
//! Invariant: a `Linear` computes every input row independently of the other rows (padding,
//! rotation and activation quantization are per row; the Q4_1 kernel sums every output in one
//! fixed order whatever the tile), so a token's output does not depend on what else is in the
//! batch.

use std::borrow::Cow;
use std::sync::Arc;

use candle_core::quantized::{GgmlDType, QMatMul, QStorage, QTensor};
use candle_core::{Device, Module, Tensor};

use crate::cpu::Isa;
use crate::error::ModelError;
use crate::ops::{rotate_blocks, unrotate_blocks, HADAMARD_BLOCK};
use crate::quant::{
    amx_available, GroupedQ4_1Matrix, GroupedQ8_0Matrix, Q4_1Matrix, Q8Rows, Q8_0Matrix,
};

/// How weights are held in memory. See the module docs; `--dtype auto` picks one per CPU and
/// file with [`WeightMode::auto_for`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum WeightMode {
    /// Everything dequantized to f32: the accuracy mode.
    F32,
    /// Matrices re-quantized to Q8_0 (padded for the VNNI kernels): what `auto` picks where
    /// candle's tiled Q8_0 kernels run (AVX512-VNNI), and for files other than Q4_1.
    Q8_0,
    /// Matrices kept in the file's quantized type; f32 for unquantized (safetensors) files.
    /// Q4_1 (the default model) runs our batched kernel with f32 activations; Q8_0 matrices
    /// take the `Q8_0` mode's padded form (module docs): aggregate decode at 16 streams is 4.1x
    /// batch 1 (1.1x with candle's kernels), prefill ~660 tok/s (BENCHMARKS.md). Other quantized
    /// types run candle's `QMatMul` as stored.
    Native,
    /// The file's Q4_1 and Q8_0 matrices regrouped for integer kernels, activations quantized
    /// to 8 bits per 32 values before each of their matmuls, as llama.cpp multiplies Q4_1; on
    /// AMX tiles where the CPU has them (module docs). A little further from f32 than
    /// `Native`; other matrices as in `Native`.
    NativeI8,
    /// `NativeI8` where AMX-INT8 runs, refused elsewhere (module docs).
    NativeAmx,
    /// Matrices in bf16 in a GPU's memory (the GPU decoder, `--device cuda`); the CPU decoder
    /// refuses it.
    Bf16,
}

impl WeightMode {
    /// Parses `f32`, `q8_0`/`q8`, `native`/`gguf`, `native-i8`, `native-amx`, `bf16`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Some(WeightMode::F32),
            "q8_0" | "q8" => Some(WeightMode::Q8_0),
            "native" | "gguf" => Some(WeightMode::Native),
            "native-i8" | "native_i8" => Some(WeightMode::NativeI8),
            "native-amx" | "native_amx" => Some(WeightMode::NativeAmx),
            "bf16" | "bfloat16" => Some(WeightMode::Bf16),
            _ => None,
        }
    }
    /// The mode `--dtype auto` runs on this CPU for a model whose layer matrices are all Q4_1
    /// (`layers_q4_1`) or not:
    /// - `NativeI8` for Q4_1 matrices on AVX2 or better (AMX tiles inside it where the CPU has
    ///   them): on a Xeon with AVX512-VNNI 1.2–1.3x `Q8_0`'s prefill, 1.6–2.0x its batch-1
    ///   decode and 1.3x its batch-16 decode; on an AVX2-only CPU `Q8_0` runs candle's untiled
    ///   kernel, a third as fast (BENCHMARKS.md);
    /// - else `Q8_0` (other files, and the portable variant, were not measured against it).
    ///
    /// `TANDEM_CPU_ISA=portable` therefore makes `auto` choose `Q8_0`.
    pub fn auto_for(layers_q4_1: bool) -> WeightMode {
        if layers_q4_1 && Isa::active() >= Isa::Avx2 {
            WeightMode::NativeI8
        } else {
            WeightMode::Q8_0
        }
    }

    pub const fn name(self) -> &'static str {
        match self {
            WeightMode::F32 => "f32",
            WeightMode::Q8_0 => "q8_0",
            WeightMode::Native => "native",
            WeightMode::NativeI8 => "native-i8",
            WeightMode::NativeAmx => "native-amx",
            WeightMode::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for WeightMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The storage of a [`HostMatrix`].
#[derive(Debug, Clone)]
pub(crate) enum MatData {
    F32(Vec<f32>),
    /// Whole quantized blocks, row after row (`cols` is a multiple of the block size).
    Quant {
        dtype: GgmlDType,
        bytes: Vec<u8>,
    },
}

/// A `[rows, cols]` matrix loaded from a file, row-major.
#[derive(Debug, Clone)]
pub(crate) struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: MatData,
}

impl HostMatrix {
    /// Whether the matrix is stored as Q4_1 (what our integer kernel multiplies).
    pub fn is_q4_1(&self) -> bool {
        matches!(
            self.data,
            MatData::Quant {
                dtype: GgmlDType::Q4_1,
                ..
            }
        )
    }

    pub fn from_f32(rows: usize, cols: usize, data: Vec<f32>) -> Result<Self, ModelError> {
        if data.len() != rows * cols {
            return Err(ModelError::format(format!(
                "matrix [{rows}, {cols}] given {} values",
                data.len()
            )));
        }
        Ok(HostMatrix {
            rows,
            cols,
            data: MatData::F32(data),
        })
    }

    /// From a 2-D quantized tensor (`[rows, cols]` in candle's order).
    pub fn from_qtensor(t: &QTensor) -> Result<Self, ModelError> {
        let (rows, cols) = t.shape().dims2()?;
        let data = match t.dtype() {
            GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16 => {
                MatData::F32(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
            }
            dtype => MatData::Quant {
                dtype,
                bytes: t.data()?.into_owned(),
            },
        };
        Ok(HostMatrix { rows, cols, data })
    }

    fn row_bytes(&self) -> usize {
        match &self.data {
            MatData::F32(_) => self.cols * 4,
            MatData::Quant { dtype, .. } => self.cols / dtype.block_size() * dtype.type_size(),
        }
    }

    /// The values as f32 (dequantizing if needed).
    pub fn to_f32(&self) -> Result<Vec<f32>, ModelError> {
        match &self.data {
            MatData::F32(v) => Ok(v.clone()),
            MatData::Quant { dtype, bytes } => {
                let q = quant_tensor(*dtype, bytes, self.rows, self.cols)?;
                Ok(q.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
            }
        }
    }

    /// Row `r` of the result is row `src[r]` of `self`.
    pub fn permute_rows(&self, src: &[usize]) -> Self {
        debug_assert_eq!(src.len(), self.rows);
        let data = match &self.data {
            MatData::F32(v) => MatData::F32(
                src.iter()
                    .flat_map(|&r| v[r * self.cols..(r + 1) * self.cols].iter().copied())
                    .collect(),
            ),
            MatData::Quant { dtype, bytes } => {
                let rb = self.row_bytes();
                MatData::Quant {
                    dtype: *dtype,
                    bytes: src
                        .iter()
                        .flat_map(|&r| bytes[r * rb..(r + 1) * rb].iter().copied())
                        .collect(),
                }
            }
        };
        HostMatrix {
            rows: self.rows,
            cols: self.cols,
            data,
        }
    }

    /// Rows `rows` of the matrix (a tensor-parallel slice of the output features).
    pub fn slice_rows(&self, rows: std::ops::Range<usize>) -> Self {
        debug_assert!(rows.end <= self.rows);
        let data = match &self.data {
            MatData::F32(v) => {
                MatData::F32(v[rows.start * self.cols..rows.end * self.cols].to_vec())
            }
            MatData::Quant { dtype, bytes } => {
                let rb = self.row_bytes();
                MatData::Quant {
                    dtype: *dtype,
                    bytes: bytes[rows.start * rb..rows.end * rb].to_vec(),
                }
            }
        };
        HostMatrix {
            rows: rows.len(),
            cols: self.cols,
            data,
        }
    }

    /// Columns `cols` of the matrix (a tensor-parallel slice of the input features). Quantized
    /// blocks are kept when the slice starts and ends on block boundaries; otherwise the result
    /// is f32.
    pub fn slice_cols(&self, cols: std::ops::Range<usize>) -> Result<Self, ModelError> {
        debug_assert!(cols.end <= self.cols);
        let width = cols.len();
        let data = match &self.data {
            MatData::Quant { dtype, bytes }
                if cols.start.is_multiple_of(dtype.block_size())
                    && width.is_multiple_of(dtype.block_size()) =>
            {
                let (rb, bs, ts) = (self.row_bytes(), dtype.block_size(), dtype.type_size());
                let (from, len) = (cols.start / bs * ts, width / bs * ts);
                MatData::Quant {
                    dtype: *dtype,
                    bytes: bytes
                        .chunks_exact(rb)
                        .flat_map(|row| row[from..from + len].iter().copied())
                        .collect(),
                }
            }
            _ => {
                let v = self.to_f32()?;
                MatData::F32(
                    v.chunks_exact(self.cols)
                        .flat_map(|row| row[cols.clone()].iter().copied())
                        .collect(),
                )
            }
        };
        Ok(HostMatrix {
            rows: self.rows,
            cols: width,
            data,
        })
    }

    /// Stacks matrices with equal `cols` row-wise. Quantized rows are kept when all parts share
    /// one quantized type; otherwise the result is f32.
    pub fn concat_rows(parts: &[HostMatrix]) -> Result<Self, ModelError> {
        let cols = parts[0].cols;
        if parts.iter().any(|p| p.cols != cols) {
            return Err(ModelError::format("concatenated matrices differ in width"));
        }
        let rows = parts.iter().map(|p| p.rows).sum();
        let same_quant = match &parts[0].data {
            MatData::Quant { dtype, .. } => parts
                .iter()
                .all(|p| matches!(&p.data, MatData::Quant { dtype: d, .. } if d == dtype))
                .then_some(*dtype),
            MatData::F32(_) => None,
        };
        let data = match same_quant {
            Some(dtype) => MatData::Quant {
                dtype,
                bytes: parts
                    .iter()
                    .flat_map(|p| match &p.data {
                        MatData::Quant { bytes, .. } => bytes.iter().copied(),
                        MatData::F32(_) => unreachable!("checked above"),
                    })
                    .collect(),
            },
            None => {
                let mut v = Vec::with_capacity(rows * cols);
                for p in parts {
                    v.extend(p.to_f32()?);
                }
                MatData::F32(v)
            }
        };
        Ok(HostMatrix { rows, cols, data })
    }

    /// Builds the forward-pass form of this matrix.
    pub fn into_linear(self, mode: WeightMode) -> Result<Linear, ModelError> {
        let (rows, cols) = (self.rows, self.cols);
        // `NativeI8` and `NativeAmx` differ from `Native` only in how Q4_1 and Q8_0 matrices
        // are held (grouped) and take their inputs (8 bits)
        let (mode, grouped) = match mode {
            WeightMode::NativeI8 => (WeightMode::Native, true),
            WeightMode::NativeAmx if !amx_available() => {
                return Err(ModelError::Unsupported(
                    "--dtype native-amx needs a CPU with AMX-INT8 (Intel Sapphire Rapids or \
                     later), the Linux tile-state grant, and Tandem's AVX-512 kernels (no \
                     TANDEM_CPU_ISA cap below avx512); use native-i8 or auto"
                        .into(),
                ))
            }
            WeightMode::NativeAmx => (WeightMode::Native, true),
            WeightMode::Bf16 => {
                return Err(ModelError::Unsupported(
                    "bf16 weights run on a GPU (--device cuda); on the CPU use f32, q8_0, \
                     native or native-i8"
                        .into(),
                ))
            }
            mode => (mode, false),
        };
        let weight = match (mode, self.data) {
            (WeightMode::F32, data) | (WeightMode::Native, data @ MatData::F32(_)) => {
                let v = match data {
                    MatData::F32(v) => v,
                    MatData::Quant { dtype, bytes } => quant_tensor(dtype, &bytes, rows, cols)?
                        .dequantize(&Device::Cpu)?
                        .flatten_all()?
                        .to_vec1()?,
                };
                Weight::F32(Tensor::from_vec(v, (rows, cols), &Device::Cpu)?)
            }
            (
                WeightMode::Native,
                MatData::Quant {
                    dtype: GgmlDType::Q4_1,
                    bytes,
                },
            ) if grouped => Weight::GroupedQ4_1(Arc::new(GroupedQ4_1Matrix::new(
                &Q4_1Matrix::new(rows, cols, bytes)?,
            ))),
            (
                WeightMode::Native,
                MatData::Quant {
                    dtype: GgmlDType::Q4_1,
                    bytes,
                },
            ) => Weight::Q4_1(Arc::new(Q4_1Matrix::new(rows, cols, bytes)?)),
            // With 8-bit inputs, Q8_0 matrices keep the file's blocks: the integer kernels need
            // no padding (and 8-bit inputs per 32 values do not need the rotation's help).
            (
                WeightMode::Native,
                MatData::Quant {
                    dtype: GgmlDType::Q8_0,
                    bytes,
                },
            ) if grouped => Weight::GroupedQ8_0(Arc::new(GroupedQ8_0Matrix::new(
                &Q8_0Matrix::new(rows, cols, bytes)?,
            ))),
            // Q8_0 matrices of a native file (SmolLM2's tied embedding / lm_head) take the Q8_0
            // mode's padded, rotated form: as stored (576 wide) candle runs them untiled.
            (WeightMode::Q8_0, data)
            | (
                WeightMode::Native,
                data @ MatData::Quant {
                    dtype: GgmlDType::Q8_0,
                    ..
                },
            ) => {
                let v = match data {
                    MatData::F32(v) => v,
                    MatData::Quant { dtype, bytes } => quant_tensor(dtype, &bytes, rows, cols)?
                        .dequantize(&Device::Cpu)?
                        .flatten_all()?
                        .to_vec1()?,
                };
                let padded = q8_padded_cols(rows, cols);
                let v = if padded == cols {
                    v
                } else {
                    let mut p = vec![0f32; rows * padded];
                    for (dst, src) in p.chunks_exact_mut(padded).zip(v.chunks_exact(cols)) {
                        dst[..cols].copy_from_slice(src);
                    }
                    p
                };
                // Rotate the input dimension (see the module docs) where the tiled kernels run.
                let rotate = padded.is_multiple_of(HADAMARD_BLOCK);
                let mut v = v;
                if rotate {
                    rotate_blocks(&mut v);
                }
                let t = Tensor::from_vec(v, (rows, padded), &Device::Cpu)?;
                Weight::Quant {
                    q: Arc::new(QTensor::quantize(&t, GgmlDType::Q8_0)?),
                    rotated: rotate,
                }
            }
            (WeightMode::Native, MatData::Quant { dtype, bytes }) => Weight::Quant {
                q: Arc::new(quant_tensor(dtype, &bytes, rows, cols)?),
                rotated: false,
            },
            (WeightMode::NativeI8 | WeightMode::NativeAmx | WeightMode::Bf16, _) => {
                unreachable!("handled above")
            }
        };
        Ok(Linear {
            weight,
            in_dim: cols,
            out_dim: rows,
        })
    }
}

/// The width a Q8_0 matrix is stored with: padded to a multiple of 256 where candle's tiled
/// VNNI kernels then apply (rows a multiple of 16), unpadded otherwise.
fn q8_padded_cols(rows: usize, cols: usize) -> usize {
    if rows.is_multiple_of(16) && cols.is_multiple_of(32) {
        cols.div_ceil(256) * 256
    } else {
        cols
    }
}

fn quant_tensor(
    dtype: GgmlDType,
    bytes: &[u8],
    rows: usize,
    cols: usize,
) -> Result<QTensor, ModelError> {
    let storage = QStorage::from_data(Cow::Borrowed(bytes), &Device::Cpu, dtype)?;
    Ok(QTensor::new(storage, (rows, cols))?)
}

#[derive(Debug, Clone)]
enum Weight {
    /// `[out, in]` f32.
    F32(Tensor),
    /// `[out, in_padded]` quantized; `rotated`: the input dimension is multiplied by a
    /// block-diagonal Hadamard matrix (inputs are rotated likewise before the matmul).
    Quant { q: Arc<QTensor>, rotated: bool },
    /// `[out, in]` Q4_1 as stored, multiplied by our batched kernel ([`Q4_1Matrix`]) with f32
    /// inputs (`Native`).
    Q4_1(Arc<Q4_1Matrix>),
    /// Q4_1 regrouped 16 rows at a time, inputs quantized to 8 bits ([`Q8Rows`]; `NativeI8`,
    /// `NativeAmx`).
    GroupedQ4_1(Arc<GroupedQ4_1Matrix>),
    /// Q8_0 regrouped likewise (`NativeI8`, `NativeAmx`).
    GroupedQ8_0(Arc<GroupedQ8_0Matrix>),
}

/// `y = x Wᵀ` for a weight `W` of `[out_dim, in_dim]`.
#[derive(Debug, Clone)]
pub(crate) struct Linear {
    weight: Weight,
    in_dim: usize,
    out_dim: usize,
}

impl Linear {
    /// The width the weight is stored with (`in_dim` or padded).
    fn stored_in_dim(&self) -> usize {
        match &self.weight {
            Weight::F32(_) | Weight::Q4_1(_) | Weight::GroupedQ4_1(_) | Weight::GroupedQ8_0(_) => {
                self.in_dim
            }
            Weight::Quant { q, .. } => q.shape().dims()[1],
        }
    }

    /// Bytes of the weight in memory.
    pub fn bytes(&self) -> usize {
        match &self.weight {
            Weight::F32(t) => t.elem_count() * 4,
            Weight::Quant { q, .. } => q.storage_size_in_bytes(),
            Weight::Q4_1(w) => w.size_in_bytes(),
            Weight::GroupedQ4_1(w) => w.size_in_bytes(),
            Weight::GroupedQ8_0(w) => w.size_in_bytes(),
        }
    }

    /// `x` holds `m` rows of `in_dim`; returns `m` rows of `out_dim`.
    pub fn forward(&self, x: &[f32], m: usize) -> Result<Vec<f32>, ModelError> {
        debug_assert_eq!(x.len(), m * self.in_dim);
        if m == 0 {
            return Ok(Vec::new());
        }
        if let Weight::Q4_1(w) = &self.weight {
            return Ok(w.matmul(x, m));
        }
        if let Weight::GroupedQ4_1(w) = &self.weight {
            return Ok(w.matmul_q8(&Q8Rows::quantize(x, self.in_dim)));
        }
        if let Weight::GroupedQ8_0(w) = &self.weight {
            return Ok(w.matmul_q8(&Q8Rows::quantize(x, self.in_dim)));
        }
        let k = self.stored_in_dim();
        let mut input = if k == self.in_dim {
            x.to_vec()
        } else {
            let mut p = vec![0f32; m * k];
            for (dst, src) in p.chunks_exact_mut(k).zip(x.chunks_exact(self.in_dim)) {
                dst[..self.in_dim].copy_from_slice(src);
            }
            p
        };
        let y = match &self.weight {
            Weight::F32(w) => Tensor::from_vec(input, (m, k), &Device::Cpu)?.matmul(&w.t()?)?,
            Weight::Quant { q, rotated } => {
                if *rotated {
                    rotate_blocks(&mut input);
                }
                let xt = Tensor::from_vec(input, (m, k), &Device::Cpu)?;
                QMatMul::QTensor(q.clone()).forward(&xt)?
            }
            Weight::Q4_1(_) | Weight::GroupedQ4_1(_) | Weight::GroupedQ8_0(_) => {
                unreachable!("returned above")
            }
        };
        Ok(y.flatten_all()?.to_vec1()?)
    }

    /// Rows `ids` of the weight as f32 (`[ids.len(), in_dim]`): an embedding lookup when the
    /// weight is a (tied) embedding table.
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>, ModelError> {
        if let Some(&bad) = ids.iter().find(|&&i| i as usize >= self.out_dim) {
            return Err(ModelError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.out_dim
            )));
        }
        let idx = Tensor::new(ids, &Device::Cpu)?;
        let (rows, rotated) = match &self.weight {
            Weight::F32(w) => (w.index_select(&idx, 0)?, false),
            Weight::Quant { q, rotated } => (q.embedding(&idx)?, *rotated),
            Weight::Q4_1(w) => return Ok(w.dequantize_rows(ids)),
            Weight::GroupedQ4_1(w) => return Ok(w.dequantize_rows(ids)),
            Weight::GroupedQ8_0(w) => return Ok(w.dequantize_rows(ids)),
        };
        let k = self.stored_in_dim();
        let mut v: Vec<f32> = rows.flatten_all()?.to_vec1()?;
        if rotated {
            unrotate_blocks(&mut v);
        }
        if k == self.in_dim {
            return Ok(v);
        }
        Ok(v.chunks_exact(k)
            .flat_map(|r| r[..self.in_dim].iter().copied())
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn auto_picks_native_i8_for_q4_1_files_on_avx2_and_better() {
        use crate::cpu::on_this_thread;
        for isa in Isa::runnable() {
            let (q4_1, other) = on_this_thread(isa, || {
                (WeightMode::auto_for(true), WeightMode::auto_for(false))
            });
            assert_eq!(other, WeightMode::Q8_0, "{isa:?}: a file other than Q4_1");
            let want = match isa {
                Isa::Portable => WeightMode::Q8_0,
                _ => WeightMode::NativeI8,
            };
            assert_eq!(q4_1, want, "{isa:?}");
        }
    }

    fn matrix(rows: usize, cols: usize) -> HostMatrix {
        let v = (0..rows * cols)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
            .collect();
        HostMatrix::from_f32(rows, cols, v).unwrap()
    }

    fn naive(m: &HostMatrix, x: &[f32]) -> Vec<f32> {
        let w = m.to_f32().unwrap();
        x.chunks_exact(m.cols)
            .flat_map(|row| {
                w.chunks_exact(m.cols)
                    .map(|wr| wr.iter().zip(row).map(|(a, b)| a * b).sum::<f32>())
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    #[test]
    fn every_mode_computes_x_w_transposed() {
        let m = matrix(32, 96); // 96 is padded to 256 in Q8_0
        let x: Vec<f32> = (0..3 * 96).map(|i| (i as f32 * 0.37).sin()).collect();
        let want = naive(&m, &x);
        for mode in [
            WeightMode::F32,
            WeightMode::Q8_0,
            WeightMode::Native,
            WeightMode::NativeI8,
            WeightMode::NativeAmx,
        ] {
            if mode == WeightMode::NativeAmx && !amx_available() {
                let err = m.clone().into_linear(mode).unwrap_err().to_string();
                assert!(
                    err.contains("native-amx needs a CPU with AMX-INT8"),
                    "{err}"
                );
                continue;
            }
            let lin = m.clone().into_linear(mode).unwrap();
            let got = lin.forward(&x, 3).unwrap();
            // Q8_0: weights and (rotated, per-256) activations quantized to 8 bits
            let tol = if mode == WeightMode::Q8_0 { 0.15 } else { 1e-4 };
            for (g, w) in got.iter().zip(&want) {
                assert!((g - w).abs() < tol, "{mode}: {g} vs {w}");
            }
            // rows are computed independently of the batch
            let solo = lin.forward(&x[96..192], 1).unwrap();
            assert_eq!(&got[32..64], &solo[..], "{mode}");
        }
    }

    #[test]
    fn embedding_rows_drop_the_padding() {
        let m = matrix(32, 64);
        for mode in [WeightMode::F32, WeightMode::Q8_0] {
            let lin = m.clone().into_linear(mode).unwrap();
            let rows = lin.rows(&[3, 0]).unwrap();
            assert_eq!(rows.len(), 2 * 64);
            let w = m.to_f32().unwrap();
            for (g, e) in rows[..64].iter().zip(&w[3 * 64..4 * 64]) {
                assert!((g - e).abs() < 0.02, "{mode}: {g} vs {e}");
            }
            assert!(lin.rows(&[32]).is_err());
        }
    }

    #[test]
    fn permute_and_concat_rows_of_quantized_matrices() {
        let m = matrix(4, 32);
        let q = Tensor::from_vec(m.to_f32().unwrap(), (4, 32), &Device::Cpu).unwrap();
        let q = HostMatrix::from_qtensor(&QTensor::quantize(&q, GgmlDType::Q8_0).unwrap()).unwrap();
        let p = q.permute_rows(&[2, 0, 3, 1]);
        let (a, b) = (q.to_f32().unwrap(), p.to_f32().unwrap());
        assert_eq!(&b[..32], &a[64..96]);
        assert_eq!(&b[96..], &a[32..64]);
        let c = HostMatrix::concat_rows(&[q.clone(), p]).unwrap();
        assert!(matches!(c.data, MatData::Quant { .. }));
        assert_eq!(c.rows, 8);
        assert_eq!(&c.to_f32().unwrap()[..128], &a[..]);
    }
}

#[cfg(test)]
mod native_tests {
    use super::*;

    /// Matrices kept in a GGUF quantized type compute what their dequantized f32 form does.
    #[test]
    fn native_quantized_types_match_their_f32_form() {
        for (rows, cols, m_rows) in [
            (64, 576, 2),
            (960, 576, 1),
            (576, 1536, 1),
            (3072, 576, 3),
            (960, 576, 37),
            (576, 1536, 20),
        ] {
            let v: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
                .collect();
            let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
            let x: Vec<f32> = (0..m_rows * cols)
                .map(|i| (i as f32 * 0.11).cos())
                .collect();
            for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4_0] {
                let m = HostMatrix::from_qtensor(&QTensor::quantize(&t, dt).unwrap()).unwrap();
                let forward = |mode| {
                    m.clone()
                        .into_linear(mode)
                        .unwrap()
                        .forward(&x, m_rows)
                        .unwrap()
                };
                let got = forward(WeightMode::Native);
                // a native Q8_0 matrix is the Q8_0 mode's padded, rotated one; the others
                // compute what their f32 form does
                if dt == GgmlDType::Q8_0 {
                    assert_eq!(got, forward(WeightMode::Q8_0), "[{rows}, {cols}]");
                    continue;
                }
                let want = forward(WeightMode::F32);
                let d = got
                    .iter()
                    .zip(&want)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0f32, f32::max);
                assert!(d < 0.5, "{dt:?} [{rows}, {cols}] m={m_rows}: {d}");
            }
        }
    }
}
