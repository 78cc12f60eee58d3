"""`dflash-trt train-report --lineage`: successive runs of the shipped drafter on cumulative axes.

The shipped drafter directory keeps its earlier runs' records (training_config.stepN.yaml), so these
tests read real lineage records; no model loads.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dflash_trt.commands.common import SHIPPED_DRAFTER
from dflash_trt.commands.train_report import branch_step, lineage, path_steps, read_run
from dflash_trt.errors import InputError

RECORDS = sorted(SHIPPED_DRAFTER.glob("training_config.step*.yaml"), key=lambda p: int(p.stem.split("step")[1]))


def _held(path: Path) -> list[str]:
    return read_run(path)["data"]["recipe"]["heldout_files"]


def _split_b_runs() -> list[Path]:
    """The longest run of records measured on the same held-out prompts (steps 3-10: split B; steps 11
    on select on split C), oldest first, with the shipped run's record when it shares them."""
    groups = [_held(p) for p in RECORDS]
    files = max(groups, key=groups.count)
    runs = [p for p, held in zip(RECORDS, groups) if held == files]
    last = SHIPPED_DRAFTER / "training_config.yaml"
    return runs + [last] if _held(last) == files else runs


def test_lineage_puts_runs_on_cumulative_axes():
    runs = _split_b_runs()
    assert len(runs) >= 2
    records = [read_run(p) for p in runs]
    labels = [p.stem for p in runs]
    curves, data = lineage(labels, records)
    offset = blocks = 0
    for label, rec in zip(labels, records):
        per_step = rec["cfg"]["batch_size"] * rec["cfg"]["anchors_per_seq"]
        held = rec["results"]["heldout"]
        assert curves[label] == [(offset + st, blocks + st * per_step, acc) for st, _, acc in held]
        # steps 3-10 each went on from the previous run's end (step 10 from step 9's last checkpoint)
        offset += rec["results"]["steps"]
        blocks += rec["results"]["steps"] * per_step
    assert [d[0] for d in data] == labels
    assert [d[1] for d in data] == [rec["data"]["response_tokens"] for rec in records]
    assert [d[2] for d in data] == [rec["results"]["heldout"][-1][2] for rec in records]
    # each run starts (step 0 of its own) where the previous one's axis ended
    for before, after in zip(labels, labels[1:]):
        assert curves[after][0][0] == curves[before][-1][0]


def test_lineage_refuses_runs_that_do_not_continue_each_other(tmp_path):
    runs = _split_b_runs()
    first, second = read_run(runs[-2]), read_run(runs[-1])
    fresh = dict(second, cfg=dict(second["cfg"], drafter_init=None, continue_from=None))
    with pytest.raises(InputError, match="did not start from a trained drafter"):
        lineage(["a", "b"], [first, fresh])
    # a run that continued from the other run's checkpoint (weights and AdamW moments) continues it too
    carried = dict(second, cfg=dict(second["cfg"], drafter_init=None, continue_from="/runs/a.work"))
    assert list(lineage(["a", "b"], [first, carried])[0]) == ["a", "b"]
    other = dict(second, data=dict(second["data"], recipe={"heldout_files": ["/elsewhere/heldout.jsonl"]}))
    with pytest.raises(InputError, match="other held-out prompts"):
        lineage(["a", "b"], [first, other])


def test_lineage_starts_a_continuation_where_it_branched_off():
    """A run that went on from the previous run's WORK_DIR/stable (its full-rate state, here step 420 of
    600) starts at step 420 on the cumulative axis: the 180 cooldown steps after it are a branch it never
    took. A checkpoint outside the previous run's work directory counts all of the previous run's steps."""
    runs = _split_b_runs()
    first, second = read_run(runs[-2]), read_run(runs[-1])
    first = dict(first, cfg=dict(first["cfg"], work_dir="/runs/a.work"),
                 results=dict(first["results"], steps=600))
    branched = dict(second, cfg=dict(second["cfg"], drafter_init=None, continue_from="/runs/a.work/stable"),
                    continued_from={"checkpoint": "/runs/a.work/stable/step-0000420", "step": 420})
    per_step = first["cfg"]["batch_size"] * first["cfg"]["anchors_per_seq"]
    curves = lineage(["a", "b"], [first, branched])[0]
    assert curves["b"][0][:2] == (420 + branched["results"]["heldout"][0][0],
                                  420 * per_step + branched["results"]["heldout"][0][0] * per_step)
    assert branch_step(first, branched) == 420
    assert path_steps([first, branched]) == 420 + branched["results"]["steps"]
    elsewhere = dict(branched, continued_from={"checkpoint": "/runs/other.work/stable/step-0000420", "step": 420})
    assert lineage(["a", "b"], [first, elsewhere])[0]["b"][0][0] == 600 + branched["results"]["heldout"][0][0]
    assert path_steps([first, elsewhere]) == 600 + branched["results"]["steps"]
    # a sibling directory whose name merely starts like the work directory is elsewhere too
    sibling = dict(branched, continued_from={"checkpoint": "/runs/a.work2/stable/step-0000420", "step": 420})
    assert branch_step(first, sibling) == 600


def test_cli_lineage_plot_and_yaml_runs(tmp_path):
    runs = _split_b_runs()[-2:]
    png = tmp_path / "lineage.png"
    out = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-report", *map(str, runs), "--label", "earlier",
                          "--label", "shipped", "--lineage", "--plot", str(png)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| earlier |") or line.startswith("| shipped |")]
    assert len(rows) == 2
    records = [yaml.safe_load(p.read_text()) for p in runs]
    total = sum(r["results"]["steps"] for r in records)
    start, end = records[0]["results"]["heldout"][0][2], records[1]["results"]["heldout"][-1][2]
    assert f"lineage: 2 runs, {total:,} optimizer steps; held-out tau {start:.3f} -> {end:.3f}" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    missing = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-report", str(tmp_path / "none.yaml")],
                             capture_output=True, text=True, timeout=300)
    assert missing.returncode == 2 and "training_config" in missing.stderr and "Traceback" not in missing.stderr
    twice = subprocess.run([sys.executable, "-m", "dflash_trt.cli", "train-report", str(runs[0]), str(runs[0])],
                           capture_output=True, text=True, timeout=300)
    assert twice.returncode == 2 and "labels must be unique" in twice.stderr and "Traceback" not in twice.stderr
