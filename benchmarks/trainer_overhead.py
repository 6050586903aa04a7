"""Benchmark: the instrumented trainer against a bare PyTorch training loop.

Same model (ResNet-20), same data (the embedded digits, batch 64, the same loader and seed), same
optimizer and the same number of steps. The trainer's training time is the sum of its epochs'
training phases (its loop with per-iteration timing, accuracy bookkeeping and progress, excluding
the validation pass the bare loop does not do). Each round runs both, in alternating order, and the
ratio compares each side's fastest round, the least disturbed one (timeit's rule: on a shared 2-core
VM, rounds of the same loop vary by 10% or more); the ratio of medians is printed and recorded beside it.
Target: the trainer at most 3% slower.
"""

from __future__ import annotations

import tempfile
import time

import torch
import torch.nn.functional as F
from common import median, parser, report, run

from anytime.backbones import create_model
from anytime.data import load_dataset, make_loader
from anytime.train import TrainConfig, Trainer, lr_factor
from anytime.utils.seed import derive_seed, seed_everything

TARGET = 1.03


def bare_loop(config: TrainConfig, splits) -> float:
    """The loop a researcher writes by hand: no timing, no bookkeeping. Returns seconds spent training."""
    seed_everything(config.seed)
    info = splits.info
    model = create_model(config.model, num_classes=info.num_classes, in_channels=info.in_channels)
    optimizer = torch.optim.SGD(model.parameters(), lr=config.lr, momentum=config.momentum,
                                weight_decay=config.weight_decay)  # fmt: skip
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda e: lr_factor(config, e))
    loader = make_loader(splits.train, info, batch_size=config.batch_size, train=True, seed=config.seed)
    total = 0.0
    for epoch in range(config.epochs):
        torch.manual_seed(derive_seed(config.seed, epoch))
        loader.set_epoch(epoch)
        model.train()
        start = time.perf_counter()
        for images, labels in loader:
            loss = F.cross_entropy(model(images), labels)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
        total += time.perf_counter() - start
        scheduler.step()
    return total


def main() -> int:
    args = parser(__doc__.splitlines()[0]).parse_args()
    epochs, rounds = (1, 1) if args.quick else (3, 5)
    config = TrainConfig(model="resnet20", data="digits", epochs=epochs, batch_size=64, lr=0.05, device="cpu")
    splits = load_dataset("digits", seed=config.seed)
    bare, ours, fit_wall = [], [], []

    def run_trainer() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            start = time.perf_counter()
            summary = Trainer(config, tmp).fit(splits=splits)
            fit_wall.append(time.perf_counter() - start)
        ours.append(summary.train_time_s)

    for r in range(rounds):
        if r % 2 == 0:
            bare.append(bare_loop(config, splits))
            run_trainer()
        else:
            run_trainer()
            bare.append(bare_loop(config, splits))
        print(f"round {r + 1}: bare loop {bare[-1]:.2f} s   trainer {ours[-1]:.2f} s "
              f"(whole fit with validation, checkpoints and test: {fit_wall[-1]:.2f} s)")  # fmt: skip
    ratio = min(ours) / min(bare)
    figures = {"bare_min_s": min(bare), "trainer_min_s": min(ours), "ratio_of_medians": median(ours) / median(bare),
               "bare_rounds_s": bare, "trainer_rounds_s": ours, "trainer_fit_wall_median_s": median(fit_wall),
               "epochs": epochs, "rounds": rounds, "model": config.model, "data": config.data,
               "batch_size": config.batch_size, "steps_per_epoch": -(-len(splits.train) // config.batch_size)}  # fmt: skip
    print(
        f"fastest rounds: trainer {min(ours):.2f} s vs bare loop {min(bare):.2f} s: {ratio:.3f}x "
        f"(medians: {median(ours):.2f} s vs {median(bare):.2f} s: {median(ours) / median(bare):.3f}x)"
    )
    return report("trainer_overhead", args, figures, ratio, f"<= {TARGET}x", ratio <= TARGET)


if __name__ == "__main__":
    run(main)
