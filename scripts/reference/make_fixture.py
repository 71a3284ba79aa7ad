#!/usr/bin/env python3
"""Regenerates the reference fixtures of the models crate from Hugging Face transformers.

    python scripts/reference/make_fixture.py [--gguf .models/SmolLM2-135M-Instruct.Q4_1.gguf]
    python scripts/reference/make_fixture.py --arch gemma3   (.models/gemma-3-270m-q4_k_m.gguf)

Writes, under models/tests/fixtures/ (prefixed `gemma3_` for --arch gemma3):
- reference_greedy.json: for each prompt (chat-templated or raw text), the prompt ids and
  transformers' greedy continuation (32 new tokens, EOS not treated specially), with the
  reference's top-two logit margin at every generated step;
- tokenizer_golden.json: token ids of a set of strings and chat renderings, as transformers'
  tokenizer for the same GGUF produces them.

transformers loads the GGUF with `from_pretrained(dir, gguf_file=...)`, dequantizing every tensor
to float32 (the same numbers as Tandem's `--dtype f32`). Needs torch, transformers, gguf, numpy
(and accelerate, which transformers 5 wants for GGUF files);
CI never runs this: the fixtures are committed.
"""
import argparse
import json
import os

import torch
import transformers
from transformers import AutoModelForCausalLM, AutoTokenizer

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NEW_TOKENS = 32

CHAT_PROMPTS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Give me three tips for planning a small vegetable garden."}],
    [{"role": "system", "content": "You are a concise assistant."},
     {"role": "user", "content": "Explain what a hash function is in one paragraph."}],
    [{"role": "user", "content": "Write a haiku about the ocean."}],
    [{"role": "user", "content": "How many legs does a spider have?"},
     {"role": "assistant", "content": "A spider has eight legs."},
     {"role": "user", "content": "And an insect?"}],
    [{"role": "user", "content": "Translate 'good morning' into Spanish and German."}],
]

# Gemma 3's GGUF carries no chat template; Tandem supplies this one (models/src/gemma3.rs), and
# the fixture renders the chats with it through transformers' own jinja renderer.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}{% set system = namespace(text='') %}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{% set system.text = m['content'] + '\n\n' %}"
    "{% else %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ system.text }}{{ m['content'] | trim }}<end_of_turn>\n{% set system.text = '' %}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Prompts around and far beyond Gemma 3's 512-token sliding window (up to ~2k tokens).
LONG_PARAGRAPH = (
    "A lighthouse keeper's log, day after day, records the weather, the ships that passed and "
    "the small repairs that keep the lamp turning. The entries are short and rarely change: "
    "wind from the west, a trawler at dawn, oil for the mechanism, a cracked pane replaced. "
)

RAW_PROMPTS = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a small village by the sea, there lived",
    "1, 2, 3, 5, 8, 13,",
    "The printing press was invented by",
    # a long prompt (over 200 tokens): several KV blocks, chunked prefill in the Rust test
    "The history of computing is a story of people building machines to help them think. "
    "Early mechanical calculators, such as the ones designed by Pascal and Leibniz in the "
    "seventeenth century, could add and multiply numbers with gears and wheels. In the "
    "nineteenth century Charles Babbage designed the Analytical Engine, a general-purpose "
    "machine that was never completed, and Ada Lovelace wrote what many consider to be the "
    "first computer program for it. The twentieth century brought electronic computers: "
    "machines like ENIAC filled whole rooms, used thousands of vacuum tubes, and consumed "
    "enormous amounts of power. The invention of the transistor in 1947 and of the integrated "
    "circuit a decade later made computers smaller, faster and cheaper. By the 1970s "
    "microprocessors put an entire processor on a single chip, which led to the personal "
    "computer revolution of the 1980s. The internet connected these machines in the 1990s, and "
    "smartphones put a computer in almost every pocket in the 2010s. Today, the most important "
    "trend in computing is",
]

