"""`dflash-trt bench` on a tiny float64 checkpoint: report schema, internal consistency, the
identical-output check, skipped peers. Runs the real CLI in-process with one torch thread."""
from __future__ import annotations

import json
import math
import sys
import warnings

import pytest
import torch

from dflash_trt.bench import modes as bench_modes
from dflash_trt.bench.report import first_difference, per_position, tau_of
from dflash_trt.cli import main
from dflash_trt.engine import CPU_DRAFT_CONFIDENCE
from dflash_trt.models.tiny import save_tiny_checkpoint

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
BLOCK = 4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench_tiny")
    target, drafter = save_tiny_checkpoint(root, "llama", seed=0, block_size=BLOCK)
    prompts = root / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps(x) for x in [
        {"id": "poem", "prompt": "Write a poem about the sea.", "category": "writing"},
        {"id": "add", "prompt": "def add(a, b):\n", "kind": "code", "category": "code"},
        {"id": "sum", "prompt": "What is 2+2?", "category": "math"},
    ]) + "\n")
    return target, drafter, prompts


@pytest.fixture(autouse=True)
def _restore_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def bench(tiny, out, *extra):
    target, drafter, _ = tiny
    return main(["bench", "--target", str(target), "--drafter", str(drafter), "--dtype", "float64",
                 "--threads", "1", "--no-progress", "--max-new-tokens", "10", "--output", str(out), *extra])


