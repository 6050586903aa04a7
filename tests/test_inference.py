"""The inference form: batch norm folded into convolutions, channels-last, and the form recorded and replayed."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from anytime.deploy.inference import InferenceForm, fold_batchnorm, inference_form
from anytime.errors import AnytimeError


def _randomise_norms(model: nn.Module, seed: int = 0) -> nn.Module:
    """Running statistics and affine parameters far from their initial 0/1, so a wrong fold shows."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(torch.randn(c, generator=generator) * 0.5)
                m.running_var.copy_(torch.rand(c, generator=generator) + 0.5)
                if m.bias is not None:
                    m.bias.copy_(torch.randn(c, generator=generator) * 0.2)
                if m.weight is not None and m.weight.requires_grad:
                    m.weight.copy_(torch.rand(c, generator=generator) + 0.5)
    return model.eval()


def _norms(model: nn.Module) -> int:
    return sum(isinstance(m, nn.BatchNorm2d) for m in model.modules())


@pytest.mark.parametrize("name", ["resnet20", "fastcnn", "vgg11", "mobilenetv2", "tv:resnet18"])
def test_folding_removes_the_norms_and_keeps_every_output(name):
    from anytime.backbones import create_model

    model = _randomise_norms(create_model(name, num_classes=10))
    x = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    folded = copy.deepcopy(model)
    count = fold_batchnorm(folded)
    assert count > 0 and _norms(folded) == _norms(model) - count
    assert _norms(folded) == 0 or name == "mobilenetv2"  # every conv-then-norm pair of these nets
    with torch.inference_mode():
        expected, got = model(x), folded(x)
    assert torch.allclose(expected, got, rtol=1e-4, atol=1e-4), (expected - got).abs().max()


def test_a_norm_with_a_negative_scale_is_not_folded_across_a_max_pool():
    conv = nn.Conv2d(3, 4, 3, padding=1, bias=False)
    norm = nn.BatchNorm2d(4)
    model = nn.Sequential(conv, nn.MaxPool2d(2), norm).eval()
    with torch.no_grad():
        norm.weight.copy_(torch.tensor([1.0, -1.0, 0.5, 2.0]))  # max(-x) != -max(x): must stay a norm
    x = torch.randn(2, 3, 8, 8)
    folded = copy.deepcopy(model)
    assert fold_batchnorm(folded) == 0 and isinstance(folded[2], nn.BatchNorm2d)
    with torch.no_grad():
        norm.weight.abs_()
        model_positive = copy.deepcopy(model)
    assert fold_batchnorm(model_positive) == 1
    with torch.inference_mode():
        assert torch.allclose(model(x), model_positive(x), atol=1e-5)


def test_folding_needs_eval_mode():
    with pytest.raises(AnytimeError, match="eval mode"):
        fold_batchnorm(nn.Sequential(nn.Conv2d(1, 2, 3), nn.BatchNorm2d(2)).train())


def test_multi_exit_and_ladder_steps_keep_their_outputs_and_flags_after_folding():
    from anytime.backbones import create_model
    from anytime.families import attach_exits
    from anytime.families.residual import BlockDropLadder

    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(2))
    exits = _randomise_norms(attach_exits(create_model("resnet20", num_classes=10), "auto"))
    ladder = _randomise_norms(BlockDropLadder(create_model("resnet20", num_classes=10)))
    for model in (exits, ladder):
        form = inference_form(model, InferenceForm(fold=True), probe=x)
        assert form is not model and form.inference_form == "fold"
        with torch.inference_mode():
            for k in range(model.num_steps):
                assert torch.allclose(model.forward_until(x, k), form.forward_until(x, k), atol=1e-4), k


def test_channels_last_form_equals_eager_and_the_eager_form_is_the_model_itself():
    from anytime.backbones import create_model

    model = _randomise_norms(create_model("resnet20", num_classes=10))
    x = torch.randn(2, 3, 32, 32)
    assert inference_form(model, InferenceForm()) is model
    converted = inference_form(model, InferenceForm.parse("fold+channels-last"), probe=x)
    assert converted.inference_form == "fold+channels-last"
    conv = next(m for m in converted.modules() if isinstance(m, nn.Conv2d))
    assert conv.weight.is_contiguous(memory_format=torch.channels_last)


