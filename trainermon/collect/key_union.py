"""The union of every rank's row keys, for the cross-rank summaries' table layout (`xrank.CrossRank`).

Ranks mostly hold the same keys: every data-parallel replica of a (tensor, pipeline, expert) coordinate
writes the same rows. Gathering each rank's list would make every rank receive world x list bytes (tens of
MB at thousands of ranks); instead the ranks gather a digest of their lists (24 bytes each), and each
distinct list travels once, from the lowest rank holding it. Collective on `group`, which must span every
rank of the job (its ranks are the global ranks), on the CPU: one all-gather of the digests; nothing more
when every rank holds the same list (the usual case, data parallelism alone), else one all-reduce of all
the distinct lists laid end to end (each byte nonzero on at most one rank, so the sum is exact). So at most
two collectives, however many lists differ. Keys travel as JSON, never pickled.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import torch


def digest_of(data: bytes) -> list[int]:
    """Two signed 64-bit words of a 128-bit hash of the list's bytes, then its length."""
    raw = hashlib.blake2b(data, digest_size=16).digest()
    words = [int.from_bytes(raw[i : i + 8], "little", signed=True) for i in (0, 8)]
    return [*words, len(data)]


def union_of_keys(known: Sequence[tuple], local: Sequence[tuple], rank: int, world: int, group: Any) -> tuple:
    """`known` followed by the keys of every rank not in it, in rank order and then in each rank's own order
    (the order a gather of every list would give). `local`: this rank's keys (JSON-serialisable tuples)."""
    import torch.distributed as dist

    data = json.dumps(list(local)).encode()
    every = [torch.zeros(3, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(every, torch.tensor(digest_of(data), dtype=torch.int64), group=group)
    first: dict[tuple[int, ...], int] = {}  # digest -> the lowest rank holding that list
    for r, digest in enumerate(every):
        first.setdefault(tuple(digest.tolist()), r)
    sources = list(first.items())  # in rank order: the same union as a gather of every list
    if len(sources) == 1:  # one 128-bit digest and length: every rank holds this very list
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        buf = torch.zeros(sum(digest[2] for digest, _ in sources), dtype=torch.uint8)
        offset = 0
        for digest, source in sources:
            if source == rank:
                buf[offset : offset + digest[2]] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            offset += digest[2]
        dist.all_reduce(buf, group=group)
    packed, offset = buf.numpy().tobytes(), 0
    union = dict.fromkeys(known)
    for digest, _ in sources:
        keys = json.loads(packed[offset : offset + digest[2]].decode())
        offset += digest[2]
        union.update(dict.fromkeys(tuple(k) for k in keys))
    return tuple(union)
