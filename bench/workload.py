"""What the benchmarks run: the model sizes, the workload plans, the random model and its prompts.

bench/engine_bench.py runs them on the engine and transformers, bench/stack_bench.py the uniform
one through the whole service. Importing this module puts the repository root on the module path,
so the scripts run from a checkout without an install.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, PreTrainedTokenizerFast

from workers.engine import Engine, EngineConfig
from workers.engine.tiny import (
    special_token_ids,
    tiny_corpus,
    tiny_tokenizer,
    train_tokenizer,
    wrap_tokenizer,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


# -- sizes ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelSize:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    max_position_embeddings: int


@dataclass(frozen=True)
class Plan:
    model: ModelSize
    # uniform
    uniform_requests: int
    uniform_prompt_len: tuple[int, int]
    uniform_new_tokens: int
    uniform_batch: int
    # mixed
    mixed_requests: int
    mixed_prompt_len: tuple[int, int]
    mixed_max_tokens: tuple[int, int]
    mixed_batch: int
    # decode
    decode_contexts: tuple[int, int]
    decode_steps: int  # timed step() calls per context, cached paths
    nocache_steps: tuple[int, int]  # timed steps per context, no-cache loop
    decode_max_model_len: int
    # prefix: shared prefix (one prefix + unique tails) and multi-turn conversations
    prefix_requests: int
    prefix_len: int
    prefix_tail_len: tuple[int, int]
    prefix_new_tokens: int
    prefix_batch: int
    conversations: int
    turns: int
    turn_first_len: int  # the first turn's prompt (a system prompt and a question)
    turn_user_len: int  # what each later turn adds after the previous reply
    turn_new_tokens: int
    # a warm-up runs this many requests (and at most warmup_tokens new tokens each)
    warmup_requests: int
    warmup_tokens: int


# Each knob as (FULL, QUICK): FULL is the measured run (docs/benchmarks.md), QUICK (--quick) runs
# every code path in seconds.
_SIZES: dict[str, tuple[int, int]] = {
    "vocab_size": (32000, 4096),
    "hidden_size": (512, 64),
    "num_layers": (8, 2),
    "num_heads": (8, 4),
    "num_kv_heads": (8, 2),
    "intermediate_size": (1408, 128),
    "max_position_embeddings": (2048, 512),
}
_WORKLOADS: dict[str, tuple[Any, Any]] = {
    "uniform_requests": (32, 8),
    "uniform_prompt_len": ((16, 128), (4, 16)),
    "uniform_new_tokens": (64, 8),
    "uniform_batch": (32, 8),
    "mixed_requests": (64, 12),
    "mixed_prompt_len": ((16, 128), (4, 16)),
    "mixed_max_tokens": ((16, 128), (2, 8)),
    "mixed_batch": (16, 4),
    "decode_contexts": ((64, 1024), (16, 128)),
    "decode_steps": (32, 4),
    "nocache_steps": ((16, 4), (2, 2)),
    "decode_max_model_len": (2048, 256),
    "prefix_requests": (64, 8),
    "prefix_len": (1024, 64),
    "prefix_tail_len": ((16, 64), (4, 8)),
    "prefix_new_tokens": (32, 4),
    "prefix_batch": (16, 4),
    "conversations": (16, 4),
    "turns": (4, 3),
    "turn_first_len": (256, 32),
    "turn_user_len": (64, 8),
    "turn_new_tokens": (32, 4),
    "warmup_requests": (4, 2),
    "warmup_tokens": (8, 2),
}


def _plan(column: int) -> Plan:
    # A knob missing from the tables, or one Plan lacks, fails at import (a TypeError).
    size = ModelSize(**{k: v[column] for k, v in _SIZES.items()})
    return Plan(size, **{k: v[column] for k, v in _WORKLOADS.items()})


FULL, QUICK = _plan(0), _plan(1)


def quiet_libraries() -> None:
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # "no psutil" noise on CPU
    warnings.filterwarnings("ignore")


def unseen_like(rng: random.Random, prompts: Sequence[Sequence[int]], vocab: int) -> list[list[int]]:
    """Other random prompts of the same lengths: an engine warmed up on them has none of the timed
    prompts in its prefix cache."""
    return [[rng.randrange(4, vocab) for _ in p] for p in prompts]


def random_prompts(rng: random.Random, n: int, lengths: tuple[int, int], vocab: int) -> list[list[int]]:
    # Ids 4.. avoid the special tokens (pad, bos, <|im_start|>, eos) of the tiny tokenizer.
    return [[rng.randrange(4, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


# -- the model ------------------------------------------------------------------------------------


def bench_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The tiny tokenizer's byte-level BPE, its vocabulary padded with plain words to ``vocab_size``.

    Prompts are token ids, so the tokenizer only matters for the engine's incremental
    detokenizer; padding the vocabulary makes every id the model can emit decode to text
    (ids past the end of a vocabulary decode to nothing, which would make detokenizing free).
    A vocabulary smaller than the tiny tokenizer's is a byte-level BPE of that size trained on
    the same corpus.
    """
    base = tiny_tokenizer()
    if vocab_size < len(base):
        return train_tokenizer(tiny_corpus(), vocab_size)
    data = json.loads(base.backend_tokenizer.to_str())
    vocab = data["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"\u0120w{i}"] = i  # "\u0120" is the byte-level space: id i decodes to " w{i}"
    return wrap_tokenizer(Tokenizer.from_str(json.dumps(data)))


def build_model(out_dir: Path, size: ModelSize, seed: int) -> int:
    """Write a random Llama and its tokenizer to ``out_dir``; return its parameter count."""
    tokenizer = bench_tokenizer(size.vocab_size)
    assert len(tokenizer) == size.vocab_size, (len(tokenizer), size.vocab_size)
    ids = special_token_ids(tokenizer)
    config = LlamaConfig(
        vocab_size=size.vocab_size,
        hidden_size=size.hidden_size,
        num_hidden_layers=size.num_layers,
        num_attention_heads=size.num_heads,
        num_key_value_heads=size.num_kv_heads,
        intermediate_size=size.intermediate_size,
        max_position_embeddings=size.max_position_embeddings,
        tie_word_embeddings=False,
        **ids,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config = GenerationConfig(**ids)
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sum(p.numel() for p in model.parameters())


def spool_engine(
    model_dir: Path, args: argparse.Namespace, batch: int, max_model_len: int, **config: Any
) -> Engine:
    return Engine(
        EngineConfig(
            model=str(model_dir),
            device=args.device,
            dtype=args.dtype,
            quantization=getattr(args, "quantization", "none"),  # peers_bench's --quantization
            max_batch_size=batch,
            max_model_len=max_model_len,
            **config,
        ),
        seed=0,
    )


# -- the uniform workload as text (bench/stack_bench.py) -------------------------------------


def single_token_words(tokenizer: Any) -> list[str]:
    """Words that the tokenizer turns into exactly one token when preceded by a space, sorted by id."""
    words = []
    for piece, token_id in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        word = piece[1:]
        plain = piece.startswith("\u0120") and word.isascii() and word.isalpha()  # "\u0120": byte-level space
        if plain and tokenizer.encode(" " + word, add_special_tokens=False) == [token_id]:
            words.append(word)
    return words


def text_prompts(plan: Plan, seed: int, tokenizer: Any) -> list[str]:
    """engine_bench's uniform prompts as text the job API accepts, with the same token counts.

    The prompts are engine_bench's (same seed, same lengths); each id past the first is replaced
    by a word that is one token after a space, and the tokenizer's BOS takes the first position,
    so the text encodes to exactly the engine benchmark's prompt length.
    """
    ids = random_prompts(
        random.Random(seed), plan.uniform_requests, plan.uniform_prompt_len, plan.model.vocab_size
    )
    words = single_token_words(tokenizer)
    prompts = ["".join(" " + words[i % len(words)] for i in p[1:]) for p in ids]
    for text, p in zip(prompts, ids, strict=True):
        n = len(tokenizer.encode(text, add_special_tokens=True))
        if n != len(p):
            raise RuntimeError(f"a prompt encodes to {n} tokens instead of {len(p)}: {text[:80]!r}")
    return prompts
