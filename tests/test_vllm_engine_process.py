"""EngineProcess's temporary directory: the pinned vLLM leaves a vllm_dist_<hex> file in TMPDIR per engine and never
removes it (found by make test's TMPDIR check), so each engine process runs with a TMPDIR of its own that goes when
the engine ends. No engine is started here: the process is killed while it is still importing."""
from __future__ import annotations

import tempfile
import time
from pathlib import Path

import pytest

from kmesh.vllm.engine import EngineError, EngineProcess, engine_env


@pytest.fixture
def unloadable(tmp_path_factory):
    """A folder the engine accepts (it has a config.json) and vLLM could never load: killed while importing."""
    d = tmp_path_factory.mktemp("unloadable-model")
    (d / "config.json").write_text("{}")
    return d


def _environ(pid: int) -> list[bytes]:
    """/proc/PID/environ once the process's exec has set it up: spawn returns when the child releases the parent's
    memory inside execve, a moment before its own environment is in place (read there, the file is empty; seen
    once under make test's load)."""
    deadline = time.monotonic() + 10
    while not (raw := Path(f"/proc/{pid}/environ").read_bytes().strip(b"\0")) and time.monotonic() < deadline:
        time.sleep(0.01)
    return raw.split(b"\0")


def test_a_folder_without_a_model_is_refused_before_any_process_starts(tmp_path):
    with pytest.raises(EngineError, match="no model in .*no-model: it has no config.json"):
        EngineProcess(tmp_path / "no-model", None, wait=False)
    assert list(tmp_path.iterdir()) == []         # no engine temp directory either


def test_an_engine_has_a_temporary_directory_of_its_own_removed_when_it_ends(tmp_path, monkeypatch, unloadable):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)        # tempfile caches the first TMPDIR it saw
    engines = [EngineProcess(unloadable, None, wait=False, zygote=False) for _ in range(2)]
    a, b = engines
    assert a.tmpdir != b.tmpdir and {a.tmpdir.parent, b.tmpdir.parent} == {tmp_path}
    for eng in engines:
        environ = _environ(eng.pid)
        assert f"TMPDIR={eng.tmpdir}".encode() in environ
        (eng.tmpdir / "vllm_dist_0123456789abcdef0123456789abcdef").write_text("what vLLM leaves")
    a.kill()
    assert not a.tmpdir.exists() and b.tmpdir.is_dir()      # one engine's end removes its own directory only
    b.kill()
    assert list(tmp_path.iterdir()) == []



def test_engines_run_without_torch_compile_unless_the_caller_says_otherwise(unloadable, monkeypatch):
    """vLLM's sampler compiles its logprob-rank helper with inductor at an engine's first logprobs request (16-25 s
    on the 2-core machine): every engine runs with torch.compile off, which a caller's own setting overrides."""
    monkeypatch.delenv("TORCH_COMPILE_DISABLE", raising=False)
    assert engine_env()["TORCH_COMPILE_DISABLE"] == "1"
    eng = EngineProcess(unloadable, None, wait=False, zygote=False)
    try:
        assert b"TORCH_COMPILE_DISABLE=1" in _environ(eng.pid)
    finally:
        eng.kill()
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "0")
    assert engine_env()["TORCH_COMPILE_DISABLE"] == "0"
