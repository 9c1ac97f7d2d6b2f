"""The (data, expert, tensor) mesh over scale-up domains, and logical->mesh axis rules."""

import itertools
import random
import warnings
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from maxmoe.config import ConfigError, load_config
from maxmoe.parallel.layout import build_layout
from maxmoe.parallel.mesh import build_mesh, check_divisible, logical_to_spec, resolve_rules, resolve_shape
from maxmoe.training import step as step_lib
from maxmoe.training.optim import make_optimizer
from maxmoe.training.programs import build_programs

REPO = Path(__file__).resolve().parents[1]
DOMAIN = 4
# tensor=8 needs model sizes divisible by 8 (the tiny default has 4 heads and 260 tokens).
MODEL_FOR_8 = ["model.num_heads=8", "model.vocab_size=256"]


def _config(data, expert, tensor, *more):
    return load_config(
        [],
        [
            f"mesh.data={data}",
            f"mesh.expert={expert}",
            f"mesh.tensor={tensor}",
            f"mesh.scale_up_domain={DOMAIN}",
            *MODEL_FOR_8,
            *more,
        ],
    )


def _domain_of(devices, size):
    """Oracle: scale-up domain = consecutive blocks of `size` devices in (process, id) order."""
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    return {d.id: i // size for i, d in enumerate(ordered)}


def _shapes(total):
    return [(d, e, t) for d, e, t in itertools.product([1, 2, 4, 8], repeat=3) if d * e * t == total]


FITTING = [s for s in _shapes(8) if s[1] * s[2] <= DOMAIN]
NOT_FITTING = [s for s in _shapes(8) if s[1] * s[2] > DOMAIN]


def test_shape_lists_cover_all_layouts():
    assert len(FITTING) + len(NOT_FITTING) == 10 and len(jax.devices()) == 8
    assert (1, 8, 1) in NOT_FITTING and (2, 2, 2) in FITTING


@pytest.mark.parametrize("shape", FITTING)
def test_expert_and_tensor_groups_stay_inside_a_domain(shape):
    devices = list(jax.devices())
    random.Random(sum(shape)).shuffle(devices)  # the builder must not rely on the input order
    mesh = build_mesh(_config(*shape), devices)
    assert dict(mesh.shape) == dict(zip(("data", "expert", "tensor"), shape))  # no replica axis under fsdp
    domain = _domain_of(devices, DOMAIN)
    grid = mesh.devices
    data, expert, tensor = shape
    assert sorted(d.id for d in grid.flat) == list(range(8))
    for d in range(data):
        assert len({domain[x.id] for x in grid[d].flat}) == 1, "expert x tensor block crosses domains"
        for t in range(tensor):
            assert len({domain[x.id] for x in grid[d, :, t]}) == 1, "expert group crosses domains"
        for e in range(expert):
            assert len({domain[x.id] for x in grid[d, e, :]}) == 1, "tensor group crosses domains"


@pytest.mark.parametrize("shape", NOT_FITTING)
def test_groups_larger_than_a_domain_are_refused(shape):
    with pytest.raises(ConfigError, match="scale-up domain") as error:
        build_mesh(_config(*shape))
    assert "mesh.allow_cross_domain" in str(error.value)


@pytest.mark.parametrize("shape", NOT_FITTING)
def test_allow_cross_domain_builds_with_a_warning(shape):
    with pytest.warns(UserWarning, match="scale-up domain"):
        mesh = build_mesh(_config(*shape, "mesh.allow_cross_domain=true"))
    assert dict(mesh.shape) == dict(zip(("data", "expert", "tensor"), shape))


def test_group_larger_than_the_smallest_domain_is_refused():
    # 8 devices in domains of 6 and 2: expert=4 fits the first domain but not the second.
    config = load_config([], ["mesh.data=2", "mesh.expert=4", "mesh.scale_up_domain=6"])
    with pytest.raises(ConfigError, match="scale-up domain"):
        build_mesh(config)


def test_uneven_domains_do_not_let_groups_straddle():
    config = load_config([], ["mesh.data=4", "mesh.expert=2", "mesh.scale_up_domain=3"])
    try:
        mesh = build_mesh(config)
    except ConfigError:
        return  # refusing is also correct
    domain = _domain_of(jax.devices(), 3)
    for block in mesh.devices:
        assert len({domain[x.id] for x in block.flat}) == 1


def test_default_domain_is_one_per_process():
    # 8 fake CPU devices in one process: one domain of 8, so expert=8 fits.
    config = load_config([], ["mesh.data=1", "mesh.expert=8", "mesh.tensor=1"])
    assert dict(build_mesh(config).shape) == {"data": 1, "expert": 8, "tensor": 1}


@pytest.mark.parametrize(
    "sizes, domain, expected",
    [
        ((4, 2, 1), 4, (2, 2, 2, 1)),  # two domains of 4: a replica each, data 2 inside
        ((8, 1, 1), 4, (2, 4, 1, 1)),
        ((2, 2, 2), 4, (2, 1, 2, 2)),  # expert x tensor fill a domain: data goes across
        ((4, 2, 1), 8, (1, 4, 2, 1)),  # one domain: nothing crosses, the mesh of mode fsdp
        ((2, 2, 1), 8, (1, 2, 2, 1)),
    ],
)
def test_zero1_splits_data_into_replicas_across_domains(sizes, domain, expected):
    data, expert, tensor = sizes
    config = _config(data, expert, tensor, "mesh.across_domains=zero1", f"mesh.scale_up_domain={domain}")
    devices = list(jax.devices())
    random.Random(domain).shuffle(devices)
    mesh = build_mesh(config, devices[: data * expert * tensor])
    # One replica (everything in one domain) is the mesh of mode fsdp: no replica axis.
    names = ("replica", "data", "expert", "tensor")
    assert dict(mesh.shape) == {a: s for a, s in zip(names, expected) if a != "replica" or s > 1}
    of = _domain_of(devices[: data * expert * tensor], domain)
    blocks = mesh.devices if expected[0] > 1 else mesh.devices[None]
    replicas = [{of[d.id] for d in block.flat} for block in blocks]
    assert all(len(r) == 1 for r in replicas), "a replica straddles domains"
    if expected[0] > 1:
        assert len(set.union(*replicas)) == expected[0], "replicas share a domain"


def test_rules_cannot_name_the_replica_axis():
    with pytest.raises(ConfigError, match="replica"):
        load_config([], ["mesh.rules.embed=[replica]"])


@pytest.mark.parametrize(
    "overrides, expected",
    [
        (["mesh.data=-1", "mesh.expert=2", "mesh.tensor=2"], {"data": 2, "expert": 2, "tensor": 2}),
        (["mesh.data=2", "mesh.expert=-1", "mesh.tensor=1"], {"data": 2, "expert": 4, "tensor": 1}),
        (["mesh.data=1", "mesh.expert=2", "mesh.tensor=-1"], {"data": 1, "expert": 2, "tensor": 4}),
    ],
)
def test_minus_one_fills_the_remaining_devices(overrides, expected):
    config = load_config([], overrides)
    assert resolve_shape(config, 8) == {"pipeline": 1, **expected}
    assert dict(build_mesh(config).shape) == expected  # no pipeline axis without stages


def test_pipeline_is_the_outermost_axis():
    config = load_config([], ["mesh.pipeline=2", "mesh.data=2", "mesh.expert=2", "train.grad_accum=2"])
    mesh = build_mesh(config)
    assert dict(mesh.shape) == {"pipeline": 2, "data": 2, "expert": 2, "tensor": 1}
    # A stage is a contiguous block of devices: the first half, then the second.
    assert [d.id for d in mesh.devices[0].flat] == [0, 1, 2, 3]


def test_fill_that_does_not_divide_is_refused():
    config = load_config([], ["mesh.data=-1", "mesh.expert=4"])
    with pytest.raises(ConfigError, match="cannot fill mesh.data"):
        resolve_shape(config, 6)


@pytest.mark.parametrize("overrides", [["mesh.data=2", "mesh.expert=2"], ["mesh.data=4", "mesh.expert=4"]])
def test_product_mismatch_is_refused(overrides):
    with pytest.raises(ConfigError, match="8 are available"):
        build_mesh(load_config([], overrides))


# ------------------------------------------------------------------------- rules


def _rules(*overrides):
    return resolve_rules(load_config([], list(overrides)))


def test_fsdp_virtual_axis():
    assert _rules("mesh.fsdp=true")["embed"] == ("data",)
    assert _rules("mesh.fsdp=false")["embed"] == ()
    assert _rules("mesh.fsdp=true")["batch"] == ("data", "expert")


def test_first_come_first_served():
    fsdp = _rules("mesh.fsdp=true")
    # Activations: batch takes data and expert, so embed (which wants data under FSDP) gets nothing.
    assert logical_to_spec(("batch", "seq", "embed"), fsdp) == PartitionSpec(("data", "expert"), None, None)
    # Weights: embed comes first and takes data.
    assert logical_to_spec(("embed", "heads", "head_dim"), fsdp) == PartitionSpec("data", "tensor", None)
    assert logical_to_spec(("expert", "embed", "expert_mlp"), fsdp) == PartitionSpec("expert", "data", "tensor")
    # Two dimensions asking for tensor: the left one wins, whichever it is.
    assert logical_to_spec(("mlp", "heads"), fsdp) == PartitionSpec("tensor", None)
    assert logical_to_spec(("heads", "mlp"), fsdp) == PartitionSpec("tensor", None)
    # Router: embed x expert with FSDP off is replicated; unknown or None axes replicate.
    assert logical_to_spec(("embed", "expert"), _rules()) == PartitionSpec(None, "expert")
    assert logical_to_spec((None, "no_such_axis"), fsdp) == PartitionSpec(None, None)


def test_size_one_axes_are_left_out():
    shape = {"data": 8, "expert": 1, "tensor": 1}
    assert logical_to_spec(("batch", "seq", "embed"), _rules(), shape) == PartitionSpec("data", None, None)
    assert logical_to_spec(("embed", "mlp"), _rules("mesh.fsdp=true"), shape) == PartitionSpec("data", None)


def test_rules_from_the_command_line_change_only_what_they_name():
    rules = _rules("mesh.rules={batch: [data], expert: [expert, tensor]}")
    assert rules["batch"] == ("data",) and rules["expert"] == ("expert", "tensor")
    assert logical_to_spec(("embed", "mlp"), rules) == PartitionSpec(None, "tensor")  # default kept
    with pytest.raises(ConfigError, match="mesh.rules.batch"):
        load_config([], ["mesh.rules={batch: [rack]}"])


def test_specs_shard_arrays_as_the_table_says():
    # Oracle: per-device shard shapes of a real placement on the 2 x 2 x 2 mesh.
    config = load_config([], ["mesh.data=2", "mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=true"])
    mesh, rules = build_mesh(config), resolve_rules(config)

    def shard_shape(logical, shape):
        sharding = NamedSharding(mesh, logical_to_spec(logical, rules, dict(mesh.shape)))
        return jax.device_put(np.zeros(shape, np.float32), sharding).addressable_shards[0].data.shape

    assert shard_shape(("batch", "seq", "embed"), (16, 4, 64)) == (4, 4, 64)
    assert shard_shape(("expert", "embed", "expert_mlp"), (8, 64, 32)) == (4, 32, 16)
    assert shard_shape(("vocab", "embed"), (256, 64)) == (128, 32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert shard_shape(("embed", "expert"), (64, 8)) == (32, 4)


def test_partial_rules_merge_over_the_defaults():
    from maxmoe.config import DEFAULT_RULES
    from maxmoe.parallel.mesh import resolve_rules

    config = load_config([], ["mesh.rules.vocab=[]", "mesh.rules.batch=[data]"])
    rules = resolve_rules(config)
    assert rules["vocab"] == () and rules["batch"] == ("data",)
    assert rules["heads"] == tuple(DEFAULT_RULES["heads"])
    flow = load_config([], ["mesh.rules={vocab: []}"])
    assert resolve_rules(flow)["vocab"] == () and resolve_rules(flow)["expert"] == ("expert",)


def _boxed_state(config):
    return step_lib.abstract_state(config, make_optimizer(config.train), boxed=True)


@pytest.mark.parametrize(
    "overrides, line",
    [
        # A rule that puts the 260-token vocabulary on data=8.
        (
            ["mesh.data=8", "mesh.rules.vocab=[data]"],
            "params/embed/embedding [260, 64]: dimension 0 (vocab) of size 260 cannot be split 8 ways by "
            "mesh.rules.vocab -> data=8; change that rule or the mesh",
        ),
        # The virtual fsdp axis: embed goes to data only when mesh.fsdp is on.
        (
            ["mesh.data=8", "mesh.fsdp=true", "model.hidden_size=36"],
            "params/dense_layers/attention/w_k_rope [1, 36, 8]: dimension 1 (embed) of size 36 cannot be split "
            "8 ways by mesh.rules.embed -> data=8; change that rule or the mesh",
        ),
        # The token batch: its rows split over the axes of mesh.rules.batch.
        (
            ["mesh.data=2", "mesh.tensor=4", "mesh.rules.batch=[data, tensor]", "train.batch_size=12"],
            "the token batch [12, 129]: dimension 0 (batch) of size 12 cannot be split 8 ways by "
            "mesh.rules.batch -> data=2 x tensor=4; change that rule or the mesh",
        ),
    ],
)
def test_a_rule_the_mesh_cannot_divide_is_one_line_before_compiling(overrides, line):
    config = load_config([], overrides)
    with pytest.raises(ConfigError) as error:
        build_programs(config, build_layout(config))  # builds shardings only; nothing is compiled
    assert str(error.value) == line
    fine = load_config([], overrides[:-1])  # without the last override everything divides
    build_programs(fine, build_layout(fine))


def test_the_671b_rules_on_1024_devices_name_the_latent_that_does_not_divide():
    # No devices needed: the check reads only the mesh sizes (data=16 x expert=64 = 1,024).
    config = load_config(
        [str(REPO / "configs" / "deepseek_v3_671b.yaml"), str(REPO / "configs" / "mesh_256_gb300.yaml")]
    )
    boxed = _boxed_state(config)
    with pytest.raises(ConfigError) as error:
        check_divisible(boxed, resolve_rules(config), {"data": 16, "expert": 64, "tensor": 1})
    assert "(kv_lora) of size 512 cannot be split 1024 ways by mesh.rules.kv_lora -> data=16 x expert=64" in str(
        error.value
    )
    check_divisible(boxed, resolve_rules(config), {"data": 4, "expert": 64, "tensor": 1})  # the shipped 256-GPU mesh


def test_zero1_with_pipeline_stages_is_refused():
    with pytest.raises(ConfigError, match="mesh.across_domains=zero1 with mesh.pipeline=2"):
        load_config([], ["mesh.across_domains=zero1", "mesh.pipeline=2", "mesh.data=2", "train.grad_accum=2"])
