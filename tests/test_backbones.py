"""The zoo, parametrised over the registry: a new model is tested for free."""

from __future__ import annotations

import resource

import pytest
import torch
import torch.nn.functional as F

from anytime.backbones import (
    StagedBackbone,
    create_model,
    get_spec,
    list_models,
    model_cost,
    model_modality,
    register_model,
)  # fmt: skip
from anytime.backbones.resnet import ResidualBlock
from anytime.errors import AnytimeError

ZOO = [n for n in list_models(include_torchvision=False) if model_modality(n) == "image"]  # text: test_text.py
TORCHVISION = ["tv:resnet18", "tv:mobilenet_v2", "tv:vgg11"]


@pytest.mark.parametrize("name", ZOO)
@pytest.mark.parametrize("in_channels", [1, 3])
def test_zoo_forward_shapes(name, in_channels):
    torch.manual_seed(0)
    model = create_model(name, num_classes=7, in_channels=in_channels).eval()
    with torch.no_grad():
        logits = model(torch.randn(2, in_channels, 32, 32))
    assert logits.shape == (2, 7)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("name", ZOO)
def test_stage_contract_matches_the_feature_maps(name):
    model = create_model(name).eval()
    assert isinstance(model, StagedBackbone)
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        outputs = model.forward_stages(x)
        assert torch.allclose(model(x), model.forward_head(model.forward_features(x)), atol=1e-5)
    assert len(outputs) == len(model.stage_info) >= 2
    for out, info in zip(outputs, model.stage_info):
        if hasattr(model, "exit_view"):  # MSDNet passes its scales packed: the stage's map is what an exit reads
            out = model.exit_view(info.name, tuple(out.shape[1:]))[0](out)
        assert out.shape[1] == info.channels, info
        assert out.shape[-1] in (32 // info.stride, 31 // info.stride), info  # fastcnn: its 2x2 stem trims a pixel
        assert model.get_submodule(info.name) is not None
    strides = [s.stride for s in model.stage_info]
    assert strides == sorted(strides)


@pytest.mark.parametrize("name", ZOO)
def test_zoo_runs_at_larger_inputs(name):
    size = (64, 64) if name == "msdnet" else (64, 48)  # MSDNet takes square images: tests/test_msdnet.py
    with torch.no_grad():
        assert create_model(name, num_classes=3).eval()(torch.randn(1, 3, *size)).shape == (1, 3)


@pytest.mark.parametrize("name", ["resnet20", "mobilenetv2", "preact_resnet18"])
def test_backward_reaches_every_parameter(name):
    model = create_model(name, num_classes=5)
    F.cross_entropy(model(torch.randn(4, 3, 32, 32)), torch.tensor([0, 1, 2, 3])).backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize(
    ("name", "millions"),
    [("resnet18", 11.17), ("resnet50", 23.5), ("resnet20", 0.27), ("resnet56", 0.85), ("resnext29_2x64d", 9.13),
     ("mobilenetv2", 2.24), ("vgg11", 9.23), ("lenet", 0.062)],
)  # fmt: skip
def test_parameter_counts_match_the_literature(name, millions):
    count = sum(p.numel() for p in create_model(name).parameters())
    assert abs(count / 1e6 - millions) / millions < 0.1


@pytest.mark.parametrize(
    ("name", "count"), [("resnet18", 8), ("resnet50", 16), ("resnet20", 9), ("resnext29_2x64d", 9)]
)
def test_residual_blocks_are_branch_plus_shortcut(name, count):
    blocks = [m for m in create_model(name).eval().modules() if isinstance(m, ResidualBlock)]
    assert len(blocks) == count
    for block in blocks[:: max(1, count // 3)]:
        channels = next(m for m in block.branch.modules() if isinstance(m, torch.nn.Conv2d)).in_channels
        x = torch.randn(1, channels, 8, 8)
        with torch.no_grad():
            assert torch.allclose(block(x), torch.relu(block.branch(x) + block.shortcut(x)))


def test_flops_are_counted_per_image():
    cost = model_cost("resnet20")
    assert 75e6 < cost.flops < 90e6  # 40.5M multiply-adds, counted as 2 FLOPs each
    assert cost.parameters == sum(p.numel() for p in create_model("resnet20").parameters())


@pytest.mark.parametrize("name", TORCHVISION)
def test_torchvision_models_by_name(name):
    assert name in list_models()
    with torch.no_grad():
        assert create_model(name, num_classes=4).eval()(torch.randn(1, 3, 32, 32)).shape == (1, 4)


def test_torchvision_model_with_grey_input():
    with torch.no_grad():
        assert create_model("tv:resnet18", in_channels=1).eval()(torch.randn(1, 1, 32, 32)).shape == (1, 10)


@pytest.mark.parametrize("name", ["tv:vit_h_14", "tv:regnet_y_128gf"])  # RegNet cannot use the meta device context
def test_huge_torchvision_model_is_costed_without_allocating_it(name):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    cost = model_cost(name, count_flops=False)
    assert cost.parameters > 600e6
    # Allocated, its weights alone would take 2.4 GB or more; the peak resident set must not grow by half of that.
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1.2e6  # KiB


def test_unknown_names_suggest_a_close_match():
    with pytest.raises(AnytimeError, match="did you mean .*'resnet20'"):
        create_model("resnet2O")
    with pytest.raises(AnytimeError, match="tv:resnet18"):
        create_model("tv:resnet-18")
    with pytest.raises(AnytimeError, match="anytime models"):
        get_spec("nothing-like-it")


def test_bad_sizes_are_refused():
    with pytest.raises(AnytimeError, match="2 classes"):
        create_model("lenet", num_classes=1)
    with pytest.raises(AnytimeError, match="in_channels"):
        create_model("lenet", in_channels=0)


def test_duplicate_registration_raises():
    with pytest.raises(ValueError, match="twice"):
        register_model("lenet", family="x", description="x")(lambda **kw: None)
