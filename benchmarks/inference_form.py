"""Benchmark: what each inference form of a trained multi-exit network costs, side by side in one process.

The model is the fast exits card's run (models/cifar10-fastcnn-exits.toml; trained by early_exit_cifar10.py
if absent). Each form (eager; batch norm folded; channels-last; both) is built from the same weights, checked
against eager on a probe batch, and timed interleaved on the same random inputs: the whole backbone and the
first exit alone at batch 1, and the backbone at batch 32. Ratio: eager backbone time at batch 1 over the
fastest form's. No target: the issue asks that the form be recorded and its results equal eager's.
"""

from __future__ import annotations

import torch
from common import add_exit_run_options, exit_run_dir, parser, prepare_exit_run, report, run

from anytime.deploy.inference import InferenceForm, inference_form
from anytime.profile import latency_summary, per_sample_latency
from anytime.train.runs import load_run

FORMS = ("eager", "fold", "channels-last", "fold+channels-last")
SAMPLES_BATCH1 = 400  # inputs timed one at a time per form
BATCHES_32 = 40  # batches of 32 per form


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    add_exit_run_options(p)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    run_dir = exit_run_dir(args.run, args.quick, args.card)
    prepare_exit_run(run_dir, args.quick, max_drop=1.0, card_path=args.card)
    base = load_run(run_dir).model
    probe = torch.randn(4, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    models = {name: inference_form(base, InferenceForm.parse(name), probe=probe) for name in FORMS}
    torch.manual_seed(0)
    ones = torch.randn(40 if args.quick else SAMPLES_BATCH1, 3, 32, 32)
    batches = torch.randn(32 * (4 if args.quick else BATCHES_32), 3, 32, 32)
    with torch.inference_mode():
        single = per_sample_latency(
            {**{f"{n} backbone": (lambda m: lambda x: m.backbone(x))(m) for n, m in models.items()},
             **{f"{n} exit 0": (lambda m: lambda x: m.forward_until(x, 0))(m) for n, m in models.items()}},
            ones, warmup=20,
        )  # fmt: skip
        batched = per_sample_latency({n: (lambda m: lambda x: m.backbone(x))(m) for n, m in models.items()},
                                     batches, warmup=3, batch_size=32)  # fmt: skip
    figures: dict[str, dict[str, float]] = {}
    for name in FORMS:
        b1, e0, b32 = (latency_summary(single[f"{name} backbone"]), latency_summary(single[f"{name} exit 0"]),
                       latency_summary(batched[name]))  # fmt: skip
        figures[name] = {
            "backbone_b1_ms": b1["mean_ms"],
            "exit0_b1_ms": e0["mean_ms"],
            "backbone_b32_ms": b32["mean_ms"],
        }
        print(f"{name:<20} batch 1: backbone {b1['mean_ms']:.3f} ms, exit 0 alone {e0['mean_ms']:.3f} ms; "
              f"batch 32: backbone {b32['mean_ms']:.2f} ms")  # fmt: skip
    fastest = min(FORMS, key=lambda n: figures[n]["backbone_b1_ms"])
    ratio = figures["eager"]["backbone_b1_ms"] / figures[fastest]["backbone_b1_ms"]
    print(f"fastest at batch 1: {fastest}, {ratio:.2f}x eager ({torch.get_num_threads()} threads)")
    return report("inference_form", args, {"forms": figures, "threads": torch.get_num_threads()}, ratio,
                  "none (recorded)", True)  # fmt: skip


if __name__ == "__main__":
    run(main)