def test_full_run_report_is_consistent(tiny, tmp_path, capsys):
    rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--dataset", "humaneval", "--limit", "2",
               "--concurrency", "1,2")
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    for key in ("schema_version", "config", "environment", "modes", "records", "aggregates", "ratios",
                "per_position_acceptance", "sweep", "errors"):
        assert key in report
    assert report["errors"] == []
    env = report["environment"]
    assert env["torch"] == torch.__version__ and env["cpu_count"] >= 1 and "transformers" in env["versions"]
    modes = report["modes"]["measured"]
    assert modes == ["dflash", "ar", "hf-generate", "hf-prompt-lookup", "dflash-reference"]
    assert report["config"]["block_size"] == BLOCK and report["config"]["max_new_tokens"] == 10
    assert report["config"]["draft_confidence"] == CPU_DRAFT_CONFIDENCE  # unset: the CPU default, recorded

    records = report["records"]
    prompts = {(r["dataset"], r["prompt_id"]) for r in records}
    assert {d for d, _ in prompts} == {"prompts", "humaneval"} and len(prompts) == 4
    assert len(records) == len(prompts) * len(modes)
    assert {r["category"] for r in records if r["dataset"] == "prompts"} == {"writing", "code"}  # spread
    for r in records:
        assert r["tokens"] == len(r["token_ids"]) and 1 <= r["tokens"] <= 10
        assert r["tokens_per_s"] == pytest.approx(r["tokens"] / r["time_s"])
        assert 0 < r["ttft_s"] <= r["time_s"]
        assert r["matches_reference"]
        assert 1.0 <= r["tau"] <= BLOCK
        if r["accepted"] is not None:
            assert len(r["accepted"]) == r["steps"] and all(0 <= a <= BLOCK - 1 for a in r["accepted"])
            assert sum(a + 1 for a in r["accepted"]) >= r["tokens"] - 1  # the last step may be cut
    # all modes produced the same greedy tokens, and each prompt saw a rotated mode order
    for key in prompts:
        rs = [r for r in records if (r["dataset"], r["prompt_id"]) == key]
        assert len({tuple(r["token_ids"]) for r in rs}) == 1
        assert sorted(r["order"] for r in rs) == list(range(len(modes)))
    firsts = {next(r["mode"] for r in records if (r["dataset"], r["prompt_id"]) == k and r["order"] == 0)
              for k in prompts}
    assert len(firsts) == len(prompts)

    # speed ratios are the per-prompt tokens/s ratios of the records
    by = {(r["mode"], r["dataset"], r["prompt_id"]): r for r in records}
    ratio = report["ratios"]["dflash/ar"]
    expected = [by[("dflash", d, p)]["tokens_per_s"] / by[("ar", d, p)]["tokens_per_s"] for d, p in prompts]
    assert ratio["prompts"] == len(prompts)
    assert sorted(x["ratio"] for x in ratio["per_prompt"]) == pytest.approx(sorted(expected))
    assert ratio["mean"] == pytest.approx(sum(expected) / len(expected))
    assert ratio["geomean"] == pytest.approx(math.exp(sum(map(math.log, expected)) / len(expected)))
    time_ratios = [by[("ar", d, p)]["time_s"] / by[("dflash", d, p)]["time_s"] for d, p in prompts]
    assert sorted(x["ratio"] for x in ratio["per_prompt"]) == pytest.approx(sorted(time_ratios))  # same tokens
    assert "dflash/hf-generate" in report["ratios"] and "dflash-reference/ar" in report["ratios"]

    agg = {(a["mode"], a["dataset"]): a for a in report["aggregates"]["by_dataset"]}
    a = agg[("dflash", "humaneval")]
    he = [r for r in records if r["mode"] == "dflash" and r["dataset"] == "humaneval"]
    assert a["prompts"] == 2 and a["tokens"] == sum(r["tokens"] for r in he)
    assert 1.0 <= a["tau"] <= BLOCK and agg[("ar", "humaneval")]["tau"] == pytest.approx(1.0)
    assert {c["category"] for c in report["aggregates"]["by_category"] if c["dataset"] == "prompts"} == {"writing", "code"}

    for curve in report["per_position_acceptance"].values():
        assert len(curve) == BLOCK - 1 and all(0.0 <= x <= 1.0 for x in curve)
        assert all(x >= y for x, y in zip(curve, curve[1:]))

    sweep = report["sweep"]
    assert [(p["mode"], p["concurrency"]) for p in sweep] == [("dflash", 1), ("dflash", 2), ("ar", 1), ("ar", 2)]
    tokens_per_prompt = sum(by[("ar", d, p)]["tokens"] for d, p in prompts)
    for p in sweep:
        assert p["requests"] == len(prompts) and p["tokens"] == tokens_per_prompt
        assert p["total_tokens_per_s"] == pytest.approx(p["tokens"] / p["wall_s"])
        assert 0 < p["ttft_s"]["p50"] <= p["ttft_s"]["p99"] and p["itl_s"]["p50"] <= p["itl_s"]["p99"]
        assert p["tokens_per_s_per_user"] > 0 and 1.0 <= p["tau"] <= BLOCK
        assert all(x >= y for x, y in zip(p["per_position_acceptance"], p["per_position_acceptance"][1:]))

    md = (tmp_path / "report.md").read_text()
    assert "| dataset | mode |" in md and "## Concurrency sweep" in md and "dflash/ar" in md
    for name in ("pareto.png", "acceptance.png"):
        data = (tmp_path / name).read_bytes()
        assert data.startswith(PNG_MAGIC)
        from PIL import Image

        with Image.open(tmp_path / name) as img:
            img.verify()
            assert img.size[0] > 200 and img.size[1] > 200
    assert report["plots"] == ["pareto.png", "acceptance.png"]
    assert report["config"]["command"].startswith("dflash-trt bench --dataset")


def test_report_command_reruns_as_written():
    """The report's command is one a user can paste: flags parsed to other types (the concurrency
    list, the draft-length schedule) are written back in the form the parser reads."""
    import shlex

    from dflash_trt.cli import build_parser
    from dflash_trt.commands.bench import command_line

    argv = ["bench", "--dataset", "mtbench", "--limit", "4", "--modes", "dflash,dflash-full,ar",
            "--concurrency", "1,4,8", "--draft-len-schedule", "1:7,4:3,8:0", "--output", "out"]
    args = build_parser().parse_args(argv)
    line = command_line(args)
    assert "--draft-len-schedule 1:7,4:3,8:0" in line and "--concurrency 1,4,8" in line
    again = build_parser().parse_args(shlex.split(line)[1:])
    for key in ("dataset", "limit", "modes", "concurrency", "draft_len_schedule", "output"):
        assert getattr(again, key) == getattr(args, key), key


class _BrokenMode(bench_modes.EngineMode):
    """Autoregressive decoding whose fourth token is altered: a 'speedup' over a different output."""

    def __init__(self, name, ctx):
        super().__init__(name, ctx, kind="ar")

    def run(self, prompt, max_new_tokens):
        out = super().run(prompt, max_new_tokens)
        tokens = list(out.tokens)
        tokens[3] = (tokens[3] + 1) % 200
        return bench_modes.ModeOutput(tokens=tokens, time_s=out.time_s, ttft_s=out.ttft_s, steps=out.steps)


