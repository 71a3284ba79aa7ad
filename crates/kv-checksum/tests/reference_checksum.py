#!/usr/bin/env python3
"""An independent implementation of Tandem's KV checksum definition (DESIGN.md), numpy only.

Reads the same safetensors input as `tandem kv-checksum` and prints the same JSON:

    python3 reference_checksum.py FILE --block-size B [--start-token T] [--num-tokens N]

The file holds `layers.{L}.k` and `layers.{L}.v`, each [tokens, kv_heads, head_dim] in
F32, F16 or BF16, for the request's tokens [T, T + tokens). For each block position
p = T // B .. ceil(N / B) - 1, over tokens [max(p * B, T), min((p + 1) * B, N)):

    c = sum over layers L, heads h of  m * s   (mod 2**64),  m = 2 * (L * 2**16 + h) + 1
    s = sum_j x_j * (2 j + 1)                  (mod 2**64)

with x_j piece p of token t (the token's K row then its V row, cut into little-endian
u64s), j = t * P + p. The safetensors parser is written out here too, so nothing is
shared with the Rust code. The Rust tests do not need this script.
"""

import argparse
import json
import struct
import sys

import numpy as np

DTYPE_SIZES = {"F32": 4, "F16": 2, "BF16": 2}


def read_safetensors(path):
    with open(path, "rb") as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])
    body = data[8 + header_len :]
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        tensors[name] = (info["dtype"], info["shape"], body[begin:end])
    return tensors


def checksums(path, block_size, start_token=0, num_tokens=None):
    layers = {}
    for name, (dtype, shape, raw) in read_safetensors(path).items():
        prefix, number, part = name.split(".")
        assert prefix == "layers" and part in ("k", "v"), name
        assert dtype in DTYPE_SIZES, dtype
        layers.setdefault(int(number), {})[part] = (dtype, shape, raw)

    per_token = None  # u64 per token: sum over layers and heads of m * s_t
    given = 0
    for number, parts in sorted(layers.items()):
        (dtype, shape, k_raw), (_, _, v_raw) = parts["k"], parts["v"]
        tokens, heads, head_dim = shape
        given = tokens
        row = head_dim * DTYPE_SIZES[dtype]
        k = np.frombuffer(k_raw, dtype=np.uint8).reshape(tokens, heads, row)
        v = np.frombuffer(v_raw, dtype=np.uint8).reshape(tokens, heads, row)
        joined = np.ascontiguousarray(np.concatenate([k, v], axis=2))
        assert joined.shape[2] % 8 == 0, "not whole 8-byte pieces"
        x = joined.view("<u8")  # [tokens, heads, P]
        pieces = x.shape[2]
        t = np.arange(start_token, start_token + tokens, dtype=np.uint64)
        j = t[:, None] * np.uint64(pieces) + np.arange(pieces, dtype=np.uint64)[None, :]
        weights = np.uint64(2) * j + np.uint64(1)
        s = (x * weights[:, None, :]).sum(axis=2, dtype=np.uint64)  # [tokens, heads]
        heads_idx = np.arange(heads, dtype=np.uint64)
        m = np.uint64(2) * (np.uint64(number) * np.uint64(1 << 16) + heads_idx) + np.uint64(1)
        layer_sum = (s * m[None, :]).sum(axis=1, dtype=np.uint64)
        per_token = layer_sum if per_token is None else per_token + layer_sum

    n = start_token + given if num_tokens is None else num_tokens
    assert n <= start_token + given, "num_tokens exceeds the tokens given"
    first = start_token // block_size
    out = []
    if n > start_token:
        for pos in range(first, -(-n // block_size)):
            lo = max(pos * block_size, start_token) - start_token
            hi = min((pos + 1) * block_size, n) - start_token
            total = 0 if per_token is None else int(per_token[lo:hi].sum(dtype=np.uint64))
            out.append("0x%016x" % total)
    return {"block_size": block_size, "first_block": first, "checksums": out}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("input")
    p.add_argument("--block-size", type=int, required=True)
    p.add_argument("--start-token", type=int, default=0)
    p.add_argument("--num-tokens", type=int, default=None)
    a = p.parse_args()
    with np.errstate(over="ignore"):
        result = checksums(a.input, a.block_size, a.start_token, a.num_tokens)
    json.dump(result, sys.stdout)
    print()


if __name__ == "__main__":
    main()
