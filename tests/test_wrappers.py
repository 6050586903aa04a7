"""Exits on every backbone: shapes and order, the last exit equals the backbone, points, heads, costs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from anytime import attach_exits
from anytime.backbones import create_model, example_input, list_models, model_modality
from anytime.errors import AnytimeError
from anytime.families import HEADS, MultiExitModel
from anytime.families.tracing import traced_chain

TORCHVISION_FAMILIES = [
    "tv:resnet18", "tv:vgg11_bn", "tv:mobilenet_v2", "tv:mobilenet_v3_small", "tv:densenet121", "tv:efficientnet_b0",
    "tv:shufflenet_v2_x0_5", "tv:regnet_x_400mf", "tv:mnasnet0_5",
]  # fmt: skip


def _check_contract(model: MultiExitModel, backbone: nn.Module, x: torch.Tensor) -> None:
    model.eval()
    with torch.no_grad():
        everything = model.forward_all(x)
        reference = backbone(x)
        stepped = list(model.steps(x))
        assert everything.shape == (model.num_steps, x.shape[0], reference.shape[1])
        assert torch.equal(everything[-1], reference)  # the last exit is the backbone, bit for bit
        assert len(stepped) == model.num_steps
        for k in range(model.num_steps):
            assert torch.equal(model.forward_until(x, k), everything[k])
            assert torch.equal(stepped[k], everything[k])
    flops = [e.flops for e in model.exit_info]
    assert all(a < b for a, b in zip(flops, flops[1:])), flops  # cheapest first
    assert model.exit_info[-1].flops == model.backbone_flops
    assert all(e.cost_flops >= e.flops for e in model.exit_info)
    heads = model.exit_info[:-1]
    if hasattr(backbone, "exit_head_at"):
        # a backbone's own first head may only read an answer its stem computed (ngram_encoder's bag): free
        assert heads[0].head_params >= 0 and heads[0].head_flops >= 0
        heads = heads[1:]
    assert all(e.head_params > 0 and e.head_flops > 0 for e in heads)


@pytest.mark.parametrize("name", list_models(include_torchvision=False))
def test_exits_on_every_zoo_model(name):
    torch.manual_seed(0)
    backbone = create_model(name).eval()
    model = attach_exits(backbone, "auto")
    assert model.num_steps >= 2
    assert [e.name for e in model.exit_info][-1] == "output"
    assert all(e.name.startswith("stages.") for e in model.exit_info[:-1])
    shape = (backbone.max_length,) if model_modality(name) == "text" else (3, 32, 32)
    _check_contract(
        model, backbone, example_input(shape, 3, tokens=len(shape) == 1, generator=torch.Generator().manual_seed(0))
    )


@pytest.mark.parametrize("name", TORCHVISION_FAMILIES)
def test_exits_on_torchvision_families(name):
    torch.manual_seed(0)
    backbone = create_model(name).eval()
    model = attach_exits(backbone, "auto")
    assert model.num_steps >= 3, [e.name for e in model.exit_info]
    _check_contract(model, backbone, torch.randn(2, 3, 32, 32))


def test_torchvision_resnet_exits_at_its_layers():
    model = attach_exits(create_model("tv:resnet18"), "auto")
    assert [e.name for e in model.exit_info] == ["layer1", "layer2", "layer3", "output"]


def test_a_users_own_module_is_split_by_tracing():
    torch.manual_seed(0)
    net = nn.Sequential(
        nn.Conv2d(1, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(8, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(16 * 7 * 7, 5),
    ).eval()  # fmt: skip
    model = attach_exits(net, ["3"], input_shape=(1, 28, 28))
    assert [e.name for e in model.exit_info] == ["3", "output"]
    assert model.exit_info[0].shape == (8, 14, 14)
    _check_contract(model, net, torch.randn(4, 1, 28, 28))


class _Branchy(nn.Module):
    """A user's module whose forward branches in Python: on a tensor's value, or on ``self.training``."""

    def __init__(self, on: str) -> None:
        super().__init__()
        self.on = on
        self.conv = nn.Conv2d(3, 4, 3)
        self.fc = nn.Linear(4, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        if (y.sum() > 0) if self.on == "value" else self.training:
            y = y * 2
        return self.fc(y.mean(dim=(2, 3)))


def test_a_module_that_cannot_be_split_is_named():
    with pytest.raises(AnytimeError, match="cannot split _Branchy"):
        attach_exits(_Branchy("value"))


def test_in_place_consumers_are_not_cut_points():
    # VGG's batch norms feed in-place ReLUs: an exit reading a BN's output would see it overwritten.
    chain = traced_chain(create_model("tv:vgg11_bn"), torch.zeros(1, 3, 32, 32))
    names = {c.name for c in chain.cuts}
    assert "features.1" not in names  # BN, whose output the next ReLU overwrites
    assert {"features.0", "features.2"} <= names  # the conv before it and the ReLU itself


@pytest.mark.parametrize(
    ("points", "names"),
    [
        ("auto", ["stages.0.2", "stages.1.2", "output"]),
        ("stages.0,stages.1", ["stages.0.2", "stages.1.2", "output"]),  # a stage's name reaches its last block
        ("stages.0.0,stages.2.1", ["stages.0.0", "stages.2.1", "output"]),
        (4, ["stages.0.1", "stages.1.0", "stages.2.0", "output"]),  # nearest to 25, 50, 75% of the FLOPs
        ("1", ["output"]),
        ("0.5", ["stages.1.0", "output"]),
    ],
)
def test_exit_points(points, names):
    model = attach_exits(create_model("resnet20"), points)
    assert [e.name for e in model.exit_info] == names


def test_sdn_points_sit_at_fractions_of_the_flops():
    model = attach_exits(create_model("resnet56"), "sdn")
    fractions = [e.flops / model.backbone_flops for e in model.exit_info[:-1]]
    assert len(fractions) == 6
    for got, want in zip(fractions, (0.15, 0.3, 0.45, 0.6, 0.75, 0.9)):
        assert abs(got - want) < 0.04


@pytest.mark.parametrize(
    ("points", "message"),
    [
        ("stages.7", "no exit point named 'stages.7'"),
        ("stages.0,stages.0.2", "name the same point twice"),
        ("1.5", "fractions of the backbone's FLOPs"),
        ("0", "at least 1"),
        ("", "no exit points given"),
        (30, "distinct ones fit"),
    ],
)
def test_bad_exit_points_are_refused(points, message):
    with pytest.raises(AnytimeError, match=message):
        attach_exits(create_model("resnet20"), points)


@pytest.mark.parametrize("head", HEADS)
def test_every_head_design(head):
    model = attach_exits(create_model("resnet20"), "auto", head=head).eval()
    assert model.forward_all(torch.randn(2, 3, 32, 32)).shape == (3, 2, 10)
    assert model.exit_info[0].head_flops > 0


def test_conv_heads_cost_more_than_linear_ones():
    costs = {h: attach_exits(create_model("resnet20"), "auto", head=h).exit_info[0].head_flops for h in HEADS}
    assert costs["linear"] < costs["pool"] < costs["conv"]


def test_the_scaled_head_is_the_pool_head_with_its_logits_scaled_by_its_width():
    pool = attach_exits(create_model("resnet20"), "auto", head="pool").eval()
    scaled = attach_exits(create_model("resnet20"), "auto", head="scaled").eval()
    scaled.load_state_dict(pool.state_dict())  # same parameters: the scale has none
    x = torch.randn(2, 3, 32, 32)
    features = pool.heads[0][2].in_features
    with torch.no_grad():
        assert torch.allclose(scaled.heads[0](pool.segments[0](x)), pool.heads[0](pool.segments[0](x)) * 2 / features**0.5,
                              atol=1e-6)  # fmt: skip


def test_unknown_head_is_refused():
    with pytest.raises(AnytimeError, match="unknown exit head"):
        attach_exits(create_model("resnet20"), head="mlp")


def test_parameters_are_registered_once_under_backbone_names():
    backbone = create_model("resnet20")
    model = attach_exits(backbone, "auto")
    keys = set(model.state_dict())
    assert {f"backbone.{k}" for k in backbone.state_dict()} <= keys
    assert all(k.startswith(("backbone.", "heads.")) for k in keys)
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in backbone.parameters()) + sum(
        e.head_params for e in model.exit_info
    )


def test_frozen_backbone_stays_in_eval_mode():
    model = attach_exits(create_model("resnet20"), "auto").freeze_backbone()
    model.train()
    assert not model.backbone.training and model.heads.training
    assert not any(p.requires_grad for p in model.backbone.parameters())


def test_step_out_of_range_is_refused():
    model = attach_exits(create_model("resnet20"), "auto")
    with pytest.raises(AnytimeError, match="exit 3 does not exist"):
        model.forward_until(torch.zeros(1, 3, 32, 32), 3)


class _Normalised(nn.Module):
    """A user's module that reads a buffer directly in its forward (a get_attr in the traced graph)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((1, 3, 1, 1), 0.5))
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pool(torch.relu(self.conv(x - self.mean))).flatten(1))


