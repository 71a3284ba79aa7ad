//! The CPU backend refuses jobs that do not fit the memory, instead of panicking.

use tandem_kv_cache::{BlockLayout, CacheDtype, LayerKv};
use tandem_kv_checksum::*;

fn job_result(layer: LayerJob, block: BlockJob, views: &[LayerKv<'_>], out_len: usize) -> String {
    let mut out = vec![0u64; out_len];
    match CpuBackend::new(views).checksum(
        &GroupJob {
            layers: &[layer],
            blocks: &[block],
            columns: 1,
        },
        &mut out,
    ) {
        Ok(()) => "ok".into(),
        Err(e) => e.to_string(),
    }
}

#[test]
fn jobs_outside_the_memory_are_errors() {
    let layout = BlockLayout::token_major(2, 4, 1, 8, CacheDtype::F32);
    let (k, v) = (
        vec![1u8; layout.total_bytes()],
        vec![2u8; layout.total_bytes()],
    );
    let views = [LayerKv::new(&k, &v, layout).unwrap()];
    let layer = LayerJob {
        source_index: 0,
        layout,
        layer_number: 0,
        head_base: 0,
        column: 0,
    };
    let block = BlockJob {
        block_id: 1,
        first_slot: 1,
        token_begin: 5,
        token_end: 8,
    };
    assert_eq!(job_result(layer.clone(), block, &views, 1), "ok");
    // block out of the pool, slots past the block, reversed tokens
    for b in [
        BlockJob {
            block_id: 2,
            ..block
        },
        BlockJob {
            first_slot: 2,
            ..block
        },
        BlockJob {
            token_begin: 9,
            ..block
        },
        BlockJob {
            first_slot: usize::MAX,
            ..block
        },
    ] {
        assert!(
            job_result(layer.clone(), b, &views, 1).contains("invalid checksum job"),
            "{b:?}"
        );
    }
    // output of the wrong size, a column that does not exist, another layout, another layer
    assert!(job_result(layer.clone(), block, &views, 2).contains("output"));
    assert!(job_result(
        LayerJob {
            column: 1,
            ..layer.clone()
        },
        block,
        &views,
        1
    )
    .contains("column"));
    let other = BlockLayout::token_major(2, 4, 2, 4, CacheDtype::F32);
    assert!(job_result(
        LayerJob {
            layout: other,
            ..layer.clone()
        },
        block,
        &views,
        1
    )
    .contains("laid out"));
    assert!(job_result(
        LayerJob {
            source_index: 1,
            ..layer.clone()
        },
        block,
        &views,
        1
    )
    .contains("no layer 1"));
    // heads past the factor's bound
    assert!(job_result(
        LayerJob {
            head_base: 65536,
            ..layer.clone()
        },
        block,
        &views,
        1
    )
    .contains("2^16"));
    // a view shorter than its layout cannot even be built
    assert!(LayerKv::new(&k[..8], &v, layout).is_err());
    // rows that are not whole pieces
    let odd = BlockLayout::token_major(2, 4, 1, 3, CacheDtype::F16);
    let (k3, v3) = (vec![0u8; odd.total_bytes()], vec![0u8; odd.total_bytes()]);
    let odd_views = [LayerKv::new(&k3, &v3, odd).unwrap()];
    assert!(job_result(
        LayerJob {
            layout: odd,
            ..layer
        },
        block,
        &odd_views,
        1
    )
    .contains("pieces"));
}
