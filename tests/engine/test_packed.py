"""One step is one packed forward (decode rows and prefill chunks share the linear layers), and
reads device data back once."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
from greedy import TEST_DEVICE
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from workers.engine import Engine, SamplingParams
from workers.engine.tiny import ARCHITECTURES


def test_a_step_with_decode_rows_and_prefill_chunks_runs_one_forward(make_engine) -> None:  # type: ignore[no-untyped-def]
    engine = make_engine(prefill_chunk_size=8, max_prefill_tokens_per_step=16)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    engine.add_request("a", "the quick brown fox", params)
    engine.add_request("b", "rivers run to the sea", params)
    engine.step()  # prefills both; from now on they decode

    forwards: list[int] = []  # tokens per model forward

    def count(_module: Any, _args: Any, kwargs: dict[str, Any]) -> None:
        forwards.append(kwargs["input_ids"].shape[1])

    handle = engine.runner.model.register_forward_pre_hook(count, with_kwargs=True)
    try:
        engine.add_request("c", "old forests singing songs of time " * 4, params)  # longer than one chunk
        deltas = engine.step()
    finally:
        handle.remove()

    # Two decode rows and one 8-token chunk of "c", in a single forward of 10 tokens.
    assert forwards == [2 + 8]
    assert sorted(d.request_id for d in deltas) == ["a", "b"]  # "c" is not due a token yet


# Tensor methods and functions that read device data back to the host (a sync on a GPU).
HOST_READS = {
    *("tolist", "item", "cpu", "numpy", "nonzero", "any", "all", "equal", "unique", "masked_select"),
    *(
        "__contains__",
        "__bool__",
        "__int__",
        "__float__",
        "__index__",
        "__iter__",
        "__len__",
        "__format__",
        "__repr__",
    ),
}


# ATen ops that read device data (or wait for it to size their output): what the Python-level
# count misses when a composite op (``Tensor.__contains__``, boolean indexing, ...) calls them.
# (Under inference_mode ``.item()`` reaches the mode as ``item``, not ``_local_scalar_dense``.)
SYNCING_ATEN_OPS = {
    "item",
    "_local_scalar_dense",
    "is_nonzero",
    "equal",
    "nonzero",
    "masked_select",
    "_unique2",
    "unique_dim",
}


class CountSyncingOps(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func.overloadpacket.__name__ in SYNCING_ATEN_OPS:
            self.ops.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


class CountHostReads(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if getattr(func, "__name__", "") in HOST_READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def engine_mid_run(make_engine, model_dir: Path) -> Engine:  # type: ignore[no-untyped-def]
    """An engine whose next step decodes two rows (greedy, top-p) and prefills a chunk of a third
    (top-k): the step the tests below watch."""
    engine: Engine = make_engine(model=str(model_dir), prefill_chunk_size=8, max_prefill_tokens_per_step=16)
    engine.add_request(
        "greedy", "the quick brown fox jumps over", SamplingParams(max_tokens=8, temperature=0)
    )
    engine.add_request("top-p", "hello", SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1))
    engine.step()
    engine.add_request("top-k", "rivers run to the sea " * 4, SamplingParams(max_tokens=4, top_k=5))
    return engine


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_step_reads_device_data_back_once(arch: str, tiny_model_dirs: dict[str, Path], make_engine) -> None:  # type: ignore[no-untyped-def]
    """The sampled ids, and nothing else: no .item() or data-dependent branch in the hot loop.

    Counted at the Python level (what the engine and the model's Python code call) and at the
    ATen level (what composite ops call inside), on a step that decodes, prefills a chunk and
    samples greedy, top-p and top-k rows together.
    """
    engine = engine_mid_run(make_engine, tiny_model_dirs[arch])
    with CountHostReads() as counter, CountSyncingOps() as aten:
        deltas = engine.step()
    assert {d.request_id for d in deltas} == {"greedy", "top-p"}  # "top-k" is mid-prefill
    assert counter.reads == ["tolist"]
    assert aten.ops == []  # (tolist reads CPU memory directly: on a GPU it is a copy, not one of these)


@pytest.mark.skipif(not TEST_DEVICE.startswith("cuda"), reason="CUDA's sync debug mode (TEST_DEVICE=cuda)")
@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_a_step_synchronizes_the_gpu_once(arch: str, tiny_model_dirs: dict[str, Path], make_engine) -> None:  # type: ignore[no-untyped-def]
    """The same step seen from below Python: CUDA's sync debug mode warns on every call that
    waits for the GPU, including those inside C++ ops the Python-level count cannot see."""
    engine = engine_mid_run(make_engine, tiny_model_dirs[arch])
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            deltas = engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert {d.request_id for d in deltas} == {"greedy", "top-p"}
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == 1, syncs  # the sampled ids
