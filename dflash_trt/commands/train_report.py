"""`dflash-trt train-report`: compare drafter training runs (an ablation table and training curves).

Reads each RUN directory's training_config.yaml (written by `dflash-trt train`), prints one markdown
row per run -- the levers it used (init, distillation weight, layers, block size, vocabulary subset),
its steps, its data and its best and last held-out block acceptance length -- and, with --plot, draws
the held-out acceptance length against optimizer steps and against anchored blocks seen.

With --lineage the runs are one drafter's successive continuations (each run after the first trained
with --drafter-init or --continue-from from the one before, all measured on the same held-out prompts), in order: the
plot then puts every run on one cumulative optimizer-step axis and shows each run's last held-out
acceptance against the response tokens its training data held, so compute accumulated across
sessions reads as one curve. A run that continued from a checkpoint inside the previous run's work
directory (`--continue-from WORK_DIR/stable`) starts on that axis at the checkpoint's step, not at the
previous run's end: the steps after it were a branch the later run did not take. A RUN may also be a
training_config*.yaml file itself (a drafter directory keeps earlier runs' records as
training_config.stepN.yaml).
"""
from __future__ import annotations

import argparse
from pathlib import Path

from dflash_trt.errors import InputError

COLUMNS = ("run", "init", "kd", "layers", "block", "train vocab", "steps", "blocks seen", "response tokens",
           "held-out tau best (step)", "held-out tau last", "held-out CE last", "slot weights")


def register(sub) -> None:
    p = sub.add_parser("train-report", help="ablation table and training curves of `train` runs", description=__doc__)
    p.add_argument("runs", type=Path, nargs="+", metavar="RUN",
                   help="`dflash-trt train --output` directories or training_config*.yaml files")
    p.add_argument("--label", action="append", default=[], help="a name per RUN, in order (default: the folder name)")
    p.add_argument("--plot", type=Path, default=None, metavar="PNG", help="write the training curves here")
    p.add_argument("--lineage", action="store_true",
                   help="the runs continue one another in the order given: plot them on cumulative axes")
    p.set_defaults(func=run)


def read_run(run: Path) -> dict:
    import yaml

    run = Path(run)
    path = run if run.suffix in (".yaml", ".yml") else run / "training_config.yaml"
    if not path.is_file():
        raise InputError(f"{run} has no training_config.yaml: pass a `dflash-trt train --output` directory "
                         "or a training_config*.yaml file")
    doc = yaml.safe_load(path.read_text())
    try:
        cfg, results = doc["train_config"], doc["results"]
        drafter, data = doc["drafter"], doc["data"]
    except (KeyError, TypeError) as exc:
        raise InputError(f"{path} is not a training record ({exc})") from exc
    if not results["heldout"]:
        raise InputError(f"{path} has no held-out evaluations: train with --heldout-prompts and --heldout-every")
    return {"cfg": cfg, "results": results, "drafter": drafter, "data": data,
            "continued_from": doc.get("continued_from")}


def row(label: str, rec: dict) -> list[str]:
    cfg, res, drafter = rec["cfg"], rec["results"], rec["drafter"]
    per_step = cfg["batch_size"] * cfg["anchors_per_seq"]
    best_step, best = res["best"]
    last_step, last_loss, last = res["heldout"][-1]
    init = ("drafter " + Path(cfg["drafter_init"]).name if cfg["drafter_init"]
            else "checkpoint " + Path(cfg["continue_from"]).name if cfg.get("continue_from") else cfg["init"])
    if cfg.get("grow_layers"):
        init += f" + {cfg['grow_layers']} grown layer(s)"
    return [label, init, f"{cfg['kd_weight']:g}", str(drafter["num_layers"]), str(drafter["block_size"]),
            "the start's" if cfg.get("train_vocab_from") == "init" else str(cfg["train_vocab"] or "all"),
            str(res["steps"]), f"{res['steps'] * per_step:,}", f"{rec['data']['response_tokens']:,}",
            f"{best:.3f} ({best_step})", f"{last:.3f}", f"{last_loss:.3f}", cfg.get("loss_weighting", "paper")]


