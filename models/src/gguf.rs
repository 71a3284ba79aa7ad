//! Reading GGUF files: typed metadata access and tensors in Hugging Face layout.
//!
//! Invariant: matrices handed out are in HF layout (`[out_features, in_features]`, Q/K rows in
//! the "rotate half" order). llama.cpp's converter permutes the rows of `attn_q`/`attn_k` of
//! Llama-family models for its interleaved RoPE; `GgufFile::matrix` undoes that when asked, so
//! the K written to the cache is the same as an HF-loaded model's.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::QTensor;
use candle_core::Device;

use crate::error::ModelError;
use crate::weights::HostMatrix;

/// An open GGUF file: its metadata, and a reader for its tensors.
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .finish()
    }
}

/// True when `path` starts with the GGUF magic.
pub fn is_gguf(path: &Path) -> bool {
    use std::io::Read;
    let mut magic = [0u8; 4];
    File::open(path)
        .and_then(|mut f| f.read_exact(&mut magic))
        .is_ok()
        && &magic == b"GGUF"
}

fn as_u64(v: &Value) -> Option<u64> {
    Some(match *v {
        Value::U8(x) => x as u64,
        Value::I8(x) if x >= 0 => x as u64,
        Value::U16(x) => x as u64,
        Value::I16(x) if x >= 0 => x as u64,
        Value::U32(x) => x as u64,
        Value::I32(x) if x >= 0 => x as u64,
        Value::U64(x) => x,
        Value::I64(x) if x >= 0 => x as u64,
        _ => return None,
    })
}

fn as_f64(v: &Value) -> Option<f64> {
    match *v {
        Value::F32(x) => Some(x as f64),
        Value::F64(x) => Some(x),
        _ => as_u64(v).map(|x| x as f64),
    }
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, ModelError> {
        let file = File::open(path).map_err(|e| ModelError::io(path, e))?;
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader)
            .map_err(|e| ModelError::format(format!("{}: {e}", path.display())))?;
        Ok(GgufFile {
            path: path.to_owned(),
            content,
            reader,
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.content.metadata.get(key)
    }

    fn missing(&self, key: &str, what: &str) -> ModelError {
        ModelError::format(format!(
            "{}: metadata `{key}` is missing or not {what}",
            self.path.display()
        ))
    }

    pub fn opt_str(&self, key: &str) -> Option<&str> {
        match self.get(key) {
            Some(Value::String(s)) => Some(s),
            _ => None,
        }
    }
    pub fn str(&self, key: &str) -> Result<&str, ModelError> {
        self.opt_str(key)
            .ok_or_else(|| self.missing(key, "a string"))
    }
    pub fn opt_usize(&self, key: &str) -> Option<usize> {
        self.get(key).and_then(as_u64).map(|x| x as usize)
    }
    pub fn usize(&self, key: &str) -> Result<usize, ModelError> {
        self.opt_usize(key)
            .ok_or_else(|| self.missing(key, "an integer"))
    }
    pub fn opt_f32(&self, key: &str) -> Option<f32> {
        self.get(key).and_then(as_f64).map(|x| x as f32)
    }
    pub fn opt_bool(&self, key: &str) -> Option<bool> {
        match self.get(key) {
            Some(Value::Bool(b)) => Some(*b),
            _ => None,
        }
    }
    pub fn str_array(&self, key: &str) -> Result<Vec<String>, ModelError> {
        match self.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match v {
                    Value::String(s) => Ok(s.clone()),
                    _ => Err(self.missing(key, "an array of strings")),
                })
                .collect(),
            _ => Err(self.missing(key, "an array of strings")),
        }
    }
    pub fn f32_array(&self, key: &str) -> Result<Vec<f32>, ModelError> {
        match self.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match *v {
                    Value::F32(x) => Ok(x),
                    Value::F64(x) => Ok(x as f32),
                    _ => Err(self.missing(key, "an array of floats")),
                })
                .collect(),
            _ => Err(self.missing(key, "an array of floats")),
        }
    }
    pub fn opt_int_array(&self, key: &str) -> Option<Vec<i64>> {
        match self.get(key) {
            Some(Value::Array(a)) => a
                .iter()
                .map(|v| match *v {
                    Value::I32(x) => Some(x as i64),
                    Value::I64(x) => Some(x),
                    _ => as_u64(v).map(|x| x as i64),
                })
                .collect(),
            _ => None,
        }
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    pub fn tensor(&mut self, name: &str) -> Result<QTensor, ModelError> {
        if !self.has_tensor(name) {
            return Err(ModelError::format(format!(
                "{}: tensor `{name}` is missing",
                self.path.display()
            )));
        }
        Ok(self.content.tensor(&mut self.reader, name, &Device::Cpu)?)
    }

    /// A 1-D tensor as f32.
    pub fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        let t = self.tensor(name)?;
        Ok(t.dequantize(&Device::Cpu)?.flatten_all()?.to_vec1()?)
    }

    /// A 2-D tensor as a `[out, in]` matrix; `unpermute_heads` undoes llama.cpp's Q/K row
    /// permutation for that many heads.
    pub(crate) fn matrix(
        &mut self,
        name: &str,
        unpermute_heads: Option<usize>,
    ) -> Result<HostMatrix, ModelError> {
        let m = HostMatrix::from_qtensor(&self.tensor(name)?)?;
        Ok(match unpermute_heads {
            Some(heads) => m.permute_rows(&unpermute_rows(m.rows, heads)?),
            None => m,
        })
    }
}

/// Source row of each HF row: llama.cpp stores head `h`'s rows as `(i, j)` pairs
/// (`h*hd + 2i + j`) where HF stores them as halves (`h*hd + j*hd/2 + i`).
pub fn unpermute_rows(rows: usize, heads: usize) -> Result<Vec<usize>, ModelError> {
    if heads == 0 || !rows.is_multiple_of(heads) || !(rows / heads).is_multiple_of(2) {
        return Err(ModelError::format(format!(
            "cannot split {rows} rows into {heads} heads of even size"
        )));
    }
    let hd = rows / heads;
    let half = hd / 2;
    let mut src = Vec::with_capacity(rows);
    for h in 0..heads {
        for j in 0..2 {
            for i in 0..half {
                src.push(h * hd + 2 * i + j);
            }
        }
    }
    Ok(src)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unpermute_inverts_llama_cpp_permute() {
        // llama.cpp: w.reshape(heads, 2, hd/2, in).swapaxes(1, 2): GGUF row h*hd + 2i + j holds
        // HF row h*hd + j*hd/2 + i.
        let (heads, hd) = (3, 8);
        let hf: Vec<usize> = (0..heads * hd).collect();
        let mut gguf = vec![0; heads * hd];
        for h in 0..heads {
            for i in 0..hd / 2 {
                for j in 0..2 {
                    gguf[h * hd + 2 * i + j] = hf[h * hd + j * hd / 2 + i];
                }
            }
        }
        let src = unpermute_rows(heads * hd, heads).unwrap();
        let back: Vec<usize> = src.iter().map(|&r| gguf[r]).collect();
        assert_eq!(back, hf);
        assert!(unpermute_rows(10, 3).is_err());
    }
}
