"""The build runner: config -> validated plan -> cached stages -> atomic output directory.

1. Load and validate the config (static rules), read the sources (and check them against it).
2. Dry run: return the plan; nothing is written.
3. Take the build lock in the stage cache `<DIR>.build-cache/` (a sibling of DIR), clear leftovers of
   interrupted runs.
4. Each cached stage has a key: a hash of its config section, the source fingerprints, upstream
   keys and the dflash_trt version. A stage whose `<cache>/<stage>-<key>/` is complete is skipped;
   otherwise it runs in `<cache>/<stage>.tmp-<pid>/` which is renamed into place when done.
   Stages COPY their sources (reflinks where the filesystem supports them), never hard-link them:
   editing a build never edits the checkpoint it came from.
5. Assemble: hard-link the stage folders of the cache into a temporary `.DIR.tmp-*` next to DIR
   (one copy on disk), write llm_api_options.yaml, launch/, triton/ and manifest.json, then rename
   it to DIR. An interrupted build never leaves DIR behind; a re-run (`--force` when DIR exists)
   reuses the finished stages, except a stage whose files were edited since it finished (their
   size or mtime changed): that one runs again.
"""
from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_trt.builder import deploy, stages
from dflash_trt.builder.config import BuildConfig, load_build_config
from dflash_trt.builder.manifest import build_manifest, tensor_group_report, write_manifest
from dflash_trt.builder.plan import BuildPlan, make_plan
from dflash_trt.builder.sizes import dir_bytes
from dflash_trt.builder.sources import fingerprint, human_bytes, json_digest, load_sources
from dflash_trt.errors import ConfigError

log = logging.getLogger(__name__)

DONE = ".done.json"
STAMPS = ".files.json"  # {relative path: [size, mtime_ns]} of a finished stage


@dataclass(frozen=True)
class BuildOptions:
    output: Path
    dry_run: bool = False
    force: bool = False
    progress: bool = True
    default_target: Path | None = None  # the resolved `@default` target directory
    tiny_gpt_oss: Path | None = None  # root of the `@tiny-gpt-oss` stand-in (target/, drafter/)
    stage_delay_s: dict[str, float] = field(default_factory=dict)  # test hook: sleep inside these stages


@dataclass(frozen=True)
class StageResult:
    name: str
    status: str  # run | skipped | missing
    seconds: float
    bytes: int
    key: str = ""
    facts: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "status": self.status, "seconds": round(self.seconds, 3), "bytes": self.bytes,
                "key": self.key, "facts": self.facts}


@dataclass(frozen=True)
class BuildReport:
    plan: BuildPlan
    results: tuple[StageResult, ...] = ()
    output: Path | None = None  # None for a dry run

    def summary(self) -> str:
        rows = [("stage", "status", "seconds", "size")]
        rows += [(r.name, r.status, f"{r.seconds:.2f}", human_bytes(r.bytes) if r.bytes else "-") for r in self.results]
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)


def stage_keys(plan: BuildPlan, fps: dict) -> dict[str, str]:
    cfg: BuildConfig = plan.config
    from dflash_trt import __version__

    keys = {"target": json_digest({"v": __version__, "target": cfg.target.model_dump(mode="json"),
                                   "calib": cfg.calibration_samples, "src": fps["target"]["sha256"]})}
    keys["drafter"] = json_digest({"v": __version__, "drafter": cfg.drafter.model_dump(mode="json"),
                                   "calib": cfg.calibration_samples, "src": fps["drafter"]["sha256"],
                                   "target_src": fps["target"]["sha256"] if cfg.drafter.quantization != "none" else ""})
    keys["shard"] = json_digest({"target": keys["target"], "parallel": cfg.parallel.model_dump(mode="json")})
    return keys


