"""Class activation maps per step: the method each head gets, maps that find where the evidence is, the
`anytime cam` command and its refusals."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

from anytime.backbones.registry import create_model
from anytime.errors import AnytimeError
from anytime.families import attach_exits
from anytime.tasks.cam import step_maps


class Bright(nn.Module):
    """One step: class 1's evidence is bright pixels, wherever they are (a 1x1 convolution, then ``head``)."""

    num_steps = 1

    def __init__(self, head: str) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 1, 1)
        self.relu = nn.ReLU()
        pool = nn.AdaptiveAvgPool2d(1) if head == "gap" else nn.AdaptiveMaxPool2d(1)
        self.head = nn.Sequential(pool, nn.Flatten(), nn.Linear(1, 2))
        with torch.no_grad():
            self.conv.weight.fill_(1.0)
            self.conv.bias.zero_()
            self.head[2].weight.copy_(torch.tensor([[-1.0], [1.0]]))
            self.head[2].bias.zero_()

    def forward_until(self, x: torch.Tensor, k: int) -> torch.Tensor:
        return self.head(self.relu(self.conv(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_until(x, 0)


@pytest.mark.parametrize("head,method", [("gap", "CAM"), ("max", "Grad-CAM")])
def test_the_map_finds_the_evidence(head, method):
    x = torch.zeros(2, 1, 16, 16)
    x[0, :, :4, :4] = 1.0  # top left
    x[1, :, 12:, 10:] = 1.0  # bottom right
    (maps,) = step_maps(Bright(head), x)
    assert maps.method == method and maps.layer in ("relu", "conv") and maps.maps.shape == (2, 16, 16)
    assert list(maps.predicted) == [1, 1]
    for i, (rows, cols) in enumerate([(slice(0, 4), slice(0, 4)), (slice(12, 16), slice(10, 16))]):
        inside = maps.maps[i][rows, cols].mean()
        outside = maps.maps[i].sum() - maps.maps[i][rows, cols].sum()
        assert inside > 0.9 and outside / (256 - maps.maps[i][rows, cols].size) < 0.2


def test_each_head_gets_its_method():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 32, 32)
    linear = step_maps(attach_exits(create_model("resnet20"), "auto", head="linear"), x)
    assert [m.method for m in linear] == ["CAM"] * 3
    assert [m.layer for m in linear] == [f"backbone.stages.{s}.2" for s in range(3)]
    pooled = step_maps(attach_exits(create_model("resnet20"), "auto", head="pool"), x, steps=[0, 2])
    assert [(m.step, m.method) for m in pooled] == [(0, "Grad-CAM"), (2, "CAM")]
    labelled = step_maps(create_model("resnet20"), x, labels=torch.tensor([3, 4]))
    assert list(labelled[0].target) == [3, 4]
    assert all(0 <= m.maps.min() and m.maps.max() <= 1 for m in linear + pooled)


def test_steps_without_a_spatial_map_are_refused():
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(12, 4))
    with pytest.raises(AnytimeError, match="no spatial feature map"):
        step_maps(mlp, torch.randn(1, 3, 2, 2))
    with pytest.raises(AnytimeError, match="step 5 does not exist"):
        step_maps(create_model("lenet", in_channels=1), torch.randn(1, 1, 28, 28), steps=[5])


def test_cam_command_on_a_trained_run(exit_run, tmp_path, capsys, cli_error):
    from PIL import Image

    from anytime.cli import main

    out = tmp_path / "maps"
    assert main(["cam", str(exit_run), "--split", "test", "--count", "3", "--explain", "label", "--out", str(out),
                 "--json"]) == 0  # fmt: skip
    report = json.loads(capsys.readouterr().out)
    assert [s["name"] for s in report["steps"]] == ["exit0", "exit1", "exit2"]
    arrays = np.load(out / "cam.npz")
    assert arrays["maps"].shape == (3, 3, 32, 32) and arrays["images"].shape == (3, 32, 32, 1)
    assert (arrays["target"] == arrays["labels"][None]).all() and (out / "cam.png").is_file()
    picture = tmp_path / "digit.png"
    Image.fromarray((np.arange(1024).reshape(32, 32) % 256).astype(np.uint8)).save(picture)
    assert main(["cam", str(exit_run), "--images", str(picture), "--steps", "0,2", "--out", str(tmp_path / "one")]) == 0
    assert "exit2: CAM on backbone.stages.2" in capsys.readouterr().out
    assert json.loads((tmp_path / "one" / "cam.json").read_text())["images"] == [str(picture)]
    cli_error(["cam", str(exit_run), "--out", str(tmp_path / "x")], "--images", "--split")
    cli_error(
        ["cam", str(exit_run), "--images", str(tmp_path / "missing.png"), "--out", str(tmp_path / "x")], "missing.png"
    )
    cli_error(
        ["cam", str(exit_run), "--images", str(picture), "--explain", "label", "--out", str(tmp_path / "x")], "--split"
    )
    cli_error(["cam", str(exit_run), "--split", "test", "--steps", "0,9", "--out", str(tmp_path / "x")], "step 9")
    cli_error(["cam", str(exit_run), "--split", "test", "--steps", "a", "--out", str(tmp_path / "x")], "--steps")
    assert not (tmp_path / "x").exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "cam.png").write_bytes(b"my own figure")
    cli_error(["cam", str(exit_run), "--split", "test", "--count", "1", "--out", str(mine)], "did not write", "cam.png")
    assert (mine / "cam.png").read_bytes() == b"my own figure" and sorted(p.name for p in mine.iterdir()) == ["cam.png"]
    assert main(["cam", str(exit_run), "--split", "test", "--count", "2", "--out", str(out)]) == 0  # its own: replaced
    (out / "notes.txt").write_text("mine")
    cli_error(
        ["cam", str(exit_run), "--split", "test", "--count", "2", "--out", str(out)], "did not write", "notes.txt"
    )
