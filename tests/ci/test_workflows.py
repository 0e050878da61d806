"""Structural checks of the GitHub workflows beyond their schema (which .ci/run
checks with check-jsonschema): job references, shell syntax of every `run:`
block, the scripts they call, and the accuracy workflow's required properties."""

import re
import subprocess
from pathlib import Path

import pytest
import yaml

REPO_ROOT = Path(__file__).resolve().parents[2]
WORKFLOWS = sorted((REPO_ROOT / ".github" / "workflows").glob("*.yaml"))
EXPRESSION = re.compile(r"\$\{\{.*?\}\}")
SCRIPT_PATH = re.compile(r"\bscripts/ci/[\w./-]+\.sh\b")
SCRIPT_MODULE = re.compile(r"-m (scripts\.ci\.\w+)")


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def run_blocks(workflow: dict):
    for job_name, job in workflow["jobs"].items():
        for step in job.get("steps", []):
            if "run" in step:
                yield job_name, step


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_jobs_need_existing_jobs(path):
    jobs = load(path)["jobs"]
    for name, job in jobs.items():
        needs = job.get("needs", [])
        for need in [needs] if isinstance(needs, str) else needs:
            assert need in jobs, f"{path.name}: job {name} needs unknown job {need}"


@pytest.mark.parametrize("path", WORKFLOWS, ids=lambda p: p.name)
def test_run_blocks_are_valid_bash_calling_existing_scripts(path):
    for job, step in run_blocks(load(path)):
        script = EXPRESSION.sub("X", step["run"])
        check = subprocess.run(
            ["bash", "-n"], input=script, text=True, capture_output=True
        )
        assert check.returncode == 0, f"{path.name} {job}: {check.stderr}"
        for script_path in SCRIPT_PATH.findall(script):
            assert (REPO_ROOT / script_path).is_file(), script_path
        for module in SCRIPT_MODULE.findall(script):
            assert (REPO_ROOT / (module.replace(".", "/") + ".py")).is_file(), module


def test_accuracy_workflow_has_its_required_pieces():
    workflow = load(REPO_ROOT / ".github" / "workflows" / "gpu-accuracy.yaml")
    jobs = workflow["jobs"]
    cpu = jobs["cpu-accuracy"]
    assert "if" not in cpu and "needs" not in cpu  # runs on every event
    assert any("scripts/ci/accuracy_cpu.sh" in s.get("run", "") for s in cpu["steps"])
    gpu = jobs["gpu"]
    assert "cpu-accuracy" in gpu["needs"]
    assert gpu["strategy"]["fail-fast"] is False
    assert gpu["runs-on"] == "${{ matrix.runner }}"
    for job in (cpu, gpu):
        uploads = [s for s in job["steps"] if "upload-artifact" in s.get("uses", "")]
        assert uploads and all(s.get("if") == "always()" for s in uploads)
    for name in ("ROCM_IMAGE", "CUDA_IMAGE"):
        assert re.search(r"@sha256:[0-9a-f]{64}$", workflow["env"][name]), name
    runs = "\n".join(step["run"] for _, step in run_blocks(workflow))
    for needed in ("--device=/dev/kfd", "--device /dev/dri", "--group-add video",
                   "--gpus all", "scripts.ci.fetch", "accuracy_entry.sh"):  # fmt: skip
        assert needed in runs, needed


def test_pd_entries_get_mooncake_for_their_platform():
    workflow = load(REPO_ROOT / ".github" / "workflows" / "gpu-accuracy.yaml")
    steps = workflow["jobs"]["gpu"]["steps"]
    install = [s for s in steps if s.get("if") == "matrix.pd"]
    assert len(install) == 1
    for wheel in ("mooncake-transfer-engine-rocm", "mooncake-transfer-engine ",
                  "libibverbs1 librdmacm1 libnuma1"):  # fmt: skip
        assert wheel in install[0]["run"] + " ", wheel
    names = [s.get("name") for s in steps]
    assert names.index(install[0]["name"]) < next(
        i for i, s in enumerate(steps) if "accuracy_entry.sh" in s.get("run", "")
    )
