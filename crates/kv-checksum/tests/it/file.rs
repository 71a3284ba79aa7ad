//! The `tandem kv-checksum` backend: safetensors files written with the `safetensors` crate,
//! checked against the naive definition and against a paged worker holding the same KV.

use proptest::prelude::*;
use safetensors::tensor::TensorView;
use safetensors::Dtype;
use tandem_kv_cache::CacheDtype;
use tandem_kv_checksum::*;

use crate::common::*;

fn st_dtype(d: CacheDtype) -> Dtype {
    match d {
        CacheDtype::F32 => Dtype::F32,
        CacheDtype::F16 => Dtype::F16,
        CacheDtype::Bf16 => Dtype::BF16,
    }
}

/// A file holding tokens `[t, model.tokens)` of every layer.
fn file_bytes(model: &Model, t: usize) -> Vec<u8> {
    let tensors: Vec<(String, TensorView<'_>)> = model
        .layers
        .iter()
        .flat_map(|l| {
            let per_token = l.heads * l.row_bytes();
            let shape = vec![model.tokens - t, l.heads, l.head_dim];
            [("k", &l.k), ("v", &l.v)].map(|(part, buf)| {
                (
                    format!("layers.{}.{part}", l.number),
                    TensorView::new(st_dtype(l.dtype), shape.clone(), &buf[t * per_token..])
                        .unwrap(),
                )
            })
        })
        .collect();
    safetensors::serialize(tensors, None).unwrap()
}

const DTYPES: [CacheDtype; 3] = [CacheDtype::F32, CacheDtype::F16, CacheDtype::Bf16];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn file_checksums_match_naive(
        dt in 0..3usize,
        head_dim in prop::sample::select(vec![2usize, 4, 8, 64]),
        heads in 1..4usize,
        numbers in prop::collection::btree_set(0u32..100, 1..4),
        bs in prop::sample::select(vec![1usize, 4, 16, 32]),
        t in 0..40usize,
        given in 0..50usize,
        cut in prop::option::of(0..50usize),
        seed in any::<u64>(),
    ) {
        let dtype = DTYPES[dt];
        prop_assume!(pieces_per_token(head_dim, dtype).is_some());
        let names: Vec<String> = numbers.iter().map(|n| format!("layers.{n}")).collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let model = Model::random(&mut Rng(seed), &refs, heads, head_dim, dtype, t + given);
        let bytes = file_bytes(&model, t);
        let n = cut.map(|c| t + c.min(given));
        let got = checksum_safetensors(&bytes, bs, t, n).unwrap();
        let n = n.unwrap_or(t + given);
        prop_assert_eq!(got.block_size, bs);
        prop_assert_eq!(got.first_block, t / bs);
        let positions = if n > t { n.div_ceil(bs) - t / bs } else { 0 };
        let want = naive_blocks(&model, t / bs, positions, bs, t, n);
        prop_assert_eq!(got.checksums, want);
    }
}

#[test]
fn file_checksums_equal_a_paged_workers() {
    let names = ["layers.0", "layers.1", "layers.7"];
    for dtype in DTYPES {
        let model = Model::random(&mut Rng(3), &names, 4, 16, dtype, 90);
        for t in [0usize, 32] {
            let file = checksum_safetensors(&file_bytes(&model, t), 16, t, None).unwrap();
            let mut cfg = ClusterConfig::new(2, 2, 16, 90);
            cfg.from = t;
            let cluster = Cluster::new(&mut Rng(4), &model, cfg);
            let merged = cluster.merged(Role::Consumer, &cluster.request(t, 90));
            assert_eq!(
                file.checksums,
                checks(&merged).checks[0],
                "{dtype} from {t}"
            );
        }
    }
}

#[test]
fn the_cli_json_and_its_errors() {
    let model = Model::random(&mut Rng(5), &["layers.3"], 2, 8, CacheDtype::Bf16, 40);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("kv.safetensors");
    std::fs::write(&path, file_bytes(&model, 20)).unwrap();
    let json = checksum_safetensors_file(&path, 16, 20, Some(35)).unwrap();
    let want: Vec<String> = naive_blocks(&model, 1, 2, 16, 20, 35)
        .iter()
        .map(|c| format!("0x{c:016x}"))
        .collect();
    assert_eq!(
        json,
        serde_json::json!({"block_size": 16, "first_block": 1, "checksums": want})
    );
    let s = json["checksums"][0].as_str().unwrap();
    assert_eq!(s.len(), 18);
    assert!(s[2..]
        .chars()
        .all(|c| c.is_ascii_hexdigit() && !c.is_ascii_uppercase()));

    // nothing to checksum
    let empty = checksum_safetensors_file(&path, 16, 20, Some(20)).unwrap();
    assert_eq!(empty["checksums"], serde_json::json!([]));

    // errors, never panics
    let err = |r: Result<serde_json::Value, KvChecksumError>| r.unwrap_err().to_string();
    assert!(err(checksum_safetensors_file(&path, 16, 20, Some(41))).contains("exceeds"));
    assert!(err(checksum_safetensors_file(&path, 0, 20, None)).contains("block size"));
    assert!(matches!(
        checksum_safetensors_file(&dir.path().join("nope"), 16, 0, None),
        Err(KvChecksumError::Io { .. })
    ));
    let write = |tensors: Vec<(&str, Dtype, Vec<usize>)>| {
        let data = vec![0u8; 4096];
        let views: Vec<(String, TensorView<'_>)> = tensors
            .into_iter()
            .map(|(n, d, shape)| {
                let len = shape.iter().product::<usize>() * d.bitsize() / 8;
                (
                    n.to_string(),
                    TensorView::new(d, shape, &data[..len]).unwrap(),
                )
            })
            .collect();
        let p = dir.path().join("bad.safetensors");
        std::fs::write(&p, safetensors::serialize(views, None).unwrap()).unwrap();
        err(checksum_safetensors_file(&p, 16, 0, None))
    };
    let s3 = vec![4usize, 2, 8];
    assert!(write(vec![("layers.0.k", Dtype::F32, s3.clone())]).contains("lacks"));
    assert!(write(vec![
        ("layers.0.k", Dtype::I32, s3.clone()),
        ("layers.0.v", Dtype::I32, s3.clone())
    ])
    .contains("dtype"));
    assert!(write(vec![
        ("layers.0.k", Dtype::F32, vec![4, 16]),
        ("layers.0.v", Dtype::F32, vec![4, 16])
    ])
    .contains("shape"));
    assert!(write(vec![
        ("layers.0.k", Dtype::F32, s3.clone()),
        ("layers.0.v", Dtype::F16, s3.clone())
    ])
    .contains("differ"));
    assert!(write(vec![("layers.0.q", Dtype::F32, s3.clone())]).contains("unexpected"));
    assert!(write(vec![
        ("layers.0.k", Dtype::F16, vec![4, 2, 3]),
        ("layers.0.v", Dtype::F16, vec![4, 2, 3])
    ])
    .contains("pieces"));
    assert!(write(vec![
        ("layers.0.k", Dtype::F32, s3.clone()),
        ("layers.0.v", Dtype::F32, s3.clone()),
        ("layers.1.k", Dtype::F32, vec![5, 2, 8]),
        ("layers.1.v", Dtype::F32, vec![5, 2, 8])
    ])
    .contains("tokens"));
    let p = dir.path().join("garbage");
    std::fs::write(&p, b"not a safetensors file").unwrap();
    assert!(matches!(
        checksum_safetensors_file(&p, 16, 0, None),
        Err(KvChecksumError::InvalidInput(_))
    ));
}
