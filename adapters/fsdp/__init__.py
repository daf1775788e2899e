"""PyTorch FSDP: FSDP1 (`FullyShardedDataParallel`, flat parameters, `fsdp1`) and FSDP2 (`fully_shard`,
DTensors, `fsdp2`). Sharded pieces are `TensorPiece(local slice or None, Sharded(group), full shape, dtype)`;
the core merges partial statistics with one packed reduction. Nothing is ever gathered here (no
`summon_full_params`, no `full_tensor()`).
"""

from __future__ import annotations

import sys


def fsdp_imported() -> bool:
    # A model can only contain FSDP modules if the user imported FSDP; this keeps `detect` free of the
    # import for everyone else.
    return "torch.distributed.fsdp" in sys.modules
