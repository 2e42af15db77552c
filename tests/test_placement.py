"""Neuron placement: the integer program against brute force, the GPU index file and its reuse rules."""

from __future__ import annotations

import itertools
import struct
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFValueType
from hypothesis import example, given, settings
from hypothesis import strategies as st

from powerinfer.config import FFNActivation
from powerinfer.errors import PowerInferError
from powerinfer.gguf import open_gguf
from powerinfer.gguf.writer import TensorData, write_gguf
from powerinfer.models import load_model, read_config
from powerinfer.ops.linear import CPU
from powerinfer.options import FFNOptions
from powerinfer.placement.apply import apply_placement
from powerinfer.placement.costs import ModelShape, Speeds, dense_parts, model_shape
from powerinfer.placement.gpu_index import ARCHITECTURE, index_path, load_gpu_index, read_gpu_index, write_gpu_index
from powerinfer.placement.planner import neuron_budget, place_dense, plan_for_model
from powerinfer.placement.solver import Plan, Problem, layer_groups, plan_from_counts, solve_counts
from powerinfer.placement.spec import DensePlacement, Placement
from powerinfer.sparse.ffn import FFNTensors
from powerinfer.sparse.hybrid import KernelNeurons

# ---------------------------------------------------------------- the solver against brute force

instances = st.integers(1, 3).flatmap(lambda n_layers: st.tuples(
    st.lists(st.lists(st.integers(0, 30), min_size=1, max_size=9), min_size=n_layers, max_size=n_layers),
    st.lists(st.integers(1, 40).map(lambda k: 1000 * k), min_size=n_layers, max_size=n_layers),  # bytes per neuron
    st.integers(1, 4),  # group size
    st.floats(0.0, 1.0),  # budget as a share of all neuron bytes
    st.sampled_from([0.0, 1e-6, 3e-5, 1e-4]),  # sync seconds (a neuron costs 1-40 us per activation)
    st.sampled_from([2.0, 10.0, 1000.0]),  # accelerator bandwidth / CPU bandwidth
))


def brute_force(problem: Problem) -> float:
    best = float("inf")
    for n in itertools.product(*(range(g.n_groups + 1) for g in problem.layers)):
        if sum(problem.bytes_of(i, k) for i, k in enumerate(n)) <= problem.budget:
            best = min(best, sum(problem.layer_time(i, k) for i, k in enumerate(n)))
    return best


@settings(max_examples=60, deadline=None)
@given(instances)
# a budget one byte short of both layers' neuron: HiGHS's tolerance (~a byte in MiB) once let both in
@example(([[1], [1]], [2000, 1000], 1, 0.9999999999999999, 0.0, 2.0))
def test_solver_is_optimal_and_within_budget(instance):
    counts, neuron_bytes, group_size, share, sync, ratio = instance
    speeds = Speeds(1e9, 1e9 * ratio, sync)
    budget = int(share * sum(len(c) * b for c, b in zip(counts, neuron_bytes)))
    problem = Problem(tuple(layer_groups(np.array(c), 10, group_size) for c in counts), tuple(neuron_bytes), budget, speeds)
    best = brute_force(problem)
    for formulation in ("groups", "cumulative"):
        n, optimal = solve_counts(problem, formulation)
        assert optimal
        assert sum(problem.bytes_of(i, k) for i, k in enumerate(n)) <= budget
        assert sum(problem.layer_time(i, k) for i, k in enumerate(n)) <= best * (1 + 1e-6) + 1e-12


@settings(max_examples=25, deadline=None)
@given(st.lists(st.lists(st.integers(0, 50), min_size=3, max_size=40), min_size=1, max_size=4),
       st.floats(0.0, 1.2), st.integers(1, 8))
def test_plan_takes_the_hottest_neurons_and_respects_the_budget(counts, share, group_size):
    shape = ModelShape(tuple(len(c) for c in counts), tuple(8 * (i + 1) for i in range(len(counts))))
    budget = int(share * shape.ffn_bytes)
    plan = plan_from_counts([torch.tensor(c) for c in counts], 50, shape, budget, Speeds(sync_seconds=0.0), group_size)
    assert plan.bytes_used == sum(len(h) * b for h, b in zip(plan.hot, shape.neuron_bytes)) <= budget
    for hot, c in zip(plan.hot, counts):
        c = np.array(c)
        assert np.all(np.diff(hot) > 0)
        if 0 < len(hot) < len(c):  # every neuron left on the CPU fires no more often than any placed one
            assert c[hot].min() >= np.delete(c, hot).max()
    if share >= 1.0:  # everything fits, and with no sync cost everything goes
        assert sum(len(h) for h in plan.hot) == sum(shape.n_ff) and plan.served_share == pytest.approx(1.0)


