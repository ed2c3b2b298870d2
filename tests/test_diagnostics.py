"""kmesh.diagnostics and `python -m kmesh diagnose`: the list, the unknown-name error, every module importable without
a GPU with a main(argv) and a docstring, the GPU ones refusing clearly without one, decode_reproducibility running on
a tiny CPU model; and scripts/ holding shell glue only, every command it and the Makefile name existing."""
from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import importgraph
from kmesh import cli, diagnostics
from kmesh.diagnostics import DiagnosticError, UnknownDiagnosticError
from kmesh.diagnostics.decode_reproducibility import compare

ROOT = Path(__file__).resolve().parents[1]
MODULES = sorted(p.stem for p in (ROOT / "src" / "kmesh" / "diagnostics").glob("*.py") if not p.stem.startswith("_"))
# every diagnostic but decode_reproducibility needs a GPU; the arguments each requires besides
GPU_ONLY = {"attention_variants": ["--out"], "blend_profile": ["--out"], "decode_isolation": ["--out"],
            "restore_breakdown": ["--out"], "layer_step_pair": ["--out"], "gpu_hash_overhead": [],
            "cufile_registration": [], "kernel_pair": []}
TINY_QWEN2 = ("{num_hidden_layers: 2, hidden_size: 64, intermediate_size: 128, num_attention_heads: 4, "
              "num_key_value_heads: 2, head_dim: 16, vocab_size: 300, max_position_embeddings: 512, dtype: float32}")
# One token a byte: a fact sentence needs segments longer than the cpu profile's SmolLM2-token ones.
BYTE_WORKLOAD = "{prompt_tokens: 512, segment_tokens: [128, 112, 96, 80], children: 4, block_size: 16}"


def _kmesh(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "kmesh", *args], capture_output=True, text=True, timeout=timeout,
                          cwd=ROOT, env=env)


def test_diagnose_without_a_name_lists_every_diagnostic():
    out = _kmesh("diagnose")
    assert out.returncode == 0, out.stderr
    listed = [line.split()[0] for line in out.stdout.splitlines()[1:]]
    assert listed == MODULES == sorted(diagnostics.available())
    assert len(MODULES) >= 7
    assert "decode_reproducibility" in listed and "_common" not in listed


def test_unknown_diagnostic_fails_with_exit_code_2_and_the_list():
    out = _kmesh("diagnose", "no_such_diagnostic")
    assert out.returncode == 2
    assert "unknown diagnostic 'no_such_diagnostic'" in out.stderr
    assert all(name in out.stderr for name in MODULES)
    with pytest.raises(UnknownDiagnosticError, match="available: attention_variants"):
        diagnostics.run("_common", [])          # a helper module is not a diagnostic


@pytest.mark.parametrize("name", MODULES)
def test_every_diagnostic_imports_without_a_gpu_and_has_main_and_a_docstring(name):
    module = importlib.import_module(f"kmesh.diagnostics.{name}")
    assert callable(getattr(module, "main", None))
    doc = module.__doc__ or ""
    summary, _, body = doc.partition("\n\n")
    assert summary.strip() and len(summary) <= 120, f"{name}: the first paragraph is the one-line summary"
    assert "Output" in body, f"{name}: the docstring says what its output is and how to read it"


