"""The project's own models: tiny random ones for tests and the trained default model.

Everything loads through `from_pretrained`, the path the engine and the worker use. The tiny
models come from the session fixture `tiny_model_dirs` in conftest.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerBase

from workers.engine.tiny import ARCHITECTURES, build_tiny_model, default_model_path

ENGLISH = "The quick brown fox jumps over the lazy dog. It's 3.14, isn't it?  Two  spaces.\n"
KOREAN = "안녕하세요. 오늘 날씨가 참 좋네요! 뷁 똠방각하"


@pytest.fixture(scope="module")
def tokenizer(llama_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(llama_dir)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_each_architecture_loads_and_generates(tiny_model_dirs: dict[str, Path], arch: str) -> None:
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch])
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    assert model.config.model_type == arch
    assert 100_000 < model.num_parameters() < 2_000_000
    gen = model.generation_config
    assert (gen.bos_token_id, gen.eos_token_id, gen.pad_token_id) == (
        tok.bos_token_id,
        tok.eos_token_id,
        tok.pad_token_id,
    )
    assert len({tok.bos_token_id, tok.eos_token_id, tok.pad_token_id}) == 3
    ids = tok(ENGLISH, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8) or out[0, -1] == tok.eos_token_id


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_greedy_logits_are_decisive(tiny_model_dirs: dict[str, Path], arch: str) -> None:
    """Greedy comparisons against model.generate() need clear winners, not near-ties."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch])
    tok = AutoTokenizer.from_pretrained(tiny_model_dirs[arch])
    ids = tok([ENGLISH + KOREAN], return_tensors="pt")["input_ids"]
    with torch.no_grad():
        top2 = model(ids).logits[0].topk(2, dim=-1).values
    margins = top2[:, 0] - top2[:, 1]
    assert margins.median() > 1.0


def test_same_seed_same_weights(tmp_path: Path) -> None:
    a = load_file(build_tiny_model(tmp_path / "a", "qwen2", seed=3) / "model.safetensors")
    b = load_file(build_tiny_model(tmp_path / "b", "qwen2", seed=3) / "model.safetensors")
    c = load_file(build_tiny_model(tmp_path / "c", "qwen2", seed=4) / "model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="mamba"):
        build_tiny_model(tmp_path, "mamba")


@pytest.mark.parametrize("text", [ENGLISH, KOREAN, ENGLISH + KOREAN])
def test_tokenizer_round_trips(tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    ids = tokenizer(text)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_splits_rare_korean_syllables(tokenizer: PreTrainedTokenizerBase) -> None:
    """Streaming detokenizers must cope with a character whose bytes span several tokens."""
    ids = tokenizer("뷁", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1
    assert "\ufffd" in tokenizer.decode(ids[:1])
    assert 1000 <= len(tokenizer) <= 4096


def test_chat_template_is_chatml(tokenizer: PreTrainedTokenizerBase) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "안녕?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|bos|><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n안녕?<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == tokenizer.eos_token_id


@pytest.fixture(scope="module")
def default_model() -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    path = default_model_path()
    model = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(model, LlamaForCausalLM)
    return model, AutoTokenizer.from_pretrained(path)


def greedy(
    model: LlamaForCausalLM, tok: PreTrainedTokenizerBase, prompt: str, n: int, chat: bool = False
) -> str:
    """The greedy continuation of `prompt` (already rendered with BOS when `chat`)."""
    ids = tok(prompt, add_special_tokens=not chat, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return tok.batch_decode(out[:, ids.shape[1] :], skip_special_tokens=True)[0]


def test_default_model_writes_english_words(
    default_model: tuple[LlamaForCausalLM, PreTrainedTokenizerBase],
) -> None:
    model, tok = default_model
    assert model.dtype == torch.float32  # fp16 on disk, float32 in config.json
    text = greedy(model, tok, "ROMEO:\nWhat light through yonder window", 40)
    words = [w.strip(".,;:!?'-") for w in text.split()]
    assert len(words) >= 10, text
    assert sum(w.isascii() and w.isalpha() for w in words) >= 0.7 * len(words), text
    common = {"the", "and", "i", "to", "of", "my", "you", "a", "is", "that", "not", "me", "with", "it"}
    assert len(common & {w.lower() for w in words}) >= 3, text


def test_default_model_answers_in_chat(
    default_model: tuple[LlamaForCausalLM, PreTrainedTokenizerBase],
) -> None:
    model, tok = default_model
    assert tok.chat_template is not None
    messages = [{"role": "user", "content": "What news from the king?"}]
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert isinstance(prompt, str)
    reply = greedy(model, tok, prompt, 60, chat=True)
    assert "<|im_start|>" not in reply
    assert sum(c.isascii() for c in reply) >= 0.9 * len(reply) > 0, reply
