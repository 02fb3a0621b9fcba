"""The float graph's indices (``graph.Graph``: ``binding``, ``value``, ``binding_readers``, ``outputs``,
``layer_readers``): each equal to the map it replaces, made once per graph and shared by the planner,
the fusions and the backends."""
from __future__ import annotations

from functools import cached_property

import pytest
import torch
from torch import nn

from tvm_qconv.config import QuantConfig
from tvm_qconv.graph import Graph
from tvm_qconv.pipeline import fused
from tvm_qconv.quantization import plan_quantization
from tvm_qconv.int8_module import float_graph
from tvm_qconv.relax_utils import free_vars
from tvm_qconv.target import TargetInfo, make_target

SIZE = 16
INDICES = ("binding", "value", "binding_readers", "outputs", "layer_readers")


class Net(nn.Module):
    """A stem read by two branches (one tensor, several layer readers), SiLU and hardswish tables, a
    residual add, a squeeze-excite gate (its sigmoid becomes the scale's gate chain), a concat, and a
    sigmoid no int8 layer reads (a lut layer the analysis drops again)."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.a = nn.Conv2d(8, 8, 3, padding=1)
        self.b = nn.Conv2d(8, 8, 1)
        self.se = nn.Conv2d(8, 8, 1)
        self.head = nn.Conv2d(16, 10, 1)

    def forward(self, x):
        x = nn.functional.silu(self.stem(x))
        y = nn.functional.hardswish(self.a(x)) + x
        z = self.b(x)
        z = z * torch.sigmoid(self.se(z.mean((2, 3), keepdim=True)))
        return torch.sigmoid(self.head(torch.cat([y, z], 1)).mean((2, 3)))


@pytest.fixture(scope="module")
def graph() -> Graph:
    torch.manual_seed(0)
    return float_graph(Net().eval(), (1, 3, SIZE, SIZE))


def test_each_index_is_the_map_it_replaces(graph):
    assert graph.binding == {b.var: b for b in graph.bindings}
    assert graph.value == {b.var: b.value for b in graph.bindings}
    readers: dict = {}
    for b in graph.bindings:
        for v in free_vars(b.value):
            readers.setdefault(v, set()).add(b.var)
    assert graph.binding_readers == readers
    assert graph.outputs == set(free_vars(graph.func.body.body)) and len(graph.outputs) == 1
    by_layer: dict = {}
    for ly in graph.layers:
        for v in ly.inputs:
            by_layer.setdefault(v, []).append(ly)
    assert graph.layer_readers.keys() == by_layer.keys()
    for v, layers in by_layer.items():   # the same layers, in layer order
        assert [id(ly) for ly in graph.layer_readers[v]] == [id(ly) for ly in layers]
    # the model has what the indices are for: a tensor several layers read, in layer order, and
    # the layers the analysis removed (a gate chain, a dropped table) read nothing here
    position = {id(ly): i for i, ly in enumerate(graph.layers)}
    shared = [lys for lys in graph.layer_readers.values() if len(lys) > 1]
    assert shared and all([position[id(ly)] for ly in lys] == sorted(position[id(ly)] for ly in lys)
                          for lys in shared)
    assert all(id(ly) in position for lys in graph.layer_readers.values() for ly in lys)
    assert any(ly.kind == "scale" and ly.gate_chain is not None for ly in graph.layers)


def test_a_graph_makes_each_index_once(graph):
    for name in INDICES:
        assert getattr(graph, name) is getattr(graph, name), name


def test_planning_and_fusing_make_each_index_once(monkeypatch):
    # every index of a fresh graph counted through plan_quantization and the fusions (epilogue
    # tables, LayerNorms, residual adds): one computation each at most
    made: dict = {}
    for name in INDICES:
        make = Graph.__dict__[name].func

        def counted(self, make=make, name=name):
            made[name] = made.get(name, 0) + 1
            return make(self)

        prop = cached_property(counted)
        prop.__set_name__(Graph, name)
        monkeypatch.setattr(Graph, name, prop)
    torch.manual_seed(0)
    g = float_graph(Net().eval(), (1, 3, SIZE, SIZE))
    target = TargetInfo.from_target(make_target("llvm"))
    plan = fused(plan_quantization(g, {p: 4.0 for p in g.points.values()}, QuantConfig(), target))
    assert any(lp.fused_into is not None for lp in plan.layers)   # a fusion asked binding_readers
    assert made.get("layer_readers") == 1 and made.get("binding_readers") == 1 and made.get("outputs") == 1
    assert all(n == 1 for n in made.values()), made