def test_every_compiled_part_stays_compiled_at_every_batch_size(monkeypatch):
    from torch._dynamo.utils import counters

    from anytime.backbones import create_model
    from anytime.families import attach_exits

    compile_ = torch.compile  # TorchDynamo's graphs without inductor's code: it is the graphs' count that falls short
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(*args, **{**kwargs, "backend": "eager"}))
    torch.manual_seed(0)
    model = attach_exits(create_model("lenet", num_classes=10), "auto", num_classes=10, input_shape=(3, 32, 32))
    compiled = inference_form(model.eval(), InferenceForm(compile=True))
    before = counters["stats"]["unique_graphs"]
    with torch.no_grad():
        for batch in (1, 2, 3):  # 3 parts x 3 shapes: past TorchDynamo's default 8 graphs per compiled function
            compiled(torch.randn(batch, 3, 32, 32))
    assert counters["stats"]["unique_graphs"] - before == 9, "a part fell back to eager"


def test_a_wrong_fold_is_refused_by_the_probe(monkeypatch):
    from anytime.deploy import inference

    def break_it(model):
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                with torch.no_grad():
                    m.weight.mul_(3)
        return 1

    monkeypatch.setattr(inference, "fold_batchnorm", break_it)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten()).eval()
    with pytest.raises(AnytimeError, match="differs"):
        inference_form(model, InferenceForm(fold=True), probe=torch.randn(2, 3, 8, 8))


@pytest.mark.parametrize("text,name", [("eager", "eager"), ("fold", "fold"), ("channels-last+fold", "fold+channels-last"),
                                       ("fold+channels-last+compile", "fold+channels-last+compile")])  # fmt: skip
def test_form_names_parse_in_any_order(text, name):
    assert InferenceForm.parse(text).name == name


@pytest.mark.parametrize("text", ["", "folded", "fold+fast", "eager+fold"])
def test_an_unknown_form_is_a_clear_error(text):
    with pytest.raises(AnytimeError, match="inference form"):
        InferenceForm.parse(text)


def test_the_profile_records_the_form_and_the_runtime_runs_it(exit_run, tmp_path, monkeypatch):
    from anytime.scheduler.runs import runner_for_run
    from anytime.tasks.profiling import ProfileSettings, profile_run
    from anytime.train.runs import load_run
    from anytime.utils import memory

    monkeypatch.setattr(memory, "_applied", None)
    unset = memory.allocator_state()
    loaded = load_run(exit_run, form="fold")
    assert loaded.form == "fold" and _norms(loaded.model) == 0
    assert _norms(load_run(exit_run).model) > 0
    path = tmp_path / "profile.json"
    profile, _ = profile_run(
        exit_run, ProfileSettings(batch_sizes=(1,), repeats=3, warmup=1, memory=False, form="fold"), out=path
    )
    assert profile.settings["form"] == "fold"
    assert profile.settings["allocator"] == memory.allocator_state() != unset  # held by the profiler, as by the runtime
    _, run = runner_for_run(exit_run, path, quantile=0.5)
    assert run.form == "fold" and _norms(run.model) == 0


def test_cli_form_option_refuses_an_unknown_form(capsys):
    from anytime.cli import main

    with pytest.raises(SystemExit) as info:
        main(["profile", "some-run", "--form", "folded"])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err
    assert "unknown inference form 'folded'" in err and "fold+channels-last" in err


def test_the_runtime_runs_with_the_profiled_thread_count(exit_run, tmp_path):
    from anytime.scheduler.runs import runner_for_run
    from anytime.tasks.profiling import ProfileSettings, profile_run

    before = torch.get_num_threads()
    try:
        path = tmp_path / "profile-auto.json"
        profile, _ = profile_run(
            exit_run, ProfileSettings(batch_sizes=(1,), repeats=3, warmup=1, memory=False, threads="auto"), out=path
        )
        chosen = profile.settings["threads_chosen"]
        assert profile.settings["threads"] == chosen["threads"] >= 1 and chosen["source"]
        one, _ = profile_run(
            exit_run,
            ProfileSettings(batch_sizes=(1,), repeats=3, warmup=1, memory=False, threads=1),
            out=tmp_path / "p1.json",
        )
        assert one.settings["threads"] == 1 and "threads_chosen" not in one.settings
        torch.set_num_threads(2)
        runner_for_run(exit_run, tmp_path / "p1.json", quantile=0.5)
        assert torch.get_num_threads() == 1
        runner_for_run(exit_run, tmp_path / "p1.json", quantile=0.5, threads=2)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("head", ["pool", "linear", "scaled", "conv"])