@pytest.mark.parametrize("name", MODULES)
def test_help_shows_the_whole_docstring(name, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main(["diagnose", name, "--help"])
    assert exit_.value.code == 0
    module = importlib.import_module(f"kmesh.diagnostics.{name}")
    last_line = module.__doc__.strip().splitlines()[-1]
    assert last_line in capsys.readouterr().out


CPU_RUNNABLE = ("decode_reproducibility", "device_plan", "service_load")   # device_plan runs the GPU machine's plans


def test_gpu_list_covers_every_diagnostic_but_the_cpu_runnable_ones():
    assert sorted(GPU_ONLY) == [name for name in MODULES if name not in CPU_RUNNABLE]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
@pytest.mark.parametrize("name", sorted(GPU_ONLY))
def test_gpu_diagnostics_refuse_clearly_without_a_gpu(name, tmp_path, capsys):
    args = [arg for option in GPU_ONLY[name] for arg in (option, str(tmp_path / "out.json"))]
    with pytest.raises(DiagnosticError, match=f"diagnostic {name} needs a CUDA GPU"):
        diagnostics.run(name, args)
    assert cli.main(["diagnose", name, *args]) == 2
    assert f"kmesh: error: diagnostic {name} needs a CUDA GPU" in capsys.readouterr().err
    assert not (tmp_path / "out.json").exists()


def test_decode_reproducibility_on_the_cpu_profile(tmp_path):
    """The one CPU-runnable diagnostic, end to end on a 2-layer seeded Qwen2 (~10 s): seven runs, a service process
    during runs 2-4, and on the CPU every run bit-equal to run 0."""
    out = _kmesh("diagnose", "decode_reproducibility", "--profile", "cpu", "--steps", "1",   # the prefill and a step
                 "--set", f"results_dir={tmp_path}", "--set", "equivalence.model=qwen2_random",
                 "--set", "equivalence.byte_token_offset=0", "--set", f"model.qwen2_random={TINY_QWEN2}",
                 "--set", "equivalence.workload={prompt_tokens: 352, segment_tokens: [80, 80, 80], children: 3, "
                          "block_size: 16}", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.strip().splitlines()
    assert [line.split()[0] for line in lines] == [str(run) for run in range(7)]
    assert all(line.endswith("token_div None first_logits_neq_step None") for line in lines), lines


def test_decode_reproducibility_names_an_unknown_child(tmp_path):
    with pytest.raises(DiagnosticError, match="no child 'Z'"):
        diagnostics.run("decode_reproducibility", ["--profile", "cpu", "--child", "Z", "--steps", "1",
                                                   "--set", f"results_dir={tmp_path}",
                                                   "--set", "equivalence.model=qwen2_random",
                                                   "--set", "equivalence.byte_token_offset=0",
                                                   "--set", f"equivalence.workload={BYTE_WORKLOAD}",
                                                   "--set", f"model.qwen2_random={TINY_QWEN2}"])


def test_compare_reports_the_first_differing_token_and_logits():
    logits = [torch.tensor([0.0, 1.0, 0.5]), torch.tensor([2.0, 0.0, 1.0]), torch.tensor([0.0, 0.0, 3.0])]
    base = ([1, 0, 2], logits)
    assert compare(0, base, base) == "0 token_div None first_logits_neq_step None"
    one_ulp = [logits[0], torch.tensor([2.0, 0.0, float(torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)))]),
               logits[2]]
    assert compare(1, base, ([1, 0, 2], one_ulp)) == "1 token_div None first_logits_neq_step 1"
    flipped = [logits[0], logits[1], torch.tensor([0.0, 4.0, 3.0])]
    line = compare(2, base, ([1, 0, 1], flipped))
    assert line.startswith("2 token_div 2 first_logits_neq_step 2 run top3 [4.0, 3.0, 0.0] [1, 2, 0]")


def test_no_diagnostic_imports_a_stage():
    found = sorted(f"{module} -> {target}" for module in importgraph.all_modules()
                   if module.startswith("kmesh.diagnostics") for target in importgraph.imports_of(module)
                   if target == "kmesh.stages" or target.startswith("kmesh.stages."))
    assert not found, found


def test_scripts_is_shell_glue_only():
    assert sorted(p.name for p in (ROOT / "scripts").iterdir() if p.suffix != ".sh") == []


def _named_commands() -> list[tuple[str, str]]:
    """(file, command) for every `kmesh diagnose NAME` and `python -m kmesh.X` the Makefile and scripts/ run."""
    found = []
    for path in [ROOT / "Makefile", *sorted((ROOT / "scripts").glob("*.sh"))]:
        text = path.read_text()
        found += [(path.name, f"diagnose {name}") for name in re.findall(r"kmesh diagnose (\w+)", text)]
        found += [(path.name, module) for module in re.findall(r"-m (kmesh\.[\w.]+)", text)]
    return found


def test_every_command_the_makefile_and_scripts_name_exists():
    named = _named_commands()
    assert ("Makefile", "kmesh.devtools.lock") in named and ("Makefile", "kmesh.devtools.mutation_report") in named
    assert ("device.sh", "kmesh.diagnostics.device_plan") in named
    for where, command in named:
        if command.startswith("diagnose "):
            assert command.split()[1] in MODULES, f"{where}: {command}"
        else:
            assert callable(importlib.import_module(command).main), f"{where}: {command}"


def test_every_script_the_repository_names_exists():
    """Code, docs and configs name only scripts that are there (measurement data files keep the command they
    were made with: they are records, not instructions; so do the measurement pages, for the device scripts since
    folded into scripts/device.sh, kmesh.diagnostics.device_plan.FOLDED)."""
    from kmesh.diagnostics.device_plan import FOLDED

    texts = [ROOT / "Makefile", ROOT / "README.md", ROOT / "pyproject.toml", ROOT / "flake.nix", ROOT / ".ci" / "run",
             *ROOT.glob("scripts/*"), *ROOT.glob("src/**/*.py"), *ROOT.glob("tests/*.py"), *ROOT.glob("docs/**/*.md"),
             *ROOT.glob("requirements/*.in"), *ROOT.glob("workflow/**/*.yaml"), *ROOT.glob("kernels/*")]
    named = {(path.relative_to(ROOT).as_posix(), ref) for path in texts if path.is_file()
             for ref in re.findall(r"\bscripts/[\w.-]*\w", path.read_text(errors="replace"))}
    assert any(where == "Makefile" for where, _ in named)
    missing = sorted(f"{where}: {ref}" for where, ref in named if not (ROOT / ref).exists()
                     and not (where.startswith("docs/measurements/") and ref.removeprefix("scripts/") in FOLDED))
    assert not missing, missing


