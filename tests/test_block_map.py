"""The directory's packed block map answers as a dict of its blocks would, through adds, drops and a pickle."""

from __future__ import annotations

import pickle
import random

import pytest

from kvtransfer.directory_index.block_map import BlockMap


def test_the_block_map_answers_as_a_dict_would() -> None:
    rng = random.Random(0)
    # Hashes that share their first 8 bytes (one bucket, one first half) as well as unrelated ones.
    shared = rng.randbytes(8)
    keys = [shared + rng.randbytes(8) for _ in range(50)] + [rng.randbytes(16) for _ in range(5000)]
    packed: BlockMap = BlockMap()
    model: dict[bytes, int] = {}
    for step in range(30_000):
        key = rng.choice(keys)
        if rng.random() < 0.6:
            packed[key] = model[key] = step
        elif key in model:
            del packed[key], model[key]
        else:
            with pytest.raises(KeyError):
                del packed[key]
        if step % 5000 == 0:
            packed = pickle.loads(pickle.dumps(packed))  # as a mirror receives the directory
    assert len(packed) == len(model)
    assert dict(packed.items()) == model
    for key in keys:
        assert packed.get(key) == model.get(key) and (key in packed) == (key in model)
    assert b"short" not in packed and packed.get(rng.randbytes(16), "none") == "none"
    for key in list(model):
        del packed[key]
    assert len(packed) == 0 and packed.overhead_bytes == BlockMap().overhead_bytes  # emptied buckets are let go
