"""The tuner's choices under a modelled noisy machine: what the final race and the drift reference change.

    .venv/bin/python scripts/tuner_study.py --runs 300 --json tuner_study.json

Each run is one :class:`commsched.tuner.Tuner` on 9 settings whose true step periods lie within
12 % of each other (drawn per run), measured as ``true x (1 + m + e)``: ``m`` the machine's
wandering speed (AR(1), ``--rho`` a step, ``--machine`` standard deviation), ``e`` independent noise
per step (``--step``). ``--slow SHARE,BY``: that share of steps runs BY slower besides (bimodal
steps, as balanced's on 2 cores). The sampler cycles through the settings (no model, so only the
rules differ). Per ``race_samples`` (0: no race; ``+``: with ``race_extend``) it reports the kept
setting's mean and p90 excess over the best, the kept score's mean bias against the kept setting's
true period, the samples and steps to settle, and the share of runs that re-tuned within
``--after`` steps of settling, where nothing changes (every re-tune is spurious). No timing of this
machine enters: a study of the rules, not a benchmark of the code.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys

from commsched.tuner import UNLIMITED_BYTES, Settings, Tuner

MIB = 1 << 20
SETTINGS = [Settings("dynamic", p, c, 256 << 10) for p in (MIB, 4 * MIB) for c in (MIB, 4 * MIB)] + \
           [Settings("fifo", UNLIMITED_BYTES, UNLIMITED_BYTES, f) for f in (0, 64 << 10, 256 << 10, MIB, 4 * MIB)]


#: ``--lead``: the starts of ``auto`` (the config's own, plain fifo, and two where one is best by the lead, as
#: torch's reducer with 1 MiB buckets where communication is hidden), the others proposed by the sampler
LEAD_STARTS = (SETTINGS[0], SETTINGS[4], SETTINGS[-2], SETTINGS[-1])


def one_run(seed: int, race_samples: int, rho: float, machine: float, step_noise: float, after: int,
            slow_share: float = 0.0, slow_by: float = 0.0, race_extend: bool = False, race_width: int = 2,
            race_margin: float = 0.05, lead: float | None = None, favoured: str = "none",
            favour_z: float | None = None) -> dict:
    rng = random.Random(seed)
    if lead is None:
        true = {s: 0.25 * (1 + rng.uniform(0, 0.12)) for s in SETTINGS}
        starts = (SETTINGS[0], SETTINGS[-1])
    else:  # one start best by ``lead``, every other setting up to 12 % slower than it
        true = {s: 0.25 * (1 + rng.uniform(lead, 0.12)) for s in SETTINGS}
        true[LEAD_STARTS[2]] = 0.25
        starts = LEAD_STARTS
    proposed = SETTINGS if lead is None else [s for s in SETTINGS if s not in starts]
    order = itertools.cycle(rng.sample(proposed, len(proposed)))

    class Cycle:
        def ask(self) -> Settings:
            return next(order)

        def tell(self, settings: Settings, score: float) -> None:
            pass

    race = {"race_samples": race_samples} if race_samples else {}  # (also runs on a tuner without the race)
    if race_extend:
        race["race_extend"] = True
    if race_width != 2 or race_margin != 0.05:  # only when asked: the old rules' Tuner has neither parameter
        race.update(race_width=race_width, race_margin=race_margin)
    if favoured != "none":  # the cost model's pick: the best setting ("right") or another start ("wrong")
        best = min(true, key=true.get)
        race["favoured"] = best if favoured == "right" else next(s for s in starts[::-1] if s != best)
        if favour_z is not None:  # beaten only beyond favour_z standard errors (else the larger spread)
            race["favour_z"] = favour_z
    tuner = Tuner(starts[0], extra_starts=starts[1:], sampler=Cycle(), **race)
    running, m, next_decision, pending, first = SETTINGS[0], 0.0, 2, None, True
    settled = None
    step = 0
    while settled is None or step < settled["step"] + after:
        m = rho * m + (1 - rho * rho) ** 0.5 * machine * rng.gauss(0, 1)
        slow = slow_by if rng.random() < slow_share else 0.0  # bimodal steps: some run slow_by slower
        tuner.observe(step, true[running] * (1 + m + slow + rng.gauss(0, step_noise)))
        if pending is not None and step == pending[0] + 1:
            running = pending[1].settings or running
            pending = None
        if step == next_decision:
            d = tuner.first(step) if first else tuner.decide(step)
            first, next_decision, pending = False, d.next, (step, d)
        if settled is None and tuner.phase == "settled":
            settled = {"step": step, "samples": tuner.samples, "excess": true[tuner.incumbent] / min(true.values()) - 1,
                       "bias": tuner.incumbent_score / true[tuner.incumbent] - 1}
        step += 1
    settled["retuned"] = tuner.rounds > 1
    return settled


def study(runs: int, race_samples: int, race_extend: bool = False, race_width: int = 2, race_margin: float = 0.05,
          favoured: str = "none", favour_z: float | None = None, **noise) -> dict:
    out = [one_run(seed, race_samples, race_extend=race_extend, race_width=race_width, race_margin=race_margin,
                   favoured=favoured, favour_z=favour_z, **noise) for seed in range(runs)]
    excess = sorted(r["excess"] for r in out)
    return {"race_samples": race_samples, "race_extend": race_extend, "race_width": race_width, "favoured": favoured,
            "favour_z": favour_z,
            "race_margin": race_margin, "runs": runs, "missed_share": sum(r["excess"] > 0 for r in out) / runs,
            "excess_mean": statistics.mean(excess),
            "excess_p90": excess[int(0.9 * runs)], "score_bias_mean": statistics.mean(r["bias"] for r in out),
            "samples_mean": statistics.mean(r["samples"] for r in out), "samples_max": max(r["samples"] for r in out),
            "settled_at_step_mean": statistics.mean(r["step"] for r in out),
            "retuned_share": sum(r["retuned"] for r in out) / runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=300)
    p.add_argument("--race", default="0,1,2,3", help="race_samples values to compare")
    p.add_argument("--rho", type=float, default=0.9)
    p.add_argument("--machine", type=float, default=0.04, help="the wandering speed's standard deviation")
    p.add_argument("--step", type=float, default=0.03, help="independent noise per step")
    p.add_argument("--after", type=int, default=300, help="steps watched after settling")
    p.add_argument("--slow", default="0,0", help="SHARE,BY: that share of steps runs BY slower (bimodal steps), "
                                                 "e.g. 0.3,0.15")
    p.add_argument("--extend", action="store_true", help="also each race with race_extend=True")
    p.add_argument("--width", default="2", help="race_width values to compare (each with every race_samples > 0)")
    p.add_argument("--margin", type=float, default=0.05, help="race_margin")
    p.add_argument("--lead", type=float, default=None,
                   help="auto's case: 4 starts, one best by this share, every other setting up to 12 %% slower")
    p.add_argument("--favoured", default="none",
                   help="comma-separated: none, right (the cost model's pick, Tuner(favoured=...), is the best "
                        "setting), wrong (it is another start); each with every race_samples > 0")
    p.add_argument("--favour-z", default="none",
                   help="comma-separated favour_z values (none: the larger spread) for each favoured run")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    share, by = (float(x) for x in a.slow.split(","))
    noise = dict(rho=a.rho, machine=a.machine, step_noise=a.step, after=a.after, slow_share=share, slow_by=by,
                 lead=a.lead)
    zs = [None if z == "none" else float(z) for z in a.favour_z.split(",")]
    rows = [study(a.runs, int(r), extend, race_width=int(w), race_margin=a.margin, favoured=f, favour_z=z, **noise)
            for r in a.race.split(",")
            for extend in ((False, True) if a.extend and int(r) else (False,))
            for w in (a.width.split(",") if int(r) else ("2",))
            for f in (a.favoured.split(",") if int(r) else ("none",))
            for z in (zs if f != "none" else (None,))]
    print(f"noise: machine {a.machine:.1%} (AR {a.rho}), per step {a.step:.1%}, {share:.0%} of steps {by:.0%} "
          f"slower; {a.runs} runs each")
    print(f"race_margin {a.margin:.0%}" + (f"; 4 starts, one {a.lead:.0%} ahead of every other setting"
                                            if a.lead is not None else ""))
    print("race width  favoured  favour_z  excess mean  excess p90  missed  score bias  samples  settled at  re-tuned")
    for r in rows:
        z = "-" if r["favour_z"] is None else f"{r['favour_z']:g}"
        print(f"{r['race_samples']:>3}{'+' if r['race_extend'] else ' '}  {r['race_width']:>4}  {r['favoured']:>8}  "
              f"{z:>8}  "
              f"{r['excess_mean']:>10.2%}  {r['excess_p90']:>10.2%}  {r['missed_share']:>6.0%}  "
              f"{r['score_bias_mean']:>+10.2%}  {r['samples_mean']:>7.1f}  {r['settled_at_step_mean']:>10.0f}  "
              f"{r['retuned_share']:>8.0%}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"noise": noise, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
