"""Int8 weights (``SPOOL_QUANTIZATION=int8``) against float32: quality, and the engine's speed.

For each model of ``--models``: ``default`` (the trained default model, workers/engine/default_model),
``tiny`` (``spool tiny-model``'s random Llama) and peers_bench's random Llama shapes (``bench``,
``deep``, ``gqa``: bench/peers_bench.py SHAPES, built here with bench/workload.py build_model):

quality  greedy token agreement: ``--prompts`` prompts (random token ids of 16..128 tokens, as the
         benchmarks'; for the default model, its corpus's lines), ``--tokens`` new tokens each, EOS
         ignored, float32 and int8 engines (eager): the fraction of positions equal before each
         output's first divergence, the fraction of all positions equal, and outputs equal whole.
         Perplexity of float32 and int8 (transformers' forward on the same weights) on
         ``--ppl-tokens`` tokens of a text, in windows of 256: the default model on its corpus
         (shakespeare.txt, its training text) and on english.txt; random models on english.txt.
         A random model's logits have small margins, so its greedy path flips on small errors:
         agreement on it is a weak signal, and its perplexity is near the vocabulary size either way.
speed    with ``--speed``: the engine alone (peers_bench's uniform workload: 32 prompts of 16..128
         tokens, 64 new tokens each, greedy, batch 32), float32 and int8, eager and (with
         ``--compile``) compiled, alternating for ``--rounds`` rounds, medians and int8 / float32.

    .venv/bin/python bench/quant_quality.py                                  # quality, every model
    .venv/bin/python bench/quant_quality.py --models deep,bench --speed --compile --rounds 3 --threads 1
"""

from __future__ import annotations

import argparse
import math
import os
import random
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from workload import FULL, build_model, quiet_libraries, random_prompts

from workers.engine import Engine, EngineConfig, SamplingParams
from workers.engine.model_runner import _quantize_int8
from workers.engine.tiny import CORPUS_DIR, build_tiny_model, default_model_path

MODELS = ("default", "tiny", "bench", "deep", "gqa")
WINDOW = 256  # perplexity window, tokens (the default model was trained on 256-token windows)


def shapes() -> dict[str, Any]:
    from peers_bench import SHAPES

    return SHAPES


def model_dir(name: str, root: Path, seed: int) -> Path:
    if name == "default":
        return default_model_path()
    out = root / name
    if not (out / "config.json").exists():
        if name == "tiny":
            build_tiny_model(out, "llama")
        else:
            build_model(out, shapes()[name], seed)
    return out


def prompts_for(name: str, path: Path, n: int, seed: int) -> list[list[int]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    rng = random.Random(seed)
    if name != "default":
        return random_prompts(rng, n, FULL.uniform_prompt_len, len(tokenizer))
    lines = [line for line in (CORPUS_DIR / "shakespeare.txt").read_text().splitlines() if len(line) > 40]
    return [tokenizer.encode(line) for line in rng.sample(lines, n)]


def engine(path: Path, args: argparse.Namespace, quantization: str, compile: bool = False) -> Engine:
    return Engine(
        EngineConfig(
            model=str(path),
            device=args.device,
            max_batch_size=32,
            max_model_len=512,
            quantization=quantization,
            compile=compile,
            compile_cache_dir=None,
        ),
        seed=0,
    )


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    firsts = [
        next((i for i, (x, y) in enumerate(zip(p, q, strict=True)) if x != y), len(p))
        for p, q in zip(a, b, strict=True)
    ]
    total = sum(len(p) for p in a)
    return {
        "before_first_divergence": sum(firsts) / total,
        "positions_equal": sum(x == y for p, q in zip(a, b, strict=True) for x, y in zip(p, q, strict=True))
        / total,
        "outputs_equal": sum(f == len(p) for f, p in zip(firsts, a, strict=True)) / len(a),
        "first_divergence_median": statistics.median(firsts),
    }


@torch.inference_mode()
def perplexity(model: Any, ids: list[int], device: str) -> float:
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, WINDOW):
        window = torch.tensor([ids[start : start + WINDOW + 1]], device=device)
        if window.shape[1] < 2:
            break
        logits = model(input_ids=window[:, :-1]).logits.float()
        nll += torch.nn.functional.cross_entropy(logits[0], window[0, 1:], reduction="sum").item()
        count += window.shape[1] - 1
    return math.exp(nll / count)


