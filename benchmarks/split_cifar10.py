"""Benchmark: split computing with early exit over a shaped link, predicted against measured.

The multi-exit fast CIFAR card (`models/cifar10-fastcnn-exits.toml`, trained first if its run is missing) is served
by two processes on this machine, pinned to one core each with one torch thread: the server (`anytime serve RUN
--role server`, core 1) and the device (`anytime split-run`, core 0), which emulates a board SLOWDOWN times slower
than a core here (each segment waits SLOWDOWN-1 times its own time; its profile is measured the same way). The
link is shaped on the device's side (token bucket without burst, and an added round trip) at each bandwidth and
delay of LINKS. Both profiles are measured again before each link's sessions (this VM's batch-1 timings drift over
minutes), the server's with an idle gap of one round trip before each repetition, as it idles between requests, and
with its suffixes (the stages after each partition point timed from a stored activation, `--suffixes`).

For every link, three sessions answer the same REQUESTS test images one at a time against one deadline (DEADLINE
times the device's own p99 through every exit, so the device alone cannot answer everything in time): the planner's
choice over every partition, codec and threshold (`split-run`), the best device-only plan (`--partitions device`)
and the best server-only plan (`--partitions server`). Each session first measures its link with LINK_SAMPLES
exchanges (`--link-samples`: the bandwidth it gets, and the p99 of what an exchange takes beyond the round trip and
its bytes) and plans for what it measured. Reported per session: the plan, its predicted p99 and the
measured end-to-end p99, the miss rate, test accuracy, and where the answers came from. Then one adaptive session and
one fixed session on a link that drops from FAST to SLOW Mbit/s halfway: the miss rate of each half.
Ratio: the largest |measured / predicted p99 - 1| of the planner's sessions (target <= 0.15); the run also fails if
a planner's session whose plan fits misses more than 1% of its deadlines. Quick: a digits ResNet-20, few requests.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, parser, report, run

from anytime.errors import AnytimeError

# Hyper-parameters
CARD = REPO / "models" / "cifar10-fastcnn-exits.toml"
RUN = REPO / "runs" / "cifar10-fastcnn-exits"  # --run to change
SLOWDOWN = 4.0  # the device is a board this many times slower than one core here (emulated)
LINKS = [(1.0, 5.0), (10.0, 5.0), (100.0, 5.0), (10.0, 20.0)]  # (Mbit/s, round trip ms)
DEADLINE = 0.7  # deadline = this x the device's p99 through every exit
QUANTILE = 0.99
REQUESTS = 1000  # test images per session (--quick: 40)
LINK_SAMPLES = 100  # exchanges that measure the link before a session plans
PROFILE_REPEATS = 500  # batch-1 repetitions of each profile (--quick: 100)
FAST, SLOW = 100.0, 0.3  # the adaptive sessions' link before and after the drop (Mbit/s), at ADAPT_RTT ms
ADAPT_RTT = 5.0
TARGET_ERROR = 0.15
TARGET_MISS = 0.01
DEVICE_CORE, SERVER_CORE = 0, 1


def _cli(core: int | None) -> list[str]:
    pin = (
        [shutil.which("taskset") or "taskset", "-c", str(core)] if core is not None and shutil.which("taskset") else []
    )
    return [*pin, sys.executable, "-m", "anytime"]


def _call(args: list[str], core: int | None = None) -> str:
    done = subprocess.run([*_cli(core), *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise AnytimeError(f"anytime {' '.join(args[:2])} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def _prepare(run_dir: Path, quick: bool) -> None:
    """Train (or reuse) the run and collect its validation outputs."""
    if not (run_dir / "model.safetensors").is_file():
        if quick:
            _call(["train", "--model", "resnet20", "--data", "digits", "--epochs", "3", "--exits", "auto",
                   "--out", str(run_dir)])  # fmt: skip
        else:
            resume = ["--resume"] if (run_dir / "checkpoint.pt").is_file() else []
            _call(["train", "--card", str(CARD), "--out", str(run_dir), *resume])
    if not (run_dir / "outputs" / "val.npz").is_file():
        _call(["collect", str(run_dir), "--split", "val"])


def _profiles(run_dir: Path, quick: bool, folder: Path, gap_ms: float) -> tuple[Path, Path]:
    """Profile the device (emulated, back to back) and the server (idling ``gap_ms`` between repetitions, as it
    idles at least a round trip between one device's requests, with its suffixes), each on its own core; the
    profiles' paths. Taken
    again before every link's sessions: batch-1 timings on this VM drift over minutes."""
    repeats = str(100 if quick else PROFILE_REPEATS)
    dev, srv = folder / "device.json", folder / "server.json"
    for path, core, slow, extra in ((dev, DEVICE_CORE, SLOWDOWN, []),
                                    (srv, SERVER_CORE, 1.0, ["--gap-ms", str(gap_ms), "--suffixes"])):  # fmt: skip
        if path.exists():
            path.unlink()
        _call(["profile", str(run_dir), "--batch-sizes", "1", "--repeats", repeats, "--threads", "1", "--no-memory",
               "--emulate-slowdown", str(slow), *extra, "--out", str(path)], core)  # fmt: skip
    return dev, srv


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_server(run_dir: Path) -> tuple[subprocess.Popen, int]:
    port = _free_port()
    proc = subprocess.Popen([*_cli(SERVER_CORE), "serve", str(run_dir), "--role", "server", "--port", str(port),
                             "--threads", "1"], stderr=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()
    if "split server" not in line:
        proc.kill()
        raise AnytimeError(f"the split server did not start: {line.strip()}")
    return proc, port


def _session(run_dir: Path, port: int, dev: Path, srv: Path, mbps: float, rtt: float, deadline: float, requests: int,
             extra: list[str]) -> dict:  # fmt: skip
    out = _call(["split-run", str(run_dir), "--server", f"127.0.0.1:{port}", "--device-profile", str(dev),
                 "--server-profile", str(srv), "--bandwidth-mbps", str(mbps), "--rtt-ms", str(rtt), "--deadline-ms",
                 f"{deadline:.4f}", "--quantile", str(QUANTILE), "--requests", str(requests),
                 "--emulate-slowdown", str(SLOWDOWN), "--link-samples", str(LINK_SAMPLES), "--json", *extra],
                DEVICE_CORE)  # fmt: skip
    return json.loads(out)


def _row(summary: dict) -> dict:
    plan = summary["plan"]
    return {"plan": plan["name"], "fits": plan["fits"], "planned_val_acc": plan["accuracy"],
            "link_overhead_ms": plan["link_overhead_ms"], "link_mbps": plan["bandwidth_mbps"],
            "predicted_p99_ms": summary["planned_ms"], "measured_p99_ms": summary["p99_ms"],
            "p99_error": summary["p99_ms"] / summary["planned_ms"] - 1, "p50_ms": summary["p50_ms"],
            "miss_rate": summary["miss_rate"], "test_acc": summary["accuracy"], "device_share": summary["device_share"],
            "server_share": summary["server_share"], "fallback_share": summary["fallback_share"],
            "mean_sent_bytes": summary["mean_sent_bytes"]}  # fmt: skip


def main() -> int:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--run", type=Path, help=f"the multi-exit run (default {RUN.relative_to(REPO)})")
    args = p.parse_args()
    run_dir = args.run or (REPO / "runs" / "split-bench-quick" if args.quick else RUN)
    folder = run_dir.with_name(
        run_dir.name + "-split-bench"
    )  # profiles; beside the run, which holds only its own files
    folder.mkdir(parents=True, exist_ok=True)
    requests = 40 if args.quick else REQUESTS
    _prepare(run_dir, args.quick)
    dev, srv = _profiles(run_dir, args.quick, folder, LINKS[0][1])
    from anytime.profile import DeviceProfile

    device = DeviceProfile.load(dev)
    full = float(device.path_samples(device.num_steps - 1).max())
    deadline = DEADLINE * sorted(device.path_samples(device.num_steps - 1))[int(0.99 * (device.samples_per_step - 1))]
    _call(["split", str(run_dir), "--device-profile", str(dev), "--server-profile", str(srv), "--bandwidth-mbps", "10",
           "--deadline-ms", str(deadline)])  # builds the fp16/int8 tables once  # fmt: skip
    server, port = _start_server(run_dir)
    rows, worst, missed = [], 0.0, False
    try:
        for i, (mbps, rtt) in enumerate(LINKS):
            started = time.perf_counter()
            if i:
                dev, srv = _profiles(run_dir, args.quick, folder, rtt)
            entry = {"bandwidth_mbps": mbps, "rtt_ms": rtt}
            for label, extra in (("planned", ["--fixed"]), ("device_only", ["--fixed", "--partitions", "device"]),
                                 ("server_only", ["--fixed", "--partitions", "server"])):  # fmt: skip
                entry[label] = _row(_session(run_dir, port, dev, srv, mbps, rtt, deadline, requests, extra))
            planned = entry["planned"]
            worst = max(worst, abs(planned["p99_error"]))
            missed |= bool(planned["fits"] and planned["miss_rate"] > TARGET_MISS)
            rows.append(entry)
            print(f"{mbps:g} Mbit/s, {rtt:g} ms (measured {planned['link_mbps']:.3g} Mbit/s, overhead "
                  f"{planned['link_overhead_ms']:.2f} ms): {planned['plan']} predicted p99 "
                  f"{planned['predicted_p99_ms']:.2f} ms, "
                  f"measured {planned['measured_p99_ms']:.2f} ms ({100 * planned['p99_error']:+.1f}%), misses "
                  f"{100 * planned['miss_rate']:.1f}%, test {100 * planned['test_acc']:.1f}% | device only "
                  f"{100 * entry['device_only']['test_acc']:.1f}% ({100 * entry['device_only']['miss_rate']:.1f}% "
                  f"missed) | server only {100 * entry['server_only']['test_acc']:.1f}% "
                  f"({100 * entry['server_only']['miss_rate']:.1f}% missed) [{time.perf_counter() - started:.0f} s]",
                  flush=True)  # fmt: skip
        half = requests // 2
        drop = f"{FAST:g}:{half},{SLOW:g}"
        adaptive = {}
        dev, srv = _profiles(run_dir, args.quick, folder, ADAPT_RTT)
        for label, extra in (("adaptive", []), ("fixed", ["--fixed"])):
            summary = _session(run_dir, port, dev, srv, FAST, ADAPT_RTT, deadline, requests,
                               ["--shape-bandwidth", drop, *extra])  # fmt: skip
            adaptive[label] = {"phases": summary["phases"], "replans": summary["replans"]}
            print(f"{label}: " + "; ".join(f"{ph['bandwidth_mbps']:g} Mbit/s misses {100 * ph['miss_rate']:.1f}%, "
                                           f"test {100 * ph['accuracy']:.1f}%, {' -> '.join(ph['plans'])}"
                                           for ph in summary["phases"]), flush=True)  # fmt: skip
    finally:
        server.terminate()
        server.wait(timeout=10)
    figures = {"run": str(run_dir), "slowdown": SLOWDOWN, "deadline_ms": deadline, "device_full_max_ms": full,
               "quantile": QUANTILE, "requests": requests, "links": rows, "link_drop": adaptive,
               "cores": {"device": DEVICE_CORE, "server": SERVER_CORE} if shutil.which("taskset") else None,
               "cpu_count": os.cpu_count()}  # fmt: skip
    return report("split_cifar10", args, figures, worst, f"<= {TARGET_ERROR} (|p99 error|), misses <= 1% where it fits",
                  worst <= TARGET_ERROR and not missed)  # fmt: skip


if __name__ == "__main__":
    run(main)