def test_sync_cost_keeps_a_layer_whole_when_splitting_saves_less():
    shape = ModelShape((128, 128), (1000, 1000))
    counts = [torch.full((128,), 100), torch.full((128,), 1)]  # layer 1 hardly ever fires
    # per token: layer 0 costs 128 us on the CPU, layer 1 about 1.3 us; the round trip costs 20 us
    plan = plan_from_counts(counts, 100, shape, shape.ffn_bytes, Speeds(1e9, 1e12, 20e-6))
    assert plan.split_layers == [0]


def test_plan_rejects_statistics_of_another_model():
    shape = ModelShape((16, 16), (10, 10))
    with pytest.raises(PowerInferError, match="cover 1 layers"):
        plan_from_counts([torch.ones(16)], 1, shape, 100)
    with pytest.raises(PowerInferError, match="count 15 neurons"):
        plan_from_counts([torch.ones(16), torch.ones(15)], 1, shape, 100)


def test_70b_shaped_instance_solves_in_seconds():
    rng = np.random.default_rng(0)
    x = (np.arange(28672) + 1) / 28672
    counts = [rng.binomial(1000, np.minimum(1.0, 0.05 * x ** -0.6))[rng.permutation(28672)] for _ in range(80)]
    shape = ModelShape((28672,) * 80, (13824,) * 80)  # Q4_0 gate, up and down rows of 8192 values
    plan = plan_from_counts(counts, 1000, shape, 8 << 30)
    assert plan.optimal and plan.solve_seconds < 30
    assert plan.bytes_used <= 8 << 30 and 0.3 < plan.served_share < 1.0


# ---------------------------------------------------------------- the GPU index file

def random_plan(rng: np.random.Generator, n_ff: tuple[int, ...], capacity: int = 1 << 40) -> Plan:
    hot = tuple(np.sort(rng.choice(n, rng.integers(0, n + 1), replace=False)).astype(np.int32) for n in n_ff)
    return Plan(hot, n_ff, 0, capacity, None, None, None, None)


# PowerInfer's ggml type table for what an index holds: type code -> (block size, bytes per block).
# Its ggml predates the IQ types, so I32 is 18 there (the gguf package's 18 is IQ3_XXS).
POWERINFER_TYPES = {0: (1, 4), 1: (1, 2), 18: (1, 4)}  # F32, F16, I32


