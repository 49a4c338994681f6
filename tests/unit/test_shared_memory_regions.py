"""The region registry behind the shared-memory extension, on real /dev/shm objects."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from slipstream.errors import InvalidRequest
from slipstream.server.journal import EngineJournal
from slipstream.serving.shared_memory import (
    MAX_REGIONS_PER_KEY,
    SHM_DIR,
    RegionNotFound,
    SystemSharedMemory,
)
from slipstream.types import (
    InferRequest,
    InferResponse,
    RequestedOutput,
    SharedMemoryInput,
    SharedMemoryRef,
)


@pytest.fixture
def key() -> Iterator[str]:
    """A 64 KiB POSIX shared-memory object holding 0, 1, 2, ... as FP32."""
    name = f"slipstream_unit_{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    np.arange(16384, dtype=np.float32).tofile(path)
    yield "/" + name
    os.unlink(path)


def _request(ref: SharedMemoryRef, shape: list[int]) -> InferRequest:
    return InferRequest(
        "m", "", {}, shared_memory_inputs={"x": SharedMemoryInput("FP32", shape, ref)}
    )


def test_inputs_are_read_only_views_of_the_region_at_any_offset(key: str) -> None:
    regions = SystemSharedMemory(allowed=True)
    # An offset that is not page aligned: the mapping starts at the page below it.
    regions.register("r", key, offset=4100 * 4, byte_size=64)
    request = _request(SharedMemoryRef("r", 8, 16), [2, 2])
    regions.read_inputs(request)
    x = request.inputs["x"]
    np.testing.assert_array_equal(x, [[4102, 4103], [4104, 4105]])
    assert not x.flags.writeable and not x.flags.owndata  # a view, never a copy
    assert request.shared_memory_inputs == {}
    # The same tensor at the same place again: the same view, not a new one.
    again = _request(SharedMemoryRef("r", 8, 16), [2, 2])
    regions.read_inputs(again)
    assert again.inputs["x"] is x
    # Unregistering while a request still holds a view is safe: the view stays valid.
    regions.unregister("r")
    np.testing.assert_array_equal(x[0], [4102, 4103])


def test_outputs_are_written_and_the_response_keeps_their_shapes(key: str) -> None:
    regions = SystemSharedMemory(allowed=True)
    regions.register("out", key, offset=0, byte_size=32)
    request = InferRequest(
        "m", "", {}, outputs=[RequestedOutput("y", shared_memory=SharedMemoryRef("out", 8, 24))]
    )
    targets = regions.output_targets(request)
    response = InferResponse("m", "1", {"y": np.full(4, 7, np.int32)})
    regions.write_outputs(targets, response)
    assert response.in_shared_memory == {"y"}
    written = np.fromfile(os.path.join(SHM_DIR, key[1:]), dtype=np.float32, count=8)
    assert written[:2].tolist() == [0.0, 1.0]  # before the output's offset: untouched
    assert written[2:6].view(np.int32).tolist() == [7, 7, 7, 7]
    assert written[6:].tolist() == [6.0, 7.0]  # past the output's 16 bytes: untouched


def test_a_shrunk_object_is_refused_not_read(key: str) -> None:
    regions = SystemSharedMemory(allowed=True)
    regions.register("r", key, offset=0, byte_size=8192)
    os.truncate(os.path.join(SHM_DIR, key[1:]), 4096)
    with pytest.raises(InvalidRequest, match="shrank to 4096 bytes"):
        regions.read_inputs(_request(SharedMemoryRef("r", 4096, 16), [4]))


def test_disabled_server_refuses_every_region(key: str) -> None:
    regions = SystemSharedMemory(allowed=False)
    with pytest.raises(InvalidRequest, match="--allow-client-shm"):
        regions.register("r", key, offset=0, byte_size=8)
    assert regions.status() == []
    with pytest.raises(InvalidRequest, match="'r' is not registered"):
        regions.read_inputs(_request(SharedMemoryRef("r", 0, 4), [1]))


def test_symlinks_and_empty_regions_are_refused(key: str, tmp_path: os.PathLike[str]) -> None:
    regions = SystemSharedMemory(allowed=True)
    link = f"slipstream_unit_link_{uuid.uuid4().hex[:8]}"
    os.symlink(os.path.join(SHM_DIR, key[1:]), os.path.join(SHM_DIR, link))
    try:
        with pytest.raises(InvalidRequest, match="cannot open"):
            regions.register("r", "/" + link, offset=0, byte_size=8)
    finally:
        os.unlink(os.path.join(SHM_DIR, link))
    with pytest.raises(InvalidRequest, match="at least one byte"):
        regions.register("r", key, offset=0, byte_size=0)
    with pytest.raises(InvalidRequest, match="region name"):
        regions.register("", key, offset=0, byte_size=8)


def test_each_owner_sees_uses_and_unregisters_only_its_own_regions(key: str) -> None:
    """Regions of API keys: two owners may use one name; neither can see, read, write or
    unregister the other's region, which is "not registered" to it."""
    regions = SystemSharedMemory(allowed=True)
    regions.register("r", key, offset=0, byte_size=64, owner="a")
    regions.register("r", key, offset=64, byte_size=64, owner="b")
    regions.register("only_a", key, offset=128, byte_size=64, owner="a")
    with pytest.raises(InvalidRequest, match="already registered"):
        regions.register("r", key, offset=0, byte_size=64, owner="a")
    assert [(s.name, s.offset) for s in regions.status(owner="a")] == [("only_a", 128), ("r", 0)]
    assert [(s.name, s.offset) for s in regions.status(owner="b")] == [("r", 64)]
    assert regions.status(owner="") == []
    with pytest.raises(RegionNotFound, match="'only_a' is not registered"):
        regions.status("only_a", owner="b")

    # One name, each owner's own bytes: a's region starts at element 0, b's at 16.
    for owner, first in (("a", 0.0), ("b", 16.0)):
        request = _request(SharedMemoryRef("r", 0, 8), [2])
        request.owner = owner
        regions.read_inputs(request)
        assert request.inputs["x"].tolist() == [first, first + 1]
    stranger = _request(SharedMemoryRef("only_a", 0, 8), [2])
    stranger.owner = "b"
    with pytest.raises(InvalidRequest, match="region 'only_a' is not registered"):
        regions.read_inputs(stranger)
    output = RequestedOutput("y", shared_memory=SharedMemoryRef("only_a", 0, 8))
    with pytest.raises(InvalidRequest, match="region 'only_a' is not registered"):
        regions.output_targets(InferRequest("m", "", {}, outputs=[output], owner="b"))
    targets = regions.output_targets(InferRequest("m", "", {}, outputs=[output], owner="a"))
    with pytest.raises(InvalidRequest, match="region 'only_a' is not registered"):
        regions.write_outputs(targets, InferResponse("m", "1", {"y": np.ones(2, np.float32)}), "b")

    # b's unregister, by name or of all, never touches a's regions.
    regions.unregister("only_a", owner="b")
    regions.unregister(owner="b")
    assert regions.status(owner="b") == []
    assert [s.name for s in regions.status(owner="a")] == ["only_a", "r"]
    assert [(s.owner, s.name) for s in regions.registered()] == [("a", "only_a"), ("a", "r")]
    regions.close()
    assert regions.registered() == []