def lineage(labels: list[str], records: list[dict]) -> tuple[dict, list[tuple[str, int, float]]]:
    """Successive runs on cumulative axes, each starting where it branched off the run before
    (`branch_step`): ({label: [(cumulative step, cumulative blocks seen, tau)]},
    [(label, response tokens of its data, last held-out tau)]). Refuses runs that do not continue one
    another (no --drafter-init after the first) or were measured on different held-out prompts."""
    held = [tuple(rec["data"].get("recipe", {}).get("heldout_files") or ()) for rec in records]
    for label, rec, files in zip(labels[1:], records[1:], held[1:]):
        if not (rec["cfg"].get("drafter_init") or rec["cfg"].get("continue_from")):
            raise InputError(f"--lineage: run '{label}' did not start from a trained drafter (--drafter-init or "
                             "--continue-from), "
                             "so it does not continue the run before it")
        if files != held[0]:
            raise InputError(f"--lineage: run '{label}' was measured on other held-out prompts ({list(files)}) than "
                             f"'{labels[0]}' ({list(held[0])}); held-out figures compare on the same prompts only")
    curves, data = {}, []
    step0 = blocks0 = 0
    for i, (label, rec) in enumerate(zip(labels, records)):
        if i:  # the run before's steps up to where this one branched off, at its blocks per step
            took = branch_step(records[i - 1], rec)
            step0 += took
            blocks0 += took * per_step
        per_step = rec["cfg"]["batch_size"] * rec["cfg"]["anchors_per_seq"]
        curves[label] = [(step0 + st, blocks0 + st * per_step, acc) for st, _, acc in rec["results"]["heldout"]]
        data.append((label, int(rec["data"]["response_tokens"]), rec["results"]["heldout"][-1][2]))
    return curves, data


def branch_step(before: dict, after: dict) -> int:
    """How many of `before`'s optimizer steps lie on `after`'s path: the step of the checkpoint `after`
    continued from (`--continue-from` a checkpoint in `before`'s work directory, e.g. its WORK_DIR/stable
    full-rate state: the steps `before` took after it are a branch `after` never saw), else all of them
    (`--drafter-init` from its result, or a checkpoint recorded elsewhere)."""
    cont = after.get("continued_from") or {}
    work_dir = before["cfg"].get("work_dir")
    if cont.get("checkpoint") and cont.get("step") is not None and work_dir:
        if Path(work_dir) in Path(cont["checkpoint"]).parents:
            return int(cont["step"])
    return int(before["results"]["steps"])


def path_steps(records: list[dict]) -> int:
    """Optimizer steps from the first run's start to the last run's end along the continuations."""
    return sum(branch_step(a, b) for a, b in zip(records, records[1:])) + int(records[-1]["results"]["steps"])


def run(args: argparse.Namespace) -> int:
    if args.label and len(args.label) != len(args.runs):
        raise InputError(f"{len(args.label)} --label values for {len(args.runs)} runs: give one per run or none")
    labels = args.label or [r.name for r in args.runs]
    if len(set(labels)) != len(labels):
        raise InputError(f"run labels must be unique (curves are keyed by them); got {labels}: pass --label per run")
    records = [read_run(r) for r in args.runs]
    print("| " + " | ".join(COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for label, rec in zip(labels, records):
        print("| " + " | ".join(row(label, rec)) + " |")
    if args.lineage:
        curves, data = lineage(labels, records)
        total = path_steps(records)
        print(f"\nlineage: {len(records)} runs, {total:,} optimizer steps; held-out tau "
              f"{records[0]['results']['heldout'][0][2]:.3f} -> {records[-1]['results']['heldout'][-1][2]:.3f}")
        if args.plot is not None:
            from dflash_trt.bench.plots import lineage_plot

            lineage_plot(curves, data, args.plot, "DFlash drafter training, run after run (held-out split)")
            print(f"\nwrote {args.plot}")
        return 0
    if args.plot is not None:
        from dflash_trt.bench.plots import training_curves_plot

        curves = {label: [(st, st * rec["cfg"]["batch_size"] * rec["cfg"]["anchors_per_seq"], acc)
                          for st, _, acc in rec["results"]["heldout"]] for label, rec in zip(labels, records)}
        training_curves_plot(curves, args.plot, "DFlash drafter training (held-out split)")
        print(f"\nwrote {args.plot}")
    return 0