def test_traced_segments_follow_the_backbone_when_it_moves():
    model = attach_exits(_Normalised(), ["conv"])
    model.to(torch.float64)
    assert model.segments[0].mean.dtype == torch.float64  # type: ignore[union-attr]
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    assert torch.equal(model.eval().forward_all(x)[-1], model.backbone(x))


def test_a_forward_that_branches_on_training_is_refused():
    with pytest.raises(AnytimeError, match="branches on self.training"):
        attach_exits(_Branchy("training"))


def test_gradient_equilibrium_gives_shared_layers_the_mean_of_the_exits_gradients():
    torch.manual_seed(0)
    plain = attach_exits(create_model("resnet20"), "auto").train()
    balanced = attach_exits(create_model("resnet20"), "auto").train()
    balanced.load_state_dict(plain.state_dict())
    balanced.gradient_equilibrium = True
    x = torch.randn(4, 3, 32, 32)
    outputs = {}
    for name, model in (("plain", plain), ("balanced", balanced)):
        torch.manual_seed(1)
        logits = model(x)
        logits.square().sum().backward()
        outputs[name] = logits.detach()
    assert torch.allclose(outputs["plain"], outputs["balanced"])  # values unchanged
    first = next(p for n, p in plain.named_parameters() if n.startswith("backbone.stem"))
    first_balanced = next(p for n, p in balanced.named_parameters() if n.startswith("backbone.stem"))
    k = plain.num_steps
    scale = float(first.grad.abs().max())
    assert torch.allclose(first_balanced.grad, first.grad / k, rtol=1e-3, atol=1e-5 * scale)  # each exit: 1/K there
    for head, head_balanced in zip(plain.heads, balanced.heads):  # the heads' own gradients are untouched
        for p, q in zip(head.parameters(), head_balanced.parameters()):
            assert torch.allclose(p.grad, q.grad, rtol=1e-3, atol=1e-5 * float(p.grad.abs().max()))
    with torch.no_grad():  # and nothing changes outside training
        assert torch.equal(balanced.eval()(x), plain.eval()(x))