TOKENIZER_STRINGS = [
    "Hello world",
    "Hello, world! How are you doing today?",
    "<|im_start|>user\nHi 12345<|im_end|>\n",
    "  leading spaces and ünïcödé 🦀",
    "numbers: 3.14159, 2718, 1e-9 and 100%",
    "def f(x):\n\treturn x ** 2  # square\n",
    "中文字符和日本語のテキスト",
    "I'm sure they'll say it's fine, won't they?",
    "trailing spaces   \n\n\nnew lines",
    "<|endoftext|><repo_name>tandem<file_sep>",
]

CHAT_RENDERINGS = [
    ([{"role": "user", "content": "Hi"}], True),
    ([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}], False),
    (CHAT_PROMPTS[4], True),
]


@torch.no_grad()
def greedy(model, ids):
    """Greedy decoding for NEW_TOKENS steps, with a KV cache; EOS is not special."""
    out, margins, top1 = [], [], []
    input_ids = torch.tensor([ids])
    past = None
    for _ in range(NEW_TOKENS):
        res = model(input_ids=input_ids, past_key_values=past, use_cache=True)
        past = res.past_key_values
        logits = res.logits[0, -1].float()
        top = torch.topk(logits, 2)
        nxt = int(top.indices[0])
        out.append(nxt)
        margins.append(float(top.values[0] - top.values[1]))
        top1.append(float(top.values[0]))
        input_ids = torch.tensor([[nxt]])
    return out, margins, top1


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", default="llama", choices=["llama", "gemma3"])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--out", default=os.path.join(ROOT, "models", "tests", "fixtures"))
    args = ap.parse_args()
    gemma = args.arch == "gemma3"
    default = "gemma-3-270m-q4_k_m.gguf" if gemma else "SmolLM2-135M-Instruct.Q4_1.gguf"
    d, f = os.path.split(os.path.abspath(args.gguf or os.path.join(ROOT, ".models", default)))
    prefix = "gemma3_" if gemma else ""
    raw_prompts = RAW_PROMPTS
    if gemma:
        # ~600, ~1200 and ~2000 tokens: beyond the window, and far beyond it
        raw_prompts = RAW_PROMPTS + [LONG_PARAGRAPH * n + "The keeper's last entry says" for n in (12, 24, 40)]
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
    if gemma:
        tok.chat_template = GEMMA3_CHAT_TEMPLATE
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    model.eval()

    cases = []
    for msgs in CHAT_PROMPTS:
        text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False)["input_ids"]
        cases.append({"kind": "chat", "messages": msgs, "prompt": text, "prompt_ids": ids})
    for text in raw_prompts:
        ids = tok(text)["input_ids"]
        cases.append({"kind": "raw", "prompt": text, "prompt_ids": ids})
    for c in cases:
        out, margins, top1 = greedy(model, c["prompt_ids"])
        c["output_ids"] = out
        c["top2_margins"] = margins
        c["top1_logits"] = top1
        c["output_text"] = tok.decode(out)
        print(len(c["prompt_ids"]), "->", repr(c["output_text"][:60]), "min margin %.4f" % min(margins))

    meta = {
        "model": f,
        "generator": "scripts/reference/make_fixture.py --arch " + args.arch,
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "dtype": "float32",
        "new_tokens": NEW_TOKENS,
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, prefix + "reference_greedy.json"), "w") as fh:
        json.dump({"meta": meta, "cases": cases}, fh, indent=1, ensure_ascii=False)
        fh.write("\n")

    golden = {
        "meta": meta,
        "encode": [
            {"text": s, "ids": tok(s)["input_ids"], "decoded": tok.decode(tok(s)["input_ids"])}
            for s in TOKENIZER_STRINGS
        ],
        "chat": [
            {
                "messages": m,
                "add_generation_prompt": g,
                "text": tok.apply_chat_template(m, tokenize=False, add_generation_prompt=g),
            }
            for m, g in CHAT_RENDERINGS
        ],
        "bos_token_id": tok.bos_token_id,
        "eos_token_id": tok.eos_token_id,
    }
    with open(os.path.join(args.out, prefix + "tokenizer_golden.json"), "w") as fh:
        json.dump(golden, fh, indent=1, ensure_ascii=False)
        fh.write("\n")


if __name__ == "__main__":
    main()