def test_truncated_dflash_against_full_blocks(tiny, tmp_path, capsys):
    rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--modes", "dflash,dflash-full,ar", "--concurrency", "2",
               "--draft-confidence", "0.5", "--step-costs")
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == []  # same tokens in every mode, batch 1 and sweep
    assert report["config"]["draft_confidence"] == 0.5  # the `dflash` mode's threshold is recorded
    by_mode = {r["mode"]: r for r in report["aggregates"]["by_dataset"]}
    assert by_mode["dflash-full"]["verified_per_step"] == BLOCK - 1
    assert by_mode["dflash"]["verified_per_step"] < BLOCK - 1  # a random drafter is rarely confident
    assert by_mode["ar"]["verified_per_step"] is None
    assert {p["mode"] for p in report["sweep"]} == {"dflash", "dflash-full", "ar"}
    md = (tmp_path / "report.md").read_text()
    assert "drafts verified/step" in md and "## Step costs" in md
    costs = report["step_costs"]
    assert costs["verify_ratio"]["1"] == 1.0 and set(costs["verify_ratio"]) == {"1", "2", "4", "8"}


def test_confidence_sweep_modes(tiny, tmp_path, capsys):
    """dflash@C modes: one threshold each, same output; @0 verifies whole blocks; dflash-ngram@N drafts
    some steps by n-gram lookup (a tiny target's greedy text repeats itself)."""
    rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--limit", "2", "--modes",
               "dflash@0,dflash@0.9,dflash-full-vocab,dflash-ngram@1,ar",
               "--concurrency", "", "--no-plots", "--no-warmup")
    assert rc == 0, capsys.readouterr().err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["errors"] == []
    assert report["modes"]["measured"] == ["dflash@0", "dflash@0.9", "dflash-full-vocab", "dflash-ngram@1", "ar"]
    by_mode = {r["mode"]: r for r in report["aggregates"]["by_dataset"]}
    assert by_mode["dflash@0"]["verified_per_step"] == BLOCK - 1
    assert by_mode["dflash@0.9"]["verified_per_step"] < BLOCK - 1
    assert by_mode["dflash-ngram@1"]["lookup_share"] > 0 and by_mode["dflash@0"]["lookup_share"] is None
    row = next(line for line in (tmp_path / "report.md").read_text().splitlines() if "| dflash-ngram@1 |" in line)
    assert f"| {by_mode['dflash-ngram@1']['lookup_share']:.2f} |" in row


@pytest.fixture
def broken_mode():
    bench_modes.register_mode("broken", _BrokenMode)
    yield "broken"
    bench_modes.unregister_mode("broken")


def test_output_mismatch_is_an_error(tiny, tmp_path, capsys, broken_mode):
    rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--limit", "2", "--modes", "ar,broken", "--concurrency", "",
               "--no-plots", "--no-warmup")
    assert rc == 1
    err = capsys.readouterr().err
    assert "mode 'broken' differs from 'ar' on prompts:poem at generated token 3" in err
    report = json.loads((tmp_path / "report.json").read_text())
    errors = report["errors"]
    assert len(errors) == 2 and {e["prompt_id"] for e in errors} == {"poem", "add"}
    assert all(e["mode"] == "broken" and e["first_diff_index"] == 3 and e["kind"] == "output_mismatch" for e in errors)
    assert all(not r["matches_reference"] for r in report["records"] if r["mode"] == "broken")
    assert report["ratios"]["broken/ar"]["prompts"] == 0  # no ratio over different outputs
    assert "## Errors" in (tmp_path / "report.md").read_text()


def test_missing_peers_are_skipped(tiny, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "dflash", None)  # find_spec("dflash") -> None: not installed
    rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--limit", "1", "--concurrency", "",
               "--modes", "dflash,ar,dflash-reference", "--no-plots", "--no-warmup")
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["modes"]["measured"] == ["dflash", "ar"]
    assert "not installed" in report["modes"]["skipped"]["dflash-reference"]
    assert "dflash-reference" in (tmp_path / "report.md").read_text()


