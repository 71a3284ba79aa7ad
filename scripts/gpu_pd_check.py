#!/usr/bin/env python3
"""P/D on one GPU, checked as a user would (run by scripts/gpu_pd_check.sh on the GPU machine).

For each KV mode (pull, push): a single `tandem serve --device cuda` instance answers a set of
greedy prompts; then a prefill and a decode instance on the same GPU (KV in VRAM, moved by NIXL
over CUDA IPC, checksummed by the GPU kernel on both sides) behind `tandem proxy` answer the same
prompts. Checks: every answer equals the single instance's, every load was verified, no load was
unverified or failed, and both instances end with every KV block free. Then a decode instance that
corrupts every load it receives (`kv_fault_injection`) behind its own proxy: every load is caught
as a mismatch and recomputed, and the answers are still equal. Exits non-zero on the first failed
check. Standard library only (the GPU machine has no extra Python packages).

`--transfer-bench` instead measures KV transfer (pull mode unless `--bench-mode push`) on the model
of `--model-args` (configs/llama-8b-dummy.json: Llama 3.1 8B's shape with dummy weights, 128 KiB of
bf16 KV per token; configs/llama-8b-kv-shape.json: the same KV shape with small matrices): prompts
of `--bench-tokens` tokens through the proxy, the decode instance's transfer bytes and seconds per
request, against a device-to-device copy of the same bytes in the same run (torch, when present),
and the checksum's share of the consumer's load-to-first-token time: the checksum time after the
load's last byte landed (`tandem:kv_checksum_load_wait_seconds`), once per `--read-chunk-bytes`
value (default: 128 MiB chunks, then one READ). `--bench-mode push` times the prefill instance's
WRITEs instead (one per load: `--read-chunk-bytes 0`); `--bench-no-checksum` runs without checksums,
to see what they cost the transfer.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request

PROMPTS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "What is 12 times 12?",
    "Give a synonym of 'quick'.",
    "Who wrote Hamlet?",
]


def post(url, body, timeout=300):
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise SystemExit(f"POST {url}: HTTP {e.code}: {e.read().decode(errors='replace')[:500]}")


def get(url, timeout=10):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric(text, name, labels=None):
    """Sum of the series of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#") or not line.startswith(name):
            continue
        m = re.match(r'^([^{\s]+)(\{[^}]*\})?\s+(\S+)$', line)
        if not m or m.group(1) != name:
            continue
        have = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if labels and any(have.get(k) != v for k, v in labels.items()):
            continue
        total += float(m.group(3))
    return total


