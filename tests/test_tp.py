"""Head sharding rules, in-place sharding of the model (TP and TP x CP), sharded weights and the
traced collectives.

The multi-process runs (gloo, 1-8 ranks) are in test_decode_tp.py.
"""

import pytest
import torch
import torch.distributed as dist
from hypothesis import given
from hypothesis import strategies as st

from lean_tp.distributed import (
    ContextShard,
    ParallelGroups,
    apply_tp,
    check_shardable,
    describe_grid,
    plan_heads,
    torchrun_env,
)
from lean_tp.distributed import env as dist_env
from lean_tp.distributed.env import init_distributed
from lean_tp.generate import decode_one
from lean_tp.model import CONFIGS, build_model
from lean_tp.weights import init_random_weights


@pytest.mark.parametrize(
    "hq,hkv,world,expect",
    [
        (8, 2, 2, [(0, 4, 0, 1), (4, 4, 1, 1)]),
        (8, 2, 4, [(0, 2, 0, 1), (2, 2, 0, 1), (4, 2, 1, 1), (6, 2, 1, 1)]),  # KV heads replicated twice
        (8, 2, 8, [(q, 1, q // 4, 1) for q in range(8)]),
        (64, 8, 8, [(8 * r, 8, r, 1) for r in range(8)]),
        (32, 1, 4, [(8 * r, 8, 0, 1) for r in range(4)]),  # MQA
    ],
)
def test_plan_heads_examples(hq, hkv, world, expect):
    got = [plan_heads(hq, hkv, world, r) for r in range(world)]
    assert [(p.q_start, p.n_q, p.kv_start, p.n_kv) for p in got] == expect


@given(hkv=st.integers(1, 16), group=st.integers(1, 16), world=st.integers(1, 16))
def test_plan_heads_property(hkv, group, world):
    """Either every query head lands on exactly one rank together with its own KV head and a uniform
    local group, or every rank gets the same ValueError naming the counts."""
    hq = hkv * group
    try:
        plans = [plan_heads(hq, hkv, world, r) for r in range(world)]
    except ValueError as e:
        assert f"n_heads={hq}, n_kv_heads={hkv}, world_size={world}" in str(e)
        assert hq % world or (hkv % world and group % (hq // world))
        return
    q_heads = [q for p in plans for q in range(p.q_start, p.q_start + p.n_q)]
    assert q_heads == list(range(hq))
    for p in plans:
        assert p.n_q % p.n_kv == 0
        local_group = p.n_q // p.n_kv
        for i in range(p.n_q):
            assert (p.q_start + i) // group == p.kv_start + i // local_group


@pytest.mark.parametrize("name,world", [("phi-3-medium", 4), ("phi-3-medium", 8), ("tiny", 3), ("llama-3-8b", 64)])
def test_unshardable_configs_fail_with_head_counts(name, world):
    with pytest.raises(ValueError, match=r"cannot shard attention: .*world_size="):
        check_shardable(CONFIGS[name], world)


@pytest.mark.parametrize("name", ["llama-3-8b", "llama-3-70b", "mistral-7b"])
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_real_configs_shard_on_meta(name, world):
    """Shapes after sharding a meta model (no memory), incl. KV replication for 8 KV heads on 8 ranks."""
    args = CONFIGS[name]
    model = build_model(name)
    apply_tp(model, world - 1, world)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.q_proj.weight.shape == (args.n_heads // world * args.head_dim, args.dim)
    assert attn.k_proj.weight.shape == (max(args.n_kv_heads // world, 1) * args.head_dim, args.dim)
    assert attn.o_proj.weight.shape == (args.dim, args.n_heads // world * args.head_dim)
    assert mlp.down_proj.weight.shape == (args.dim, args.intermediate_size // world)
    assert len(model.tp_shards) == (7 * args.n_layers if world > 1 else 0)


@pytest.mark.parametrize("name,world,cp", [("llama-3-70b", 16, 2), ("llama-3-8b", 8, 4), ("tiny", 8, 8)])
def test_context_parallel_shards_on_meta(name, world, cp):
    """TP x CP: heads over tp = world / cp ranks (consecutive ranks), each head's sequence over cp
    ranks tp apart, the MLP over all ranks; KV memory per rank falls as 1 / cp beyond the heads."""
    args, tp = CONFIGS[name], world // cp
    for rank in (0, world - 1):
        model = build_model(name)
        apply_tp(model, rank, world, cp, ParallelGroups(None, None, None))  # groups are used only when run
        attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
        assert attn.q_proj.weight.shape == (args.n_heads // tp * args.head_dim, args.dim)
        assert attn.n_kv_heads == max(args.n_kv_heads // tp, 1)
        assert mlp.down_proj.weight.shape == (args.dim, args.intermediate_size // world)
        assert attn.shard == ContextShard(cp, rank // tp)
        model.setup_caches(1, 4096)
        slots = -(-4096 // (16 * cp)) * 16 + 1  # this rank's share of 4096 positions, plus the spare slot
        assert attn.kv_cache.k.shape == (1, attn.n_kv_heads, slots, args.head_dim)
        assert model.cache_capacity() == 4096


def test_context_parallel_errors():
    with pytest.raises(ValueError, match="expected a cp size that divides world_size, got cp=3, world_size=4"):
        check_shardable(CONFIGS["tiny"], 4, 3)
    with pytest.raises(ValueError, match=r"n_heads=8, n_kv_heads=2, world_size=3"):  # tp = 6 / 2
        check_shardable(CONFIGS["tiny"], 6, 2)
    with pytest.raises(ValueError, match="groups: expected the ParallelGroups of the job with cp > 1, got None"):
        apply_tp(build_model("tiny"), 0, 4, 2)
    model = build_model("tiny")
    apply_tp(model, 0, 2, 2, ParallelGroups(None, None, None))
    with pytest.raises(ValueError, match="impl: expected 'lean' under context parallelism"):
        model.set_attention("sdpa")


def test_disagreement_names_the_setting_and_every_ranks_value(monkeypatch):
    ctx = dist_env.DistContext(0, 3, 0, torch.device("cpu"), None)
    ranks = [{"cp": 2, "gen": 8}, {"cp": 2, "gen": 8}, {"cp": 2, "gen": 9}]
    monkeypatch.setattr(dist_env, "gather_objects", lambda _ctx, _obj: ranks)
    assert dist_env.disagreement(ctx, ranks[0]) == (
        "ranks were started with different settings: expected one gen, got 8 on rank 0, 8 on rank 1, 9 on rank 2"
    )
    ranks[2]["gen"] = 8
    assert dist_env.disagreement(ctx, ranks[0]) is None


def test_sharded_random_weights_are_slices_of_the_full_ones():
    full = build_model("tiny")
    init_random_weights(full, 7, "cpu", torch.float32)
    for rank in range(4):  # 4 ranks: rank pairs share (replicate) a KV head
        part = build_model("tiny")
        apply_tp(part, rank, 4)
        init_random_weights(part, 7, "cpu", torch.float32)
        full_params = dict(full.named_parameters())
        for name, param in part.named_parameters():
            expect = part.tp_shards[name].take(full_params[name]) if name in part.tp_shards else full_params[name]
            assert torch.equal(param, expect), name
        kv = part.model.layers[0].self_attn.k_proj.weight
        assert torch.equal(
            kv, full_params["model.layers.0.self_attn.k_proj.weight"][64 * (rank // 2) : 64 * (rank // 2 + 1)]
        )


def _traced_decode_step(rank: int, cp: int) -> str:
    """The code of the one graph (fullgraph) of a decode step of tiny on rank ``rank`` of a fake
    2-rank process group, with ``cp`` context-parallel ranks."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group(backend="fake", store=FakeStore(), rank=rank, world_size=2)
    try:
        model = build_model("tiny")
        world = dist.group.WORLD
        apply_tp(model, rank, 2, cp, ParallelGroups(world, world if cp == 1 else None, world if cp > 1 else None))
        init_random_weights(model, 0, "cpu", torch.float32)
        model.setup_caches(2, 64)
        graphs = []
        torch._dynamo.reset()
        step = torch.compile(decode_one, backend=lambda gm, _: graphs.append(gm.code) or gm.forward, fullgraph=True)
        with torch.inference_mode():
            step(model, torch.zeros(2, dtype=torch.long), torch.tensor([1, 40], dtype=torch.int32))
    finally:
        dist.destroy_process_group()
        torch._dynamo.reset()
    assert len(graphs) == 1
    return graphs[0]


def test_decode_step_graph_has_attention_and_all_reduces():
    """TP 2: each layer's lean op and its two all-reduces (o_proj and down_proj)."""
    graph, n_layers = _traced_decode_step(0, 1), CONFIGS["tiny"].n_layers
    assert graph.count("lean_tp.decode_attention") == n_layers
    assert graph.count("all_reduce") == 2 * n_layers


def test_context_parallel_step_graph_has_one_all_gather_per_layer():
    """TP 1 x CP 2: each layer runs the lean op on its share, one all-gather of the (out, lse)
    partials, the merge op, and the MLP's all-reduce (o_proj needs none with one TP rank)."""
    graph, n_layers = _traced_decode_step(1, 2), CONFIGS["tiny"].n_layers
    assert graph.count("lean_tp.decode_attention") == n_layers
    assert graph.count("all_gather_into_tensor") == n_layers
    assert graph.count("lean_tp.merge_attention") == n_layers
    assert graph.count("all_reduce") == n_layers


@pytest.mark.parametrize(
    "env,match",
    [
        ({"WORLD_SIZE": "2"}, "RANK: expected it set by torchrun"),
        ({"WORLD_SIZE": "2", "RANK": "2", "LOCAL_RANK": "0"}, r"RANK: expected an integer in \[0, 2\), got 2"),
        ({"WORLD_SIZE": "two"}, "WORLD_SIZE: expected an integer, got 'two'"),
        ({"WORLD_SIZE": "0"}, "WORLD_SIZE: expected >= 1, got 0"),
    ],
)
def test_bad_torchrun_environment(monkeypatch, env, match):
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(ValueError, match=match):
        torchrun_env()


def test_bad_device_and_timeout(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="timeout_s: expected a positive"):
        init_distributed("cpu", timeout_s=0)
    with pytest.raises(ValueError, match="device: expected 'cuda' or 'cpu'"):
        init_distributed("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="device: expected 'cpu' on a machine without CUDA"):
            init_distributed("cuda")
    ctx = init_distributed("cpu")
    assert (ctx.rank, ctx.world_size, ctx.group) == (0, 1, None)


def test_describe_grid_follows_the_ops_backend_rule():
    model = build_model("tiny")
    init_random_weights(model, 0, "cpu", torch.float32)
    assert describe_grid(model) == "no caches on cpu yet (setup_caches sizes the grid)"
    model.setup_caches(2, 64)
    assert describe_grid(model) == "torch backend on cpu (no kernel grid)"  # "auto" on CPU
    model.set_attention("lean", "triton")  # the interpreter (tests set TRITON_INTERPRET=1)
    assert describe_grid(model) == "Triton interpreter on cpu: 4 programs"
    model.set_attention("sdpa")
    assert describe_grid(model) == "sdpa attention on cpu (no Lean grid)"