def test_one_key_cannot_take_every_region(key: str) -> None:
    """A key holds at most MAX_REGIONS_PER_KEY regions; other keys still register, and
    without keys (owner "") only the server's own bound applies."""
    regions = SystemSharedMemory(allowed=True)
    for index in range(MAX_REGIONS_PER_KEY):
        regions.register(f"r{index}", key, offset=0, byte_size=64, owner="greedy")
    with pytest.raises(InvalidRequest, match=f"holds {MAX_REGIONS_PER_KEY} shared memory"):
        regions.register("one_more", key, offset=0, byte_size=64, owner="greedy")
    regions.register("mine", key, offset=0, byte_size=64, owner="other")
    regions.unregister("r0", owner="greedy")
    regions.register("one_more", key, offset=0, byte_size=64, owner="greedy")
    for index in range(MAX_REGIONS_PER_KEY + 1):
        regions.register(f"r{index}", key, offset=0, byte_size=64, owner="")
    assert len(regions.status(owner="")) == MAX_REGIONS_PER_KEY + 1
    regions.close()


def test_an_engine_started_again_registers_each_owners_regions_again(
    key: str, tmp_path: Path
) -> None:
    """The split layout's journal keeps each region's owner: after the engine's restart
    a key's requests find their regions, and no other key does."""
    before = SystemSharedMemory(allowed=True)
    before.register("r", key, offset=0, byte_size=64, owner="a")
    before.register("r", key, offset=64, byte_size=64, owner="b")
    EngineJournal(tmp_path / "engine-state.json").save(before)
    before.close()

    after = SystemSharedMemory(allowed=True)
    EngineJournal(tmp_path / "engine-state.json").restore_regions(after)
    assert [(s.owner, s.name, s.offset) for s in after.registered()] == [
        ("a", "r", 0), ("b", "r", 64)
    ]  # fmt: skip
    assert after.status(owner="") == []
    after.close()
