"""The CPU decode attention kernel (workers/engine/decode_kernel.py): the attention SDPA computes,
each row over its own slot up to its own position; and the engine on a CPU in float32 uses it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from greedy import TEST_DEVICE, greedy
from test_parity import make_prompts

from workers.engine import SamplingParams, decode_kernel

needs_cpu = pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the kernel is the CPU's (TEST_DEVICE=cpu)")


@needs_cpu
@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (6, 2)], ids=["mha", "gqa"])
def test_the_kernel_is_sdpa_over_each_rows_slot_and_length(heads: int, kv_heads: int) -> None:
    assert decode_kernel.load(), "the kernel builds on this machine (a C++ compiler and ninja)"
    torch.manual_seed(0)
    slots, max_len, dim = 5, 40, 16
    key, value = torch.randn(slots, kv_heads, max_len, dim), torch.randn(slots, kv_heads, max_len, dim)
    # The query as a packed forward hands it over: [1, Hq, T, D] viewed as [T, Hq, D].
    query = torch.randn(1, 3, heads, dim).transpose(1, 2)[0].transpose(0, 1)
    rows_slots, rows_positions = torch.tensor([3, 0, 4]), torch.tensor([0, 17, 39])
    out = torch.ops.spool_cpu.decode_attention(query, key, value, rows_slots, rows_positions, 0.3)
    assert out.shape == (3, heads, dim)
    for r, (s, p) in enumerate(zip(rows_slots.tolist(), rows_positions.tolist(), strict=True)):
        k = key[s : s + 1, :, : p + 1].repeat_interleave(heads // kv_heads, dim=1)
        v = value[s : s + 1, :, : p + 1].repeat_interleave(heads // kv_heads, dim=1)
        expected = F.scaled_dot_product_attention(query[r][None, :, None], k, v, scale=0.3)[0, :, 0]
        torch.testing.assert_close(out[r], expected, rtol=1e-5, atol=1e-5)


@needs_cpu
def test_the_kernel_refuses_a_position_past_the_cache() -> None:
    assert decode_kernel.load()
    key = torch.zeros(2, 1, 8, 4)
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.spool_cpu.decode_attention(
            torch.zeros(1, 1, 4), key, key, torch.tensor([1]), torch.tensor([8]), 1.0
        )


@needs_cpu
@pytest.mark.parametrize("kernel", [True, False], ids=["kernel", "sdpa"])
def test_greedy_parity_with_the_kernel_and_without(kernel: bool, make_engine, llama_dir: Path) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(decode_kernel=kernel, prefill_chunk_size=16, max_prefill_tokens_per_step=32)
    assert engine.runner.cache.decode_kernel is kernel
    prompts = make_prompts(7, seed=3)
    outs = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
    assert [o.token_ids for o in outs] == [greedy(llama_dir, p, 12).token_ids for p in prompts]


@needs_cpu
def test_a_lock_left_by_a_killed_process_does_not_hang_the_next_load(tmp_path: Path) -> None:
    """torch's loader waits while its build's ``lock`` file exists; a process killed while it held
    it (SIGKILL) leaves it. The next worker's load removes it under its own flock and goes on."""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path)}
    load = [sys.executable, "-c", "from workers.engine import decode_kernel; assert decode_kernel.load()"]
    subprocess.run(load, env=env, check=True, timeout=600)  # built once in this directory
    [build] = [d for d in tmp_path.rglob("spool_decode_attention_*") if d.is_dir()]
    (build / "lock").touch()  # as a process killed mid-load leaves it
    subprocess.run(load, env=env, check=True, timeout=120)  # without the flock: waits forever
    assert not (build / "lock").exists()
