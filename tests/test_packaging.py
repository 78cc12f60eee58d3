"""Packaging metadata: the project builds without setuptools deprecation warnings."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_metadata_uses_the_spdx_license_string_and_builds_without_warnings(tmp_path):
    src, meta = tmp_path / "src", tmp_path / "meta"
    src.mkdir()
    meta.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    code = ("import sys, warnings\nwarnings.simplefilter('always')\nfrom setuptools import build_meta\n"
            "print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))\n")
    proc = subprocess.run([sys.executable, "-c", code, str(meta)], cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    output = proc.stdout + proc.stderr
    assert "Deprecat" not in output and "license" not in output.lower(), output
    metadata = (meta / proc.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata


def test_readme_states_what_a_new_user_must_know():
    """Issue 17: the embedded default is the Q4_1 GGUF dequantized (its answers are not the HF
    weights'), and re-running a build into an existing directory needs --force."""
    text = " ".join((ROOT / "README.md").read_text().split())
    assert "**Q4_1 GGUF** quantization of SmolLM2-135M-Instruct, dequantized to float32" in text
    assert "differ from those of the original Hugging Face" in text
    assert "re-run needs `--force`" in text
