"""The tiny embedding model the project builds itself: a random BERT with the tiny models'
tokenizer (workers/engine/tiny.py), saved in sentence-transformers' layout (mean pooling, then
Normalize), so that sentence-transformers loads it as it is and a worker embeds with it offline.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import BertConfig, BertModel

from workers.engine.tiny import tiny_tokenizer

TINY_EMBEDDING_NAME = "spool-tiny-embedding"
_POOLING = {
    "word_embedding_dimension": 0,
    "pooling_mode_cls_token": False,
    "pooling_mode_mean_tokens": True,
    "pooling_mode_max_tokens": False,
    "pooling_mode_mean_sqrt_len_tokens": False,
    "pooling_mode_weightedmean_tokens": False,
    "pooling_mode_lasttoken": False,
    "include_prompt": True,
}
_MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def build_tiny_embedding_model(
    out_dir: str | Path,
    *,
    vocab_size: int = 2048,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    intermediate_size: int = 128,
    max_len: int = 256,
    pooling: str = "mean",
    seed: int = 0,
) -> Path:
    """Write a random BERT encoder, its tokenizer and sentence-transformers' files (pooling
    ``mean``, ``cls`` or ``last``). The same arguments give the same files. Returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = tiny_tokenizer(vocab_size)
    tokenizer.model_max_length = max_len
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_len,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(seed)
    BertModel(config).save_pretrained(out)
    tokenizer.save_pretrained(out)
    mode = {
        "mean": "pooling_mode_mean_tokens",
        "cls": "pooling_mode_cls_token",
        "last": "pooling_mode_lasttoken",
    }
    pool = {
        **_POOLING,
        "word_embedding_dimension": hidden_size,
        "pooling_mode_mean_tokens": False,
        mode[pooling]: True,
    }
    (out / "1_Pooling").mkdir(exist_ok=True)
    (out / "2_Normalize").mkdir(exist_ok=True)
    (out / "1_Pooling" / "config.json").write_text(json.dumps(pool, indent=2) + "\n")
    (out / "modules.json").write_text(json.dumps(_MODULES, indent=2) + "\n")
    st = {"max_seq_length": max_len, "do_lower_case": False}
    (out / "sentence_bert_config.json").write_text(json.dumps(st, indent=2) + "\n")
    return out


def default_embedding_model_path() -> Path:
    """The tiny embedding model a worker embeds with when no model is named: built once into the
    user's cache directory (a few seconds), then loaded from there."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    out = cache / "spool" / TINY_EMBEDDING_NAME
    if not (out / "modules.json").is_file():
        tmp = out.with_name(f"{out.name}.{os.getpid()}.tmp")
        build_tiny_embedding_model(tmp)
        try:
            tmp.rename(out)  # whole or not at all: a worker starting meanwhile builds its own
        except OSError:
            if not (out / "modules.json").is_file():
                raise
    return out