def test_decode_isolation_finds_the_first_differing_op_on_cpu(tmp_path):
    """decode_isolation's recording and comparison (its GPU-only part is the context churn): two CPU runs are
    bit-equal; a run whose attention output of one step and layer is perturbed is reported at exactly that op,
    with its inputs equal and the re-runs matching run 0's output, not the perturbed one."""
    import yaml

    from kmesh.config import load_config
    from kmesh.diagnostics import decode_isolation
    from kmesh.harness.modelsetup import equivalence_setup

    cfg = load_config(profile="cpu", overrides={
        "results_dir": str(tmp_path), "model": {"qwen2_random": yaml.safe_load(TINY_QWEN2)},
        "equivalence": {"model": "qwen2_random", "byte_token_offset": 0,
                        "workload": {"prompt_tokens": 352, "segment_tokens": [80, 80, 80], "children": 3,
                                     "block_size": 16}}})
    setup = equivalence_setup(cfg)
    runs = [decode_isolation.recorded_run(setup), decode_isolation.recorded_run(setup)]
    tokens, rec = decode_isolation.recorded_run(setup)
    rec[(5, 1, "attn")] = rec[(5, 1, "attn")] + 1e-3
    rows = decode_isolation.compare_runs(setup, [*runs, (tokens, rec)])
    assert [row["first_diff"] for row in rows] == [None, None, [5, 1, "attn"]]
    assert rows[1]["tokens_equal"] and rows[1]["prefill_equal"]
    assert rows[2]["attn_inputs_equal"] is True
    assert (rows[2]["rerun_matches_this"], rows[2]["rerun_matches_run0"]) == (0, 20)
    # on the CPU the runner's attention is SDPA's flash kernel; a backend that cannot run here is recorded
    assert rows[2]["backend_flash_eq_run0"] is True and rows[2]["backend_math_eq_this"] is False
    assert rows[2]["backend_cudnn"].startswith("RuntimeError: No viable backend")


def test_service_load_on_the_cpu_profile(tmp_path):
    """service_load end to end on a 2-layer seeded Qwen2 and a small RAG workload: a real service, every arm timed
    in every kept round, each arm's destination checked against the leader's bytes (a mismatch would stop it)."""
    out_json = tmp_path / "sl.json"
    out = _kmesh("diagnose", "service_load", "--profile", "cpu", "--rounds", "1", "--warmup", "0",
                 "--out", str(out_json), "--set", f"results_dir={tmp_path}", "--set", "equivalence.model=qwen2_random",
                 "--set", "equivalence.byte_token_offset=0", "--set", f"equivalence.workload={BYTE_WORKLOAD}",
                 "--set", f"model.qwen2_random={TINY_QWEN2.replace('512', '2048')}",
                 "--set", "equivalence.rag.workload={chunks: 4, chunk_tokens: 256, prompt_tokens: 1120, children: 2, "
                          "block_size: 16, leader_preamble_tokens: 16}", timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    got = json.loads(out_json.read_text())
    assert got["segments"] == 4 and got["rounds"] == 1 and got["profile"] == {}
    from kmesh.diagnostics.service_load import ARMS
    assert sorted(got["arms"]) == sorted(ARMS)
    assert all(row["median_ms"] > 0 for row in got["arms"].values())
    assert got["arms"]["load-many"]["ratio_to_host-floor_median"] > 0 and got["accept_ms_median"] > 0
    prov = got["provenance"]       # what ran: the tree and the config it ran on
    assert len(prov["kmesh"]["tree_sha256"]) == 64 and prov["config"]["equivalence"]["rag"]["workload"]["chunks"] == 4
    assert prov["seed"] == prov["config"]["seed"] and prov["end"]


def test_a_diagnostic_without_a_config_records_code_and_hardware(tmp_path):
    from kmesh.diagnostics._common import write_json

    write_json(tmp_path / "d.json", {"x": 1.5})
    import json

    got = json.loads((tmp_path / "d.json").read_text())
    assert got["x"] == 1.5 and len(got["provenance"]["kmesh"]["tree_sha256"]) == 64 and "torch" in got["provenance"]


def test_service_load_summarises_py_spy_raw_stacks_per_thread():
    from kmesh.diagnostics.service_load import summarise_raw

    raw = ("thread (1): MainThread;serve (s.py:1);load (o.py:9) 30\n"
           "thread (1): MainThread;serve (s.py:1);select (sel.py:4) 50\n"
           "thread (2): watch;drain (e.py:3);sync (e.py:7) 12\n"
           "garbage line\n")
    got = summarise_raw(raw)
    assert list(got) == ["thread (1): MainThread", "thread (2): watch"]
    main = got["thread (1): MainThread"]
    assert main["samples"] == 80 and main["self"][0] == ("select (sel.py:4)", 50)
    assert dict(main["inclusive"])["serve (s.py:1)"] == 80 and got["thread (2): watch"]["samples"] == 12