def test_pooled_exit_heads_fold_into_one_module_and_answer_the_same(head):
    from anytime.backbones import create_model
    from anytime.deploy.inference import PooledLinear
    from anytime.families import attach_exits

    model = _randomise_norms(attach_exits(create_model("resnet20", num_classes=10), "auto", head=head))
    for form in ("fold", "fold+channels-last"):
        converted = inference_form(model, InferenceForm.parse(form))
        fused = [m for h in converted.heads for m in h.modules() if isinstance(m, PooledLinear)]
        assert len(fused) == len(converted.heads) and not any(
            isinstance(m, nn.AdaptiveAvgPool2d) for h in converted.heads for m in h.modules()
        )
        for batch in (1, 3):
            x = torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(batch))
            if form.endswith("channels-last"):
                x = x.contiguous(memory_format=torch.channels_last)
            with torch.inference_mode():
                for k in range(model.num_steps):
                    expected, got = model.forward_until(x, k), converted.forward_until(x, k)
                    assert torch.allclose(expected, got, rtol=1e-4, atol=1e-4), (form, k, (expected - got).abs().max())


def test_a_small_pooled_head_answers_as_one_linear_map_over_the_whole_map():
    from anytime.deploy.inference import WHOLE_MAP_MACS, PooledLinear

    torch.manual_seed(0)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(6 * 16, 10)).eval()
    fused = PooledLinear(4, head[2])
    small, large = torch.randn(1, 6, 16, 16), torch.randn(4, 6, 16, 16)
    assert small.numel() * 10 <= WHOLE_MAP_MACS < large.numel() * 10  # one call of each kind
    with torch.inference_mode():
        for x in (small, large, small[:, :, :8, :8]):  # a second map size makes its own weights
            for layout in (torch.contiguous_format, torch.channels_last):
                assert torch.allclose(head(x), fused(x.contiguous(memory_format=layout)), atol=1e-5)
        assert fused._plan is not None and fused._plan.shape == (1, 6, 8, 8) and fused._plan.pool == "none"
        assert len(fused._plans) == 6  # each map shape and layout keeps its own
        for layout in (torch.contiguous_format, torch.channels_last):  # maps that start inside a larger tensor
            maps = large.contiguous(memory_format=layout)
            for i in range(4):
                assert maps[i : i + 1].storage_offset() > 0 or i == 0
                assert torch.allclose(head(large[i : i + 1]), fused(maps[i : i + 1]), atol=1e-5), (layout, i)
        for layout in (torch.contiguous_format, torch.channels_last):  # neither layout in memory: read as it lies
            corner = large.contiguous(memory_format=layout)[:, :, :8, :8]
            assert fused._plan_for(corner) is None
            assert torch.allclose(head(large[:, :, :8, :8]), fused(corner), atol=1e-5), layout
        double = fused.to(torch.float64)  # weights that move drop the whole-map weights made from them
        assert double._plan is None and double(small.double()).dtype == torch.float64
        double.load_state_dict({k: v * 2 for k, v in double.state_dict().items()})
        for x in (small, large):  # new weights: every weight derived from them is made again
            for layout in (torch.contiguous_format, torch.channels_last):
                got = double(x.double().contiguous(memory_format=layout)).float()
                assert torch.allclose(got, 2 * head(x), atol=1e-4), layout


def test_a_map_pooled_to_one_value_per_channel_is_summed_and_answers_the_same_in_either_layout(monkeypatch):
    import torch.nn.functional as F

    from anytime.deploy.inference import WHOLE_MAP_MACS, PooledLinear

    torch.manual_seed(0)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10)).eval()
    fused = PooledLinear(1, head[2])
    tiny, small, large = torch.randn(1, 16, 4, 4), torch.randn(1, 16, 32, 32), torch.randn(8, 16, 32, 32)
    assert tiny.numel() * 10 <= WHOLE_MAP_MACS < small.numel() * 10
    pooled = []
    average = F.avg_pool2d
    monkeypatch.setattr(F, "avg_pool2d", lambda x, *a, **k: pooled.append(x.shape[0]) or average(x, *a, **k))
    with torch.inference_mode():
        for x, way in ((tiny, "none"), (small, "sum"), (large, "sum")):
            for layout in (torch.contiguous_format, torch.channels_last):
                assert torch.allclose(head(x), fused(x.contiguous(memory_format=layout)), atol=1e-5), (x.shape, layout)
                assert fused._plan is not None and fused._plan.pool == way, (x.shape, layout)
    assert pooled == []  # no averaging operator: the division is in the weight
    half = PooledLinear(1, nn.Linear(16, 10).half())
    bright = torch.full((1, 16, 32, 32), 100.0, dtype=torch.float16)  # its sum, 102,400, is past float16's range
    with torch.inference_mode():
        assert torch.isfinite(half(bright)).all() and half._plan is not None and half._plan.pool == "window"


