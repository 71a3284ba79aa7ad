//! `tandem kv-checksum` from outside: the binary's JSON equals a deliberately naive implementation
//! of DESIGN.md's definition, written here from the text, on random KV in a safetensors file.

mod common;

use std::collections::HashMap;
use std::process::Command;

use serde_json::Value;

/// A small deterministic generator (xorshift64*).
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
}

/// Checksum of block position `b` per the definition: for each layer L and head h, the slice is
/// token by token K row then V row (f32 bytes) cut into u64 pieces x_j, j = t * P + p;
/// s = Σ x_j (2j + 1); c = Σ (2 (L * 65536 + h) + 1) s; all mod 2^64. Only tokens < n count.
fn naive(
    layers: &[(u64, Vec<f32>, Vec<f32>)],
    heads: usize,
    dim: usize,
    start: usize,
    n: usize,
    bs: usize,
    b: usize,
) -> u64 {
    let mut c = 0u64;
    for (layer, k, v) in layers {
        for h in 0..heads {
            let mut s = 0u64;
            for t in (b * bs).max(start)..((b + 1) * bs).min(n) {
                let row = |x: &Vec<f32>| -> Vec<u8> {
                    let i = ((t - start) * heads + h) * dim;
                    x[i..i + dim].iter().flat_map(|f| f.to_le_bytes()).collect()
                };
                let bytes = [row(k), row(v)].concat();
                let p_count = bytes.len() / 8;
                for (p, piece) in bytes.chunks(8).enumerate() {
                    let x = u64::from_le_bytes(piece.try_into().unwrap());
                    let j = (t * p_count + p) as u64;
                    s = s.wrapping_add(x.wrapping_mul(2 * j + 1));
                }
            }
            let m = 2 * (layer * 65536 + h as u64) + 1;
            c = c.wrapping_add(m.wrapping_mul(s));
        }
    }
    c
}

#[test]
fn cli_output_equals_a_naive_implementation() {
    let (heads, dim, tokens, start, bs) = (3usize, 8usize, 37usize, 16usize, 16usize);
    let mut rng = Rng(7);
    let layer_numbers = [0u64, 1, 5];
    let mut layers = Vec::new();
    let mut tensors: HashMap<String, (Vec<u8>, Vec<usize>)> = HashMap::new();
    for &l in &layer_numbers {
        let mk = |rng: &mut Rng| -> Vec<f32> {
            (0..tokens * heads * dim)
                .map(|_| (rng.next() % 2000) as f32 / 100.0 - 10.0)
                .collect()
        };
        let k = mk(&mut rng);
        let v = mk(&mut rng);
        for (name, data) in [("k", &k), ("v", &v)] {
            let bytes: Vec<u8> = data.iter().flat_map(|f| f.to_le_bytes()).collect();
            tensors.insert(
                format!("layers.{l}.{name}"),
                (bytes, vec![tokens, heads, dim]),
            );
        }
        layers.push((l, k, v));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(n, (b, shape))| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(safetensors::Dtype::F32, shape.clone(), b)
                    .unwrap(),
            )
        })
        .collect();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.safetensors");
    safetensors::serialize_to_file(views, None, &path).unwrap();

    for num_tokens in [None, Some(start + 20)] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_tandem"));
        cmd.args([
            "kv-checksum",
            "--input",
            path.to_str().unwrap(),
            "--block-size",
            "16",
        ])
        .args(["--start-token", &start.to_string()]);
        if let Some(n) = num_tokens {
            cmd.args(["--num-tokens", &n.to_string()]);
        }
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v: Value = serde_json::from_slice(&out.stdout).unwrap();
        let n = num_tokens.unwrap_or(start + tokens);
        assert_eq!(v["block_size"], 16);
        assert_eq!(v["first_block"], start / bs);
        let got: Vec<String> = v["checksums"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_str().unwrap().to_string())
            .collect();
        let want: Vec<String> = (start / bs..n.div_ceil(bs))
            .map(|b| format!("0x{:016x}", naive(&layers, heads, dim, start, n, bs, b)))
            .collect();
        assert_eq!(got, want, "num_tokens {num_tokens:?}");
    }
    // bad input: a clear error, no panic
    let out = Command::new(env!("CARGO_BIN_EXE_tandem"))
        .args([
            "kv-checksum",
            "--input",
            "/nonexistent.safetensors",
            "--block-size",
            "16",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(!String::from_utf8_lossy(&out.stderr).contains("panicked"));
}
