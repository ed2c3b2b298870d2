"""Executor profiles (workflow/profiles/): Kubernetes by a dry run — every rule planned — whose planned resources
are then turned into Job specs by the pinned Kubernetes plugin's own run_job (its API client replaced by a
recorder; no cluster is contacted): GPU stages request nvidia.com/gpu, CPU stages do not. The plugin lies off the
venv's path (kmesh.executors): the dry runs name its folder on PYTHONPATH as the docs tell a Snakemake user to, and
`kmesh pipeline` finds it by itself. SLURM by its dry run here (the real cluster run is tests/test_slurm_profile.py)."""
import logging
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from kmesh.executors import KUBERNETES_PLUGIN_DIR, asks_for_kubernetes, snakemake_env
from kmesh.stages import STAGES

ROOT = Path(__file__).resolve().parent.parent
SNAKEMAKE = [sys.executable, "-m", "snakemake"]
RULES = set(STAGES) | {"all"}   # every stage's rule (kmesh.stages.STAGES), and `all`
# vllm, peers: the pinned vLLM (and LMCache) run on the CPU; reliability: the cache service and the CPU engine
CPU_ONLY = {"sources", "report", "vllm", "peers", "reliability", "all"}


def _dry_run(profile_dir: str, pipeline_profile: str, tmp_path: Path) -> dict[str, dict[str, str]]:
    """Rule -> its planned resources (as Snakemake prints them) of `snakemake -n --profile ...`."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(KUBERNETES_PLUGIN_DIR)])}
    # A scratch results dir: with the user's results/ up to date a dry run would plan nothing.
    out = subprocess.run([*SNAKEMAKE, "-n", "--profile", profile_dir, "--config", f"profile={pipeline_profile}",
                          f"results_dir={tmp_path / 'results'}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    return _planned_resources(text)


@pytest.fixture(scope="module")
def k8s_cuda(tmp_path_factory):
    return _dry_run("workflow/profiles/kubernetes", "cuda", tmp_path_factory.mktemp("k8s"))


def test_kubernetes_dry_run_plans_every_rule(k8s_cuda):
    assert set(k8s_cuda) == RULES


def test_kubernetes_dry_run_resources(k8s_cuda):
    for rule, res in k8s_cuda.items():
        if rule in CPU_ONLY:
            assert "gpu" not in res, (rule, res)
        else:
            assert res.get("gpu") == "1" and res.get("gpu_manufacturer") == "nvidia", (rule, res)


def _pod_resources(resources: dict[str, str]) -> dict:
    """The container resources and tolerations the pinned plugin's run_job builds for a job with `resources`."""
    if str(KUBERNETES_PLUGIN_DIR) not in sys.path:
        sys.path.append(str(KUBERNETES_PLUGIN_DIR))
    from snakemake_executor_plugin_kubernetes import Executor, PersistentVolume

    sent = []
    usable = {k: (int(v) if v.isdigit() else v) for k, v in resources.items() if v != "<TBD>" and " " not in v}
    stub = SimpleNamespace(
        format_job_exec=lambda job: "true", logger=logging.getLogger("k8s-test"), run_namespace="ns",
        container_image="img", persistent_volumes=[PersistentVolume("kmesh-shared", Path("/x"))],
        k8s_cpu_scalar=0.95, privileged=False, k8s_service_account_name=None, secret_envvars={},
        workflow=SimpleNamespace(deployment_settings=SimpleNamespace(deployment_method=[])),
        namespace="default", _kubernetes_retry=lambda f: f(),
        batchapi=SimpleNamespace(create_namespaced_job=lambda ns, body: sent.append(body)),
        report_job_submission=lambda info: None)
    job = SimpleNamespace(resources=usable, jobid=1, attempt=1, is_containerized=False)
    Executor.run_job(stub, job)
    (body,) = sent
    spec = body.spec.template.spec
    c = spec.containers[0]
    return {"requests": c.resources.requests, "limits": c.resources.limits,
            "tolerations": [t.key for t in spec.tolerations or []]}


def test_kubernetes_job_specs_request_gpus_only_for_gpu_stages(k8s_cuda):
    for rule, res in k8s_cuda.items():
        if rule == "all":
            continue
        pod = _pod_resources(res)
        if rule in CPU_ONLY:
            assert "nvidia.com/gpu" not in pod["requests"] and not pod["tolerations"], (rule, pod)
        else:
            assert pod["requests"]["nvidia.com/gpu"] == "1" and pod["tolerations"] == ["nvidia.com/gpu"], (rule, pod)
        assert pod["requests"]["memory"] == f"{res['mem_mb']}M"


def _planned_resources(text: str) -> dict[str, dict[str, str]]:
    planned = {}
    for block in re.split(r"\n(?=rule \w+:)", text):
        m = re.match(r"rule (\w+):", block)
        res = re.search(r"^\s+resources: (.*)$", block, re.M)
        if m and res:
            planned[m.group(1)] = dict(kv.split("=", 1) for kv in res.group(1).split(", "))
    return planned


def test_cpu_pipeline_on_kubernetes_requests_no_gpu(tmp_path):
    # Through `kmesh pipeline`, with nothing on PYTHONPATH but the checkout: the console puts the plugin's folder on
    # the path itself because the profile names the kubernetes executor.
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    out = subprocess.run([sys.executable, "-m", "kmesh", "pipeline", "-n", "--profile", "workflow/profiles/kubernetes",
                          "--config", "profile=cpu", f"results_dir={results}"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    planned = _planned_resources((results / "cpu" / "logs" / "snakemake-dry-run.log").read_text())
    assert set(planned) == RULES
    assert not [r for r, res in planned.items() if "gpu" in res]


def test_the_kubernetes_plugin_is_off_the_default_path_and_found_where_asked(tmp_path):
    from importlib.machinery import PathFinder

    assert (KUBERNETES_PLUGIN_DIR / "snakemake_executor_plugin_kubernetes").is_dir(), "scripts/setup-env.sh installs it"
    # nowhere else on the path: Snakemake would import it (and the kubernetes client) in every process
    elsewhere = [p for p in sys.path if p != str(KUBERNETES_PLUGIN_DIR)]
    assert PathFinder.find_spec("snakemake_executor_plugin_kubernetes", elsewhere) is None
    profile = tmp_path / "p"
    profile.mkdir()
    (profile / "config.yaml").write_text("executor: kubernetes\njobs: 2\n")
    asked = [["--executor", "kubernetes"], ["-e", "kubernetes"], ["--executor=kubernetes"], ["--profile", str(profile)],
             ["--profile=" + str(profile)], ["--workflow-profile", "p", "-n"]]
    for args in asked:
        assert asks_for_kubernetes(args, tmp_path), args
        assert snakemake_env(args, tmp_path)["PYTHONPATH"].split(os.pathsep)[0] == str(KUBERNETES_PLUGIN_DIR)
    for args in (["--cores", "2"], ["--profile", "workflow/profiles/slurm"], ["--profile", str(tmp_path / "none")],
                 ["--", "--executor", "kubernetes"]):
        assert not asks_for_kubernetes(args, ROOT) and snakemake_env(args, ROOT) is None, args


def test_slurm_dry_run_plans_every_rule_with_resources(tmp_path):
    planned = _dry_run("workflow/profiles/slurm", "cuda", tmp_path)
    assert set(planned) == RULES
    assert planned["equivalence"]["gpu"] == "1" and "gpu" not in planned["sources"]
    assert planned["synthetic"]["mem_mb"] == "4000" and planned["sources"]["runtime"] == "120"