def test_the_fold_form_puts_a_lone_fused_head_in_its_container_s_place():
    from anytime.backbones import create_model
    from anytime.deploy.inference import PooledLinear
    from anytime.families import attach_exits

    model = attach_exits(create_model("lenet"), "stages.0").eval()
    converted = inference_form(model, InferenceForm.parse("fold"))
    assert isinstance(converted.heads[0], PooledLinear) and isinstance(model.heads[0], nn.Sequential)
    x = torch.randn(1, 3, 32, 32)
    with torch.inference_mode():
        assert torch.allclose(model.forward_until(x, 0), converted.forward_until(x, 0), atol=1e-5)


def test_a_map_the_size_does_not_divide_is_pooled_by_one_product_for_one_sample():
    from anytime.deploy.inference import MATRIX_POOL_MACS, PooledLinear

    torch.manual_seed(0)
    head = nn.Sequential(nn.AdaptiveAvgPool2d(4), nn.Flatten(), nn.Linear(64 * 16, 10)).eval()  # fastcnn's exits
    fused = PooledLinear(4, head[2])
    one, three, wide = torch.randn(1, 64, 15, 15), torch.randn(3, 64, 15, 15), torch.randn(1, 64, 33, 33)
    assert one.numel() * 16 <= MATRIX_POOL_MACS < wide.numel() * 16
    with torch.inference_mode():
        for x, pool in ((one, "matrix"), (three, "adaptive"), (wide, "adaptive"), (one[:, :, :7, :9], "matrix")):
            for layout in (torch.contiguous_format, torch.channels_last):
                got = fused(x.contiguous(memory_format=layout))
                assert fused._plan is not None and fused._plan.pool == pool, (x.shape, layout)
                assert torch.allclose(head(x), got, atol=1e-5), (x.shape, layout, (head(x) - got).abs().max())


def test_a_pooled_linear_reads_either_layout_and_maps_that_its_size_does_not_divide():
    from anytime.deploy.inference import PooledLinear, fuse_pooled_heads

    torch.manual_seed(0)
    for height, size in ((8, 4), (6, 4), (5, 1)):
        head = nn.Sequential(nn.AdaptiveAvgPool2d(size), nn.Flatten(), nn.Linear(3 * size * size, 5)).eval()
        fused = copy.deepcopy(head)
        assert fuse_pooled_heads(fused) == 1 and len(fused) == 1 and isinstance(fused[0], PooledLinear)
        x = torch.randn(2, 3, height, height)
        for layout in (torch.contiguous_format, torch.channels_last):
            with torch.inference_mode():
                assert torch.allclose(head(x), fused(x.contiguous(memory_format=layout)), atol=1e-5), (height, layout)
    other = nn.Sequential(nn.AdaptiveAvgPool2d((2, 3)), nn.Flatten(), nn.Linear(18, 5))  # not a square pooling
    assert fuse_pooled_heads(other) == 0 and len(other) == 3

    class OtherLinear(nn.Linear):  # e.g. a QAT or quantized linear layer: it computes something else
        pass

    assert fuse_pooled_heads(nn.Sequential(nn.AdaptiveAvgPool2d(2), nn.Flatten(), OtherLinear(12, 5))) == 0
    named = nn.Sequential(nn.ReLU(), nn.AdaptiveAvgPool2d(2), nn.Flatten(), nn.Linear(12, 5), nn.Tanh()).eval()
    fused = copy.deepcopy(named)
    assert fuse_pooled_heads(fused) == 1 and list(fused._modules) == ["0", "1", "4"]  # the others keep their names
    assert "1.weight_nhwc" not in fused.state_dict()  # derived from the weight, not saved beside it
    unfused = fused[1].unfused()
    x = torch.randn(3, 3, 6, 6)
    with torch.inference_mode():
        assert torch.allclose(named(x), fused(x), atol=1e-5) and torch.allclose(named[1:4](x), unfused(x), atol=1e-6)
