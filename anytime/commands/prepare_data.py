"""``anytime prepare-data``: pack an image folder into shards of resized uint8 images (resumable, decoded in
parallel) that training reads batch by batch (``anytime train --data shards``)."""

from __future__ import annotations

import argparse

from anytime.commands.options import add_json, add_out, positive_int
from anytime.commands.output import print_json, progress_printer
from anytime.utils.resources import format_bytes

SUMMARY = (
    "pack an image folder into shards of resized uint8 images (resumable, parallel) that training "
    "reads batch by batch (--data shards)"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``anytime prepare-data``."""
    parser.add_argument("src", metavar="SRC", help="an image folder holding train/<class>/* and test/<class>/*")
    parser.add_argument(
        "--image-size",
        type=positive_int,
        required=True,
        metavar="S",
        help="every image is resized to SxS (PIL bilinear)",
    )
    add_out(
        parser,
        "the shard folder (new, empty, or an unfinished one of the same arguments to resume)",
        metavar="SHARDS",
        required=True,
    )
    parser.add_argument(
        "--workers",
        type=positive_int,
        metavar="N",
        help="processes decoding shards in parallel (default: the cores, at most 8)",
    )
    parser.add_argument(
        "--shard-size", type=positive_int, metavar="N", help="images per shard (default: as many as fill 64 MiB)"
    )
    parser.add_argument(
        "--verify", action="store_true", help="also check the finished shards' checksums and rewrite those that differ"
    )
    add_json(parser, "print the manifest as JSON")


def run(args: argparse.Namespace) -> int:
    """Write (or finish) the shards and print what they hold."""
    from anytime.data.shard_writer import prepare_shards

    result = prepare_shards(args.src, args.out, image_size=args.image_size, workers=args.workers,
                            shard_size=args.shard_size, verify=args.verify,
                            on_progress=progress_printer(args))  # fmt: skip
    m = result.manifest
    if args.json:
        return print_json({**m.to_dict(), "root": str(m.root), "written": result.written, "reused": result.reused})
    shards = len(m.train.shards) + len(m.test.shards)
    size = sum(s.bytes for s in m.train.shards + m.test.shards)
    print(f"shards {m.root}: {m.train.count:,} train + {m.test.count:,} test images at {m.image_size}x{m.image_size}, "
          f"{len(m.classes)} classes, {shards} shards ({format_bytes(size)}); {result.written} written, "
          f"{result.reused} already done, {result.seconds:.1f} s")  # fmt: skip
    print(f"next: anytime train --data shards --data-root {m.root}")
    return 0
