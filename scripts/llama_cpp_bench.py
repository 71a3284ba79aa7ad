#!/usr/bin/env python3
"""llama.cpp (through llama-cpp-python) on the same GGUF, prompt and step counts as Tandem's
`bench_model` example: prefill tok/s of one 200-token prompt (BENCH_PROMPT_LEN tokens where set;
best of 3), then decode tok/s at batch 1 over STEPS greedy steps. Prints one Markdown row in
bench_model's column order.

Usage: llama_cpp_bench.py GGUF [STEPS] [THREADS]
"""
import os
import sys
import time

import llama_cpp
import numpy as np

PROMPT_LEN = int(os.environ.get("BENCH_PROMPT_LEN", "200"))


def prompt(i, n):
    # the ids bench_model uses: deterministic, from the ordinary vocabulary
    return [17 + ((i * 7919 + j * 104_729) % 40_000) for j in range(n)]


def main():
    path = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 32
    threads = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    # the scores array holds n_batch rows: as many as the context, for long decodes
    n_ctx = max(1024, PROMPT_LEN + steps + 16)
    llm = llama_cpp.Llama(
        model_path=path,
        n_ctx=n_ctx,
        n_batch=n_ctx,
        n_ubatch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )
    toks = prompt(0, PROMPT_LEN)
    # warm-up
    llm.reset()
    llm.eval(toks[:16])
    best = float("inf")
    for _ in range(3):
        llm.reset()
        t = time.perf_counter()
        llm.eval(toks)
        best = min(best, time.perf_counter() - t)
    decode = 0.0
    for _ in range(steps):
        nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        llm.eval([nxt])
        decode += time.perf_counter() - t
    print(
        f"| llama.cpp {llama_cpp.__version__} ({threads} threads) | {PROMPT_LEN / best:.0f} "
        f"| {steps / decode:.1f} | {1e3 * decode / steps:.2f} |"
    )


if __name__ == "__main__":
    main()