class Deployment:
    def __init__(self, binary, logs):
        self.binary, self.logs, self.procs = binary, logs, []

    def start(self, name, args):
        log = open(os.path.join(self.logs, f"{name}.log"), "w")
        p = subprocess.Popen([self.binary] + args, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append((name, p))
        return p

    def wait_healthy(self, port, timeout=300):
        deadline = time.time() + timeout
        while time.time() < deadline:
            for name, p in self.procs:
                if p.poll() is not None:
                    self.dump()
                    sys.exit(f"{name} exited with {p.returncode}")
            try:
                get(f"http://127.0.0.1:{port}/health", timeout=2)
                return
            except Exception:
                time.sleep(0.5)
        self.dump()
        sys.exit(f"port {port} did not come up")

    def dump(self):
        for name, _ in self.procs:
            path = os.path.join(self.logs, f"{name}.log")
            print(f"---- {name} (last lines of {path})")
            with open(path) as f:
                print("".join(f.readlines()[-25:]))

    def stop_one(self, name):
        for n, p in self.procs:
            if n == name:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    p.kill()
        self.procs = [(n, p) for n, p in self.procs if n != name]

    def stop(self):
        for _, p in self.procs:
            p.send_signal(signal.SIGTERM)
        for _, p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs = []


# A greedy choice whose top two logprobs are closer than this is a near-tie: bf16 roundings that
# differ between paths (the prefill kernel on one instance, the decode kernel for the last prompt
# token on the other) may flip it. Answers must agree up to the first such position.
NEAR_TIE = 0.05


def answers(port, model, max_tokens):
    """Per prompt: (text, token ids, top-two logprob margin per position)."""
    out = []
    for q in PROMPTS:
        r = post(f"http://127.0.0.1:{port}/v1/chat/completions", {
            "model": model, "temperature": 0, "max_tokens": max_tokens,
            "return_token_ids": True, "logprobs": True, "top_logprobs": 2,
            "messages": [{"role": "user", "content": q}]})
        choice = r["choices"][0]
        margins = []
        for entry in choice["logprobs"]["content"]:
            top = sorted((t["logprob"] for t in entry["top_logprobs"]), reverse=True)
            margins.append(top[0] - top[1] if len(top) > 1 else float("inf"))
        # Token ids too: a dummy model's byte-level text may be empty.
        out.append((choice["message"]["content"], choice["token_ids"], margins))
    return out


def same_answers(reference, got, what):
    """Checks that `got` equals `reference` token for token, or up to a position where the
    reference's greedy choice was a near-tie (then the rest may differ); prints the divergences."""
    identical = 0
    for i, ((_, want, margins), (_, have, _)) in enumerate(zip(reference, got)):
        if want == have:
            identical += 1
            continue
        at = next((j for j, (x, y) in enumerate(zip(want, have)) if x != y),
                  min(len(want), len(have)))
        margin = margins[at] if at < len(margins) else float("inf")
        print(f"  {what}: prompt {i} diverges at token {at} of {len(want)} "
              f"(reference top-two margin {margin:.4f})")
        check(margin < NEAR_TIE, f"{what}: prompt {i} diverges only at a near-tie")
    check(len(got) == len(reference), f"{what}: every prompt answered")
    print(f"OK   {what}: {identical}/{len(reference)} answers identical token for token, the "
          "others equal up to a near-tie")


def check(cond, what):
    print(("OK   " if cond else "FAIL ") + what)
    if not cond:
        raise SystemExit(1)


def transfer_config(mode, role, extra=None, checksum=True):
    cfg = {
        "kv_connector": "NixlConnector" if mode == "pull" else "NixlPushConnector",
        "kv_role": role,
        "enable_kv_checksum": checksum,
    }
    if role == "kv_consumer":
        cfg.update({"kv_checksum_fail_closed": True, "kv_load_failure_policy": "recompute"})
    cfg.update(extra or {})
    return json.dumps(cfg)


def device_copy_gbps(nbytes):
    """Read GB/s of a device-to-device copy of `nbytes` (median of 10), or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    torch.cuda.empty_cache()
    return nbytes / sorted(times[2:])[len(times[2:]) // 2] / 1e9


def pull_pd(a, logs, common, name):
    """A pull-mode 1P1D on this GPU: prefill :8100, decode :8200, proxy :8000, healthy."""
    d = Deployment(a.bin, logs)
    d.start(f"{name}-prefill", common + [
        "--port", "8100", "--kv-transfer-config", transfer_config("pull", "kv_producer")])
    d.start(f"{name}-decode", common + [
        "--port", "8200", "--kv-transfer-config", transfer_config("pull", "kv_consumer")])
    d.start(f"{name}-proxy", ["proxy", "--host", "127.0.0.1", "--port", "8000",
                              "--prefill", "http://127.0.0.1:8100",
                              "--decode", "http://127.0.0.1:8200"])
    d.wait_healthy(8000)
    return d


def transfer_bench(a, logs, common):
    """One prefill instance and the proxy; for each `--read-chunk-bytes` value in turn, a decode
    instance with it: 8000-token prompts through the proxy, the transfer's metrics (pull: the
    decode instance's READ; push: the prefill instance's WRITE) and the decode instance's checksum
    metrics per request (median), against a device copy of the same bytes."""
    mode = a.bench_mode
    if mode == "push" and a.read_chunk_bytes.strip("0,"):
        check(False, "--bench-mode push: a push load is one WRITE (--read-chunk-bytes 0[,0...])")
    # Which instance's metrics time the transfer: the side that posts it.
    xfer_port = 8200 if mode == "pull" else 8100
    d = Deployment(a.bin, logs)
    prefill = list(common)
    if a.prefill_kv_cache_memory:
        # A larger producer pool: every setting's requests get fresh, consecutive blocks (one
        # run of blocks per request), so the settings compare on the same producer layout.
        prefill[prefill.index("--kv-cache-memory") + 1] = a.prefill_kv_cache_memory
    d.start("bench-prefill", prefill + [
        "--port", "8100", "--kv-transfer-config",
        transfer_config(mode, "kv_producer", checksum=not a.bench_no_checksum)])
    d.start("bench-proxy", ["proxy", "--host", "127.0.0.1", "--port", "8000", "--kv-mode", mode,
                            "--prefill", "http://127.0.0.1:8100",
                            "--decode", "http://127.0.0.1:8200"])
    # The transfer's, from the instance that posts it; the rest from the decode instance.
    xfer_keys = ("tandem:kv_transfer_bytes_total", "tandem:kv_transfer_seconds_sum",
                 "tandem:kv_transfer_descriptors_total")
    decode_keys = ("tandem:kv_checksum_compute_seconds_sum",
                   "tandem:kv_checksum_load_wait_seconds_sum",
                   "tandem:request_prefill_time_seconds_sum")
    med = lambda xs: sorted(xs)[len(xs) // 2]
    copy = None
    try:
        d.wait_healthy(8100)
        for k, setting in enumerate(a.read_chunk_bytes.split(",")):
            # BYTES or BYTES:IN_FLIGHT (read_chunks_in_flight).
            chunk, _, in_flight = setting.partition(":")
            chunk = int(chunk)
            extra = {"read_chunk_bytes": chunk} if mode == "pull" else {}
            if in_flight:
                extra["read_chunks_in_flight"] = int(in_flight)
            name = f"bench-decode-{k}"
            d.start(name, common + ["--port", "8200", "--kv-transfer-config", transfer_config(
                mode, "kv_consumer", {"kv_connector_extra_config": extra},
                checksum=not a.bench_no_checksum)])
            d.wait_healthy(8200)
            d.wait_healthy(8000)
            rows = []
            for i in range(a.bench_runs + 1):
                before = get("http://127.0.0.1:8200/metrics")
                xfer_before = before if xfer_port == 8200 else get(
                    f"http://127.0.0.1:{xfer_port}/metrics")
                # Distinct printable bytes (the dummy tokenizer is byte-level): no prefix hit.
                prompt = "".join(chr(33 + ((k * 100 + i) * 7919 + j * 104729) % 90)
                                 for j in range(a.bench_tokens))
                t0 = time.time()
                post("http://127.0.0.1:8000/v1/completions", {
                    "model": a.served, "prompt": prompt, "max_tokens": 1, "temperature": 0})
                wall = time.time() - t0
                after = get("http://127.0.0.1:8200/metrics")
                xfer_after = after if xfer_port == 8200 else get(
                    f"http://127.0.0.1:{xfer_port}/metrics")
                delta = {key: metric(after, key) - metric(before, key) for key in decode_keys}
                delta.update({key: metric(xfer_after, key) - metric(xfer_before, key)
                              for key in xfer_keys})
                verified = (metric(after, "tandem:kv_checksum_loads_total",
                                   {"verdict": "verified"})
                            - metric(before, "tandem:kv_checksum_loads_total",
                                     {"verdict": "verified"}))
                if not a.bench_no_checksum:
                    check(verified == 1,
                          f"read_chunk_bytes {setting}, request {i}: its load verified")
                if i > 0:  # the first warms up
                    rows.append((wall, delta))
            d.stop_one(name)
            nbytes = rows[0][1]["tandem:kv_transfer_bytes_total"]
            if copy is None and a.device == "cuda":
                copy = device_copy_gbps(int(nbytes))
            col = lambda key: med([r[1][key] for r in rows])
            secs = col("tandem:kv_transfer_seconds_sum")
            total_ck = col("tandem:kv_checksum_compute_seconds_sum")
            wait = col("tandem:kv_checksum_load_wait_seconds_sum")
            ltft = col("tandem:request_prefill_time_seconds_sum")
            print(f"transfer bench, read_chunk_bytes {setting}: {a.bench_tokens} tokens, "
                  f"{nbytes / 2**20:.1f} MiB of KV per request, "
                  f"{col('tandem:kv_transfer_descriptors_total'):.0f} descriptors")
            op = "READ" if mode == "pull" else "WRITE"
            print(f"  NIXL {op} (post to last completion) {secs * 1e3:.3f} ms = "
                  f"{nbytes / secs / 1e9:.1f} GB/s (median of {len(rows)})")
            if copy:
                print(f"  device copy of the same bytes: {copy:.1f} GB/s read; transfer/copy = "
                      f"{nbytes / secs / 1e9 / copy:.2f}x")
            print(f"  consumer checksum: {total_ck * 1e3:.3f} ms in all, {wait * 1e3:.3f} ms after "
                  f"the last byte landed, of a {ltft * 1e3:.1f} ms load-to-first-token "
                  f"({100 * wait / max(ltft, 1e-9):.2f}%)")
            print(f"  end-to-end request through the proxy: {med([r[0] for r in rows]) * 1e3:.1f} "
                  "ms", flush=True)
    except SystemExit:
        d.dump()
        raise
    finally:
        d.stop()


def serving_bench(a, logs, common):
    """`tandem bench` (TTFT, ITL, throughput at 1 and 16 streams) on one instance, then on 1P1D
    (pull) through the proxy, both on this GPU."""
    bench = [a.bin, "bench", "--concurrency", "1,16", "--requests", "32",
             "--prompt-tokens", str(a.bench_prompt), "--max-tokens", "64"]
    d = Deployment(a.bin, logs)
    d.start("serving-single", common + ["--port", "8391"])
    d.wait_healthy(8391)
    print("== one GPU instance", flush=True)
    subprocess.run(bench + ["--url", "http://127.0.0.1:8391"], check=True)
    d.stop()
    d = pull_pd(a, logs, common, "serving")
    print("== 1P1D (pull) on the same GPU, through the proxy", flush=True)
    try:
        subprocess.run(bench + ["--url", "http://127.0.0.1:8000",
                                "--kv-metrics-url", "http://127.0.0.1:8200"], check=True)
    finally:
        d.stop()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--modes", default="pull,push")
    ap.add_argument("--device", default="cuda",
                    help="where every instance runs (cpu: the same checks and benchmarks on the "
                         "host, e.g. the transfer bench's chunked loads)")
    ap.add_argument("--model-args", default="--model smollm2-135m",
                    help="how every instance loads the model")
    ap.add_argument("--served", default="smollm2-135m")
    ap.add_argument("--kv-cache-memory", default="2GiB")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--transfer-bench", action="store_true")
    ap.add_argument("--bench-tokens", type=int, default=8000)
    ap.add_argument("--bench-runs", type=int, default=5)
    ap.add_argument("--bench-no-checksum", action="store_true",
                    help="the transfer bench without checksums (what they cost the transfer)")
    ap.add_argument("--bench-mode", choices=("pull", "push"), default="pull",
                    help="the transfer bench's mode (push: the producer WRITEs each load)")
    ap.add_argument("--check-read-chunk-bytes", type=int, default=None,
                    help="read_chunk_bytes of the pull checks' clean decode instance (e.g. 65536 "
                         "to check chunked loads on a small model)")
    ap.add_argument("--read-chunk-bytes", default="134217728,0",
                    help="the decode instance's read_chunk_bytes, one run each (0: one READ); "
                         "BYTES:N also sets read_chunks_in_flight to N")
    ap.add_argument("--prefill-kv-cache-memory", default=None,
                    help="the transfer bench's prefill instance's --kv-cache-memory (default: "
                         "--kv-cache-memory)")
    ap.add_argument("--serving-bench", action="store_true")
    ap.add_argument("--bench-prompt", type=int, default=1000)
    a = ap.parse_args()
    logs = tempfile.mkdtemp(prefix="tandem-gpu-pd.")
    print(f"logs in {logs}")
    common = ["serve", "--device", a.device, "--host", "127.0.0.1",
              "--kv-cache-memory", a.kv_cache_memory] + a.model_args.split()
    os.environ.setdefault("TANDEM_KV_TRANSFER_SECRET", "gpu-pd-check-secret")
    if a.serving_bench:
        serving_bench(a, logs, common)
        return
    if a.transfer_bench:
        transfer_bench(a, logs, common + ["--max-model-len", str(a.bench_tokens + 64)])
        return

    d = Deployment(a.bin, logs)
    d.start("single", common + ["--port", "8391"])
    d.wait_healthy(8391)
    reference = answers(8391, a.served, a.max_tokens)
    print("single-instance answers:", json.dumps([r[:2] for r in reference])[:300])
    check(all(len(r[1]) > 0 for r in reference), "the single instance answers every prompt")
    d.stop()

    for mode in a.modes.split(","):
        d = Deployment(a.bin, logs)
        d.start(f"{mode}-prefill", common + [
            "--port", "8100", "--kv-transfer-config", transfer_config(mode, "kv_producer")])
        chunked = {}
        if mode == "pull" and a.check_read_chunk_bytes is not None:
            chunked = {"kv_connector_extra_config": {"read_chunk_bytes": a.check_read_chunk_bytes}}
        d.start(f"{mode}-decode", common + [
            "--port", "8200", "--kv-transfer-config",
            transfer_config(mode, "kv_consumer", chunked)])
        d.start(f"{mode}-faulty-decode", common + [
            "--port", "8300", "--kv-transfer-config", transfer_config(mode, "kv_consumer", {
                "kv_fault_injection": {"kind": "corrupt_byte", "probability": 1.0, "seed": 7}})])
        proxy = ["proxy", "--host", "127.0.0.1", "--kv-mode", mode,
                 "--prefill", "http://127.0.0.1:8100"]
        d.start(f"{mode}-proxy", proxy + ["--port", "8000", "--decode", "http://127.0.0.1:8200"])
        d.start(f"{mode}-faulty-proxy",
                proxy + ["--port", "8001", "--decode", "http://127.0.0.1:8300"])
        for port in (8000, 8001):
            d.wait_healthy(port)
        try:
            got = answers(8000, a.served, a.max_tokens)
            same_answers(reference, got, f"{mode}: 1P1D against the single GPU instance")
            m = get("http://127.0.0.1:8200/metrics")
            loads = metric(m, "tandem:kv_checksum_loads_total")
            verified = metric(m, "tandem:kv_checksum_loads_total", {"verdict": "verified"})
            print(f"{mode}: loads by verdict:",
                  [l for l in m.splitlines() if l.startswith("tandem:kv_checksum_loads_total")])
            check(verified == len(PROMPTS) and loads == verified,
                  f"{mode}: every load verified by checksum ({verified:.0f}/{len(PROMPTS)})")
            check(metric(m, "tandem:kv_load_failures_total") == 0, f"{mode}: no load failed")
            steps = metric(m, "tandem:kv_checksum_compute_seconds_count")
            waits = metric(m, "tandem:kv_checksum_load_wait_seconds_count")
            overlap = (" (more steps than loads: chunks checksummed while the rest moved)"
                       if steps > waits else " (one step a load: no load was split into chunks)")
            print(f"{mode}: consumer checksum steps {steps:.0f} for {waits:.0f} loads{overlap}")
            # The side that posts the transfers counts them: the consumer in pull, the producer
            # in push.
            mover = m if mode == "pull" else get("http://127.0.0.1:8100/metrics")
            moved = metric(mover, "tandem:kv_transfer_bytes_total")
            secs = metric(mover, "tandem:kv_transfer_seconds_sum")
            print(f"{mode}: moved {moved / 1e6:.2f} MB of KV in {secs * 1e3:.2f} ms "
                  f"({moved / max(secs, 1e-9) / 1e9:.2f} GB/s over {len(PROMPTS)} transfers)")

            bad = answers(8001, a.served, a.max_tokens)
            same_answers(reference, bad, f"{mode}: every load corrupted, caught and recomputed,"
                         " against the single GPU instance")
            m = get("http://127.0.0.1:8300/metrics")
            mismatched = metric(m, "tandem:kv_checksum_loads_total", {"verdict": "mismatch"})
            check(mismatched == len(PROMPTS),
                  f"{mode}: every corrupted load caught ({mismatched:.0f}/{len(PROMPTS)})")
            recomputed = metric(m, "tandem:kv_load_recomputed_tokens_total")
            check(recomputed > 0, f"{mode}: {recomputed:.0f} prompt tokens recomputed")
            time.sleep(2)  # leases end when the consumers' reads are acknowledged
            for port in (8100, 8200, 8300):
                m = get(f"http://127.0.0.1:{port}/metrics")
                free = metric(m, "tandem:kv_cache_free_blocks")
                total = metric(m, "tandem:kv_cache_total_blocks")
                check(free == total and total > 0,
                      f"{mode}: :{port} has every KV block free ({free:.0f}/{total:.0f})")
        except SystemExit:
            d.dump()
            raise
        finally:
            d.stop()
    print("gpu_pd_check: all checks passed")


if __name__ == "__main__":
    main()
