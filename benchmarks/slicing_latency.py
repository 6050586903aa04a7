"""Benchmark: measured latency of each width of a sliced ResNet, relative to its full width.

ResNet-18 (CIFAR, 11M parameters) and ResNet-20 are sliced at widths 0.25, 0.5, 0.75 and 1.0 with
``slice_model``; every width is timed per batch (batch 1 and 32, 32x32 inputs) interleaved with the others on
the same inputs, in inference mode, after a warm-up. Side by side, each narrow width is also timed as a dense
network built at that width (weights copied out of the slice), the lower bound a slice can reach. Ratio:
ResNet-18 width 0.5 over full width at batch 1 (the worse of batch 1 and 32 is reported too). Target: <= 0.35
(the compute falls to about a quarter).
"""

from __future__ import annotations

import numpy as np
import torch
from common import parser, report, run

from anytime import create_model, slice_model
from anytime.profile import per_sample_latency

# Hyper-parameters
WIDTHS = (0.25, 0.5, 0.75, 1.0)
MODELS = ("resnet18", "resnet20")
BATCHES = {1: 200, 32: 30}  # batch size -> timed batches
TARGET = 0.35  # width 0.5 over width 1.0, median latency


def _dense_at(sliced: torch.nn.Module, k: int) -> torch.nn.Module:
    """A plain network exactly as wide as step ``k``: every sliced layer replaced by a dense one holding the
    slice's weights, so it runs the same arithmetic without the slicing machinery."""
    import copy

    from anytime.families.sliced_layers import SlicedConv2d, SwitchableBatchNorm2d, SwitchableLinear
    from anytime.families.slicing import set_module

    model = copy.deepcopy(sliced)
    model._context.step, model._context.ratio = k, model.ratios[k]  # the bare backbone now runs step k
    backbone = model.backbone
    for name, module in list(backbone.named_modules()):
        if isinstance(module, SwitchableBatchNorm2d):
            set_module(backbone, name, module.norms[k])
        elif isinstance(module, SwitchableLinear):
            set_module(backbone, name, module.heads[k])
    sample = torch.zeros(1, 3, 32, 32)
    shapes: dict[str, tuple[int, int]] = {}
    hooks = [m.register_forward_hook(lambda m, i, o, n=n: shapes.__setitem__(n, (i[0].shape[1], o.shape[1])))
             for n, m in backbone.named_modules() if isinstance(m, SlicedConv2d)]  # fmt: skip
    with torch.no_grad():
        backbone(sample)
    for h in hooks:
        h.remove()
    for name, module in list(backbone.named_modules()):
        if isinstance(module, SlicedConv2d):
            cin, cout = shapes[name]
            conv = torch.nn.Conv2d(
                cin, cout, module.kernel_size, module.stride, module.padding, bias=module.bias is not None
            )
            with torch.no_grad():
                conv.weight.copy_(module.weight[:cout, :cin])
            set_module(backbone, name, conv)
    return backbone.eval()


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    args = p.parse_args()
    torch.manual_seed(0)
    figures: dict[str, dict[str, float]] = {}
    for name in MODELS:
        model = slice_model(create_model(name), WIDTHS).eval()
        dense_half = _dense_at(model, WIDTHS.index(0.5))
        for batch, count in BATCHES.items():
            count = max(5, count // 10) if args.quick else count
            inputs = torch.randn(batch * (count + 5), 3, 32, 32)
            functions = {f"x{w:g}": (lambda x, k=k: model.forward_until(x, k)) for k, w in enumerate(WIDTHS)}
            functions["dense x0.5"] = dense_half
            times = per_sample_latency(functions, inputs, warmup=5, batch_size=batch)
            medians = {key: 1000 * float(np.median(v)) for key, v in times.items()}
            full = medians["x1"]
            row = {f"{key} ms": ms for key, ms in medians.items()}
            row.update({f"{key} ratio": ms / full for key, ms in medians.items()})
            figures[f"{name} batch {batch}"] = row
            print(f"{name:<9} batch {batch:<3} " + "  ".join(f"{key} {ms:7.2f} ms ({ms / full:.3f}x)"
                                                          for key, ms in medians.items()))  # fmt: skip
    ratio = figures["resnet18 batch 1"]["x0.5 ratio"]
    worst = max(figures[f"resnet18 batch {b}"]["x0.5 ratio"] for b in BATCHES)
    figures["summary"] = {"resnet18_x0.5_batch1": ratio, "resnet18_x0.5_worst_batch": worst,
                          "resnet20_x0.5_batch1": figures["resnet20 batch 1"]["x0.5 ratio"]}  # fmt: skip
    return report("slicing_latency", args, figures, ratio, f"<= {TARGET}", ratio <= TARGET and worst <= TARGET)


if __name__ == "__main__":
    run(main)