def test_no_spec_skips_drafter_modes(tiny, tmp_path):
    target, _, prompts = tiny
    rc = main(["bench", "--target", str(target), "--no-spec", "--dtype", "float64", "--threads", "1", "--no-progress",
               "--max-new-tokens", "6", "--dataset", str(prompts), "--limit", "1", "--modes", "dflash,ar",
               "--concurrency", "2", "--no-warmup", "--output", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["modes"]["measured"] == ["ar"] and "drafter" in report["modes"]["skipped"]["dflash"]
    assert [p["mode"] for p in report["sweep"]] == ["ar"] and report["sweep"][0]["requests"] == 2
    assert (tmp_path / "pareto.png").read_bytes().startswith(PNG_MAGIC)


@pytest.mark.parametrize("flags, message", [
    (["--modes", "dflash,nope"], "unknown modes"),
    (["--modes", "dflash@1.5"], "C in [0, 1)"),
    (["--modes", "dflash@x"], "takes a number"),
    (["--modes", "dflash-ngram@0"], "N in [1, 8]"),
    (["--modes", "dflash-ngram@two"], "takes an integer"),
    (["--dataset", "squad"], "unknown dataset"),
    (["--limit", "0"], "--limit"),
    (["--prompt-lookup-tokens", "0"], "--prompt-lookup-tokens must be >= 1"),
])
def test_bad_flags_are_user_errors(tiny, tmp_path, capsys, flags, message):
    assert bench(tiny, tmp_path, *flags) == 2
    assert message in capsys.readouterr().err


def test_default_sweep_scales_to_the_prompts_and_few_prompts_warn(tiny, tmp_path, capsys):
    """--limit 2 without --concurrency sweeps 1 and 2 (not up to 16); the summary says it rests on
    too few prompts; the reference peer runs without transformers' past_key_values FutureWarning."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = bench(tiny, tmp_path, "--dataset", str(tiny[2]), "--limit", "2", "--modes", "dflash,ar,dflash-reference",
                   "--no-plots")
    err = capsys.readouterr().err
    assert rc == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["modes"]["measured"] == ["dflash", "ar", "dflash-reference"]
    assert report["config"]["concurrency"] == [1, 2]
    assert sorted((p["mode"], p["concurrency"], p["requests"]) for p in report["sweep"]) == [
        ("ar", 1, 2), ("ar", 2, 2), ("dflash", 1, 2), ("dflash", 2, 2)]
    assert report["warnings"] and "prompts: 2 prompts (fewer than 10)" in report["warnings"][0]
    assert f"dflash-trt bench: warning: {report['warnings'][0]}" in err
    assert "## Noise warnings" in (tmp_path / "report.md").read_text()
    assert not [w for w in caught if "past_key_values" in str(w.message)], [str(w.message) for w in caught]


def test_noise_warnings_name_a_dominant_prompt():
    from dflash_trt.bench.report import noise_warnings

    def rec(pid, t):
        return {"mode": "dflash", "dataset": "d", "prompt_id": pid, "time_s": t}

    many = {"d": 12}
    assert noise_warnings([rec(str(i), 1.0) for i in range(12)], many) == []
    [warning] = noise_warnings([rec(str(i), 1.0) for i in range(11)] + [rec("slow", 12.0)], many)
    assert "d/dflash: prompt slow takes 52% of the time" in warning
    assert "fewer than 10" in noise_warnings([], {"d": 3})[0]
    # two or three similar prompts: one of them always takes half the time, which is no dominance
    assert noise_warnings([rec("a", 1.1), rec("b", 0.9)], many) == []
    assert noise_warnings([rec("a", 1.2), rec("b", 1.0), rec("c", 0.9)], many) == []
    assert "prompt a takes 80%" in noise_warnings([rec("a", 8.0), rec("b", 1.0), rec("c", 1.0)], many)[0]


@pytest.mark.parametrize("got, want, index", [
    ([1, 2, 3], [1, 2, 3], None), ([1, 2, 3], [1, 5, 3], 1), ([1, 2], [1, 2, 3], 2), ([], [4], 0),
])
def test_first_difference(got, want, index):
    assert first_difference(got, want) == index


def test_acceptance_statistics():
    assert per_position([[3, 0], [1]], 3) == pytest.approx([2 / 3, 1 / 3, 1 / 3])
    assert tau_of(7, 2, [3, 1]) == 3.0
    assert tau_of(5, 4, None) == 1.0 and tau_of(1, 0, None) is None
