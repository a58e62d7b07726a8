"""TierLike (gdskv.tier_protocol): what the engine adapters call on the tier gdskv.open_tier
gives them. Tier and ClusterStore must both offer every member, with the same parameters, so an
adapter written against one works with the other (cluster=true)."""

from __future__ import annotations

import inspect

import pytest

from gdskv.cluster import ClusterStore
from gdskv.tier import Tier
from gdskv.tier_protocol import TierLike

from reliability_helpers import LAYOUT, small_config

IMPLEMENTATIONS = [Tier, ClusterStore]
#: public methods of one implementation that are no part of what adapters use
NOT_IN_PROTOCOL = {Tier: {"from_env"}, ClusterStore: {"discover"}}


def protocol_methods() -> list[str]:
    return sorted(name for name, value in vars(TierLike).items()
                  if not name.startswith("_") and inspect.isfunction(value))


def protocol_data() -> list[str]:
    names = set(getattr(TierLike, "__annotations__", {}))
    names |= {name for name, value in vars(TierLike).items() if isinstance(value, property)}
    return sorted(names)


def parameters(fn) -> list[tuple]:
    """What a caller depends on: each parameter's name, kind and default (annotations are
    free to differ: a pin handle is an int in a Tier and (node id, slot) in a cluster)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def public_methods(cls) -> set[str]:
    return {name for name, value in inspect.getmembers(cls)
            if not name.startswith("_") and inspect.isroutine(value)}


def test_the_protocol_lists_the_shared_methods():
    methods = protocol_methods()
    assert len(methods) == 18, methods
    shared = public_methods(Tier) & public_methods(ClusterStore)
    assert shared == set(methods), "a public method both offer belongs in TierLike (or not)"
    for cls in IMPLEMENTATIONS:
        assert public_methods(cls) - set(methods) == NOT_IN_PROTOCOL[cls]


@pytest.mark.parametrize("cls", IMPLEMENTATIONS, ids=lambda c: c.__name__)
@pytest.mark.parametrize("name", protocol_methods())
def test_same_parameters_as_the_protocol(cls, name):
    assert parameters(getattr(cls, name)) == parameters(getattr(TierLike, name)), \
        f"{cls.__name__}.{name}{inspect.signature(getattr(cls, name))} differs from " \
        f"TierLike.{name}{inspect.signature(getattr(TierLike, name))}"


def test_both_have_the_data_members(tmp_path):
    assert protocol_data() == ["backend", "config", "device", "directory", "layout",
                               "read_only", "store"]
    (tmp_path / "own").mkdir()
    (tmp_path / "shared").mkdir()
    with Tier(LAYOUT, small_config(tmp_path / "own"), device="cpu") as tier, \
            ClusterStore(LAYOUT, small_config(tmp_path / "shared", cluster=True,
                                              node_id="n0"), device="cpu") as cluster:
        for obj in (tier, cluster):
            missing = [n for n in protocol_data() if not hasattr(obj, n)]
            assert not missing, f"{type(obj).__name__} lacks {missing}"
        # a cluster node's store, directory and backend are its own namespace's
        assert cluster.store is cluster.own.store and cluster.directory is cluster.own.directory
        assert cluster.backend is cluster.own.backend
