//! Hugging Face model directories: `config.json` + `*.safetensors` (+ `tokenizer.json`).
//!
//! [`SafetensorsSource`] serves weights under llama.cpp's tensor names (the names the model
//! code uses), mapping them to HF names; HF checkpoints are already in "rotate half" layout, so
//! nothing is permuted. Files are memory-mapped; tensors are converted to f32 as they are read.

use std::path::{Path, PathBuf};

use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device};

use crate::decoder::WeightSource;
use crate::error::ModelError;
use crate::weights::HostMatrix;

/// The memory-mapped safetensors files of one model directory.
pub(crate) struct SafetensorsSource {
    st: MmapedSafetensors,
    names: std::collections::HashSet<String>,
}

/// llama.cpp name → HF name, for the Llama family.
fn hf_name(name: &str) -> String {
    if let Some(rest) = name.strip_prefix("blk.") {
        if let Some((layer, tail)) = rest.split_once('.') {
            let t = match tail {
                "attn_norm.weight" => "input_layernorm.weight",
                "ffn_norm.weight" => "post_attention_layernorm.weight",
                "attn_q.weight" => "self_attn.q_proj.weight",
                "attn_k.weight" => "self_attn.k_proj.weight",
                "attn_v.weight" => "self_attn.v_proj.weight",
                "attn_output.weight" => "self_attn.o_proj.weight",
                "ffn_gate.weight" => "mlp.gate_proj.weight",
                "ffn_up.weight" => "mlp.up_proj.weight",
                "ffn_down.weight" => "mlp.down_proj.weight",
                other => other,
            };
            return format!("model.layers.{layer}.{t}");
        }
    }
    match name {
        "token_embd.weight" => "model.embed_tokens.weight".into(),
        "output_norm.weight" => "model.norm.weight".into(),
        "output.weight" => "lm_head.weight".into(),
        other => other.into(),
    }
}

/// The `*.safetensors` files of a directory, sorted.
pub(crate) fn safetensors_files(dir: &Path) -> Result<Vec<PathBuf>, ModelError> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| ModelError::io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}

impl SafetensorsSource {
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let files = safetensors_files(dir)?;
        if files.is_empty() {
            return Err(ModelError::format(format!(
                "{}: no *.safetensors files",
                dir.display()
            )));
        }
        // SAFETY: the files are memory-mapped read-only; the model directory must not be
        // modified while the model loads (the same contract as every mmap-based loader).
        let st = unsafe { MmapedSafetensors::multi(&files)? };
        let names = st.tensors().into_iter().map(|(n, _)| n).collect();
        Ok(SafetensorsSource { st, names })
    }

    fn load_f32(&self, name: &str) -> Result<(Vec<usize>, Vec<f32>), ModelError> {
        let hf = hf_name(name);
        if !self.names.contains(&hf) {
            return Err(ModelError::format(format!("tensor `{hf}` is missing")));
        }
        let t = self.st.load(&hf, &Device::Cpu)?.to_dtype(DType::F32)?;
        let dims = t.dims().to_vec();
        Ok((dims, t.flatten_all()?.to_vec1()?))
    }
}

impl WeightSource for SafetensorsSource {
    fn has(&self, name: &str) -> bool {
        self.names.contains(&hf_name(name))
    }
    fn vector(&mut self, name: &str) -> Result<Vec<f32>, ModelError> {
        Ok(self.load_f32(name)?.1)
    }
    fn matrix(&mut self, name: &str, _qk_heads: Option<usize>) -> Result<HostMatrix, ModelError> {
        let (dims, v) = self.load_f32(name)?;
        match dims[..] {
            [r, c] => HostMatrix::from_f32(r, c, v),
            _ => Err(ModelError::format(format!(
                "{name}: expected a matrix, got {dims:?}"
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_map_to_hf() {
        assert_eq!(
            hf_name("blk.3.attn_q.weight"),
            "model.layers.3.self_attn.q_proj.weight"
        );
        assert_eq!(
            hf_name("blk.12.ffn_norm.weight"),
            "model.layers.12.post_attention_layernorm.weight"
        );
        assert_eq!(hf_name("token_embd.weight"), "model.embed_tokens.weight");
        assert_eq!(hf_name("output.weight"), "lm_head.weight");
    }
}