def _stamps(directory: Path) -> dict[str, list[int]]:
    return {p.relative_to(directory).as_posix(): [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(Path(directory).rglob("*")) if p.is_file() and not p.name.startswith(".")}


class _Cache:
    """The stage cache folder with its lock; removes leftovers of interrupted runs on entry."""

    def __init__(self, out: Path) -> None:
        self.root = out.parent / f"{out.name}.build-cache"
        self.out = out

    def __enter__(self) -> "_Cache":
        self.root.mkdir(parents=True, exist_ok=True)
        self._lock = open(self.root / ".lock", "w")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ConfigError(f"another build into {self.out} is running (lock {self.root}/.lock held)") from None
        for leftover in [*self.root.glob("*.tmp-*"), *self.out.parent.glob(f".{self.out.name}.tmp-*")]:
            log.info("removing leftover of an interrupted build: %s", leftover)
            shutil.rmtree(leftover, ignore_errors=True)
        return self

    def __exit__(self, *exc) -> None:
        self._lock.close()

    def done_dir(self, name: str, key: str) -> Path:
        return self.root / f"{name}-{key[:16]}"

    def run(self, name: str, key: str, fn, options: BuildOptions) -> tuple[Path, StageResult]:
        final = self.done_dir(name, key)
        if (final / DONE).is_file():
            if (final / STAMPS).is_file() and _stamps(final) == json.loads((final / STAMPS).read_text()):
                facts = json.loads((final / DONE).read_text())
                return final, StageResult(name, "skipped", 0.0, dir_bytes(final), key, facts)
            log.warning("stage %s: its cached files (%s) changed since it finished (edited through a build "
                        "directory?): running it again", name, final)
        start = time.perf_counter()
        tmp = self.root / f"{name}.tmp-{os.getpid()}"
        tmp.mkdir()
        facts = fn(tmp)
        delay = options.stage_delay_s.get(name, 0.0)
        if delay:
            log.warning("test hook: sleeping %.1f s inside stage %s", delay, name)
            time.sleep(delay)
        (tmp / DONE).write_text(json.dumps(facts, indent=2, default=str) + "\n")
        (tmp / STAMPS).write_text(json.dumps(_stamps(tmp)) + "\n")
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        for stale in self.root.glob(f"{name}-*"):
            if stale != final:
                shutil.rmtree(stale, ignore_errors=True)
        return final, StageResult(name, "run", time.perf_counter() - start, dir_bytes(final), key, facts)


def _run_cached_stages(plan: BuildPlan, cache: _Cache, keys: dict, options: BuildOptions
                       ) -> tuple[dict[str, Path], list[StageResult]]:
    prog = options.progress
    dirs: dict[str, Path] = {}
    results: list[StageResult] = []

    def step(name: str, fn) -> None:
        dirs[name], result = cache.run(name, keys[name], fn, options)
        results.append(result)

    step("target", lambda out: stages.run_target(plan, out, prog))
    step("drafter", lambda out: stages.run_drafter(plan, out, prog))
    if plan.has("shard"):
        step("shard", lambda out: stages.run_shard(plan, dirs["target"], out, prog))
    return dirs, results


def _assemble(plan: BuildPlan, dirs: dict[str, Path], results: list[StageResult], fps: dict,
              options: BuildOptions) -> list[StageResult]:
    from dflash_trt.fileio import atomic_directory  # here: hf imports torch, a dry run does not need it

    with atomic_directory(plan.out) as tmp:
        for name, src in dirs.items():
            dest = tmp / plan.stage(name).output
            dest.mkdir(parents=True)
            stages.link_stage(src, dest)
        start = time.perf_counter()
        opts = deploy.write_llm_api_options(plan, tmp)
        launch = deploy.write_launch(plan, tmp)
        results.append(StageResult("deploy", "run", time.perf_counter() - start,
                                   dir_bytes(tmp / "launch") + dir_bytes(tmp / "llm_api_options.yaml"),
                                   facts={"llm_api_options": opts}))
        if plan.has("triton"):
            start = time.perf_counter()
            facts = deploy.write_triton(plan, tmp)
            status = "run" if facts["status"] == "written" else "missing"
            results.append(StageResult("triton", status, time.perf_counter() - start,
                                       dir_bytes(tmp / "triton") if (tmp / "triton").exists() else 0, facts=facts))
        manifest = build_manifest(plan, fps, [r.as_dict() for r in results], launch,
                                  {"tensor_groups": tensor_group_report(plan, tmp)})
        write_manifest(tmp, manifest)
        results.append(StageResult("manifest", "run", 0.0, dir_bytes(tmp / "manifest.json")))
        tmp.chmod(0o755)
    return results


def prepare(config_path: Path, options: BuildOptions) -> BuildPlan:
    """Steps 1-2: validated config, sources and plan (no writes)."""
    config_path = Path(config_path)
    cfg = load_build_config(config_path)
    src = load_sources(cfg, config_path.resolve().parent, options.default_target, require=not options.dry_run,
                       tiny_gpt_oss=options.tiny_gpt_oss)
    return make_plan(cfg, Path(options.output), src)


def build(config_path: Path, options: BuildOptions) -> BuildReport:
    start = time.perf_counter()
    plan = prepare(config_path, options)
    if options.dry_run:
        return BuildReport(plan)
    out = plan.out
    if out.exists() and not options.force:
        raise ConfigError(f"output directory {out} exists: pass --force to rebuild it (finished stages are reused)")
    results = [StageResult("validate", "run", time.perf_counter() - start, 0)]
    out.parent.mkdir(parents=True, exist_ok=True)
    with _Cache(out) as cache:
        fps = {"target": fingerprint(plan.sources.target_path), "drafter": fingerprint(plan.sources.drafter_path)}
        keys = stage_keys(plan, fps)
        dirs, ran = _run_cached_stages(plan, cache, keys, options)
        results += ran
        results = _assemble(plan, dirs, results, fps, options)
    return BuildReport(plan, tuple(results), out)
