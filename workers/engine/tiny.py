"""Small models the project makes itself: random test models and the trained default model.

Tests need real checkpoints that load through the normal path
(`AutoModelForCausalLM.from_pretrained` / `AutoTokenizer.from_pretrained`) without a network,
for each architecture the engine supports. `build_tiny_model` writes one in a few seconds from
a byte-level BPE tokenizer trained on the corpus in `corpus/` (English and Korean) and a
random model. `default_model_path` points at the small Llama that `spool up` serves when
SPOOL_MODEL is unset (trained by scripts/train_default_model.py; see docs/default-model.md).
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

CORPUS_DIR = Path(__file__).parent / "corpus"
DEFAULT_MODEL_DIR = Path(__file__).parent / "default_model"
ARCHITECTURES = ("llama", "qwen2", "gpt2", "opt")
# The norm in front of the LM head ("model.norm" for Llama and Qwen2): scaling its weight scales
# the logits, whether or not the embeddings are tied.
FINAL_NORM = {"gpt2": "transformer.ln_f", "opt": "model.decoder.final_layer_norm"}

PAD, BOS, IM_START, IM_END = "<|pad|>", "<|bos|>", "<|im_start|>", "<|im_end|>"
# NOTE: the order fixes the ids (pad 0, bos 1, <|im_start|> 2, <|im_end|> 3). <|im_end|> is EOS
# so a chat reply ends where its turn ends, as in Qwen2.5-Instruct.
SPECIAL_TOKENS = (PAD, BOS, IM_START, IM_END)
EOS = IM_END

# ChatML, with tools and calls as Qwen 2.5 writes them (Hermes' <tool_call> format).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}"
    "\n</tools>\nCall a function as <tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n'
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n</tool_response><|im_end|>\n"
    "{% else %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
    "{% for call in message['tool_calls'] or [] %}"
    '<tool_call>\n{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}'
    "\n</tool_call>"
    "{% endfor %}"
    "<|im_end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# How many characters of the English play text go into the tiny tokenizer's corpus, next to
# english.txt and korean.txt: enough for common English merges, small enough to train in < 1 s.
_TINY_SHAKESPEARE_CHARS = 200_000


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer (GPT-2 style) with bos/eos/pad and a ChatML template.

    Byte-level so that any text round-trips, and so that rare multi-byte characters (Korean
    syllables are three bytes) are split across tokens, which the detokenizer must handle.
    Every input `encode` adds BOS in front, as Llama tokenizers do.
    """
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    return wrap_tokenizer(tok)


def wrap_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    """The transformers tokenizer around `tok`, with the special tokens and the chat template."""
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        # NOTE: the default cleanup rewrites " ." as "." and would break the round trip.
        clean_up_tokenization_spaces=False,
    )


def tiny_corpus() -> list[str]:
    """The tiny tokenizer's training text: paragraphs of English and Korean."""
    english = (CORPUS_DIR / "english.txt").read_text(encoding="utf-8")
    korean = (CORPUS_DIR / "korean.txt").read_text(encoding="utf-8")
    plays = (CORPUS_DIR / "shakespeare.txt").read_text(encoding="utf-8")[:_TINY_SHAKESPEARE_CHARS]
    return [p for text in (english, korean, plays) for p in text.split("\n\n") if p.strip()]


@functools.lru_cache(maxsize=4)
def _tiny_tokenizer_json(vocab_size: int) -> str:
    """Train once per process and vocabulary size; building four architectures reuses it."""
    return train_tokenizer(tiny_corpus(), vocab_size).backend_tokenizer.to_str()


def tiny_tokenizer(vocab_size: int = 2048) -> PreTrainedTokenizerFast:
    """A fresh tokenizer object for the tiny models (training is deterministic and cached)."""
    return wrap_tokenizer(Tokenizer.from_str(_tiny_tokenizer_json(vocab_size)))


