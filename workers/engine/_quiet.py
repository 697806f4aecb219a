"""Library warnings that say nothing about the engine, switched off before transformers loads.

Where torchao is installed (the extra spool[int8], for SPOOL_QUANTIZATION=int8), transformers
imports it with its models, whatever the quantization. On a CPU build of torch it then logs a
warning per CUDA kernel library it cannot load, and torch one per enum torchao registers with
its pytree: none of them used by the engine, at every start. Errors still show.
"""

import logging

for name in ("torchao", "torch.utils._pytree"):
    logging.getLogger(name).setLevel(logging.ERROR)