def perplexities(name: str, path: Path, args: argparse.Namespace) -> dict[str, tuple[float, float]]:
    tokenizer = AutoTokenizer.from_pretrained(path)
    texts = {"english.txt": CORPUS_DIR / "english.txt"}
    if name == "default":
        texts = {"shakespeare.txt": CORPUS_DIR / "shakespeare.txt", **texts}
    out = {}
    for label, file in texts.items():
        ids = tokenizer.encode(file.read_text())[: args.ppl_tokens + 1]
        ppl = []
        for quantization in ("none", "int8"):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(args.device).eval()
            if quantization == "int8":
                _quantize_int8(model)
            ppl.append(perplexity(model, ids, args.device))
        out[f"{label} ({len(ids) - 1} tokens)"] = (ppl[0], ppl[1])
    return out


def quality(name: str, path: Path, args: argparse.Namespace) -> None:
    prompts = prompts_for(name, path, args.prompts, args.seed)
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    outs = {
        q: [o.token_ids for o in engine(path, args, q).generate(prompts, params)] for q in ("none", "int8")
    }
    a = agreement(outs["none"], outs["int8"])
    print(
        f"  greedy agreement, {len(prompts)} prompts x {args.tokens} tokens: before the first divergence "
        f"{a['before_first_divergence']:.3f}, positions equal {a['positions_equal']:.3f}, outputs equal "
        f"{a['outputs_equal']:.3f} (first divergence at token {a['first_divergence_median']:.0f}, median)"
    )
    for label, (f32, i8) in perplexities(name, path, args).items():
        print(f"  perplexity on {label}: float32 {f32:.4g}, int8 {i8:.4g} (int8 / float32 {i8 / f32:.4f})")


def run_uniform(e: Engine, prompts: Sequence[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    t0 = time.perf_counter()
    outs = e.generate(list(prompts), params)
    seconds = time.perf_counter() - t0
    assert all(len(o.token_ids) == new for o in outs)
    return sum(len(o.token_ids) for o in outs) / seconds


def speed(path: Path, vocab: int, args: argparse.Namespace) -> None:
    prompts = random_prompts(random.Random(args.seed), FULL.uniform_requests, FULL.uniform_prompt_len, vocab)
    new = FULL.uniform_new_tokens
    sides = {}
    for compiled in (False, True) if args.compile else (False,):
        for quantization in ("none", "int8"):
            label = f"{'compiled' if compiled else 'eager'} {'float32' if quantization == 'none' else 'int8'}"
            t0 = time.perf_counter()
            sides[label] = engine(path, args, quantization, compiled)
            print(f"  {label}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    for e in sides.values():  # warm-up
        run_uniform(e, prompts[:8], 4)
    got: dict[str, list[float]] = {label: [] for label in sides}
    for _ in range(args.rounds):
        for label, e in sides.items():
            got[label].append(run_uniform(e, prompts, new))
    print(
        f"  engine alone, {len(prompts)} prompts x {new} new tokens, batch 32, "
        f"{torch.get_num_threads()} threads, tok/s (rounds; median):"
    )
    med = {label: statistics.median(v) for label, v in got.items()}
    for label, v in got.items():
        print(f"    {label:<18} {', '.join(f'{x:.1f}' for x in v):<30} {med[label]:.1f}")
    for kind in ("eager", "compiled"):
        if f"{kind} int8" in med:
            print(f"    {kind}: int8 / float32 {med[f'{kind} int8'] / med[f'{kind} float32']:.3f}")


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of: {', '.join(MODELS)}")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="new tokens per prompt (agreement)")
    p.add_argument("--ppl-tokens", type=int, default=8192, help="tokens of each perplexity text")
    p.add_argument("--speed", action="store_true", help="also the engine's tok/s, float32 and int8")
    p.add_argument("--compile", action="store_true", help="with --speed: the compiled engines too")
    p.add_argument("--rounds", type=int, default=3, help="with --speed: rounds, alternating")
    p.add_argument("--no-quality", action="store_true", help="with --speed: the speed alone")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model-dir", type=Path, help="build the random models here (default: a temporary one)")
    args = p.parse_args(argv)
    unknown = set(args.models.split(",")) - set(MODELS)
    if unknown:
        p.error(f"unknown models {sorted(unknown)}")
    quiet_libraries()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, load average {os.getloadavg()}")
    with tempfile.TemporaryDirectory() as tmp:
        root = args.model_dir or Path(tmp)
        for name in args.models.split(","):
            path = model_dir(name, root, args.seed)
            vocab = len(AutoTokenizer.from_pretrained(path))
            params = sum(t.numel() for t in AutoModelForCausalLM.from_pretrained(path).parameters())
            print(f"\n{name}: {params / 1e6:.1f}M parameters, vocabulary {vocab} ({path})", flush=True)
            if not args.no_quality:
                quality(name, path, args)
            if args.speed:
                speed(path, vocab, args)
    print(f"\nload average at the end {os.getloadavg()}")


if __name__ == "__main__":
    main()