def parse_index(raw: bytes) -> tuple[dict, list[tuple[str, list[int], int, int, int]], int]:
    """A .gpuidx's header parsed from the format alone (not with our reader): (metadata, tensor
    infos (name, dims, byte position of the type code, type code, data offset), data start)."""
    pos = 0

    def take(fmt: str):
        nonlocal pos
        (value,) = struct.unpack_from("<" + fmt, raw, pos)
        pos += struct.calcsize(fmt)
        return value

    def string() -> str:
        nonlocal pos
        n = take("Q")
        pos += n
        return raw[pos - n : pos].decode()

    assert raw[:4] == b"PWRI"
    pos = 4
    assert take("I") == 3
    n_tensors, n_kv = take("Q"), take("Q")
    metadata = {}
    for _ in range(n_kv):
        key, value_type = string(), take("I")
        metadata[key] = {8: string, 4: lambda: take("I"), 10: lambda: take("Q")}[value_type]()
    infos = []
    for _ in range(n_tensors):
        name, n_dims = string(), take("I")
        dims = [take("Q") for _ in range(n_dims)]
        infos.append((name, dims, pos, take("I"), take("Q")))
    return metadata, infos, -(-pos // 32) * 32  # GGUF's default alignment, which PowerInfer's loader uses


def read_as_powerinfer(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    """(metadata, {name: int32 data}) of a .gpuidx read by PowerInfer's rules: its type table."""
    raw = path.read_bytes()
    metadata, infos, data_start = parse_index(raw)
    tensors = {}
    for name, dims, _, type_code, offset in infos:
        assert type_code == 18, f"PowerInfer's loader has no type {type_code}"
        block, size = POWERINFER_TYPES[type_code]
        tensors[name] = np.frombuffer(raw, np.int32, int(np.prod(dims)) // block * size // 4, data_start + offset)
    return metadata, tensors


@settings(max_examples=20, deadline=None)
@given(st.lists(st.integers(1, 300), min_size=1, max_size=5), st.integers(0, 2**63 - 1), st.integers(0, 1000))
def test_gpu_index_round_trip_read_by_powerinfer_rules(tmp_path_factory, n_ff, capacity, seed):
    plan = random_plan(np.random.default_rng(seed), tuple(n_ff), capacity)
    path = tmp_path_factory.mktemp("index") / "model.gguf.generated.gpuidx"
    write_gpu_index(path, plan)
    hot, stored = read_gpu_index(path, tuple(n_ff))
    assert stored == capacity and all(np.array_equal(a, b) for a, b in zip(hot, plan.hot))
    metadata, tensors = read_as_powerinfer(path)
    assert metadata == {"general.architecture": ARCHITECTURE, "generic.gpu_index.block_count": len(n_ff),
                        "split.vram_capacity": capacity}
    assert list(tensors) == [f"blk.{i}.{part}" for i in range(len(n_ff)) for part in ("gpu_idx", "gpu_bucket")]
    for i, n in enumerate(n_ff):
        flags, bucket = tensors[f"blk.{i}.gpu_idx"], tensors[f"blk.{i}.gpu_bucket"]
        assert len(flags) == n and set(np.flatnonzero(flags)) == set(plan.hot[i].tolist())
        assert np.array_equal(bucket, plan.hot[i])


def test_index_path_follows_powerinfer():
    assert index_path("/models/llama.powerinfer.gguf") == Path("/models/llama.powerinfer.gguf.generated.gpuidx")


def test_place_writes_an_index_powerinfer_reads(tiny_models, tmp_path):
    from powerinfer.cli import main

    written = tmp_path / "model.gguf.generated.gpuidx"
    assert main(["place", "-m", str(tiny_models["f32"]), "--vram-budget", "0.01", "-o", str(written)]) == 0
    metadata, tensors = read_as_powerinfer(written)
    hot, capacity = read_gpu_index(written, (160, 160))
    assert metadata["split.vram_capacity"] == capacity and metadata["generic.gpu_index.block_count"] == 2
    for i in range(2):
        assert np.array_equal(tensors[f"blk.{i}.gpu_bucket"], hot[i])
        assert np.array_equal(np.flatnonzero(tensors[f"blk.{i}.gpu_idx"]), hot[i])


def write_raw_index(path: Path, layers: list[tuple[np.ndarray, np.ndarray]], capacity: int = 1000) -> None:
    tensors = []
    for i, (flags, bucket) in enumerate(layers):
        tensors += [TensorData(f"blk.{i}.gpu_idx", flags.astype(np.int32), GGMLQuantizationType.I32),
                    TensorData(f"blk.{i}.gpu_bucket", bucket.astype(np.int32), GGMLQuantizationType.I32)]
    write_gguf(path, ARCHITECTURE, {f"{ARCHITECTURE}.block_count": len(layers)}, tensors, powerinfer=True,
               typed_metadata={"split.vram_capacity": (capacity, GGUFValueType.UINT64, None)})


def flags_of(bucket, n):
    flags = np.zeros(n, dtype=np.int32)
    flags[bucket] = 1
    return flags


BAD_INDEXES = {
    "another layer count": ([(flags_of([1], 8), np.array([1]))], "made for 1 layers"),
    "another width": ([(flags_of([1], 9), np.array([1]))] * 2, "has 9 neurons"),
    "idx and bucket disagree": ([(flags_of([1, 2], 8), np.array([1]))] * 2, "disagree"),
    "unsorted bucket": ([(flags_of([1, 2], 8), np.array([2, 1]))] * 2, "not sorted"),
    "bucket out of range": ([(flags_of([1], 8), np.array([1, 2147483647]))] * 2, "not sorted unique ids below 8"),
}


@pytest.mark.parametrize("type_code", [GGMLQuantizationType.I32.value, 18])
def test_index_with_either_i32_code_is_reused(tiny_models, type_code):
    """PowerInfer writes I32 as 18, the gguf package as 26: an index with either is the model's own."""
    path = tiny_models["f32"]
    gguf = open_gguf(path)
    config = read_config(gguf)
    hot = (np.array([1, 5, 7]), np.arange(0, 160, 3))
    capacity = sum(len(h) * b for h, b in zip(hot, model_shape(gguf, config).neuron_bytes))
    budget = dense_parts(gguf, config, 64).total + capacity
    index = index_path(path)
    write_raw_index(index, [(flags_of(h, 160), h) for h in hot], capacity=capacity)
    raw = bytearray(index.read_bytes())
    _, infos, _ = parse_index(raw)
    assert {code for *_, code, _ in infos} == {GGMLQuantizationType.I32.value}  # written with gguf's numbering
    for _, _, position, _, _ in infos:
        struct.pack_into("<I", raw, position, type_code)
    index.write_bytes(bytes(raw))
    notes = []
    plan = plan_for_model(gguf, config, path, 64, budget, note=notes.append)
    assert plan.solve_seconds is None and not [n for n in notes if "stale" in n or "corrupt" in n]
    assert [h.tolist() for h in plan.hot] == [h.tolist() for h in hot]
    index.unlink()


@pytest.mark.parametrize("case", list(BAD_INDEXES))
def test_stale_index_is_reported_and_ignored(tmp_path, case):
    layers, message = BAD_INDEXES[case]
    path = tmp_path / "m.gpuidx"
    write_raw_index(path, layers)
    warnings = []
    assert load_gpu_index(path, (8, 8), warnings.append) is None
    assert len(warnings) == 1 and "stale" in warnings[0] and message in warnings[0] and "\n" not in warnings[0]


@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_corrupt_index_is_reported_and_ignored(tmp_path, damage):
    path = tmp_path / "m.gpuidx"
    write_gpu_index(path, random_plan(np.random.default_rng(0), (64, 64)))
    raw = path.read_bytes()
    garbage = b"PWRI" + np.random.default_rng(0).bytes(200)
    path.write_bytes({"truncated": raw[: len(raw) // 2], "garbage": garbage, "empty": b""}[damage])
    warnings = []
    assert load_gpu_index(path, (64, 64), warnings.append) is None
    assert len(warnings) == 1 and "corrupt" in warnings[0]


# ---------------------------------------------------------------- a model's placement

@pytest.fixture(scope="module")
def tiny_models(tiny_relu) -> dict[str, Path]:
    """A tiny ReLU llama in f32 and q4_0, each in its own folder."""
    return {outtype: tiny_relu(outtype) for outtype in ("f32", "q4_0")}


@pytest.mark.parametrize("outtype", ["f32", "q4_0"])
def test_costs_match_what_the_accelerator_holds(tiny_models, outtype):
    """The cost model's bytes are those of the objects an accelerator gets: neuron records (the CPU
    standing in), the CUDA neuron layout, and every block's dense parts and the output head."""
    gguf = open_gguf(tiny_models[outtype])
    config = read_config(gguf)
    store = FFNTensors.read(gguf, 0, FFNActivation.RELU_GATED).neuron_store()
    shape = model_shape(gguf, config)
    assert shape.n_ff == (160, 160) and shape.neuron_bytes == (store.record_bytes,) * 2
    kernel = KernelNeurons(store, torch.arange(64), CPU)  # the int4 layer's byte count is the same on any device
    assert model_shape(gguf, config, "cuda").neuron_bytes[0] * 64 == kernel.nbytes

    parts = dense_parts(gguf, config, 100)
    everything = DensePlacement(frozenset(range(config.n_layers)), True, parts.total)
    nothing_hot = Plan((np.zeros(0, dtype=np.int32),) * 2, (160, 160), 0, 0, None, None, None, None)
    model = load_model(gguf, 100, FFNOptions(sparsity="off"))
    apply_placement(model, Placement(CPU, nothing_hot, everything))
    kv_float16 = 2 * 2 * 100 * config.kv_dim
    for i, block in enumerate(model.blocks):
        attention = block.attention.qkv.nbytes + block.attention.output.nbytes
        norms = block.attn_norm.scaled_weight.nbytes + block.ffn_norm.scaled_weight.nbytes
        assert parts.layers[i] == attention + norms + kv_float16
    assert parts.output == model.output.nbytes + model.output_norm.scaled_weight.nbytes


def test_index_is_reused_rebuilt_on_reset_and_when_the_budget_shrinks(tiny_models):
    path = tiny_models["q4_0"]
    gguf = open_gguf(path)
    config = read_config(gguf)
    dense = dense_parts(gguf, config, 64).total
    notes = []
    plan = lambda budget, **kw: plan_for_model(gguf, config, path, 64, dense + budget, note=notes.append, **kw)  # noqa: E731
    first = plan(20_000)
    index = index_path(path)
    assert index.exists() and first.capacity == 20_000 and first.solve_seconds is not None
    assert any("no activation statistics" in n for n in notes)
    assert plan(30_000).solve_seconds is None  # reused: the budget covers the stored capacity
    assert plan(30_000, index="reset").capacity == 30_000
    assert plan(25_000).capacity == 25_000  # below the stored 30 000: rebuilt
    assert read_gpu_index(index, (160, 160))[1] == 25_000
    index.write_bytes(index.read_bytes()[:200])
    notes.clear()
    assert plan(25_000).solve_seconds is not None
    assert sum("warning: ignoring corrupt GPU index" in n for n in notes) == 1
    assert read_gpu_index(index, (160, 160))[1] == 25_000  # rewritten whole
    index.unlink()
    plan(25_000, index="memory")
    assert not index.exists()
    # a budget short of the dense parts: the blocks that fit go first, what is left goes to neurons
    parts = dense_parts(gguf, config, 64)
    assert neuron_budget(gguf, config, 64, 1, dense - 1) == parts.layers[0] - 1
    short = parts.output - 1  # the output head does not fit, the blocks still do
    assert place_dense(parts, short).layers == {0, 1} and not place_dense(parts, short).output
    assert neuron_budget(gguf, config, 64, 1, short) == short - sum(parts.layers)


def test_statistics_decide_the_placement(tiny_models, tmp_path):
    from powerinfer.sparse.profiler import ActivationProfile

    hot = [torch.zeros(160, dtype=torch.int64) for _ in range(2)]
    hot[0][[3, 50, 77]], hot[1][[0, 159]] = 40, 40
    ActivationProfile("relu", 40, [0.0, 0.0], hot).save(tmp_path)
    path = tiny_models["f32"]
    gguf = open_gguf(path)
    config = read_config(gguf)
    neuron = model_shape(gguf, config).neuron_bytes[0]
    budget = dense_parts(gguf, config, 64).total + 5 * neuron
    plan = plan_for_model(gguf, config, path, 64, budget, index="memory", activations=tmp_path,
                          speeds=Speeds(sync_seconds=0.0), group_size=1)
    assert [h.tolist() for h in plan.hot] == [[3, 50, 77], [0, 159]] and plan.served_share == 1.0
    with pytest.raises(PowerInferError, match="not found"):
        plan_for_model(gguf, config, path, 64, budget, index="memory", activations=tmp_path / "none")


def test_place_command_prints_the_plan_and_writes_only_when_asked(tiny_models, tmp_path, capsys):
    from powerinfer.cli import main
    from powerinfer.sparse.profiler import ActivationProfile

    counts = [torch.arange(160) for _ in range(2)]
    ActivationProfile("relu", 200, [0.0, 0.0], counts).save(tmp_path)
    model = tiny_models["q4_0"]
    index_path(model).unlink(missing_ok=True)
    args = ["place", "-m", str(model), "--activations", str(tmp_path), "--vram-budget", "0.01", "--sync-us", "0"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["layer", "on", "accel"] and len(lines) == 1 + 2 + 4
    assert "2/2 layers use the accelerator" in out and "split layers: 0-1" in out
    assert not index_path(model).exists()
    written = tmp_path / "out.gpuidx"
    assert main([*args, "-o", str(written)]) == 0
    hot, capacity = read_gpu_index(written, (160, 160))
    assert [len(h) for h in hot] == [160, 160] and capacity > 0
    capsys.readouterr()
    assert main(["place", "-m", str(model), "--activations", str(tmp_path / "none"), "--vram-budget", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not found" in err[0]
