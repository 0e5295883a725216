"""`agentflow.ids`: fresh version-4 UUIDs that behave as `uuid.UUID`s everywhere."""

from __future__ import annotations

import multiprocessing
import pickle
import uuid
from multiprocessing.connection import Connection

import pydantic

from agentflow import ids


def test_ids_are_distinct_random_version_4_uuids() -> None:
    made = [ids.new_id() for _ in range(5_000)]  # many refills of the batch
    assert len(set(made)) == len(made)
    assert all(isinstance(i, uuid.UUID) for i in made)
    assert all(i.version == 4 and i.variant == uuid.RFC_4122 for i in made)
    # Random bits everywhere else: every hex digit outside the fixed ones takes many values.
    for position in (0, 5, 13, 20, 31):
        assert len({i.hex[position] for i in made}) > 8
    hexes = {ids.new_hex() for _ in range(1_000)}
    assert len(hexes) == 1_000 and all(len(h) == 32 and uuid.UUID(h).version == 4 for h in hexes)


def test_an_id_equals_hashes_orders_and_serializes_as_the_standard_uuid() -> None:
    made = ids.new_id()
    standard = uuid.UUID(str(made))
    assert made == standard and standard == made and hash(made) == hash(standard)
    assert {standard: 1}[made] == 1
    assert sorted([made, uuid.UUID(int=0), uuid.UUID(int=2**128 - 1)])[1] == standard
    assert pickle.loads(pickle.dumps(made)) == standard
    assert str(made) == str(standard) and made.hex == standard.hex

    class Row(pydantic.BaseModel):
        id: uuid.UUID

    assert Row(id=made).model_dump(mode="json") == {"id": str(standard)}


def _child_ids(out: Connection) -> None:
    out.send([ids.new_id() for _ in range(100)])


def test_a_forked_child_never_repeats_its_parent_s_ids() -> None:
    ids.new_id()  # the parent holds a batch when it forks
    reader, writer = multiprocessing.get_context("fork").Pipe(duplex=False)
    child = multiprocessing.get_context("fork").Process(target=_child_ids, args=(writer,))
    child.start()
    try:
        from_child = reader.recv()
    finally:
        child.join(timeout=30)
    from_parent = [ids.new_id() for _ in range(100)]
    assert child.exitcode == 0
    assert not set(from_child) & set(from_parent)
