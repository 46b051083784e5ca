#!/usr/bin/env python3
"""The seed's slack priority against plain layer order, in the simulator (issue 13).

For each profile (the bench workloads profiled on this machine, from the profile cache, and
zoo models on described clusters) and each topology, simulate ``dynamic`` (layer order:
earliest due date) and ``slack`` (the seed's rule, :mod:`commsched.costmodel.slack`) at
several α, and report the step time of each and how many layers the rule moved.

    python scripts/slack_study.py --json slack.json
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from pathlib import Path

from commsched.costmodel.profile import Profile
from commsched.costmodel.simulator import SimSettings, simulate
from commsched.costmodel.slack import slack_order
from commsched.costmodel.topology import Topology
from commsched.costmodel.zoo import zoo_profile

MB = 1 << 20


def cached_workload_profiles() -> dict[str, Profile]:
    """One cached profile per bench workload (the newest file of each), if any."""
    found: dict[str, tuple[float, str]] = {}
    root = Path(os.path.expanduser("~/.cache/commsched/profiles"))
    for path in glob.glob(str(root / "*.json")):
        name = Path(path).name.rsplit("-", 1)[0]
        mtime = os.path.getmtime(path)
        if name not in found or mtime > found[name][0]:
            found[name] = (mtime, path)
    return {name: Profile.from_json(path) for name, (_, path) in sorted(found.items())}


def cases() -> list[tuple[str, Profile, str, Topology, SimSettings]]:
    out = []
    for name, prof in cached_workload_profiles().items():
        for label, topo in (("2w@1gbit", Topology.emulated(2, None, "1gbit")),
                            ("2x2@500mbit", Topology.emulated(4, 2, "500mbit"))):
            out.append((name, prof, label, topo, SimSettings(partition_bytes=1 * MB, credit_bytes=4 * MB)))
    for model in ("resnet50", "bert-large", "gpt2-xl"):
        prof = zoo_profile(model, "h100")
        for label, topo in (("4x8 25gbit", Topology.described("4x8", "900GB/s", "25gbit")),
                            ("16x8 100gbit", Topology.described("16x8", "900GB/s", "100gbit"))):
            out.append((model, prof, label, topo, SimSettings(partition_bytes=4 * MB, credit_bytes=16 * MB)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--alphas", default="0.5,1,4,16", help="comma-separated α values (default 0.5,1,4,16)")
    ap.add_argument("--json", default=None, help="write the rows here")
    args = ap.parse_args()
    alphas = [float(a) for a in args.alphas.split(",") if a]
    rows = []
    heads = " ".join(f"{'a=' + format(a, 'g'):>15}" for a in alphas)
    print(f"{'profile':<15} {'topology':<14} {'dynamic s':>10} {heads}")
    for name, prof, label, topo, settings in cases():
        base = simulate(prof, topo, "dynamic", settings).step_time_s
        row = {"profile": name, "topology": label, "dynamic_s": base, "slack": []}
        cells = []
        for a in alphas:
            s = SimSettings(**{**settings.__dict__, "slack_alpha": a})
            t = simulate(prof, topo, "slack", s).step_time_s
            moved = slack_order(prof, topo, a).moved
            row["slack"].append({"alpha": a, "step_s": t, "vs_dynamic": base / t, "layers_moved": moved})
            cells.append(f"{base / t:>8.3f}x ({moved:>3})")
        rows.append(row)
        print(f"{name:<15} {label:<14} {base:>10.4f} " + " ".join(cells))
    print("cells: dynamic step / slack step (>1: slack faster), and (layers the rule moved out of layer order)")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
