//! The Q4_1 matmul kernels against a memcpy of the same weight bytes, in one run (the machine
//! is noisy: compare the ratio): SmolLM2-135M's MLP shapes at batch 1 and 16, f32 inputs
//! (`--dtype native`) and inputs quantized to 8 bits on the grouped layout (`--dtype
//! native-i8`, quantization included; with and without VNNI where the CPU has it), each
//! instruction-set variant this CPU runs, and on AMX tiles (`--dtype native-amx`) where the CPU
//! has AMX-INT8; batch 128 as a prefill chunk.
//!
//! ```text
//! RAYON_NUM_THREADS=2 cargo bench -p tandem-models --bench q4_1
//! ```

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use std::hint::black_box;
use tandem_models::cpu::{set_vnni_allowed, vnni_for, Isa, Vnni};
use tandem_models::quant::{amx_available, GroupedQ4_1Matrix, Q4_1Matrix, Q8Rows};

/// A `[rows, cols]` matrix of pseudo-random blocks (scales ~0.02, minimums ~-0.1).
fn matrix(rows: usize, cols: usize) -> Q4_1Matrix {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let mut bytes = Vec::with_capacity(rows * cols / 32 * 20);
    for _ in 0..rows * cols / 32 {
        bytes.extend(half::f16::from_f32(0.02).to_le_bytes());
        bytes.extend(half::f16::from_f32(-0.1).to_le_bytes());
        for _ in 0..16 {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            bytes.push(state as u8);
        }
    }
    Q4_1Matrix::new(rows, cols, bytes).expect("matrix")
}

fn bench(c: &mut Criterion) {
    // up/gate (576 -> 1536) and down (1536 -> 576), all 30 layers' worth of rows at once so the
    // weights (~50 MB) stream from memory as in a decode step
    for (name, rows, cols) in [("up", 1536 * 30, 576), ("down", 576 * 30, 1536)] {
        let w = matrix(rows, cols);
        let mut g = c.benchmark_group(format!("q4_1_{name}"));
        g.sample_size(10);
        g.throughput(Throughput::Bytes(w.size_in_bytes() as u64));
        let src = vec![1u8; w.size_in_bytes()];
        let mut dst = vec![0u8; w.size_in_bytes()];
        g.bench_function("memcpy", |b| {
            b.iter(|| {
                dst.copy_from_slice(&src);
                black_box(&mut dst);
            })
        });
        let grouped = GroupedQ4_1Matrix::new(&w);
        let amx = amx_available();
        for m in [1usize, 16, 128] {
            let x: Vec<f32> = (0..m * cols).map(|i| (i as f32 * 0.37).sin()).collect();
            if amx {
                Isa::set_active(Isa::Avx512).expect("AMX CPUs run AVX-512");
                g.bench_with_input(BenchmarkId::new("i8-amx", m), &x, |b, x| {
                    b.iter(|| {
                        black_box(grouped.matmul_q8_with(
                            Isa::Avx512,
                            true,
                            &Q8Rows::quantize(x, cols),
                        ))
                    })
                });
            }
            for isa in Isa::runnable() {
                g.bench_with_input(
                    BenchmarkId::new(format!("f32@{}", isa.name()), m),
                    &x,
                    |b, x| b.iter(|| black_box(w.matmul_on(isa, x, m))),
                );
                // with VNNI where this variant has it, then without (the same results)
                set_vnni_allowed(true);
                let has_vnni = vnni_for(isa) != Vnni::Off;
                for vnni in [true, false] {
                    if !vnni && !has_vnni {
                        continue;
                    }
                    set_vnni_allowed(vnni);
                    let name = match vnni_for(isa) {
                        Vnni::Off if vnni => format!("i8@{}", isa.name()),
                        Vnni::Off => format!("i8-novnni@{}", isa.name()),
                        _ => format!("i8-vnni@{}", isa.name()),
                    };
                    g.bench_with_input(BenchmarkId::new(name, m), &x, |b, x| {
                        b.iter(|| {
                            black_box(grouped.matmul_q8_with(
                                isa,
                                false,
                                &Q8Rows::quantize(x, cols),
                            ))
                        })
                    });
                }
                set_vnni_allowed(true);
            }
        }
        g.finish();
    }
}

criterion_group!(benches, bench);
criterion_main!(benches);