def test_heads_per_exit_by_name_or_graded_by_position():
    from anytime.families import head_kinds

    assert head_kinds("pool", [0.2, 0.5]) == ["pool", "pool"]
    assert head_kinds("conv2, pool", [0.2, 0.5]) == ["conv2", "pool"]
    assert head_kinds("graded", [0.1, 0.32, 0.34, 0.6, 0.67, 0.9]) == ["conv2", "conv2", "conv", "conv", "pool", "pool"]
    with pytest.raises(AnytimeError, match="3 exit heads given for 2 early exits"):
        head_kinds("pool,pool,conv", [0.2, 0.5])
    with pytest.raises(AnytimeError, match="unknown exit head 'mlp'.*graded"):
        head_kinds("pool,mlp", [0.2, 0.5])


def test_graded_heads_give_the_earliest_exits_the_most_layers():
    torch.manual_seed(0)
    backbone = create_model("resnet20").eval()
    model = attach_exits(backbone, "0.15,0.5,0.8", head="graded")
    convs = [sum(isinstance(m, nn.Conv2d) for m in head.modules()) for head in model.heads]
    assert convs == [2, 1, 0]
    # conv2 halves a 32x32 map twice before pooling, at the features' width; the pooled head reads 4x4.
    assert model.heads[0][0].stride == (2, 2) and model.heads[0][3].stride == (2, 2)
    assert model.heads[0][0].out_channels == model.exit_info[0].shape[0]
    _check_contract(model, backbone, torch.randn(3, 3, 32, 32))
    with pytest.raises(AnytimeError, match="2 exit heads given for 3 early exits"):
        attach_exits(create_model("resnet20"), "0.15,0.5,0.8", head="conv2,pool")


def test_a_graded_head_that_would_cost_too_much_is_made_shallower():
    from anytime.families.exits import GRADED_HEAD_SHARE

    # fastcnn's exit after its first 256-channel block sits in the second third: a conv layer there would cost
    # a quarter of the backbone, so it gets the pooled head.
    model = attach_exits(create_model("fastcnn"), "stages.0,stages.1.0,stages.1", head="graded")
    convs = [sum(isinstance(m, nn.Conv2d) for m in head.modules()) for head in model.heads]
    assert convs == [2, 0, 0]
    assert all(e.head_flops <= GRADED_HEAD_SHARE * model.backbone_flops for e in model.exit_info)


def test_convolutional_heads_are_refused_on_text_features_in_one_line():
    from anytime.families import exit_head

    with pytest.raises(AnytimeError, match="'conv2' is made of convolutions"):
        exit_head("conv2", (16, 32), 2)