def make_config(
    arch: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    initializer_range: float,
    special_ids: dict[str, Any],
) -> PretrainedConfig:
    """The transformers config for `arch` with the project's sizes and special token ids.

    `num_kv_heads` < `num_heads` gives Llama and Qwen2 grouped-query attention, which the
    engine's KV cache must handle; GPT-2 and OPT have no such option.
    """
    common: dict[str, Any] = dict(vocab_size=vocab_size, initializer_range=initializer_range, **special_ids)
    if arch in ("llama", "qwen2"):
        cls = LlamaConfig if arch == "llama" else Qwen2Config
        return cls(
            hidden_size=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            intermediate_size=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            tie_word_embeddings=False,
            **common,
        )
    if arch == "gpt2":
        return GPT2Config(
            n_embd=hidden_size,
            n_layer=num_layers,
            n_head=num_heads,
            n_inner=intermediate_size,
            n_positions=max_position_embeddings,
            **common,
        )
    if arch == "opt":
        return OPTConfig(
            hidden_size=hidden_size,
            word_embed_proj_dim=hidden_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            ffn_dim=intermediate_size,
            max_position_embeddings=max_position_embeddings,
            **common,
        )
    raise ValueError(f"unknown architecture {arch!r}; choose one of {', '.join(ARCHITECTURES)}")


def special_token_ids(tokenizer: PreTrainedTokenizerFast) -> dict[str, Any]:
    """bos/eos/pad ids as config keyword arguments, so configs never keep their class defaults."""
    return {
        "bos_token_id": tokenizer.bos_token_id,
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }


def save_model_dir(out_dir: Path, model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast) -> None:
    """Write model, tokenizer and a generation_config with bos/eos/pad set."""
    model.generation_config = GenerationConfig(**special_token_ids(tokenizer))
    model.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)


def build_tiny_model(
    out_dir: str | Path,
    arch: str = "llama",
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    initializer_range: float = 0.2,
    logit_scale: float = 10.0,
    seed: int = 0,
) -> Path:
    """Write a random causal LM of `arch` ("llama", "qwen2", "gpt2", "opt") and its tokenizer.

    The same arguments give the same files. Tests compare the engine's greedy tokens with
    `model.generate()`, and near-ties in the flat logits of a random model would flip on float
    noise, so the logits are made decisive: `initializer_range` is ten times the usual 0.02 and
    the final norm's weight is multiplied by `logit_scale`. Returns the directory.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(vocab_size)
    config = make_config(
        arch,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        special_ids=special_token_ids(tokenizer),
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        model.get_parameter(f"{FINAL_NORM.get(arch, 'model.norm')}.weight").mul_(logit_scale)
    save_model_dir(out, model, tokenizer)
    return out


def make_eos_unreachable(model_dir: str | Path, token: str = "<|unreachable_eos|>") -> int:
    """Give a saved model an EOS id past its last logit, so no request ends before max_tokens.

    The job API has no ignore_eos; the engine stops on the ids of the generation config's and
    the tokenizer's eos_token_id. A new special token gets id vocab_size, which the model (its
    logits have vocab_size columns) can never emit. Returns that id.
    """
    model_dir = Path(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.add_special_tokens({"eos_token": token})
    eos = int(tokenizer.eos_token_id)
    tokenizer.save_pretrained(model_dir)
    for name in ("config.json", "generation_config.json"):
        path = model_dir / name
        data = json.loads(path.read_text())
        data["eos_token_id"] = eos
        path.write_text(json.dumps(data, indent=2) + "\n")
    return eos


def default_model_path() -> Path:
    """The directory of the model served when SPOOL_MODEL is unset (shipped with the package)."""
    if not (DEFAULT_MODEL_DIR / "config.json").is_file():
        raise FileNotFoundError(
            f"{DEFAULT_MODEL_DIR} has no model; run scripts/train_default_model.py (docs/default-model.md)"
        )
    return DEFAULT_MODEL_DIR
